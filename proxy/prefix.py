"""Prefix-aware routing (issue 20; DESIGN.md "Prefix-aware routing"): how much
of a request's prompt each replica already holds in its KV cache.

A replica's engine reuses the longest cached prefix of a prompt
(llama-server's ``cache_prompt``; the built-in instance's slots), so a
request is cheapest where its prefix was served last. The proxy has no
tokenizer, so it works on bytes:

* :func:`canonical`: the request's prompt as one byte string that starts
  with what agents keep stable and grows at its end as a conversation
  does: the JSON of ``(tools, system, instructions, conversation)``
  (``messages``, else ``input``, else ``prompt``), without the closing
  brackets, so a turn appended to ``messages`` extends the bytes of the
  turn before. Tools come first because chat templates render them into
  the system part, before every message.
* :class:`ChainHasher`: the canonical bytes in blocks of ``block`` bytes
  (the segment's ``H_PREFIX_BLOCK``; 256 by default), each block's hash
  chained to every block before it (vLLM's prefix block hashing, on bytes):
  block ``i``'s hash stands for the whole prefix ``0..i``. A partial last
  block is not hashed. Keyed by this server's secret, so nobody outside can
  craft a collision, and seeded with the tenant under ``cache-scope key``,
  so one tenant's prefixes never match another's.
* :class:`PrefixRouting`: per request, the chain's deepest block each
  replica holds (:class:`~ggmux.shm.prefixtable.PrefixTable`, every proxy's
  part of the shared index) as a fraction of the prompt, for the
  balancer's score (:func:`~ggmux.proxy.balancer.choose`); after the
  answer, the chain is recorded for the replica that served it, and the
  replica's own count of cached tokens (its ``x-ggmux-usage`` line, or
  llama-server's ``timings``) corrects the index: a predicted hit that came
  back a miss makes every proxy distrust that replica's older entries.
* KV tiers (issue 29): a replica's entries stand for what it holds in its
  slots and its host-RAM tier; for a model with a disk tier the index also
  knows what the node's disk holds (disk rows, :mod:`~ggmux.shm.prefixtable`):
  a replica that stops leaves its entries to the disk
  (:meth:`PrefixRouting.retire`), and an answer whose usage line says
  ``disk`` records the prompt there. A disk row counts for every local
  replica of the model alike (:attr:`Prediction.disk`), at a lower weight
  than a replica's own hit (:attr:`~.balancer.BalancerConfig.prefix_disk_weight`).

Cost: one ``orjson.dumps`` of the prompt, and a fixed number of numpy calls
over its blocks (O(blocks)); nothing for a model with one replica (the
fast path never gets here).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass

import numpy as np
import orjson
import xxhash

from ..http1.exchange import Exchange
from ..http1.usage import parse_tier, parse_usage, usage_from_tail
from ..shm import layout as L
from ..shm.prefixtable import Found, PrefixTable, disk_salt, replica_salt

log = logging.getLogger(__name__)

GENERATION_PATHS = frozenset((
    b"/v1/chat/completions", b"/chat/completions", b"/v1/completions", b"/completions",
    b"/completion", b"/v1/messages", b"/v1/responses", b"/api/chat", b"/api/generate",
))
"""Client routes whose prompt a replica's cache can reuse (embeddings,
tokenizing and reranking keep nothing)."""

MAX_BLOCKS = 4096
"""Blocks of a prompt that are hashed (1 MiB at 256-byte blocks); the rest
of a longer one is not looked at."""

MIN_PREFILL_TOKENS = 64
"""A request whose replica read at least this many prompt tokens (not
cached) is a sample of its prefill time per token (``C_PREFILL_NS``);
fewer, and its TTFT is mostly fixed costs."""

PREFILL_ALPHA = 0.2
"""EWMA weight of the newest prefill sample (as the TTFT EWMA's)."""

MISS_SHARE = 0.5
"""A replica predicted to hold ``k`` tokens of a prompt that reports fewer
than ``MISS_SHARE * k`` cached tokens was a wrong prediction."""

SCOPES = ("key", "global", "none")

_ONE = np.uint64(1)
_EMPTY = np.zeros(0, dtype=np.int64)


MEDIA_PART_TYPES = frozenset(("image_url", "input_image", "image", "input_audio"))
"""Content parts that carry media (OpenAI, Responses, Anthropic, audio)."""


def _digest(value) -> str:
    """A media item as its content hash: ``#`` and the xxh3-128 of its JSON."""
    return "#" + xxhash.xxh3_128_hexdigest(orjson.dumps(value))


def _light_message(m: dict) -> dict:
    """``m`` with each media item (a content part of
    :data:`MEDIA_PART_TYPES`, Ollama's ``images``) replaced by its digest;
    ``m`` itself when it has none."""
    out = m
    images = m.get("images")
    if isinstance(images, list) and images:
        out = {**m, "images": [_digest(x) for x in images]}
    content = m.get("content")
    if isinstance(content, list):
        parts = None
        for j, p in enumerate(content):
            if isinstance(p, dict) and p.get("type") in MEDIA_PART_TYPES:
                if parts is None:
                    parts = list(content)
                parts[j] = {"type": p["type"], "digest": _digest(p)}
        if parts is not None:
            out = {**out, "content": parts}
    return out


def _light(conv):
    """The conversation with its media as digests (:func:`_light_message`):
    an image is one content hash, as the engine compares it (its
    placeholders stand for its SHA-256), not its megabytes of base64,
    which would fill :data:`MAX_BLOCKS` and hide the turns after it."""
    if not isinstance(conv, list):
        return conv
    out = None
    for i, m in enumerate(conv):
        if isinstance(m, dict):
            new = _light_message(m)
            if new is not m:
                if out is None:
                    out = list(conv)
                out[i] = new
    return conv if out is None else out


def canonical(body: dict) -> bytes:
    """The prompt of a request body as canonical bytes (module docstring),
    or ``b""`` when it has none (or it cannot be serialised). Media count
    as their content hashes (:func:`_light`); an Ollama ``/api/generate``'s
    ``images`` follow its prompt."""
    conv = body.get("messages")
    if conv is None:
        conv = body.get("input")
        if conv is None:
            conv = body.get("prompt")
            if conv is None:
                return b""
            images = body.get("images")
            if isinstance(images, list) and images:
                conv = [conv, [_digest(x) for x in images]]
    try:
        data = orjson.dumps((body.get("tools"), body.get("system"), body.get("instructions"),
                             _light(conv)))
    except (TypeError, orjson.JSONEncodeError):
        return b""
    return data[:-2]  # the conversation's closing and the tuple's: a later turn extends it


class ChainHasher:
    """Chained block hashes of byte strings (module docstring).

    ``block``: bytes per block (a multiple of 8); ``key``: this server's
    secret (every proxy of the server gets the same, so they agree). Block
    ``k``'s value is the dot product of its 32-bit words with random odd
    64-bit multipliers, times a random odd multiplier of its position (so
    blocks swapped are another prefix); the chain hash of block ``i`` is the
    seed plus the sum of the values of blocks ``0..i`` (mod 2**64): a keyed
    universal hash of the whole prefix, computed for every ``i`` at once.
    Values are int64 and odd (never 0, which marks an empty index entry)."""

    __slots__ = ("block", "mul", "pos", "words")

    def __init__(self, block: int, key: bytes) -> None:
        if block < 8 or block % 8:
            raise ValueError(f"prefix block must be a multiple of 8 bytes, not {block}")
        self.block = block
        self.words = block // 4
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=16,
                                              person=b"ggmux-prefix").digest(), "little")
        rng = np.random.Generator(np.random.PCG64(seed))
        self.mul = rng.integers(0, 1 << 63, size=self.words, dtype=np.uint64) * np.uint64(2) + _ONE
        self.pos = rng.integers(0, 1 << 63, size=MAX_BLOCKS, dtype=np.uint64) * np.uint64(2) + _ONE

    def chain(self, data: bytes, seed: int = 0) -> np.ndarray:
        """The chain hashes of ``data``'s whole blocks (at most
        :data:`MAX_BLOCKS`), int64 ``(blocks,)``; ``seed`` (a 64-bit
        tenant id, 0 for none) makes another chain of the same bytes."""
        n = min(len(data) // self.block, MAX_BLOCKS)
        if not n:
            return _EMPTY
        x = np.frombuffer(data, dtype=np.uint32, count=n * self.words).reshape(n, self.words)
        h = x.dot(self.mul)  # uint64, mod 2**64
        h *= self.pos[:n]
        if seed:  # an array add: wraps mod 2**64 without a warning
            h[:1] += np.uint64(seed & 0xFFFFFFFFFFFFFFFF)
        np.cumsum(h, out=h)
        h |= _ONE
        return h.view(np.int64)


@dataclass(slots=True)
class Prediction:
    """One request's prompt as the index sees it: ``chain`` (int64 chain
    hashes), ``length`` (canonical bytes), ``slots`` the candidates' replica
    slots and ``found`` their deepest blocks (same order), ``share`` (slot
    -> fraction of the prompt that replica holds, 0-1, for
    :func:`~ggmux.proxy.balancer.choose`); for a model with a disk tier
    (issue 29) ``model`` (else -1) and the ``epoch`` of its tiers, ``disk``
    (local slot -> fraction of the prompt the node's disk holds, the same
    for each) and ``disk_used_ns`` (that row's last use)."""

    chain: np.ndarray
    length: int
    slots: list[int]
    found: Found
    share: dict[int, float]
    model: int = -1
    epoch: int = 0
    disk: dict[int, float] | None = None
    disk_used_ns: int = 0


class PrefixRouting:
    """One proxy's use of the prefix index (module docstring).

    ``table``: the index (:class:`~ggmux.shm.prefixtable.PrefixTable`,
    this proxy's part writable); ``block``: the segment's block bytes;
    ``key``: this server's secret (the tenant secret, shared by its
    proxies)."""

    __slots__ = ("block", "hasher", "salts", "table")

    def __init__(self, table: PrefixTable, block: int, key: bytes) -> None:
        self.table = table
        self.block = block
        self.hasher = ChainHasher(block, key)
        self.salts: dict[tuple[int, int], int] = {}  # (slot, incarnation) -> replica_salt

    def _salt(self, slot: int, incarnation: int) -> int:
        k = (slot, incarnation)
        s = self.salts.get(k)
        if s is None:
            if len(self.salts) > 4096:  # replicas come and go: keep it bounded
                self.salts.clear()
            s = self.salts[k] = replica_salt(slot, incarnation)
        return s

    def predict(self, body: dict, tenant: bytes, scope: str, cands, model: int = -1,
                epoch: int = 0, remote=frozenset()) -> Prediction | None:
        """The :class:`Prediction` of a request with JSON ``body`` among
        candidates ``cands`` (:class:`~ggmux.proxy.balancer.Candidate`), or
        None when there is nothing to weigh: ``scope`` ``none``, no prompt,
        or a prompt shorter than one block. ``tenant``: the caller's 16 hex
        digits (``b""``: none), which seeds the chain under scope ``key``.
        ``model`` (>= 0: the model has a disk tier, issue 29) and ``epoch``
        (its ``M_CACHE_EPOCH``) look its disk rows up too, for the
        candidates not in ``remote`` (slots of other nodes and upstreams,
        which have not this node's disk)."""
        if scope == "none":
            return None
        data = canonical(body)
        n = len(data)
        if n < self.block:
            return None
        chain = self.hasher.chain(data, int(tenant, 16) if scope == "key" and tenant else 0)
        slots = [c.slot for c in cands]
        salts = [self._salt(c.slot, c.incarnation) for c in cands]
        if model >= 0:
            salts.append(disk_salt(model, epoch))
        found = self.table.lookup(chain, np.array(salts, dtype=np.int64), slots, model)
        share = {}
        for slot, d in zip(slots, found.depth, strict=False):
            if d:
                share[slot] = min(1.0, d * self.block / n)
        pred = Prediction(chain, n, slots, found, share, model, epoch)
        if model >= 0:
            d = found.depth.pop()
            pred.disk_used_ns = found.used_ns.pop()
            if d:
                f = min(1.0, d * self.block / n)
                pred.disk = {s: f for s in slots if s not in remote}
        return pred

    def learn(self, pred: Prediction, slot: int, incarnation: int, ex: Exchange,
              cnt: memoryview, mc: memoryview) -> None:
        """Replica ``slot`` (``incarnation``) answered the request of
        ``pred`` with :class:`~ggmux.http1.exchange.Exchange` ``ex``:
        judge the prediction by the counts it reports (its usage line, else
        the end of its body), take its prefill time per uncached token into
        its counters row ``cnt`` (``C_PREFILL_NS``), count the request in
        this proxy's model counters ``mc`` (``MC_PREFIX_*``), and record the
        chain for it (it holds the prompt now)."""
        mc[L.MC_PREFIX_ROUTED] += 1
        counts = parse_usage(ex.usage) if ex.usage is not None else (
            usage_from_tail(ex.tail) if ex.tail else None)
        if counts is not None and ex.first_byte_ns > ex.sent_ns > 0:
            read = counts[0] - counts[1]
            if read >= MIN_PREFILL_TOKENS:
                ns = (ex.first_byte_ns - ex.sent_ns) // read
                old = cnt[L.C_PREFILL_NS]
                cnt[L.C_PREFILL_NS] = ns if old == 0 else int(old + PREFILL_ALPHA * (ns - old))
                cnt[L.C_PREFILL_COUNT] += 1
        share = pred.share.get(slot, 0.0)
        disk = pred.disk.get(slot, 0.0) if pred.disk else 0.0
        if share or disk:
            mc[L.MC_PREFIX_PREDICTED] += 1
            if counts is not None and counts[1] < MISS_SHARE * max(share, disk) * counts[0]:
                mc[L.MC_PREFIX_MISSED] += 1
                if share:  # its cache no longer holds what it held then, nor anything older
                    used = pred.found.used_ns[pred.slots.index(slot)]
                    self.table.forget_before(slot, used)
                if disk and counts[1] < MISS_SHARE * disk * counts[0]:
                    self.table.forget_disk_before(pred.model, pred.disk_used_ns)
                log.debug("prefix: replica %d reported %d cached of %d prompt tokens, "
                          "%.0f%% predicted (%.0f%% on disk): forgetting the entries used up "
                          "to then", slot, counts[1], counts[0], 100 * share, 100 * disk)
        now = time.monotonic_ns()
        self.table.record(pred.chain, slot, incarnation, now)
        if pred.model >= 0 and ex.usage is not None and parse_tier(ex.usage) == "disk":
            self.table.record_disk(pred.chain, pred.model, pred.epoch, now)

    def record(self, pred: Prediction, slot: int, incarnation: int, ex: Exchange) -> None:
        """Replica ``slot`` (``incarnation``) answered the request of
        ``pred`` without the index having chosen it (one candidate, the fast
        path, a session key): record the chain for it, and on the disk rows
        when its usage line says ``disk``; no prediction is judged and no
        routed request counted (issue 37, item 18)."""
        now = time.monotonic_ns()
        self.table.record(pred.chain, slot, incarnation, now)
        if pred.model >= 0 and ex.usage is not None and parse_tier(ex.usage) == "disk":
            self.table.record_disk(pred.chain, pred.model, pred.epoch, now)

    def retire(self, old: np.ndarray, new: np.ndarray, models: np.ndarray, remote) -> int:
        """The replicas table changed from ``old`` to ``new`` (rows of
        ``(replicas, R_WORDS)``): each local replica that is gone (its slot
        freed or given another incarnation) of a model with a disk tier
        (``models``: the models table, ``M_CACHE_FLAGS``) leaves this
        proxy's entries of it to the model's disk rows (issue 29: it saved
        its slots there on its way out). ``remote``: slots that are not
        local. The number of entries moved."""
        inc_old, inc_new = old[:, L.R_INCARNATION], new[:, L.R_INCARNATION]
        gone = np.flatnonzero((inc_old != 0) & (inc_old != inc_new) & (old[:, L.R_PID] > 0))
        moved = 0
        for slot in gone.tolist():
            m = int(old[slot, L.R_MODEL])
            if slot in remote or not 0 <= m < models.shape[0]:
                continue
            if not int(models[m, L.M_CACHE_FLAGS]) & L.CACHE_DISK:
                continue
            moved += self.table.to_disk(slot, int(inc_old[slot]), m,
                                        int(models[m, L.M_CACHE_EPOCH]))
        return moved


__all__ = [
    "GENERATION_PATHS",
    "MAX_BLOCKS",
    "SCOPES",
    "ChainHasher",
    "Prediction",
    "PrefixRouting",
    "canonical",
]
