"""Which model loads next and which replica makes room: pure decisions.

Follows llama.cpp's router (tools/server/server-models.cpp), fixes the
holes its users report, and decides swaps under contention (issue 34: more
demand than ``--models-max`` or memory allows):

* the admission queue holds *models*, not requests; a model's place is the
  arrival time of its oldest waiter (the longest-waiting model goes first),
  and only the queue head may claim a slot, so a burst of requests for one
  model starts one load and its waiters are served together;
* free slots = ``models_max - running + stopping - claimed`` (a replica that
  is stopping no longer counts, as in llama.cpp);
* an *idle* victim is a replica that is loaded or sleeping, has no request
  in flight, is not stopping or draining, is not pinned, and whose model has
  no waiters: lowest ``eviction-priority`` first, then least recently used;
* a replica that became ready counts as used at that moment, so it cannot
  be chosen as a victim before the request that caused its load is served;
* **bounded wait**: when the head has waited past its bound
  (``ModelView.max_wait_ns``) and no idle victim makes room, a *busy*
  replica is drained (:class:`Drain`): it takes no new request, finishes
  those in flight, then stops (:class:`Stop`) and the head loads. Victims:
  lowest eviction priority, then least recently started; never a pinned
  one, never one still inside its minimum residency (a model swapped in
  keeps its capacity that long while it has demand, so loading stays a
  bounded share of the time: the time slice);
* with memory limits, the victims are a *set* that frees enough at the
  least cost (:meth:`Scheduler.victim_set`), not one model at a time;
* every model left waiting gets a :class:`Wait` saying why (what holds the
  capacity, and when it frees), for ``ps``, ``/v1/models`` and ``/metrics``.

:meth:`Scheduler.plan` takes a snapshot and returns actions; the supervisor
carries them out. Keeping it pure keeps it testable without processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from itertools import combinations

from ..shm.layout import WaitReason
from .memory import Amounts, Ledger, add, fmt

log = logging.getLogger(__name__)

NO_START = (1 << 63) - 1
"""``ModelView.first_ns`` of a model whose waiters have no wait start yet
(the proxy counts them but their wait runs later: a key's drain penalty):
it loads into room, and drains nothing."""
SET_SEARCH_MAX = 12
"""Victim candidates up to which :meth:`Scheduler.victim_set` tries every
subset (4096 at most); above it, it adds candidates in order until enough."""


@dataclass(slots=True)
class ReplicaView:
    """Scheduler's view of one running replica (times in ns).

    ``ready_ns``: when it became ready (its residency began; 0 while it
    loads); ``draining``: it takes no new request and stops once idle
    (``drain_for``: the model it makes room for); ``pinned``,
    ``eviction_priority``: its model's preset keys ``pin`` and
    ``eviction-priority`` (victims lowest first); ``min_residency_ns``: how
    long it keeps its capacity while it has demand once ready."""

    slot: int
    model: int
    state: str  # "loading" | "ready" | "sleeping" | "stopping"
    in_flight: int
    last_used_ns: int  # max(last request start/end, ready time)
    held: Amounts = field(default_factory=dict)  # ledger bytes per device
    ready_ns: int = 0
    draining: bool = False
    drain_for: int = -1
    pinned: bool = False
    eviction_priority: int = 0
    min_residency_ns: int = 0


@dataclass(slots=True)
class ModelView:
    """Demand for one model: ``waiters`` summed over proxies, ``first_ns``
    the oldest waiter's wait start (:data:`NO_START`: none yet),
    ``blocked_until_ns`` the load backoff,
    ``max_wait_ns`` its bound: past it a busy replica is drained for it
    (0: no bound, it waits for an idle victim)."""

    index: int
    waiters: int
    first_ns: int
    blocked_until_ns: int = 0
    replicas: int = 1  # replicas wanted while the model has demand (preset ``replicas``)
    max_wait_ns: int = 0


@dataclass(slots=True)
class MemoryView:
    """The ledger as the scheduler needs it: ``headroom`` = available minus
    margin per device (bytes, every running replica's holding deducted,
    stopping ones included), ``need`` = measured ``min`` per model (models
    absent from it are unmeasured and skip the memory check)."""

    headroom: Amounts
    need: dict[int, Amounts]


@dataclass(slots=True)
class Spawn:
    model: int
    reason: str
    warning: str = ""


@dataclass(slots=True)
class Stop:
    slot: int
    model: int
    reason: str
    for_model: int = -1  # the queue head this eviction makes room for
    drained: bool = False  # the end of a drain (its requests all finished)


@dataclass(slots=True)
class Drain:
    """Send replica ``slot`` no new request; stop it once its requests in
    flight have finished (issue 34's bounded wait)."""

    slot: int
    model: int
    for_model: int
    reason: str


@dataclass(slots=True)
class Undrain:
    """A drain no longer needed (the model it made room for stopped waiting
    or loaded elsewhere): the replica takes requests again."""

    slot: int
    model: int
    reason: str


@dataclass(slots=True)
class Wait:
    """Why model ``model`` still waits (:class:`~ggmux.shm.layout.WaitReason`),
    ``holder`` the model holding the capacity it needs (-1: none), and
    ``eta_ns`` when that capacity is expected to free (monotonic ns; 0:
    unknown)."""

    model: int
    reason: int
    holder: int = -1
    eta_ns: int = 0


Action = Spawn | Stop | Drain | Undrain


def _idle(r: ReplicaView, wanted: set[int]) -> bool:
    """An idle victim: loaded or asleep, nothing in flight, its model not
    wanted, not pinned, not already on its way out."""
    return (r.state in ("ready", "sleeping") and r.in_flight <= 0 and r.model not in wanted
            and not r.pinned and not r.draining)


def _order(r: ReplicaView, wanted: set[int]) -> tuple[int, int, int]:
    """A victim's rank, lowest first: eviction priority, then idle before
    busy, then least recently used (idle) or least recently started (busy)."""
    if _idle(r, wanted):
        return (r.eviction_priority, 0, r.last_used_ns)
    return (r.eviction_priority, 1, r.ready_ns)


@dataclass(slots=True)
class Scheduler:
    """Admission queue, victim choice and drains for ``models_max``
    replicas. After :meth:`plan`, ``waits`` holds a :class:`Wait` for every
    model of the queue that did not start loading."""

    models_max: int
    claimed: set[int] = field(default_factory=set)
    waits: dict[int, Wait] = field(default_factory=dict)

    def queue(self, models: list[ModelView], replicas: list[ReplicaView], now_ns: int) -> list[ModelView]:
        """Models with waiters and fewer serving replicas than they want,
        oldest first waiter first (ties by index). A draining replica does
        not serve its model (its new requests wait like any). Models in
        load backoff are left out: their waiters are answered 503 by the
        proxies instead of respawning."""
        running: dict[int, int] = {}
        for r in replicas:
            if r.state != "stopping" and not r.draining:
                running[r.model] = running.get(r.model, 0) + 1
        q = [
            m
            for m in models
            if m.waiters > 0
            and running.get(m.index, 0) < max(1, m.replicas)
            and m.blocked_until_ns <= now_ns
        ]
        q.sort(key=lambda m: (m.first_ns, m.index))
        return q

    def pick_victim(
        self, replicas: list[ReplicaView], wanted: set[int], exclude: set[int] = frozenset()
    ) -> ReplicaView | None:
        """The idle victim to evict first: lowest eviction priority, then
        least recently used, among idle replicas whose model nobody waits for."""
        best = None
        for r in replicas:
            if not _idle(r, wanted) or r.slot in exclude:
                continue
            if best is None or _order(r, wanted) < _order(best, wanted):
                best = r
        return best

    @staticmethod
    def victim_set(
        cands: list[ReplicaView], wanted: set[int], slots: int, need: Amounts | None,
        soon: Amounts,
    ) -> list[ReplicaView] | None:
        """The cheapest subset of ``cands`` that frees ``slots`` replica
        slots and, with ``need`` (bytes per device), enough memory that
        ``need`` fits in ``soon`` plus what the subset holds; None when no
        subset does.

        Cost, compared in this order: the highest eviction priority in the
        set (what matters stays), the busy replicas in it (a drain makes
        clients wait; an idle eviction costs nobody), its size (each victim
        is a reload later), then how recently its members were used or
        started (least recently first). With more than
        :data:`SET_SEARCH_MAX` candidates, they are added in victim order
        until enough (greedy)."""

        def enough(vs: tuple[ReplicaView, ...] | list[ReplicaView]) -> bool:
            if len(vs) < slots:
                return False
            if not need:
                return True
            freed = soon
            for v in vs:
                freed = add(freed, v.held)
            return not Ledger.deficit(need, freed)

        def cost(vs) -> tuple[int, int, int, int]:
            ranks = [_order(v, wanted) for v in vs]
            return (max(r[0] for r in ranks), sum(r[1] for r in ranks), len(vs),
                    sum(r[2] for r in ranks))

        if not cands:
            return None
        ordered = sorted(cands, key=lambda r: (_order(r, wanted), r.slot))
        if len(ordered) > SET_SEARCH_MAX:
            out: list[ReplicaView] = []
            for r in ordered:
                out.append(r)
                if enough(out):
                    return out
            return None
        best = None
        for k in range(1, len(ordered) + 1):
            for vs in combinations(ordered, k):
                if enough(vs) and (best is None or cost(vs) < cost(best)):
                    best = vs
        return list(best) if best is not None else None

    def plan(
        self,
        models: list[ModelView],
        replicas: list[ReplicaView],
        now_ns: int,
        mem: MemoryView | None = None,
    ) -> list[Action]:
        """Actions for this tick.

        First the drains: a draining replica with nothing in flight stops;
        one whose beneficiary no longer waits takes requests again. Then,
        for the queue head: make room with the cheapest set of idle victims
        (a slot when none is free, and memory for its measured ``min``);
        when none suffices and the head has waited past its bound, drain
        the cheapest set of busy victims past their minimum residency (plus
        idle ones). Load when it fits now; wait while victims are still
        exiting or draining; with nothing else running, load anyway with a
        warning. Later queue entries are looked at only when the head
        loaded (only the head may start loading). :attr:`waits` says why
        each model left waiting waits.
        """
        actions: list[Action] = []
        self.waits = {}
        q = self.queue(models, replicas, now_ns)
        in_queue = {m.index for m in q}
        reps: list[ReplicaView] = []
        for r in replicas:
            if r.draining and r.state != "stopping":
                if r.drain_for not in in_queue:
                    actions.append(Undrain(r.slot, r.model, "the model it drained for no "
                                           "longer waits"))
                    r = replace(r, draining=False, drain_for=-1)
                elif r.in_flight <= 0:
                    actions.append(Stop(r.slot, r.model, "drained (its requests finished)",
                                        r.drain_for, drained=True))
                    r = replace(r, state="stopping")
            reps.append(r)
        running = [r for r in reps if r.state != "stopping"]
        free = self.models_max - len(running)
        wanted = {m.index for m in models if m.waiters > 0}
        evicted: set[int] = set()
        headroom = dict(mem.headroom) if mem is not None else {}
        releasing: Amounts = {}
        for r in reps:
            if r.state == "stopping":
                releasing = add(releasing, r.held)
        count: dict[int, int] = {}
        for r in running:
            if not r.draining:
                count[r.model] = count.get(r.model, 0) + 1
        units = [m for m in q for _ in range(max(1, m.replicas) - count.get(m.index, 0))]
        blocked = -1  # the unit the others wait behind
        for m in units:
            need = mem.need.get(m.index) if mem is not None else None
            soon = add(headroom, releasing)
            slots = 1 if free <= 0 else 0
            short = Ledger.deficit(need, soon) if need else {}
            victims: list[ReplicaView] = []
            warning = ""
            if slots or short:
                others = [r for r in running if r.slot not in evicted]
                idle = [r for r in others if _idle(r, wanted)]
                found = self.victim_set(idle, wanted, slots, need, soon)
                if found is None and idle and len(idle) == len(others) and len(idle) >= slots:
                    found = idle  # everything else goes, and it still does not fit
                if found is None:
                    if others:
                        blocked = m.index
                        self._drain(m, others, wanted, slots, need, soon, bool(releasing),
                                    now_ns, actions, evicted)
                        break
                    if releasing:
                        blocked = m.index
                        self.waits[m.index] = Wait(m.index, WaitReason.STOPPING)
                        break
                    found = []  # nothing else loaded: load anyway (warned below)
                victims = found
                for v in victims:
                    evicted.add(v.slot)
                    why = "evicted (LRU idle)"
                    if need and short:
                        why += f" for memory, deficit {fmt(short)}"
                    actions.append(Stop(v.slot, v.model, why, m.index))
                    soon = add(soon, v.held)
                if need:
                    left = Ledger.deficit(need, soon)
                    if left and (victims or releasing):
                        blocked = m.index  # all of it goes first: then it loads anyway
                        self.waits[m.index] = Wait(m.index, WaitReason.STOPPING,
                                                   victims[0].model if victims else -1)
                        break
                    if left:
                        warning = (f"projected short by {fmt(left)} with nothing else loaded; "
                                   "loading anyway")
                    elif Ledger.deficit(need, headroom):
                        # fits once the stopping replicas have exited
                        blocked = m.index
                        self.waits[m.index] = Wait(m.index, WaitReason.STOPPING,
                                                   victims[0].model if victims else -1)
                        break
            elif need and Ledger.deficit(need, headroom):
                # fits only once the replicas already stopping have exited (an
                # evicted one saving its KV tiers holds its memory until then):
                # loading now would overcommit the device
                blocked = m.index
                self.waits[m.index] = Wait(m.index, WaitReason.STOPPING)
                break
            if need:
                headroom = add(headroom, need, -1)
            actions.append(Spawn(m.index, f"{m.waiters} waiting", warning))
            free = free + len(victims) - 1
            running = [r for r in running if r.slot not in evicted]
            # the new replica holds its slot from now on (a load is never a victim)
            running.append(ReplicaView(-1 - len(actions), m.index, "loading", 0, now_ns))
        spawned = {a.model for a in actions if isinstance(a, Spawn)}
        for m in q:
            if m.index not in spawned and m.index not in self.waits:
                self.waits[m.index] = Wait(m.index, WaitReason.QUEUED, blocked)
        return actions

    def _drain(
        self, m: ModelView, others: list[ReplicaView], wanted: set[int], slots: int,
        need: Amounts | None, soon: Amounts, releasing: bool, now_ns: int,
        actions: list[Action], evicted: set[int],
    ) -> None:
        """No idle victim makes room for head ``m`` among ``others`` (the
        replicas not already leaving): drain busy ones when it has waited
        past its bound, else record why it waits (:attr:`waits`)."""
        draining = [r for r in others if r.draining]
        if draining:  # a drain under way frees the room: one at a time
            d = next((r for r in draining if r.drain_for == m.index), draining[0])
            self.waits[m.index] = Wait(m.index, WaitReason.DRAINING, d.model)
            return
        # an idle replica kept because its own model has waiters is about to
        # serve them (just ready): draining it would only turn it over
        pool = [r for r in others if not r.pinned and r.model != m.index
                and r.state in ("ready", "sleeping")
                and (r.in_flight > 0 or _idle(r, wanted))]
        full = self.victim_set(pool, wanted, slots, need, soon)
        if full is None:
            loading = [r for r in others if r.state == "loading"]
            if loading:  # becomes a candidate once ready
                self.waits[m.index] = Wait(m.index, WaitReason.QUEUED, loading[0].model)
                return
            if releasing:
                self.waits[m.index] = Wait(m.index, WaitReason.STOPPING)
                return
            unpinned = [r for r in others if not r.pinned and r.model != m.index]
            pinned = [r for r in others if r.pinned]
            if pinned and self.victim_set(unpinned, wanted, slots, need, soon) is None:
                # nothing will ever make room until a pinned model unloads
                self.waits[m.index] = Wait(m.index, WaitReason.PINNED, pinned[0].model)
                return
            if len(pool) < len(unpinned) or not pool or len(pool) < slots:
                # a replica about to serve its own waiters: a candidate once busy
                holder = next((r for r in unpinned if r not in pool), others[0])
                self.waits[m.index] = Wait(m.index, WaitReason.SLICE, holder.model)
                return
            full = pool  # all of them, and it still will not fit: loads with a warning
        # (no wait start yet: waiters whose key's drain penalty runs, proxy.drain_penalty)
        bound_at = m.first_ns + m.max_wait_ns if 0 < m.max_wait_ns and m.first_ns < NO_START else 0
        ripe = [r for r in pool
                if _idle(r, wanted) or now_ns - r.ready_ns >= r.min_residency_ns]
        vs = None
        if bound_at and now_ns >= bound_at:
            vs = self.victim_set(ripe, wanted, slots, need, soon)
            if vs is None and full is pool and len(ripe) == len(pool):
                vs = ripe
        if vs is None:
            first = min(full, key=lambda r: _order(r, wanted))
            eta = max(bound_at, first.ready_ns + first.min_residency_ns) if bound_at else 0
            self.waits[m.index] = Wait(m.index, WaitReason.SLICE, first.model, eta)
            return
        waited_s = (now_ns - m.first_ns) / 1e9
        for v in vs:
            evicted.add(v.slot)
            if _idle(v, wanted):
                actions.append(Stop(v.slot, v.model, "evicted (LRU idle) beside a drain",
                                    m.index))
            else:
                actions.append(Drain(v.slot, v.model, m.index,
                                     f"{m.waiters} waiting for {waited_s:.1f} s, past the "
                                     f"bound of {m.max_wait_ns / 1e9:g} s (max-wait)"))
        holder = next((v for v in vs if not _idle(v, wanted)), vs[0])
        self.waits[m.index] = Wait(m.index, WaitReason.DRAINING, holder.model)
