"""The KV tiers of one model in one instance: host RAM, then disk, behind
one lookup (DESIGN.md "KV tiers", issue 29).

The engine calls, on its decode thread: :meth:`KVTiers.lookup` (the
longest cached prefix of a prompt over both tiers, in the request's scope),
:meth:`KVTiers.state` (the bytes of a hit, read and verified from disk when
it is there) and :meth:`KVTiers.save` (a slot's state about to be
overwritten or dropped). RAM entries pushed out by the limit spill to disk
on a writer thread, oldest last; :meth:`KVTiers.flush` writes what RAM
holds that disk does not, most recent first, within a deadline (a stopping
instance). The writer thread also keeps the disk tier's index
(:meth:`~.disk.DiskTier.refresh`, every :data:`~.disk.REFRESH_S`): the
decode thread never lists the folder or reads a header (issue 37, item
12). The HTTP side reads :meth:`KVTiers.report` and calls
:meth:`KVTiers.clear`. No client-supplied value sizes a tier: the limits
come from the instance's options.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from . import disk as disk_mod
from .checkpoint import Checkpoint, CheckpointError, unpack
from .disk import DiskTier
from .entry import Entry, common_prefix
from .entry_file import entry_key
from .ram import RamTier

log = logging.getLogger(__name__)

KEEP_SHARE = 0.25
"""A tier entry is restored only when the prompt keeps at least this share
of it (llama-server's prompt cache: "don't trash large prompts", f_keep)."""
READS_KEPT = 4
"""Disk entries read and verified ahead (:meth:`KVTiers.fetch`) kept for the
request that asked, at most (file mappings: page cache, not fresh memory)."""
SPILL_PENDING_MAX = 1 << 30
"""Bytes of states waiting for the disk writer; past it a spilled state is
dropped (a disk slower than the slots' turnover)."""


@dataclass(slots=True)
class CacheSettings:
    """The tiers' options: ``ram_mib`` (``--cache-ram``, llama-server's
    meaning: -1 no byte limit, 0 off, default 8192), ``disk_dir``
    (``--cache-disk``, None: off), ``disk_max_gib`` (``--cache-disk-max``,
    per model), ``save_timeout`` (``--cache-save-timeout``, seconds a
    stopping instance spends writing its caches); ``checkpoints`` and
    ``checkpoint_mib`` (``--cache-checkpoints``, ``--cache-checkpoint-max``,
    ggmux's, issue 35): the most context checkpoints, newest first, and
    their most bytes one entry carries; 0: none. A returning conversation
    needs its last turn's (the last user message, the prompt's end: 3 a
    turn); 4 of Gemma 3 270M's are 31 MiB, 1024 MiB holds 2 of a 27B's
    (README "KV tiers")."""

    ram_mib: int = 8192
    disk_dir: str | None = None
    disk_max_gib: float = 10.0
    save_timeout: float = 2.0
    model_name: str = ""  # the registry's name, for model.json ("": the GGUF's file name)
    checkpoints: int = 4
    checkpoint_mib: int = 1024

    @property
    def enabled(self) -> bool:
        return self.ram_mib != 0 or bool(self.disk_dir)


@dataclass(slots=True)
class Hit:
    """A lookup's answer: restore ``entry`` from ``tier`` (``ram``,
    ``disk``) and keep its first ``n`` tokens."""

    entry: Entry
    tier: str
    n: int


class KVTiers:
    """See the module docstring. ``version`` grows at every change of the
    tiers' sizes (the instance's ``cache`` state line follows it)."""

    def __init__(self, settings: CacheSettings, limit_tokens: int,
                 disk: DiskTier | None = None) -> None:
        self.settings = settings
        self.ram = RamTier(settings.ram_mib, limit_tokens)
        self.disk = disk
        self.lock = threading.Lock()
        self.version = 0
        self.hits = {"slot": 0, "ram": 0, "disk": 0}
        self.misses = 0
        self.restored_tokens = 0
        self.restore_seconds = {"ram": 0.0, "disk": 0.0}
        self.saved = 0
        self.dropped = 0
        self.rejected_checkpoints = 0
        self._spill: deque[Entry] = deque()  # RAM's leavers, waiting for the writer
        self._spill_bytes = 0
        self._cond = threading.Condition(self.lock)
        self._writing: set[str] = set()
        self._closed = False
        self._writer: threading.Thread | None = None
        self._read: dict[str, memoryview | None] = {}  # key -> verified bytes (None: refused)
        self._reading: set[str] = set()
        if disk is not None:
            self._writer = threading.Thread(target=self._write_loop, name="kv-disk",
                                            daemon=True)
            self._writer.start()

    # ---- lookup and restore (decode thread) -----------------------------------
    def lookup(self, prompt: np.ndarray, scope: str, better_than: int,
               n_swa: int = 0, recurrent: bool = False) -> Hit | None:
        """The entry of ``scope`` sharing the longest prefix with ``prompt``
        (int32), when that prefix is longer than ``better_than`` (what the
        request's slot keeps anyway) and at least :data:`KEEP_SHARE` of the
        entry. At most ``len(prompt) - 1`` tokens are kept (one is read
        to get logits). With a sliding window (``n_swa``), an entry whose
        first position is past ``keep - n_swa`` cannot serve (llama-server's
        ``pos_min`` check), nor can a recurrent (or hybrid) model's entry
        serve less than all its tokens: then the entry's newest context
        checkpoint within the prefix serves (issue 35), or nothing. RAM
        wins a tie."""
        limit = prompt.size - 1
        best: Hit | None = None
        with self.lock:
            ram = [*self.ram.entries.values(), *self._spill]
        for tier, entries in (("ram", ram),
                              ("disk", self.disk.candidates() if self.disk else ())):
            for e in entries:
                if e.scope != scope:
                    continue
                n = min(common_prefix(prompt, e.tokens), limit)
                if n <= better_than:
                    continue
                if n < e.n_tokens and (recurrent or n_swa > 0 and e.pos_min > max(0, n - n_swa)):
                    n = max((c for c in e.ckpt_tokens if c <= n), default=0)
                if n <= better_than or n < KEEP_SHARE * e.n_tokens:
                    continue
                if best is None or n > best.n:
                    best = Hit(e, tier, n)
        return best

    def fetch(self, hit: Hit, wake: Callable[[], None]) -> bool:
        """Whether ``hit``'s bytes are ready for :meth:`state` (a RAM entry,
        or a disk entry read and verified); if not, read and verify it on a
        thread of its own, off the decode thread (issue 37, item 12: a
        large entry's read and MAC would stall every stream), and call
        ``wake()`` when done. The caller asks again then."""
        e = hit.entry
        if e.data is not None or self.disk is None:
            return True
        with self.lock:
            if e.key in self._read:
                return True
            if e.key in self._reading:
                return False
            self._reading.add(e.key)

        def read() -> None:
            try:
                data = self.disk.load(e)
            except Exception:  # a bug: the request is prefilled
                log.exception("KV disk tier: reading an entry failed")
                data = None
            with self.lock:
                self._reading.discard(e.key)
                self._read[e.key] = data
                while len(self._read) > READS_KEPT:
                    self._read.pop(next(iter(self._read)))
            wake()

        threading.Thread(target=read, name="kv-read", daemon=True).start()
        return False

    @property
    def reading(self) -> bool:
        """Whether a :meth:`fetch` is in progress."""
        return bool(self._reading)

    def state(self, hit: Hit) -> bytearray | memoryview | None:
        """The bytes of ``hit``'s state (a disk entry read and verified, by
        :meth:`fetch` or here), or None when the file no longer verifies
        (counted in ``rejected``)."""
        e = hit.entry
        if e.data is not None:
            with self.lock:
                self.ram.touch(e.key)
                e.t_used = time.monotonic()
            return e.data
        with self.lock:
            fetched = e.key in self._read
            data = self._read.pop(e.key, None)
        if not fetched:
            data = self.disk.load(e) if self.disk is not None else None
        if data is None:
            self._changed()
        return data

    def checkpoints(self, hit: Hit) -> list[Checkpoint]:
        """The context checkpoints of ``hit``'s entry (RAM's, or its file's
        verified and unpacked); [] when it has none or they do not verify
        (torn, another model's, over ``--cache-checkpoint-max``: counted in
        ``rejected_checkpoints``, never loaded)."""
        e = hit.entry
        if e.checkpoints is not None:
            return list(e.checkpoints)
        if not e.ckpt_tokens or self.disk is None:
            return []
        blob = self.disk.load_checkpoints(e)
        try:
            if blob is None:
                raise CheckpointError("the section does not verify")
            return unpack(blob, self.disk.fp.hex, self.settings.checkpoint_mib << 20,
                          e.n_tokens)
        except CheckpointError as x:
            with self.lock:
                self.rejected_checkpoints += 1
            log.warning("KV tiers: not loading the checkpoints of an entry of %d tokens: %s",
                        e.n_tokens, x)
            return []

    def restored(self, tier: str, n: int, seconds: float) -> None:
        """Count a restore of ``n`` tokens from ``tier`` that took ``seconds``."""
        with self.lock:
            self.hits[tier] += 1
            self.restored_tokens += n
            self.restore_seconds[tier] += seconds

    def used_slot(self, n: int) -> None:
        """Count a request's prompt cache: ``n`` tokens its slot kept (0: a miss)."""
        with self.lock:
            if n > 0:
                self.hits["slot"] += 1
            else:
                self.misses += 1

    # ---- save (decode thread) ---------------------------------------------------
    def wants(self, scope: str, tokens: np.ndarray, nbytes: int) -> bool:
        """Whether a state of ``tokens`` (``nbytes``) is worth saving: some
        tier may keep it and none holds it already."""
        probe = Entry("", scope, tokens, 0, nbytes, 0.0)
        with self.lock:
            if self.ram.holds(probe):
                return False
            ram_ok = self.ram.admits(nbytes)
        if self.disk is None:
            return ram_ok
        if self.disk.holds(scope, tokens):
            return False
        return ram_ok or not self.disk.limit_bytes or nbytes <= self.disk.limit_bytes

    def save(self, scope: str, tokens: np.ndarray, pos_min: int, data: bytearray,
             checkpoints: list[Checkpoint] | None = None) -> None:
        """Keep a sequence's state (``data``, from ``llama_state_seq_get_data``)
        and its context ``checkpoints`` (bytes counted with it) in RAM, or
        hand it straight to the disk writer when RAM is off or it does not
        fit."""
        cks = list(checkpoints or [])
        e = Entry(entry_key(scope, tokens), scope, tokens, pos_min,
                  len(data) + sum(c.nbytes for c in cks), time.monotonic(), data=data,
                  checkpoints=cks)
        with self.lock:
            self.saved += 1
            if self.ram.admits(e.nbytes):
                leavers = self.ram.put(e)
            else:
                leavers = [e]
            for o in leavers:
                self._to_disk(o)
            self.version += 1

    def _to_disk(self, e: Entry) -> None:
        """With the lock held: queue a leaver of RAM for the writer, or drop it."""
        if self.disk is None or self._spill_bytes + e.nbytes > SPILL_PENDING_MAX:
            self.dropped += self.disk is not None
            return
        self._spill.append(e)
        self._spill_bytes += e.nbytes
        self._cond.notify_all()

    # ---- the writer thread ----------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                if not self._spill and not self._closed:
                    self._cond.wait(disk_mod.REFRESH_S)
                if self._closed:
                    return
                e = self._spill[0] if self._spill else None
                if e is not None:
                    self._writing.add(e.key)
            if e is None:  # nothing to write: look for what other processes wrote
                try:
                    self.disk.refresh()
                except Exception:  # a bug must not stop the writer
                    log.exception("KV disk tier: indexing failed")
                continue
            self._write(e)
            with self._cond:
                if self._spill and self._spill[0] is e:
                    self._spill.popleft()
                    self._spill_bytes -= e.nbytes
                self._writing.discard(e.key)
                self.version += 1
                self._cond.notify_all()

    def flush(self, deadline: float) -> int:
        """Write to disk, before ``time.monotonic()`` reaches ``deadline``,
        the RAM entries disk does not hold (most recent first), then the
        spilled ones still waiting; stops the writer thread. Returns the
        entries written. A write cut by the deadline leaves no file."""
        if self.disk is None:
            return 0
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._writing and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
            todo = [*sorted(self.ram.entries.values(), key=lambda e: -e.t_used),
                    *reversed(self._spill)]
        n = 0
        for e in todo:
            if time.monotonic() >= deadline:
                log.info("KV tiers: the save ran out of time; %d entries left unwritten",
                         len(todo) - n)
                break
            if self._write(e, deadline):
                n += 1
        self._changed()
        return n

    def _write(self, e: Entry, deadline: float | None = None) -> bool:
        try:
            return self.disk.write(e, deadline)
        except Exception:  # a bug must not stop the writer or the instance's stop
            log.exception("KV disk tier: writing an entry failed")
            return False

    # ---- the HTTP side ----------------------------------------------------------
    def clear(self, timeout: float = 10.0) -> dict:
        """Empty both tiers of this fingerprint: ``{"ram": n, "disk": n}``.
        A write in progress is waited for (at most ``timeout`` s) before the
        files go, so it cannot put an entry back after the clear."""
        with self._cond:
            n_ram = len(self.ram.take_all()) + len(self._spill)
            self._spill.clear()
            self._spill_bytes = 0
            end = time.monotonic() + timeout
            while self._writing and time.monotonic() < end:
                self._cond.wait(max(0.0, end - time.monotonic()))
        n_disk = self.disk.clear() if self.disk is not None else 0
        self._changed()
        return {"ram": n_ram, "disk": n_disk}

    def _changed(self) -> None:
        with self.lock:
            self.version += 1

    def report(self) -> dict:
        """The instance's ``GET /cache`` answer (the contract with the router
        side): ``ram`` and ``disk`` sizes and limits (bytes), ``hits`` per
        tier, ``misses``, ``restored_tokens``, ``restore_seconds``,
        ``saved``, ``rejected``, ``rejected_checkpoints`` (checkpoint
        sections refused, issue 35)."""
        with self.lock:
            ram = {"entries": len(self.ram.entries) + len(self._spill),
                   "bytes": self.ram.bytes + self._spill_bytes,
                   "limit_bytes": self.ram.limit_bytes if self.ram.enabled else 0,
                   "tokens": self.ram.tokens}
            out = {"hits": dict(self.hits), "misses": self.misses,
                   "restored_tokens": self.restored_tokens,
                   "restore_seconds": round(sum(self.restore_seconds.values()), 6),
                   "restore_seconds_by_tier": {k: round(v, 6)
                                               for k, v in self.restore_seconds.items()},
                   "saved": self.saved, "dropped": self.dropped,
                   "rejected_checkpoints": self.rejected_checkpoints}
        disk = (self.disk.report() if self.disk is not None else
                {"entries": 0, "bytes": 0, "limit_bytes": 0, "dir": None})
        out["rejected"] = self.disk.rejected if self.disk is not None else 0
        return {"ram": ram, "disk": disk, **out}


def open_tiers(settings: CacheSettings, limit_tokens: int, fp_factory: Callable[[], object],
               model: str = "", model_path: str = "", max_tokens: int = 0) -> KVTiers | None:
    """The tiers ``settings`` ask for, or None when both are off. The disk
    tier needs the model's fingerprint (``fp_factory()``, a
    :class:`~.fingerprint.Fingerprint`); ``max_tokens``: the most tokens an
    entry may hold (the context's size per request: a file claiming more is
    refused before it is read). A directory that cannot be used leaves
    only RAM (logged)."""
    if not settings.enabled:
        return None
    disk = None
    if settings.disk_dir:
        fp = fp_factory()
        d = DiskTier(settings.disk_dir, fp, int(settings.disk_max_gib * (1 << 30)), model,
                     model_path, max_tokens=max_tokens)
        if d.open():
            disk = d
            log.info("KV disk tier: %s, %d entries (%.1f MiB) of this model, limit %s",
                     d.dir, len(d.entries), d.bytes / (1 << 20), size_text(settings.disk_max_gib))
    if settings.ram_mib == 0 and disk is None:
        return None
    return KVTiers(settings, limit_tokens, disk)


def size_text(gib: float) -> str:
    """``gib`` GiB as a log shows it, with the digits it was given: ``50 MiB``
    below 1 GiB (issue 37, item 16: ``--cache-disk-max 0.05`` was logged as
    "limit 0.1 GiB"), else ``10 GiB``, ``1.5 GiB``."""
    if gib < 1:
        return f"{gib * 1024:.4g} MiB"
    return f"{gib:.4g} GiB"


__all__ = ["CacheSettings", "Hit", "KVTiers", "open_tiers"]
