"""The key table: per-key policy and window counters in a segment of their
own (issue 36), beside the main segment (:mod:`.layout`), so that the
replica rows and this table grow apart.

One POSIX shared-memory segment per server (``<shm>-keys``, mode 0600),
int64 words::

    header   HEADER_WORDS           magic, layout, seqlock word, policy
                                    generation, blob length and capacity,
                                    rows, proxies, models, clock
    blob     blob_cap bytes         the policies as JSON (names, sha-256 of
                                    the secrets, models, limits): written by
                                    the supervisor under the header's seqlock
    keys     rows x K_WORDS          one row per key: its current windows'
                                    counters (minute, day, week, month) and
                                    in-flight count
    spend    proxies x models x S_WORDS   per proxy and model: the cost of
                                    its priced replicas' answers per period
    held     proxies x rows          per proxy and key: its requests in
                                    flight (their sum is the key's
                                    ``K_IN_FLIGHT``), so that a dead proxy's
                                    share is given back (:meth:`KeyTable.proxy_gone`)

Writers. The supervisor alone writes the header and the blob (seqlocked:
:meth:`KeyTable.publish`, :meth:`KeyTable.policies`). A key's row is written
by whichever proxy admits or settles a request of that key, under a lock on
that row (:meth:`KeyTable.locked`): an ``fcntl`` byte-range lock on the
row's bytes in the segment's file. Numpy has no cross-process atomic add,
and a check-then-add over N proxies must be one step or N proxies admit N
times the limit. The lock is per key (keys never wait on each other), costs
two system calls (bench/keys.py measures it), and the kernel releases it
when its holder dies, so a proxy killed inside the critical section blocks
nobody (a posix_ipc semaphore would stay taken). Windows roll lazily, under
the same lock: a row whose window id is not the current one is zeroed for
that window before it is read (:func:`roll`), so whoever looks first after
the minute turns rolls it, exactly once. The spend rows need no lock: one
writer each (their proxy), readers sum over proxies, as the main segment's
counter rows.

The clock: window ids come from :func:`periods` of :meth:`KeyTable.now`,
wall-clock seconds since the epoch, run ``clock_scale`` times faster from
the table's creation when the supervisor is started with
``GGMUX_LIMITS_CLOCK_SCALE`` (tests roll a day in seconds; never set in
production; not ``*KEY*``: such variables are secrets, scrubbed from the
supervisor's environment).
"""

from __future__ import annotations

import fcntl
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import orjson
import posix_ipc

MAGIC = 0x6767_6B65_7973  # "ggkeys"
LAYOUT = 1
HEADER_WORDS = 16
H_MAGIC, H_LAYOUT, H_SEQ, H_GEN, H_BLOB_LEN, H_BLOB_CAP, H_ROWS, H_PROXIES, H_MODELS, \
    H_SCALE_MILLI, H_ANCHOR_S = range(11)

# a key's row: window ids and their counters; the drains its requests caused
# (thousandths, decaying: proxy.admission's drain penalty) and when they were
# last brought up to date (the table's clock, ms)
K_MINUTE, K_REQS, K_TOKENS, K_IN_FLIGHT, K_DAY, K_TOK_DAY, K_WEEK, K_TOK_WEEK, K_MONTH, \
    K_TOK_MONTH, K_SPEND_MONTH_NANO, K_ADMITTED, K_REFUSED, K_DRAINS_MILLI, K_DRAINS_MS = range(15)
K_WORDS = 16
# the windows and the counters each one zeroes when it rolls
WINDOWS = ((K_MINUTE, (K_REQS, K_TOKENS)), (K_DAY, (K_TOK_DAY,)), (K_WEEK, (K_TOK_WEEK,)),
           (K_MONTH, (K_TOK_MONTH, K_SPEND_MONTH_NANO)))

# a proxy's spend row for one model: per period, its id and cost (nano-units of currency)
S_DAY, S_COST_DAY, S_WEEK, S_COST_WEEK, S_MONTH, S_COST_MONTH = range(6)
S_WORDS = 8
NANO = 1_000_000_000

DEFAULT_RESERVE_TOKENS = 512
"""Completion tokens a request that names no limit is reserved for (a key's
``reserve-tokens`` when the keys file names none; a priced model's
spending budget for every request)."""

DEFAULT_ROWS = 256
DEFAULT_BLOB = 1 << 20
NO_KEYS_BLOB = 4096  # a server without a keys file: the table holds only the spend rows
CLOCK_ENV = "GGMUX_LIMITS_CLOCK_SCALE"


def key_table_name(shm_name: str) -> str:
    """The key table's segment name for a server whose main segment is ``shm_name``."""
    return shm_name + "-keys"


# ---- periods ---------------------------------------------------------------------


def _civil(days: int) -> tuple[int, int]:
    """(year, month 1-12) of day ``days`` since 1970-01-01 (H. Hinnant's
    civil_from_days: integers only, so a scaled test clock never overflows
    :mod:`datetime`)."""
    z = days + 719468
    era = z // 146097
    doe = z - era * 146097
    yoe = (doe - doe // 1460 + doe // 36524 - doe // 146096) // 365
    doy = doe - (365 * yoe + yoe // 4 - yoe // 100)
    mp = (5 * doy + 2) // 153
    m = mp + 3 if mp < 10 else mp - 9
    return yoe + era * 400 + (m <= 2), m


def _days(y: int, m: int) -> int:
    """Days since 1970-01-01 of the first of month ``m`` of year ``y`` (days_from_civil)."""
    y -= m <= 2
    era = y // 400
    yoe = y - era * 400
    doy = (153 * (m + (-3 if m > 2 else 9)) + 2) // 5
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    return era * 146097 + doe - 719468


_day_ids = [None, (0, 0)]  # the last day seen and its (week, month): one per request


def periods(t: float) -> tuple[int, int, int, int]:
    """Window ids of time ``t`` (seconds since the epoch, UTC): (minute,
    day, ISO week (Monday first), month as ``year * 12 + month - 1``)."""
    day = int(t // 86400)
    if _day_ids[0] != day:
        y, m = _civil(day)
        _day_ids[1] = ((day + 3) // 7, y * 12 + m - 1)
        _day_ids[0] = day
    wk, mo = _day_ids[1]
    return int(t // 60), day, wk, mo


def period_end(kind: str, pid: int) -> float:
    """When window ``pid`` of ``kind`` (``minute``, ``day``, ``week``,
    ``month``) ends, seconds since the epoch."""
    if kind == "minute":
        return (pid + 1) * 60.0
    if kind == "day":
        return (pid + 1) * 86400.0
    if kind == "week":
        return ((pid + 1) * 7 - 3) * 86400.0
    y, m = divmod(pid + 1, 12)
    return _days(y, m + 1) * 86400.0


def roll(row, ids: tuple[int, int, int, int]) -> None:
    """Zero the counters of every window of ``row`` whose id is not the
    current one in ``ids`` (:func:`periods`); call it under the row's lock."""
    for (word, fields), cur in zip(WINDOWS, ids):
        if row[word] != cur:
            row[word] = cur
            for f in fields:
                row[f] = 0


def weighed(w_input: float, w_cached: float, w_output: float, prompt: int, cached: int,
            completion: int) -> int:
    """Tokens a request counts against a key's budgets: its prompt tokens
    not cached, its cached ones and its completion tokens, each times its
    weight (a negative count, unknown, counts 0)."""
    prompt = max(prompt, 0)
    cached = min(max(cached, 0), prompt)
    return round((prompt - cached) * w_input + cached * w_cached
                 + max(completion, 0) * w_output)


@dataclass(slots=True)
class TableShape:
    """Sizes of a key table: ``rows`` keys, ``proxies`` x ``models`` spend
    rows, ``blob_cap`` bytes of policy JSON."""

    rows: int = DEFAULT_ROWS
    proxies: int = 1
    models: int = 64
    blob_cap: int = DEFAULT_BLOB


class KeyTable:
    """A mapped key table (module docstring). :meth:`create` (the
    supervisor) or :meth:`attach` (a proxy, a test)."""

    def __init__(self, mem: posix_ipc.SharedMemory, owner: bool) -> None:
        self.name = mem.name
        self.fd = mem.fd  # kept open: the row locks are on it
        self.owner = owner
        import mmap

        self.map = mmap.mmap(mem.fd, mem.size)
        self.header = np.ndarray((HEADER_WORDS,), np.int64, self.map, 0)
        if not owner and int(self.header[H_MAGIC]) != MAGIC:
            raise ValueError(f"{self.name}: not a ggmux key table")
        if not owner and int(self.header[H_LAYOUT]) != LAYOUT:
            raise ValueError(f"{self.name}: key table layout {int(self.header[H_LAYOUT])}, "
                             f"this ggmux reads {LAYOUT}")
        self._views()

    def _views(self) -> None:
        h = self.header
        cap, rows = int(h[H_BLOB_CAP]), int(h[H_ROWS])
        proxies, models = int(h[H_PROXIES]), int(h[H_MODELS])
        off = HEADER_WORDS * 8
        self.blob_off = off
        off += cap
        self.keys_off = off
        self.keys = np.ndarray((rows, K_WORDS), np.int64, self.map, off)
        off += rows * K_WORDS * 8
        self.spend = np.ndarray((proxies, models, S_WORDS), np.int64, self.map, off)
        off += proxies * models * S_WORDS * 8
        self.held = np.ndarray((proxies, rows), np.int64, self.map, off)
        self.scale = int(h[H_SCALE_MILLI]) / 1000.0 or 1.0
        self.anchor = float(h[H_ANCHOR_S])

    @staticmethod
    def size(shape: TableShape) -> int:
        """Bytes of a table of ``shape``."""
        cap = (shape.blob_cap + 7) // 8 * 8
        return (HEADER_WORDS * 8 + cap + shape.rows * K_WORDS * 8
                + shape.proxies * shape.models * S_WORDS * 8 + shape.proxies * shape.rows * 8)

    @classmethod
    def create(cls, name: str, shape: TableShape, clock_scale: float | None = None) -> KeyTable:
        """A fresh table (a stale one of the same name is removed first),
        mode 0600. ``clock_scale``: see the module docstring (None: from
        :data:`CLOCK_ENV`, else 1)."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=cls.size(shape))
        if clock_scale is None:
            clock_scale = float(os.environ.get(CLOCK_ENV) or 1.0)
        t = cls.__new__(cls)
        import mmap

        t.name, t.fd, t.owner = mem.name, mem.fd, True
        t.map = mmap.mmap(mem.fd, mem.size)
        t.header = np.ndarray((HEADER_WORDS,), np.int64, t.map, 0)
        h = t.header
        h[H_LAYOUT] = LAYOUT
        h[H_BLOB_CAP] = (shape.blob_cap + 7) // 8 * 8
        h[H_ROWS] = shape.rows
        h[H_PROXIES] = shape.proxies
        h[H_MODELS] = shape.models
        h[H_SCALE_MILLI] = round(clock_scale * 1000)
        h[H_ANCHOR_S] = int(time.time())
        h[H_MAGIC] = MAGIC
        t._views()
        return t

    @classmethod
    def attach(cls, name: str) -> KeyTable:
        """Map an existing table; raises ``posix_ipc.ExistentialError`` when
        there is none, ``ValueError`` when it is not one."""
        return cls(posix_ipc.SharedMemory(name), owner=False)

    def close(self) -> None:
        """Unmap (and, for the creator, remove) the table."""
        self.header = self.keys = self.spend = self.held = None
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes with the process
            pass
        os.close(self.fd)
        if self.owner:
            try:
                posix_ipc.unlink_shared_memory(self.name)
            except posix_ipc.ExistentialError:
                pass

    # ---- the clock ----------------------------------------------------------------
    def now(self) -> float:
        """The table's time, seconds since the epoch (module docstring)."""
        t = time.time()
        if self.scale == 1.0:
            return t
        return self.anchor + (t - self.anchor) * self.scale

    def wall(self, table_s: float) -> float:
        """The wall-clock time (seconds since the epoch) of the table's time
        ``table_s``: the inverse of :meth:`now`, so that a window of the
        table's clock can be looked up in the usage ledger, whose rows carry
        wall-clock times."""
        if self.scale == 1.0:
            return table_s
        return self.anchor + (table_s - self.anchor) / self.scale

    def real_seconds(self, table_seconds: float) -> int:
        """Wall-clock seconds (at least 1, rounded up) of ``table_seconds``
        of the table's clock: a Retry-After."""
        return max(1, math.ceil(table_seconds / self.scale))

    # ---- policies (supervisor writes, proxies read) -------------------------------
    def publish(self, doc: dict) -> int:
        """Write the policies ``doc`` (JSON-able, no secret in it) under the
        seqlock and bump the generation; returns it. Raises ``ValueError``
        when the JSON does not fit the blob."""
        data = orjson.dumps(doc)
        h = self.header
        if len(data) > int(h[H_BLOB_CAP]):
            raise ValueError(f"key policies of {len(data)} bytes do not fit the key table's "
                             f"{int(h[H_BLOB_CAP])}")
        h[H_SEQ] += 1  # odd: being written
        self.map[self.blob_off:self.blob_off + len(data)] = data
        h[H_BLOB_LEN] = len(data)
        h[H_GEN] += 1
        h[H_SEQ] += 1
        return int(h[H_GEN])

    def generation(self) -> int:
        """The policies' generation (a proxy re-reads them when it changed)."""
        return int(self.header[H_GEN])

    def policies(self, retries: int = 10_000) -> tuple[int, dict]:
        """``(generation, policies)`` as last published; raises
        ``RuntimeError`` when the writer held the seqlock past ``retries``."""
        h = self.header
        for _ in range(retries):
            s1 = int(h[H_SEQ])
            if s1 & 1:
                continue
            gen, n = int(h[H_GEN]), int(h[H_BLOB_LEN])
            data = bytes(self.map[self.blob_off:self.blob_off + n])
            if int(h[H_SEQ]) == s1:
                return gen, orjson.loads(data) if data else {}
        raise RuntimeError(f"{self.name}: the key policies stayed busy")

    # ---- a key's row ----------------------------------------------------------------
    @contextmanager
    def locked(self, row: int):
        """Hold key ``row``'s lock (module docstring); yields its int64 row."""
        off = self.keys_off + row * K_WORDS * 8
        fcntl.lockf(self.fd, fcntl.LOCK_EX, K_WORDS * 8, off)
        try:
            yield self.keys[row]
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, K_WORDS * 8, off)

    def lock(self, row: int) -> None:
        """Take key ``row``'s lock (the hot path's form of :meth:`locked`)."""
        fcntl.lockf(self.fd, fcntl.LOCK_EX, K_WORDS * 8, self.keys_off + row * K_WORDS * 8)

    def unlock(self, row: int) -> None:
        fcntl.lockf(self.fd, fcntl.LOCK_UN, K_WORDS * 8, self.keys_off + row * K_WORDS * 8)

    def proxy_gone(self, proxy: int) -> None:
        """Proxy ``proxy`` died (its replacement is not started yet): its
        requests in flight no longer count against their keys, and its spend
        rows stay (the spend happened)."""
        for row in np.flatnonzero(self.held[proxy]):
            with self.locked(int(row)) as r:
                r[K_IN_FLIGHT] = max(0, int(r[K_IN_FLIGHT]) - int(self.held[proxy, row]))
                self.held[proxy, row] = 0

    def clear_row(self, row: int) -> None:
        """Zero key ``row`` (a new key in a row no key held)."""
        with self.locked(row) as r:
            r[:] = 0

    # ---- spend of priced replicas ----------------------------------------------------
    def add_spend(self, proxy: int, model: int, nano: int, ids: tuple[int, int, int, int]) -> None:
        """Add ``nano`` (currency x 1e9) to this proxy's spend on ``model``
        in the periods ``ids``; only ``proxy`` writes its rows."""
        r = self.spend[proxy, model]
        for w, c, cur in ((S_DAY, S_COST_DAY, ids[1]), (S_WEEK, S_COST_WEEK, ids[2]),
                          (S_MONTH, S_COST_MONTH, ids[3])):
            if r[w] != cur:
                r[c] = 0
                r[w] = cur
            r[c] += nano

    @contextmanager
    def budget_locked(self, model: int):
        """Hold model ``model``'s budget lock (the bytes of proxy 0's spend row
        of it, whichever proxy asks): a reservation's check of every proxy's
        spend and its own add are one step, as a key row's check and add
        are under its lock, or N proxies would pass one budget N times."""
        off = self.keys_off + int(self.keys.shape[0]) * K_WORDS * 8 + model * S_WORDS * 8
        fcntl.lockf(self.fd, fcntl.LOCK_EX, S_WORDS * 8, off)
        try:
            yield
        finally:
            fcntl.lockf(self.fd, fcntl.LOCK_UN, S_WORDS * 8, off)

    def settle_spend(self, proxy: int, model: int, reserved: int,
                     then: tuple[int, int, int, int], cost: int,
                     now: tuple[int, int, int, int]) -> None:
        """A request of this proxy for ``model`` that reserved ``reserved``
        nano-units at admission (periods ``then``) cost ``cost``: in each
        period still current the reservation becomes the cost; a period
        that rolled since lost the reservation with its roll and gets the
        cost (periods ``now``)."""
        r = self.spend[proxy, model]
        for w, c, was, cur in ((S_DAY, S_COST_DAY, then[1], now[1]),
                               (S_WEEK, S_COST_WEEK, then[2], now[2]),
                               (S_MONTH, S_COST_MONTH, then[3], now[3])):
            if r[w] != cur:
                r[c] = 0
                r[w] = cur
            r[c] = max(0, r[c] + cost - (reserved if was == cur else 0))

    def spent(self, model: int, ids: tuple[int, int, int, int]) -> tuple[int, int, int]:
        """Nano-units spent on ``model`` by every proxy in the current day,
        week and month."""
        s = self.spend[:, model]
        return (int(s[s[:, S_DAY] == ids[1], S_COST_DAY].sum()),
                int(s[s[:, S_WEEK] == ids[2], S_COST_WEEK].sum()),
                int(s[s[:, S_MONTH] == ids[3], S_COST_MONTH].sum()))


__all__ = ["K_WORDS", "KeyTable", "TableShape", "key_table_name", "period_end", "periods",
           "roll", "weighed"]
