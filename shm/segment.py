"""The shared-memory segment: create (supervisor) or attach (proxies).

One POSIX segment per server, mode 0600, mapped as int64 numpy arrays whose
shapes come from :class:`ggmux.shm.layout.Sizes`. The supervisor creates it,
removing a stale segment of the same name first (left by a supervisor that
was killed with SIGKILL); proxies attach read-write and write only their own
counter and waiter rows.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np
import orjson
import posix_ipc

from . import layout as L
from .seqlock import SeqlockBusy, fence


def segment_name(port: int) -> str:
    """Default segment name of the server on ``port``."""
    return f"/ggmux-{port}"


def queue_name(port: int) -> str:
    """Default command-queue name of the server on ``port``."""
    return f"/ggmux-{port}-q"



def _back_off(tries: int, deadline: float, what: str) -> None:
    """After a seqlocked read's ``tries``-th failed try: spin (up to 64),
    then yield the CPU (up to 1,000), then sleep 100 us; past ``deadline``
    (``time.monotonic()`` seconds) raise :class:`SeqlockBusy` naming ``what``."""
    if tries > 1000:
        if time.monotonic() > deadline:
            raise SeqlockBusy(what)
        time.sleep(0.0001)
    elif tries > 64:
        os.sched_yield()

class Segment:
    """A mapped segment. Attributes are int64 views into shared memory.

    ``header`` (H_WORDS,), ``models`` (models, M_WORDS), ``replicas``
    (replicas, R_WORDS), ``counters`` (proxies, replicas, C_WORDS),
    ``waiters`` (proxies, models, W_WORDS), ``mcounters`` (proxies, models,
    MC_WORDS), ``devices`` (devices, D_WORDS), ``prefix`` (proxies,
    prefix_buckets, prefix_ways, X_WORDS), ``prefix_forget`` (proxies,
    replicas), ``prefix_forget_disk`` (proxies, models), ``registry``
    (registry_cap,) uint8.
    """

    def __init__(self, name: str, mm: mmap.mmap, sizes: L.Sizes, owner: bool) -> None:
        self.name = name
        self.sizes = sizes
        self.owner = owner
        self._mm = mm
        offs = sizes.offsets()
        buf = memoryview(mm)
        for table, (off, shape) in offs.items():
            if table == "registry":
                arr = np.frombuffer(buf, dtype=np.uint8, count=shape[0], offset=off)
            else:
                n = 1
                for s in shape:
                    n *= s
                arr = np.frombuffer(buf, dtype=np.int64, count=n, offset=off).reshape(shape)
            setattr(self, table, arr)
        self._registry_cache: tuple[int, dict] | None = None
        # the header as Python-level int64 words: a plain read of the
        # generation costs ~50 ns instead of a numpy scalar's ~300
        self._hwords = buf[: 8 * L.H_WORDS].cast("q")

    # ---- lifecycle ------------------------------------------------------
    @classmethod
    def create(cls, name: str, sizes: L.Sizes) -> Segment:
        """Create (replacing a stale one) and initialise a segment."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(
            name, posix_ipc.O_CREX, mode=0o600, size=sizes.total_bytes()
        )
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        seg = cls(name, mm, sizes, owner=True)
        h = seg.header
        h[L.H_VERSION] = L.VERSION
        h[L.H_N_MODELS] = sizes.models
        h[L.H_N_REPLICAS] = sizes.replicas
        h[L.H_N_PROXIES] = sizes.proxies
        h[L.H_N_DEVICES] = sizes.devices
        h[L.H_REGISTRY_CAP] = sizes.registry_cap
        h[L.H_PREFIX_BUCKETS] = sizes.prefix_buckets
        h[L.H_PREFIX_WAYS] = sizes.prefix_ways
        h[L.H_PREFIX_BLOCK] = sizes.prefix_block
        h[L.H_STARTED_NS] = time.monotonic_ns()
        seg.replicas[:, L.R_MODEL] = -1
        fence()
        h[L.H_MAGIC] = L.MAGIC  # last: an attacher that sees it sees the rest
        return seg

    @classmethod
    def attach(cls, name: str) -> Segment:
        """Attach to an existing segment. Raises ``ValueError`` on a bad magic
        or layout version, ``posix_ipc.ExistentialError`` if it is missing."""
        shm = posix_ipc.SharedMemory(name)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        head = np.frombuffer(mm, dtype=np.int64, count=L.H_WORDS)
        if int(head[L.H_MAGIC]) != L.MAGIC:
            raise ValueError(f"{name}: not a ggmux segment (bad magic)")
        if int(head[L.H_VERSION]) != L.VERSION:
            raise ValueError(f"{name}: layout version {int(head[L.H_VERSION])} != {L.VERSION}")
        sizes = L.Sizes(
            models=int(head[L.H_N_MODELS]),
            replicas=int(head[L.H_N_REPLICAS]),
            proxies=int(head[L.H_N_PROXIES]),
            devices=int(head[L.H_N_DEVICES]),
            registry_cap=int(head[L.H_REGISTRY_CAP]),
            prefix_buckets=int(head[L.H_PREFIX_BUCKETS]),
            prefix_ways=int(head[L.H_PREFIX_WAYS]),
            prefix_block=int(head[L.H_PREFIX_BLOCK]),
        )
        del head
        return cls(name, mm, sizes, owner=False)

    def close(self) -> None:
        """Drop the mapping (views must not be used afterwards)."""
        self._hwords.release()
        for table in ("header", "models", "replicas", "counters", "waiters", "mcounters",
                      "devices", "prefix", "prefix_forget", "prefix_forget_disk", "registry"):
            if hasattr(self, table):
                delattr(self, table)
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process

    def unlink(self) -> None:
        """Remove the segment's name (the supervisor does this on exit)."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    # ---- generation -----------------------------------------------------
    @property
    def generation(self) -> int:
        return self._hwords[L.H_GENERATION]

    def begin_publish(self) -> None:
        """Supervisor only: rows are about to change (generation becomes odd).

        The generation is a seqlock over the supervisor's tables as a whole:
        each row has its own sequence word, but a reader that needs several
        rows to agree (how many replicas run) reads between two equal, even
        generations (:meth:`snapshot`)."""
        fence()
        self.header[L.H_GENERATION] += 1
        fence()

    def end_publish(self) -> int:
        """Supervisor only: the change is complete (generation even again)."""
        fence()
        self.header[L.H_GENERATION] += 1
        return int(self.header[L.H_GENERATION])

    def bump_generation(self) -> int:
        """Supervisor only: announce a change waiters may care about."""
        self.begin_publish()
        return self.end_publish()

    def snapshot(self, *tables: str, timeout: float = 2.0) -> tuple[int, list[np.ndarray]]:
        """``(generation, copies)`` of whole supervisor tables (``"models"``,
        ``"replicas"``, ``"devices"``) as of one completed publish. Rows are
        also read under their own seqlocks. Spins, then yields, then sleeps
        100 us between tries (a publish takes microseconds, but a writer
        preempted on a busy machine holds the generation odd for a time
        slice); raises :class:`SeqlockBusy` after ``timeout`` seconds."""
        from .seqlock import read_table

        deadline = time.monotonic() + timeout
        n = 0
        while True:
            g = self._hwords[L.H_GENERATION]
            if not g & 1:
                fence()
                out = [read_table(getattr(self, t)) for t in tables]
                fence()
                if self._hwords[L.H_GENERATION] == g:
                    return g, out
            n += 1
            _back_off(n, deadline, "tables kept changing")

    # ---- registry blob ----------------------------------------------------
    def write_registry(self, doc: dict) -> None:
        """Supervisor only: publish the registry (names, aliases, ...) as JSON.

        Raises ``ValueError`` when it does not fit the blob capacity.
        """
        data = orjson.dumps(doc)
        if len(data) > self.sizes.registry_cap:
            raise ValueError(f"registry is {len(data)} bytes, capacity {self.sizes.registry_cap}")
        h = self.header
        h[L.H_REGISTRY_SEQ] += 1
        fence()
        self.registry[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        h[L.H_REGISTRY_LEN] = len(data)
        fence()
        h[L.H_REGISTRY_SEQ] += 1

    def read_registry(self, timeout: float = 2.0) -> tuple[int, dict]:
        """``(version, doc)``; ``version`` is the blob's even sequence word.

        Cached: parsing happens only when the version changed. Waits out a
        write as :meth:`snapshot` does (spins, then yields, then sleeps 100
        us between tries: a supervisor preempted mid-write holds the word
        odd for a time slice, and 10,000 bare spins gave up after about a
        millisecond); raises :class:`SeqlockBusy` after ``timeout`` seconds.
        """
        h = self.header
        deadline = time.monotonic() + timeout
        n = 0
        while True:
            s1 = int(h[L.H_REGISTRY_SEQ])
            if not s1 & 1:
                if self._registry_cache is not None and self._registry_cache[0] == s1:
                    return self._registry_cache
                fence()
                n_bytes = int(h[L.H_REGISTRY_LEN])
                data = self.registry[:n_bytes].tobytes()
                fence()
                if int(h[L.H_REGISTRY_SEQ]) == s1:
                    doc = orjson.loads(data) if n_bytes else {}
                    self._registry_cache = (s1, doc)
                    return self._registry_cache
            n += 1
            _back_off(n, deadline, "registry blob stayed busy")
