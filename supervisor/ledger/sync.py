"""Keys' limits across nodes (issue 36): the windows of the key table
reconciled from a shared usage ledger.

Within one server, N proxies enforce one limit through the key table in
shared memory (:mod:`ggmux.shm.keytable`). Across servers (cluster nodes,
or two servers of one machine) that share a ledger, the ledger is the
shared truth: every ``--ledger-sync`` seconds (:data:`DEFAULT_SYNC_S`), the
supervisor reads from it, in one query on a job's thread
(:meth:`~.store.SqlStore.others_since`), each key's usage by the *other*
nodes (rows whose ``node`` is not this one's) since the start of each of
its windows: the minute (requests; prompt + completion tokens), the day,
week and month (weighed tokens) and the month's cost. Back on the loop's
thread, it adds to the key's row, under the row's lock and after
:func:`~ggmux.shm.keytable.roll`, what grew since its last sync, remembering
per key and window the window's id and what it added (a new window: the
whole amount). A key's counters are then "this node's live counts + the
other nodes' usage as of the last sync", and the proxies' admission
(:mod:`ggmux.proxy.admission`) is unchanged.

At start, the day, week and month windows are seeded from this node's own
rows (:meth:`~ggmux.supervisor.keys.KeyRegistry.seed` with ``own``) and
the first sync, run before serving, adds the others', so no row counts
twice.

What it bounds, not prevents: a node sees another node's request once the
request has ended, its row has been written (the writer reads the ring
every :data:`~.ledger.READ_EVERY_S` and hands batches over every
:data:`~.ledger.FLUSH_EVERY_S`) and its own next sync has read it. So each
node may admit, beyond a limit, what the other nodes admitted within that
delay (``--ledger-sync`` + about 0.6 s + the requests' duration), and N
nodes together at most the limit plus what they admit in one such delay. A
burst spread over the nodes within one delay of a window's start is the
worst case: each node may then admit the whole limit. bench/keys.py
(``two-node``) measures it (bench/RESULTS.md §26).

What it costs: one query per interval that sums the other nodes' rows
since the earliest window any key limits (the month's, with a monthly
budget; the minute's with rpm / tpm only) through the ledger's ``time``
index, off the loop; nothing when no key has a limit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ...shm.keytable import (
    K_DAY,
    K_MINUTE,
    K_MONTH,
    K_REQS,
    K_SPEND_MONTH_NANO,
    K_TOK_DAY,
    K_TOK_MONTH,
    K_TOK_WEEK,
    K_TOKENS,
    K_WEEK,
    NANO,
    period_end,
    periods,
    roll,
    weighed,
)
from ..jobs import Jobs
from .records import Totals
from .store import SqlStore, StoreError

log = logging.getLogger(__name__)

DEFAULT_SYNC_S = 2.0
"""``--ledger-sync``: seconds between two reads of the other nodes' usage."""

KINDS = ("minute", "day", "week", "month")
WORDS = (K_MINUTE, K_DAY, K_WEEK, K_MONTH)  # each window's id word in a key's row


@dataclass(slots=True)
class Added:
    """What a sync added to one key's window: its ``window`` id and the
    amounts (``counts``: per counter word of the row)."""

    window: int
    counts: dict[int, int]


def _needed(p) -> tuple[bool, bool, bool, bool]:
    """Which windows key policy ``p`` (a :class:`~..keys.KeyPolicy`) limits:
    (minute, day, week, month)."""
    return (bool(p.rpm or p.tpm), bool(p.tokens_per_day), bool(p.tokens_per_week),
            bool(p.tokens_per_month or p.spend_per_month))


class LedgerSync:
    """See the module docstring. ``keys``: the :class:`~..keys.KeyRegistry`
    (its table, policies and rows); ``store``: a store of its own (the
    writer job holds the ledger's: a store is one thread's at a time);
    ``node``: this node's name in the ledger's ``node`` column;
    ``interval``: seconds between syncs (above 0)."""

    def __init__(self, keys, store: SqlStore, node: str, jobs: Jobs,
                 interval: float = DEFAULT_SYNC_S) -> None:
        if not interval > 0:
            raise ValueError("--ledger-sync must be above 0 (or 0: off)")
        self.keys = keys
        self.store = store
        self.node = node
        self.jobs = jobs
        self.interval = interval
        self.added: dict[tuple[str, int], Added] = {}  # (key name, window index) -> what we added
        self.busy = False  # a query in flight
        self.next_at = 0.0  # monotonic: the next sync not before
        self.error: str | None = None
        self.syncs = 0

    # ---- the query ------------------------------------------------------------------
    def _plan(self) -> tuple[tuple[int, int, int, int], list[float]] | None:
        """``(window ids, their starts as wall-clock seconds)`` of the
        windows some key limits, or None when no key limits any."""
        t = self.keys.table
        if t is None or not self.keys.keys:
            return None
        need = [False] * 4
        for p in self.keys.keys.values():
            need = [a or b for a, b in zip(need, _needed(p))]
        if not any(need):
            return None
        ids = periods(t.now())
        starts = [t.wall(period_end(k, pid - 1)) if n else float("inf")
                  for k, pid, n in zip(KINDS, ids, need)]
        return ids, starts

    def _query(self, starts: list[float]) -> dict[str, list[Totals]]:
        """The other nodes' totals per key and window (inf: a window no key
        limits, left out of the query). Raises :class:`StoreError`."""
        used = [s for s in starts if s != float("inf")]
        got = self.store.others_since(self.node, used)
        out = {}
        for key, tots in got.items():
            it = iter(tots)
            out[key] = [next(it) if s != float("inf") else None for s in starts]
        return out

    def now(self) -> None:
        """Sync at once, blocking (at start, before the proxies serve): a
        store that fails is logged and the next :meth:`step` tries again."""
        plan = self._plan()
        if plan is None:
            return
        try:
            self.apply(plan[0], self._query(plan[1]))
        except StoreError as e:
            self._failed(e)

    def step(self, now: float | None = None) -> None:
        """One turn of the supervisor's loop (monotonic seconds ``now``):
        start a sync on a job's thread when one is due and none is in
        flight. Never blocks."""
        now = time.monotonic() if now is None else now
        if self.busy or now < self.next_at:
            return
        self.next_at = now + self.interval
        plan = self._plan()
        if plan is None:
            return
        ids, starts = plan
        self.busy = True
        self.jobs.start("ledger-sync", lambda: self._query(starts),
                        lambda result: self._done(ids, result))

    def _done(self, ids, result) -> None:
        self.busy = False
        if isinstance(result, Exception):
            self._failed(result)
            return
        self.apply(ids, result)

    def _failed(self, e: Exception) -> None:
        text = str(e) if isinstance(e, StoreError) else repr(e)
        if self.error is None:
            log.error("keys: cannot read the other nodes' usage from %s (limits hold per node "
                      "until it works again): %s", self.store.where, text)
        self.error = text

    # ---- into the key table -----------------------------------------------------------
    def apply(self, ids: tuple[int, int, int, int],
              others: dict[str, list[Totals | None]]) -> None:
        """Add to each key's row what the other nodes used since the last
        sync (``others``: :meth:`_query`'s, for windows ``ids``), under the
        row's lock. A window that rolled since the query was planned is left
        alone (its usage belongs to the window before); the next sync reads
        the new one."""
        if self.error is not None:
            log.warning("keys: reading the other nodes' usage from %s works again",
                        self.store.where)
            self.error = None
        self.syncs += 1
        t = self.keys.table
        if t is None:
            return
        for name, p in self.keys.keys.items():
            row = self.keys.rows.get(name)
            tots = others.get(name)
            if row is None:
                continue
            want = []
            for i, (tot, limited) in enumerate(zip(tots or (None,) * 4, _needed(p))):
                if not limited:
                    continue
                tot = tot or Totals()
                if i == 0:
                    counts = {K_REQS: tot.requests,
                              K_TOKENS: tot.prompt_tokens + tot.completion_tokens}
                else:
                    counts = {(K_TOK_DAY, K_TOK_WEEK, K_TOK_MONTH)[i - 1]: weighed(
                        p.input_weight, p.cached_weight, p.output_weight, tot.prompt_tokens,
                        tot.cached_tokens, tot.completion_tokens)}
                    if i == 3:
                        counts[K_SPEND_MONTH_NANO] = int(tot.cost * NANO)
                want.append((i, counts))
            if not want:
                continue
            with t.locked(row) as r:
                roll(r, periods(t.now()))
                for i, counts in want:
                    if int(r[WORDS[i]]) != ids[i]:
                        continue  # rolled since the query was planned
                    was = self.added.get((name, i))
                    before = was.counts if was is not None and was.window == ids[i] else {}
                    for word, n in counts.items():
                        d = n - before.get(word, 0)
                        if d:
                            r[word] = max(0, int(r[word]) + d)
                    self.added[(name, i)] = Added(ids[i], counts)

    def close(self) -> None:
        """Close the store (a query still in flight keeps its connection
        until its thread ends)."""
        if not self.busy:
            self.store.close()

