"""KV cache events of one instance, in vLLM's shapes (``--kv-events``).

An endpoint picker with a precise-prefix scorer (llm-d's ``precise-prefix-cache-scorer``,
NVIDIA Dynamo's KV router) keeps an index of which pod holds which prompt
blocks, built from the events each model server publishes: vLLM's
``BlockStored``, ``BlockRemoved`` and ``AllBlocksCleared``
(``vllm/distributed/kv_events.py``). This module turns what the instance's
KV cache holds into those events; the pod's publisher (the supervisor's
``kv-events`` child, :mod:`ggmux.supervisor.kv_publisher`) merges every
instance's and publishes them on ZMQ as vLLM does.

**Blocks.** llama.cpp keeps cells, not blocks: the events cut each cached
token sequence into blocks of ``block_size`` tokens (vLLM's 16 by default)
and name only full ones. Block ``i``'s hash is xxh3-64 over block ``i-1``'s
hash (for block 0: a seed over the model's name and the cache scope), its
token ids (int32) and its extra keys, so equal hashes mean equal prefixes
of one model in one scope, and no two models or tenants share one. vLLM's
hashes are opaque to the pickers (they key their index by the token ids),
as ours are.

**Fields.** ``medium`` tells the tiers apart: ``GPU`` a slot's own cache
(the engine's working KV, on any device, as vLLM's main cache), ``CPU`` the
host-RAM tier (``--cache-ram``), ``STORAGE`` the disk tier (``--cache-disk``).
``lora_name`` is the model's name (ggmux's models are the pod's
"adapters"); ``lora_id`` is None. ``extra_keys`` has one tuple per block,
in vLLM's order: the model's name, then one ``(media id, offset)`` pair per
media placeholder run in the block, then the cache scope (the tenant id, 16
hex digits, an HMAC of the API key: never the key) when there is one, so no
picker matches one tenant's prefix for another. Media (images, audio) sit
in a prompt as runs of negative placeholder ids derived from the media's
content hash (one per embedding); ``token_ids`` carries 0 in their place (a
picker's tokenizer never yields a negative id) and each run's identity goes
in ``extra_keys``: ``(f"{-first placeholder:x}", run start - block start)``,
as vLLM sends ``(mm hash, offset)``; the block's hash covers the
placeholders themselves.

Events are tagged maps (msgspec ``tag=True`` structs: ``{"type":
"BlockStored", "block_hashes": [...], ...}``), the shape vLLM's classes
decode since its events stopped being arrays.

**Where changes are seen.** The engine calls :meth:`KVEvents.sync` once per
decode-loop turn (after a step, a clear, a sleep): it compares each slot's
tokens with the blocks last published for that slot, so every path that
changes a slot's cache (a new request keeping a prefix, prefill chunks,
generated tokens, speculative rollbacks, restores from a tier, clears,
sleep) is covered by one call. The tiers are compared the same way, by
their entries' keys, on the sender thread every :data:`TIER_POLL_S`.
Counts per (medium, hash) make a block shared by two slots stored once and
removed when the last one drops it. A cache clear sends
``AllBlocksCleared`` (this instance's blocks; the publisher turns it into
removals when other models of the pod still hold blocks).

The instance pushes ``[pid, model, msgpack([ts, events])]`` on a ZMQ PUSH socket to the
publisher's collector, never blocking the decode thread: events wait in a
bounded queue (:data:`QUEUE_MAX` batches; past it they are dropped and
counted) for the sender thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import xxhash

log = logging.getLogger(__name__)

MEDIUM_SLOT = "GPU"
MEDIUM_RAM = "CPU"
MEDIUM_DISK = "STORAGE"
MEDIA_TOKEN = 0
"""The token id ``token_ids`` carries where a prompt holds a media placeholder."""
TIER_POLL_S = 0.25
"""Seconds between two comparisons of the RAM and disk tiers with what was published."""
QUEUE_MAX = 10_000
"""Batches waiting for the sender thread at most; past it a batch is dropped."""
SEND_HWM = 100_000
"""The PUSH socket's high-water mark (messages), vLLM's ``hwm``."""


def seed(model: str, scope: str) -> int:
    """The parent hash of a sequence's first block: model and scope."""
    return xxhash.xxh3_64_intdigest(f"{model}\0{scope}".encode())


def media_keys(block: list[int], start: int, tokens: list[int]) -> list[tuple[str, int]]:
    """``(media id, offset)`` for each media item that touches ``block``
    (tokens ``start ..`` of ``tokens``). An item is a run of placeholder ids
    (negative, one per embedding, made from the media's content hash and
    the embedding's index: :mod:`ggmux.instance.media.spans`); its id is
    its first placeholder in hex without the sign (the same media, the same
    id), its offset where the run starts relative to the block (negative
    when it began in an earlier block), as vLLM's ``(mm hash, offset)``."""
    out: list[tuple[str, int]] = []
    for j, t in enumerate(block):
        if t < 0 and (j == 0 or block[j - 1] >= 0):
            run = start + j
            while run > 0 and tokens[run - 1] < 0:
                run -= 1
            out.append((f"{-tokens[run]:x}", run - start))
    return out


@dataclass(slots=True)
class Chain:
    """Blocks published for one cached sequence: its scope, the tokens they
    cover (a whole number of blocks) and their hashes."""

    scope: str = ""
    tokens: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class BlockCounts:
    """How many holders (slots, entries, instances) hold each (medium, hash):
    :meth:`add` returns those new to the whole, :meth:`drop` those gone."""

    def __init__(self) -> None:
        self.n: dict[tuple[str, int], int] = {}

    def add(self, medium: str, hashes: Iterable[int]) -> set[int]:
        new = set()
        for h in hashes:
            k = (medium, h)
            c = self.n.get(k, 0)
            self.n[k] = c + 1
            if c == 0:
                new.add(h)
        return new

    def drop(self, medium: str, hashes: Iterable[int]) -> list[int]:
        gone = []
        for h in hashes:
            k = (medium, h)
            c = self.n.get(k, 0)
            if c <= 1:
                self.n.pop(k, None)
                if c == 1:
                    gone.append(h)
            else:
                self.n[k] = c - 1
        return gone

    def clear(self) -> None:
        self.n.clear()

    def __len__(self) -> int:
        return len(self.n)


def stored_runs(medium: str, chain_hashes: list[int], parent0: int | None, new: set[int],
                tokens: list[int], extra: list[tuple], block_size: int, model: str) -> list[dict]:
    """``BlockStored`` events for the blocks of a chain whose hash is in
    ``new``: one per run of consecutive new blocks, its parent the block
    before the run (``parent0`` before the chain's first)."""
    out: list[dict] = []
    run: list[int] = []

    def close(end: int) -> None:
        if not run:
            return
        first = run[0]
        out.append(block_stored(
            medium, [chain_hashes[i] for i in run],
            chain_hashes[first - 1] if first > 0 else parent0,
            tokens[first * block_size:end * block_size],
            [extra[i] for i in run], block_size, model))
        run.clear()

    for i, h in enumerate(chain_hashes):
        if h in new:
            run.append(i)
        else:
            close(i)
    close(len(chain_hashes))
    return out


def block_stored(medium: str, hashes: list[int], parent: int | None, tokens: list[int],
                 extra: list[tuple], block_size: int, model: str) -> dict:
    """vLLM's ``BlockStored`` as a tagged map (its required fields all present)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": [MEDIA_TOKEN if t < 0 else t for t in tokens],
            "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": model, "extra_keys": [list(e) for e in extra]}


def block_removed(medium: str, hashes: list[int]) -> dict:
    """vLLM's ``BlockRemoved`` as a tagged map."""
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


ALL_CLEARED = {"type": "AllBlocksCleared"}


class KVEvents:
    """The hook: see the module docstring. ``model``: the registry's name;
    ``scope_of(tenant)``: the cache scope a slot's owner saves under (None:
    nothing is reused, so nothing is published); ``send(events)``: where a
    batch goes (default: the PUSH socket to ``address``, on the sender
    thread); ``tiers()``: the KV tiers (a :class:`~ggmux.instance.cache.KVTiers`
    or None), looked up at each poll (they open after the first load)."""

    def __init__(self, model: str, block_size: int = 16, address: str | None = None,
                 scope_of: Callable[[str], str | None] = lambda t: "",
                 tiers: Callable[[], object] = lambda: None,
                 send: Callable[[list[dict]], None] | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"--kv-events-block-size must be at least 1, not {block_size}")
        self.model = model
        self.block_size = block_size
        self.scope_of = scope_of
        self.tiers = tiers
        self.counts = BlockCounts()
        self.slots: dict[int, Chain] = {}
        self.entries: dict[tuple[str, str], Chain] = {}  # (medium, entry key) -> its blocks
        self.lock = threading.Lock()  # counts, slots and entries: decode and sender threads
        self.dropped = 0
        # batches; None: stop; an Event: set once what came before it is sent (flush)
        self._queue: queue.Queue[list[dict] | threading.Event | None] = queue.Queue(QUEUE_MAX)
        self._marks: list[threading.Event] = []
        self._send = send
        self._address = address
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- chains -------------------------------------------------------------
    def _chain(self, tokens: list[int], scope: str, keep: Chain) -> Chain:
        """The chain of ``tokens``' full blocks, reusing ``keep``'s hashes
        where its tokens are the same prefix."""
        bs = self.block_size
        n = len(tokens) // bs
        k = min(len(keep.hashes), n) if keep.scope == scope else 0
        if k == n == len(keep.hashes) and tokens[:n * bs] == keep.tokens:
            return keep  # unchanged (the common case: once per step per slot)
        if k and tokens[:k * bs] != keep.tokens[:k * bs]:
            k = next(i for i in range(k) if tokens[i * bs:(i + 1) * bs]
                     != keep.tokens[i * bs:(i + 1) * bs])
        hashes = keep.hashes[:k]
        parent = hashes[-1] if hashes else seed(self.model, scope)
        for i in range(k, n):
            block = tokens[i * bs:(i + 1) * bs]
            h = xxhash.xxh3_64()
            h.update(parent.to_bytes(8, "little"))
            h.update(array("i", block).tobytes())
            if min(block) < 0:
                h.update(repr(media_keys(block, i * bs, tokens)).encode())
            parent = h.intdigest()
            hashes.append(parent)
        return Chain(scope, list(tokens[:n * bs]), hashes)

    def _extra(self, chain: Chain, idx: Iterable[int]) -> dict[int, tuple]:
        bs, out = self.block_size, {}
        for i in idx:
            block = chain.tokens[i * bs:(i + 1) * bs]
            media = media_keys(block, i * bs, chain.tokens) if min(block) < 0 else []
            out[i] = (self.model, *media, *((chain.scope,) if chain.scope else ()))
        return out

    def _replace(self, medium: str, old: Chain, new: Chain, events: list[dict]) -> None:
        """Count ``new``'s blocks in and ``old``'s out (with the lock held),
        adding the events of what changed for the pod."""
        if old.hashes == new.hashes:
            return
        same = 0
        while same < min(len(old.hashes), len(new.hashes)) and \
                old.hashes[same] == new.hashes[same]:
            same += 1
        added = self.counts.add(medium, new.hashes[same:])
        gone = self.counts.drop(medium, old.hashes[same:])
        if gone:
            events.append(block_removed(medium, gone))
        if added:
            idx = [i for i in range(same, len(new.hashes)) if new.hashes[i] in added]
            extra = self._extra(new, idx)
            events.extend(stored_runs(
                medium, new.hashes, None, added, new.tokens,
                [extra.get(i, ()) for i in range(len(new.hashes))], self.block_size,
                self.model))

    # ---- the engine's side (decode thread) -------------------------------------
    def sync(self, slots: Iterable) -> None:
        """Publish what changed in the slots' caches since the last call
        (each slot: ``id``, ``tokens``, ``owner``)."""
        events: list[dict] = []
        with self.lock:
            for s in slots:
                old = self.slots.get(s.id) or Chain()
                scope = self.scope_of(s.owner) if s.tokens else None
                new = Chain() if scope is None else self._chain(s.tokens, scope, old)
                self._replace(MEDIUM_SLOT, old, new, events)
                self.slots[s.id] = new
        self._put(events)

    def cleared(self) -> None:
        """Every tier of this model was emptied (``POST /cache/clear``): all
        published blocks are gone. Slots still running keep their cells
        until they end; the next :meth:`sync` publishes them again."""
        with self.lock:
            self.counts.clear()
            self.slots.clear()
            self.entries.clear()
        self._put([dict(ALL_CLEARED)])

    # ---- the tiers (sender thread) ----------------------------------------------
    def poll_tiers(self) -> None:
        """Compare the RAM and disk tiers' entries with those published."""
        tiers = self.tiers()
        if tiers is None:
            return
        now: dict[tuple[str, str], tuple[str, object]] = {}
        with tiers.lock:
            for e in (*tiers.ram.entries.values(), *tiers._spill):
                now[(MEDIUM_RAM, e.key)] = (e.scope, e.tokens)
        disk = tiers.disk
        if disk is not None:
            with disk.lock:
                for e in disk.entries.values():
                    now[(MEDIUM_DISK, e.key)] = (e.scope, e.tokens)
        events: list[dict] = []
        with self.lock:
            for k in [k for k in self.entries if k not in now]:
                self._replace(k[0], self.entries.pop(k), Chain(), events)
            for k, (scope, tokens) in now.items():
                if k not in self.entries:
                    chain = self._chain([int(t) for t in tokens], scope, Chain())
                    self._replace(k[0], Chain(), chain, events)
                    self.entries[k] = chain
        self._put(events)

    # ---- sending ------------------------------------------------------------------
    def _put(self, events: list[dict]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(events)
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("KV events: %d batches dropped (the publisher is not keeping up)",
                            self.dropped)

    def _drain(self, batch: list[dict]) -> None:
        """Add what waits in the queue to ``batch`` (the stop mark sets ``_closed``)."""
        while True:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                return
            if more is None:
                self._closed.set()
            elif isinstance(more, threading.Event):
                self._marks.append(more)
            else:
                batch.extend(more)

    def _run(self) -> None:
        send = self._send or self._socket_sender()
        while not self._closed.is_set():
            try:
                batch = self._queue.get(timeout=TIER_POLL_S)
            except queue.Empty:
                batch = []
            if batch is None:
                self._closed.set()
                batch = []
            elif isinstance(batch, threading.Event):
                self._marks.append(batch)
                batch = []
            try:
                self.poll_tiers()
            except Exception:  # a tier's shape changed under us: a bug, logged
                log.exception("KV events: reading the tiers failed")
            self._drain(batch)  # one batch for all that waits
            if batch:
                try:
                    send(batch)
                except Exception:
                    log.exception("KV events: sending %d events failed", len(batch))
            for mark in self._marks:
                mark.set()
            self._marks.clear()

    def _socket_sender(self) -> Callable[[list[dict]], None]:
        import msgpack
        import zmq

        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.set_hwm(SEND_HWM)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.connect(self._address)
        pid, model = str(os.getpid()).encode(), self.model.encode()

        def send(events: list[dict]) -> None:
            try:
                sock.send_multipart([pid, model, msgpack.packb([time.time(), events])],
                                    zmq.NOBLOCK)
            except zmq.Again:
                self.dropped += 1

        return send

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until what was handed on before this call is sent (and the
        tiers compared once more); False after ``timeout`` seconds."""
        mark = threading.Event()
        try:
            self._queue.put(mark, timeout=timeout)
        except queue.Full:
            return False
        return mark.wait(timeout)

    def close(self, timeout: float = 1.0) -> None:
        """Send what waits (at most ``timeout`` seconds), then stop."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)


def kv_events_hook(args, name: str, engine) -> KVEvents | None:
    """The engine's hook when the supervisor passed ``--kv-events`` (the
    pod publisher's collector address) to the instance, else None."""
    address = getattr(args, "kv_events", None)
    if not address:
        return None
    return KVEvents(name, getattr(args, "kv_events_block_size", 16), address,
                    scope_of=engine._cache_scope, tiers=lambda: engine.cache)


def add_kv_events_options(ap) -> None:
    """The instance's options: where its events go, and their block size."""
    ap.add_argument("--kv-events", default=None, metavar="ADDRESS",
                    help="the pod's KV events collector (a ZMQ address the supervisor "
                         "passes); none: no events")
    ap.add_argument("--kv-events-block-size", type=int, default=16,
                    help="tokens per KV block in the events")


__all__ = ["ALL_CLEARED", "MEDIUM_DISK", "MEDIUM_RAM", "MEDIUM_SLOT", "BlockCounts",
           "KVEvents", "add_kv_events_options", "block_removed", "block_stored", "kv_events_hook", "seed",
           "stored_runs"]
