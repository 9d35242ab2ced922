"""The supervisor's side of the usage ledger: ring -> buffer -> writer job.

Each turn of the poll loop, :meth:`UsageLedger.step` reads the request
ring's new records (at most every :data:`READ_EVERY_S`; a numpy copy of
what the proxies wrote since the cursor, never a wait), turns them into
rows and appends them to an in-memory buffer; at most every
:data:`FLUSH_EVERY_S`, when no write is in flight and the store is not in
its retry pause, it hands up to :data:`BATCH_ROWS` rows to a job
(:class:`~ggmux.supervisor.jobs.Jobs`: a thread) that writes them in one
transaction. The loop never waits for the store.

What can lose a row, and what bounds it:

* The ring laps: a proxy writes more than ``--requests-kept`` records
  (default 1000) between two reads. Reads happen every turn (at most
  250 ms apart while idle, 50 ms while busy), so that takes over 4000
  requests per second per proxy; each record missed is counted
  (``lost``: the page, ``/metrics``, a warning).
* The store is down or the disk full for longer than the buffer holds:
  ``--ledger-buffer`` rows (default :data:`DEFAULT_BUFFER`) wait in memory;
  beyond, the oldest are dropped and counted (``dropped``). The failure is
  logged once when it starts and once when writing resumes.
* The server stops while the store is down: what is still buffered after
  :data:`CLOSE_TIMEOUT_S` is logged as lost (no spill file: the disk may be
  the thing that is full).

A batch is written in one transaction, so a failure writes none of it and
the retry writes it once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from ..shm.requestring import F_FORWARDED, Q_FLAGS, Q_WALL_NS, RequestRing
from .jobs import Jobs
from .records import RowContext, Totals, UsageRow
from .store import SqlStore, StoreError

log = logging.getLogger(__name__)

READ_EVERY_S = 0.1
"""The ring is read at most this often (each loop turn otherwise)."""
FLUSH_EVERY_S = 0.5
"""A batch is handed to the writer job at most this often."""
BATCH_ROWS = 5000
"""Rows per write (one transaction)."""
DEFAULT_BUFFER = 100_000
"""``--ledger-buffer``: rows kept in memory while the store cannot take them
(about 300 bytes each: 30 MB)."""
RETRY_S = 1.0
RETRY_MAX_S = 30.0
"""A failed write is retried after :data:`RETRY_S`, doubling up to this."""
CLOSE_TIMEOUT_S = 10.0
"""At a stop, how long the last rows may take to be written."""
STATUS_EVERY_S = 1.0
"""The status blob (the page, ``/metrics``) is rewritten at most this often."""


class UsageLedger:
    """See the module docstring. ``store``: where rows go; ``ring``: the
    request ring (new, its cursor at zero); ``ctx``: the record -> row
    lookups; ``jobs``: the supervisor's jobs; ``buffer``: the most rows held
    in memory; ``publish(doc)``: called with :meth:`status` when it changed
    (at most every :data:`STATUS_EVERY_S`)."""

    def __init__(self, store: SqlStore, ring: RequestRing, ctx: RowContext, jobs: Jobs,
                 buffer: int = DEFAULT_BUFFER,
                 publish: Callable[[dict], None] | None = None) -> None:
        if buffer < 1:
            raise ValueError("--ledger-buffer must be at least 1")
        self.store = store
        self.ring = ring
        self.ctx = ctx
        self.jobs = jobs
        self.buffer = buffer
        self.publish = publish
        self.pending: deque[UsageRow] = deque()
        self.writing: list[UsageRow] | None = None  # the batch of the job in flight
        self.cursor = ring.written()
        self.lost = 0  # ring records overwritten before they were read
        self.dropped = 0  # rows dropped from a full buffer
        self.written = 0
        self.error: str | None = None  # the store's failure, None while it works
        self.failing_since = 0.0
        self.retry_s = RETRY_S
        self.next_try = 0.0  # monotonic: no write before
        self.schema_ok = False
        self.counters: dict[str, Totals] = {}  # key name -> since this server started
        self._read_at = self._flush_at = self._status_at = 0.0
        self._status_dirty = True
        self.blob = None  # the status blob (.wiring), closed with the ledger
        self.warning: str | None = None  # shown beside the status (a node name two servers use)
        self.syncs = 0  # the keys' syncs with the other nodes (.sync) so far

    # ---- the loop's step ----------------------------------------------------------
    def step(self, now: float | None = None) -> None:
        """One turn (monotonic seconds ``now``): read the ring, start a
        write, publish the status, each when due. Never blocks."""
        now = time.monotonic() if now is None else now
        if now - self._read_at >= READ_EVERY_S:
            self._read_at = now
            self.read()
        if (self.pending and self.writing is None and now >= self.next_try
                and now - self._flush_at >= FLUSH_EVERY_S):
            self._flush_at = now
            self._start_write()
        if self.publish is not None and self._status_dirty and (
                now - self._status_at >= STATUS_EVERY_S):
            self._status_at = now
            self._status_dirty = False
            self.publish(self.status())

    def note_sync(self, syncs: int, warning: str | None) -> None:
        """Show the keys' sync (:mod:`.sync`) with the status (the page,
        ``/usage``) from the next publication on: ``syncs`` done, and its
        ``warning`` (None: none)."""
        if (syncs, warning) != (self.syncs, self.warning):
            self.syncs, self.warning = syncs, warning
            self._status_dirty = True

    def read(self) -> int:
        """Move the ring's new records into the buffer; the rows added. A
        request another cluster node forwarded here (``F_FORWARDED``) is
        left out: the node the client asked has its row (with this node
        as its replica), so a shared PostgreSQL ledger counts it once."""
        ring = self.ring
        if np.array_equal(ring.written(), self.cursor):
            return 0
        found, ends = ring.read(self.cursor)
        expected = int(np.maximum(ends - self.cursor, 0).sum())
        self.cursor = ends
        if len(found) < expected:
            missed = expected - len(found)
            if not self.lost:
                log.warning("usage ledger: %d request records were overwritten in the request "
                            "ring before they were read (raise --requests-kept)", missed)
            self.lost += missed
        found.sort(key=lambda r: int(r[1][Q_WALL_NS]))  # by arrival
        added = 0
        for _, rec, _, _ in found:
            if int(rec[Q_FLAGS]) & F_FORWARDED:
                continue  # (another node's request: that node's row counts it, once)
            added += 1
            row = self.ctx.row(rec)
            self.pending.append(row)
            tot = self.counters.get(row.key)
            if tot is None:
                tot = self.counters[row.key] = Totals()
            tot.add(row)
        self._bound()
        self._status_dirty = True
        return added

    def _bound(self) -> None:
        held = len(self.pending) + (len(self.writing) if self.writing else 0)
        over = held - self.buffer
        if over > 0:
            over = min(over, len(self.pending))
            for _ in range(over):
                self.pending.popleft()
            if not self.dropped:
                log.error("usage ledger: the buffer is full (%d rows, --ledger-buffer): "
                          "dropping the oldest rows", self.buffer)
            self.dropped += over

    def _start_write(self) -> None:
        n = min(BATCH_ROWS, len(self.pending))
        batch = [self.pending.popleft() for _ in range(n)]
        self.writing = batch
        store = self.store

        def write() -> int:
            if not self.schema_ok:
                store.schema()
            store.write(batch)
            return len(batch)

        self.jobs.start("ledger-write", write, self._written)

    def _written(self, result) -> None:
        """The writer job's result, on the loop's thread."""
        batch, self.writing = self.writing or [], None
        self._status_dirty = True
        if isinstance(result, Exception):
            self.pending.extendleft(reversed(batch))  # first again, in order
            self._bound()
            now = time.monotonic()
            self.next_try = now + self.retry_s
            self.retry_s = min(self.retry_s * 2, RETRY_MAX_S)
            text = str(result) if isinstance(result, StoreError) else repr(result)
            if self.error is None:
                self.failing_since = time.time()
                log.error("usage ledger: writing to %s failed, serving goes on and rows wait "
                          "in memory (up to %d): %s", self.store.where, self.buffer, text)
            self.error = text
            return
        self.schema_ok = True
        self.written += int(result)
        self.retry_s = RETRY_S
        if self.error is not None:
            log.warning("usage ledger: writing to %s works again (failed for %.0f s)",
                        self.store.where, time.time() - self.failing_since)
            self.error = None
        if self.pending:
            self._flush_at = 0.0  # more waiting: the next turn writes again

    def recover(self, rows: list[UsageRow]) -> int:
        """Queue the rows of a dead server's last requests
        (:mod:`.leftover`) that the store does not hold yet (same request
        id, arrival time and node), before this server serves: they are
        written as any row, and :meth:`totals_since` (the keys' windows)
        counts them meanwhile. Blocking (one query), at start only. The
        number queued; 0 when the store cannot be read (logged: without
        knowing which it holds, none is written twice)."""
        if not rows:
            return 0
        try:
            if not self.schema_ok:
                self.store.schema()
                self.schema_ok = True
            have = self.store.requests_since(min(r.time for r in rows), self.ctx.node)
        except StoreError as e:
            log.error("usage ledger: cannot read %s to recover the %d requests a stopped "
                      "server's ring held (they are not written): %s", self.store.where,
                      len(rows), e)
            return 0
        missing = [r for r in rows if (r.request_id, r.time) not in have]
        self.pending.extend(missing)
        self._bound()
        self._status_dirty = True
        if missing:
            log.warning("usage ledger: %d requests the stopped server answered had no row "
                        "yet; writing them now", len(missing))
        return len(missing)

    # ---- what others read ---------------------------------------------------------------
    def status(self) -> dict:
        """The ledger's state for the page and ``/metrics``: ``store`` (where,
        no password), ``ok``, ``error``, ``failing_since`` (Unix s),
        ``pending`` (rows in memory), ``written``, ``lost``, ``dropped``,
        ``syncs`` and ``warning`` (:meth:`note_sync`), and
        ``keys``: key name -> [requests, prompt, cached, completion tokens,
        cost] since this server started ("" for requests without a policy key)."""
        return {
            "store": self.store.where, "ok": self.error is None, "error": self.error,
            "failing_since": self.failing_since if self.error else None,
            "pending": len(self.pending) + (len(self.writing) if self.writing else 0),
            "written": self.written, "lost": self.lost, "dropped": self.dropped,
            "syncs": self.syncs, "warning": self.warning,
            "keys": {k: [t.requests, t.prompt_tokens, t.cached_tokens, t.completion_tokens,
                         round(t.cost, 9)] for k, t in self.counters.items()},
        }

    def totals_since(self, since_s: float, own: bool = False) -> dict[str, Totals]:
        """Key name -> :class:`Totals` since ``since_s`` (Unix seconds): the
        store's rows plus those still in memory (the contract with the keys'
        windows, read once at start: a blocking query, before serving);
        ``own``: only this node's rows (its ``node`` column: the rest of a
        shared ledger is the sync's, :mod:`.sync`). A store that fails gives
        the memory's rows only (logged)."""
        out: dict[str, Totals] = {}
        try:
            if not self.schema_ok:
                self.store.schema()
                self.schema_ok = True
            out = self.store.totals_since(since_s, self.ctx.node if own else None)
        except StoreError as e:
            log.error("usage ledger: cannot read the totals from %s (windows start from "
                      "what this server saw): %s", self.store.where, e)
        for row in [*(self.writing or ()), *self.pending]:
            if row.time >= since_s:
                out.setdefault(row.key, Totals()).add(row)
        return out

    # ---- the end ------------------------------------------------------------------------
    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """At a stop (the proxies gone): read the ring's last records and
        write everything buffered, waiting up to ``timeout`` seconds for
        the job in flight and the store; what is left is logged as lost."""
        deadline = time.monotonic() + timeout
        self.read()
        while self.writing is not None and time.monotonic() < deadline:
            self.jobs.step()
            time.sleep(0.01)
        while self.pending and self.writing is None and time.monotonic() < deadline:
            batch = [self.pending.popleft() for _ in range(min(BATCH_ROWS, len(self.pending)))]
            try:
                if not self.schema_ok:
                    self.store.schema()
                    self.schema_ok = True
                self.store.write(batch)
                self.written += len(batch)
            except StoreError as e:
                self.pending.extendleft(reversed(batch))
                log.error("usage ledger: the last writes to %s failed: %s", self.store.where, e)
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        left = len(self.pending) + (len(self.writing) if self.writing else 0)
        if left:
            log.error("usage ledger: %d rows were not written to %s and are lost",
                      left, self.store.where)
        if self.writing is None:
            self.store.close()  # (a job still in flight keeps its connection)
