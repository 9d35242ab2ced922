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
(``two-node``) measures it (bench/RESULTS.md §26b).

What it costs: off the loop, on a job's thread, one query per interval
that sums the other nodes' rows since the last full read's cut (about
:data:`LATE_S` + :data:`FULL_EVERY_S` of rows, through the ledger's
``time`` index), and every :data:`FULL_EVERY_S` a full read: the rows
since the earliest window any key limits (the month's, with a monthly
budget; 0.6 s over 130 000 rows on SQLite, bench/keys.py ``sync-query``),
which catches the rows that came later than the cut; nothing when no key
has a limit.
"""

from __future__ import annotations

import logging
import secrets
import time
from dataclasses import dataclass

from ..shm.keytable import (
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
from .jobs import Jobs
from .records import Totals
from .store import SqlStore, StoreError

log = logging.getLogger(__name__)

DEFAULT_SYNC_S = 2.0
"""``--ledger-sync``: seconds between two reads of the other nodes' usage."""

FULL_EVERY_S = 60.0
"""The other nodes' rows since each window's start are read whole at most
this often (a scan of the month's rows, with a monthly budget); in between,
each sync reads only those since the last full read's cut."""
LATE_S = 300.0
"""The cut of a full read: this long before it. A row reaches the ledger
when its request ends (its time is the request's arrival) plus the
writer's delay: a row later than this (a request longer, the store down
meanwhile) is counted at the next full read, up to :data:`FULL_EVERY_S`
later."""
INF = float("inf")
KINDS = ("minute", "day", "week", "month")
WORDS = (K_MINUTE, K_DAY, K_WEEK, K_MONTH)  # each window's id word in a key's row


@dataclass(slots=True)
class Added:
    """What a sync added to one key's window: its ``window`` id and the
    amounts (``counts``: per counter word of the row)."""

    window: int
    counts: dict[int, int]


@dataclass(slots=True)
class Plan:
    """One sync: the window ``ids`` (:func:`~ggmux.shm.keytable.periods`),
    their ``starts`` (wall-clock s; inf: no key limits it), ``need`` (which
    windows some key limits), ``full`` (a full read), ``cut`` (wall-clock
    s: a full read's base ends there, the recent rows start there) and
    ``mono`` (when it was planned, monotonic s)."""

    ids: tuple[int, int, int, int]
    starts: list[float]
    need: tuple[bool, ...]
    full: bool
    cut: float
    mono: float


def _needed(p) -> tuple[bool, bool, bool, bool]:
    """Which windows key policy ``p`` (a :class:`~ggmux.supervisor.keys_file.KeyPolicy`) limits:
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
        # the last full read: per key and window, the other nodes' rows from the
        # window's start up to `cut` (wall-clock s), for window ids `base_ids`
        self.base: dict[str, list[Totals | None]] = {}
        self.base_ids: tuple[int, int, int, int] | None = None
        self.base_need = (False,) * 4
        self.cut = 0.0
        self.full_at = -FULL_EVERY_S  # monotonic
        # this server's claim on its node name (store.claim_node): another token
        # found there after our first claim is another live server of that name
        self.token = secrets.token_hex(8)
        self.claimed = False
        self.clash: str | None = None  # why the node name is not this server's alone

    # ---- the query ------------------------------------------------------------------
    def _plan(self, mono: float) -> Plan | None:
        """The next sync's :class:`Plan`, or None when no key limits any
        window. A full read when none was made, when a window a key limits
        has no base, or every :data:`FULL_EVERY_S`."""
        t = self.keys.table
        if t is None or not self.keys.keys:
            return None
        need = (False,) * 4
        for p in self.keys.keys.values():
            need = tuple(a or b for a, b in zip(need, _needed(p)))
        if not any(need):
            return None
        ids = periods(t.now())
        starts = [t.wall(period_end(k, pid - 1)) if n else INF
                  for k, pid, n in zip(KINDS, ids, need)]
        full = (self.base_ids is None or mono >= self.full_at + FULL_EVERY_S
                or any(n and not b for n, b in zip(need, self.base_need)))
        return Plan(ids, starts, need, full, time.time() - LATE_S if full else self.cut, mono)

    def _query(self, plan: Plan) -> tuple[dict, dict]:
        """``(base, recent)``: the other nodes' totals per key and window
        (None: a window no key limits) of the rows from each window's start
        up to the plan's cut (a full read; else ``{}``), and of those since
        the later of the two. Raises :class:`StoreError`."""
        used = [i for i, s in enumerate(plan.starts) if s != INF]

        def spread(got: dict[str, list[Totals]]) -> dict[str, list[Totals | None]]:
            out = {}
            for key, tots in got.items():
                row: list[Totals | None] = [None] * 4
                for i, tot in zip(used, tots):
                    row[i] = tot
                out[key] = row
            return out

        prev = self.store.claim_node(self.node, self.token, time.time())
        recent = spread(self.store.others_since(
            self.node, [max(plan.starts[i], plan.cut) for i in used]))
        base = spread(self.store.others_since(
            self.node, [plan.starts[i] for i in used], until=plan.cut)) if plan.full else {}
        return base, recent, prev

    def now(self) -> None:
        """Sync at once, blocking (at start, before the proxies serve): a
        store that fails is logged and the next :meth:`step` tries again."""
        plan = self._plan(time.monotonic())
        if plan is None:
            return
        try:
            result = self._query(plan)
        except StoreError as e:
            self._failed(e)
            return
        self._done(plan, result)

    def step(self, now: float | None = None) -> None:
        """One turn of the supervisor's loop (monotonic seconds ``now``):
        start a sync on a job's thread when one is due and none is in
        flight. Never blocks."""
        now = time.monotonic() if now is None else now
        if self.busy or now < self.next_at:
            return
        self.next_at = now + self.interval
        plan = self._plan(now)
        if plan is None:
            return
        self.busy = True
        self.jobs.start("ledger-sync", lambda: self._query(plan),
                        lambda result: self._done(plan, result))

    def _done(self, plan: Plan, result) -> None:
        self.busy = False
        if isinstance(result, Exception):
            self._failed(result)
            return
        base, recent, prev = result
        self._claimed(prev)
        if plan.full:
            self.base, self.base_ids, self.base_need = base, plan.ids, plan.need
            self.cut, self.full_at = plan.cut, plan.mono
        totals: dict[str, list[Totals | None]] = {}
        for key in set(self.base) | set(recent):
            old, new = self.base.get(key) or [None] * 4, recent.get(key) or [None] * 4
            row: list[Totals | None] = []
            for i in range(4):
                tot = Totals()
                # a window that rolled since the base was read started after its cut
                if old[i] is not None and self.base_ids is not None \
                        and self.base_ids[i] == plan.ids[i]:
                    tot.merge(old[i])
                if new[i] is not None:
                    tot.merge(new[i])
                row.append(tot)
            totals[key] = row
        self.apply(plan.ids, totals)

    def _claimed(self, prev: str | None) -> None:
        """After a claim of the node name that found ``prev``: a token not
        ours, once we had claimed it, is another server writing this ledger
        under our node name (before our first claim it may be an earlier
        run of this server). Neither server then counts the other's usage
        (each takes the other's rows for its own), so keys' limits hold per
        server, not across both: logged once, shown in ``/usage``."""
        if self.claimed and prev is not None and prev != self.token and self.clash is None:
            self.clash = (f"another server writes {self.store.where} as node '{self.node}': "
                          "neither counts the other's usage against the keys' limits; give "
                          "each server its own --node-name")
            log.error("keys: %s", self.clash)
        self.claimed = True

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

