"""Which model loads next and which replica makes room: pure decisions.

Follows llama.cpp's router (tools/server/server-models.cpp) and fixes the
holes its users report:

* the admission queue holds *models*, not requests; a model's place is the
  arrival time of its first waiter, and only the queue head may claim a
  slot, so a burst of requests for one model starts one load;
* free slots = ``models_max - running + stopping - claimed`` (a replica that
  is stopping no longer counts, as in llama.cpp);
* a victim is the least recently used replica that is loaded or sleeping,
  has no request in flight, is not already stopping, and whose model has no
  waiters; a busy replica is never evicted, so when nothing can be evicted
  the head waits instead of failing with "model limit reached";
* a replica that became ready counts as used at that moment, so it cannot
  be chosen as a victim before the request that caused its load is served.

:meth:`Scheduler.plan` takes a snapshot and returns actions; the supervisor
carries them out. Keeping it pure keeps it testable without processes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .memory import Amounts, Ledger, add, fmt

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplicaView:
    """Scheduler's view of one running replica (times in ns)."""

    slot: int
    model: int
    state: str  # "loading" | "ready" | "sleeping" | "stopping"
    in_flight: int
    last_used_ns: int  # max(last request start/end, ready time)
    held: Amounts = field(default_factory=dict)  # ledger bytes per device


@dataclass(slots=True)
class ModelView:
    """Demand for one model: ``waiters`` summed over proxies, ``first_ns``
    the oldest waiter's arrival, ``blocked_until_ns`` the load backoff."""

    index: int
    waiters: int
    first_ns: int
    blocked_until_ns: int = 0
    replicas: int = 1  # replicas wanted while the model has demand (preset ``replicas``)


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


@dataclass(slots=True)
class Scheduler:
    """Admission queue and victim choice for ``models_max`` replicas."""

    models_max: int
    claimed: set[int] = field(default_factory=set)

    def queue(self, models: list[ModelView], replicas: list[ReplicaView], now_ns: int) -> list[ModelView]:
        """Models with waiters and fewer running replicas than they want,
        oldest first waiter first (ties by index). Models in load backoff are
        left out: their waiters are answered 503 by the proxies instead of
        respawning."""
        running: dict[int, int] = {}
        for r in replicas:
            if r.state != "stopping":
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
        """Least recently used idle replica whose model nobody waits for."""
        best = None
        for r in replicas:
            if r.state not in ("ready", "sleeping") or r.in_flight > 0:
                continue
            if r.model in wanted or r.slot in exclude:
                continue
            if best is None or r.last_used_ns < best.last_used_ns:
                best = r
        return best

    def plan(
        self,
        models: list[ModelView],
        replicas: list[ReplicaView],
        now_ns: int,
        mem: MemoryView | None = None,
    ) -> list[Spawn | Stop]:
        """Actions for this tick.

        For the queue head: evict one LRU idle replica if no slot is free;
        then, if its measured ``min`` does not fit the headroom (counting
        what stopping replicas will release), evict more LRU idle replicas
        one by one until it fits. Load when it fits now; wait while victims
        are still exiting or busy replicas hold the memory; with nothing else
        running, load anyway with a warning. Later queue entries are looked
        at only when the head loaded (only the head may start loading).
        """
        actions: list[Spawn | Stop] = []
        running = [r for r in replicas if r.state != "stopping"]
        free = self.models_max - len(running)
        wanted = {m.index for m in models if m.waiters > 0}
        evicted: set[int] = set()
        headroom = dict(mem.headroom) if mem is not None else {}
        releasing: Amounts = {}
        for r in replicas:
            if r.state == "stopping":
                releasing = add(releasing, r.held)
        count: dict[int, int] = {}
        for r in running:
            count[r.model] = count.get(r.model, 0) + 1
        units = [m for m in self.queue(models, replicas, now_ns)
                 for _ in range(max(1, m.replicas) - count.get(m.index, 0))]
        for m in units:
            victims: list[ReplicaView] = []
            if free <= 0:
                v = self.pick_victim(replicas, wanted, evicted)
                if v is None:
                    # every replica is busy or wanted: the head waits (no
                    # "limit reached" error); later models wait behind it
                    break
                victims.append(v)
                evicted.add(v.slot)
                actions.append(Stop(v.slot, v.model, "evicted (LRU idle)", m.index))
            need = mem.need.get(m.index) if mem is not None else None
            warning = ""
            if need:
                soon = add(headroom, releasing)
                for v in victims:
                    soon = add(soon, v.held)
                short = Ledger.deficit(need, soon)
                while short:
                    v = self.pick_victim(replicas, wanted, evicted)
                    if v is None:
                        break
                    actions.append(Stop(v.slot, v.model,
                                        f"evicted (LRU idle) for memory, deficit {fmt(short)}",
                                        m.index))
                    victims.append(v)
                    evicted.add(v.slot)
                    soon = add(soon, v.held)
                    short = Ledger.deficit(need, soon)
                others = len(running) - len(victims)
                if short:
                    if others > 0 or releasing or victims:
                        break  # busy replicas hold the memory, or victims still exiting
                    warning = (f"projected short by {fmt(short)} with nothing else loaded; "
                               "loading anyway")
                elif Ledger.deficit(need, headroom):
                    break  # fits once the stopping replicas have exited
                headroom = add(headroom, need, -1)
            actions.append(Spawn(m.index, f"{m.waiters} waiting", warning))
            free = free + len(victims) - 1
            running = [r for r in running if r.slot not in evicted]
        return actions
