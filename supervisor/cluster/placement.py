"""Where a cold model loads in the cluster: pure decisions on the nodes'
records (no NATS, no processes), in LocalAI's SmartRouter order (DESIGN.md
"Cluster"):

1. a node that already holds the model or is loading it;
2. drop nodes that do not have it, that drain, or that cannot fit its
   measured ``min`` even after evicting their idle models;
3. among the nodes where it fits now: the node that asked, else the one
   with most free memory, then idle nodes (nothing in flight), then the
   least loaded (fewest requests in flight);
4. if it fits nowhere now: the node holding the least recently used idle
   model (the one idle longest), which evicts to make room;
5. if every model everywhere is busy: ``None`` (the waiters wait; never
   "limit reached").

A node's record (what :func:`node_view` reads) is the JSON its supervisor
publishes every beat: ``url``, ``draining``, ``slots_free`` (replicas it may
still start under ``--models-max``), ``headroom`` (bytes per device that may
still be taken, margin deducted), ``has`` (model -> measured ``min`` bytes
per device, or null when unmeasured), ``models`` (model -> ``state``,
``in_flight``, ``idle_s`` at the beat, ``held`` bytes per device,
``replicas``). Ages are judged on this host: ``idle_s`` plus the time since
the beat *arrived*, never a clock of the sender's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..memory import Amounts, Ledger, add

HOLDING_STATES = ("loaded", "loading", "sleeping")


@dataclass(slots=True)
class HeldModel:
    """A model on one node: ``state`` (loaded, loading, sleeping, stopping),
    requests ``in_flight``, seconds idle (``idle_s``, now), ``held`` bytes."""

    state: str
    in_flight: int = 0
    idle_s: float = 0.0
    held: Amounts = field(default_factory=dict)
    replicas: int = 1


@dataclass(slots=True)
class NodeView:
    """One live node as placement sees it (see the module docstring)."""

    name: str
    url: str = ""
    draining: bool = False
    slots_free: int = 0
    headroom: Amounts = field(default_factory=dict)
    has: dict[str, Amounts | None] = field(default_factory=dict)
    models: dict[str, HeldModel] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return sum(m.in_flight for m in self.models.values())

    @property
    def free_bytes(self) -> int:
        return sum(max(0, v) for v in self.headroom.values())


@dataclass(slots=True, frozen=True)
class Placement:
    """Load (or find) the model on ``node``; ``why`` says which rule chose it;
    ``evict``: the node must evict an idle model first."""

    node: str
    why: str
    evict: bool = False


def _dict(d) -> dict:
    return d if isinstance(d, dict) else {}


def _num(v, kind=int):
    try:
        return kind(v or 0)
    except (TypeError, ValueError):
        return kind(0)


def _amounts(d) -> Amounts:
    if not isinstance(d, dict):
        return {}
    return {str(k): int(v) for k, v in d.items() if isinstance(v, (int, float))}


def node_view(name: str, record: dict, age_s: float = 0.0) -> NodeView:
    """A :class:`NodeView` from a node's published ``record`` whose beat
    arrived ``age_s`` seconds ago (idle times grow by that much). Missing or
    malformed fields read as empty: a record never raises."""
    models = {}
    for m, d in _dict(record.get("models")).items():
        if not isinstance(d, dict):
            continue
        models[str(m)] = HeldModel(
            state=str(d.get("state", "loaded")), in_flight=_num(d.get("in_flight")),
            idle_s=_num(d.get("idle_s"), float) + max(0.0, age_s),
            held=_amounts(d.get("held")), replicas=_num(d.get("replicas")) or 1)
    has = {str(m): _amounts(need) or None for m, need in _dict(record.get("has")).items()}
    return NodeView(name=name, url=str(record.get("url", "")),
                    draining=bool(record.get("draining")),
                    slots_free=_num(record.get("slots_free")),
                    headroom=_amounts(record.get("headroom")), has=has, models=models)


def _idle(n: NodeView) -> list[HeldModel]:
    """The node's evictable models, least recently used first."""
    idle = [m for m in n.models.values()
            if m.state in ("loaded", "sleeping") and m.in_flight <= 0]
    idle.sort(key=lambda m: -m.idle_s)
    return idle


def fits_now(n: NodeView, need: Amounts | None) -> bool:
    """A free replica slot and, for a measured model, memory for ``need``."""
    return n.slots_free > 0 and (not need or not Ledger.deficit(need, n.headroom))


def fits_after_eviction(n: NodeView, need: Amounts | None) -> bool:
    """Whether evicting idle models (LRU first) frees a slot and enough memory."""
    slots, room = n.slots_free, dict(n.headroom)
    for m in _idle(n):
        if slots > 0 and (not need or not Ledger.deficit(need, room)):
            return True
        slots += 1
        room = add(room, m.held)
    return slots > 0 and (not need or not Ledger.deficit(need, room))


def place(model: str, nodes: list[NodeView], asking: str,
          exclude: frozenset[str] | set[str] = frozenset()) -> Placement | None:
    """Where ``model`` should be served, or ``None`` to wait (see the module
    docstring for the order). ``nodes``: every live node, this one
    included; ``asking``: the node whose clients want it; ``exclude``: nodes
    that just refused a load of it."""
    live = [n for n in nodes if n.name not in exclude]
    holders = [n for n in live if not n.draining and model in n.models
               and n.models[model].state in HOLDING_STATES]
    if holders:
        holders.sort(key=lambda n: (n.models[model].state != "loaded", n.name != asking,
                                    n.in_flight, n.name))
        return Placement(holders[0].name, "holds it")
    cands = [n for n in live if not n.draining and model in n.has]
    now = [n for n in cands if fits_now(n, n.has[model])]
    if now:
        for n in now:
            if n.name == asking:
                return Placement(n.name, "fits on the node that asked")
        now.sort(key=lambda n: (-n.free_bytes, n.in_flight > 0, n.in_flight, n.name))
        return Placement(now[0].name, "fits, most free memory")
    later = [n for n in cands if fits_after_eviction(n, n.has[model])]
    if later:
        later.sort(key=lambda n: (-max((m.idle_s for m in _idle(n)), default=0.0), n.name))
        return Placement(later[0].name, "evicts the least recently used idle model",
                         evict=True)
    return None
