"""What this node tells the cluster and its proxies (no NATS, no processes):

* :func:`own_record`: the heartbeat record the agent writes to KV
  ``ggmux-nodes`` (the fields :mod:`.placement` reads, plus ``devices``,
  ``failed`` and ``version``);
* :func:`where`: model -> the nodes holding it, for ``/v1/models``;
* :func:`remote_wanted`: the remote replicas this node should have, one per
  (node, model) that another live node holds;
* :func:`proxy_doc`: the registry blob's ``cluster`` object the proxies read
  (see :mod:`ggmux.proxy.cluster`).
"""

from __future__ import annotations

from ... import __version__
from ...shm import layout as L
from ..state import NS, State

LOCAL_KINDS = ("llama", "fake", "cmd")  # kinds this node can load itself
STATE_NAMES = {L.ReplicaStatus.LOADING: "loading", L.ReplicaStatus.READY: "loaded",
               L.ReplicaStatus.SLEEPING: "sleeping", L.ReplicaStatus.STOPPING: "stopping"}
_RANK = {"loaded": 0, "sleeping": 1, "loading": 2, "stopping": 3}
SERVING_STATES = ("loaded", "sleeping")  # another node's model we forward to


def held_models(st: State, now_ns: int) -> dict[str, dict]:
    """This node's models with a local replica: ``state`` (the best of its
    replicas), ``in_flight``, ``idle_s`` (since the last request began or
    ended, or since ready), ``held`` bytes per device, ``replicas``."""
    inflight = st.in_flight()
    last_used = st.last_used(now_ns)
    out: dict[str, dict] = {}
    for r in st.replicas.values():
        name = st.name(r.model)
        state = STATE_NAMES.get(r.status, "loading")
        used = max(int(last_used[r.slot]), r.ready_ns or r.started_ns)
        d = out.setdefault(name, {"state": state, "in_flight": 0, "idle_s": 1e18,
                                  "held": {}, "replicas": 0})
        if _RANK[state] < _RANK[d["state"]]:
            d["state"] = state
        d["in_flight"] += max(0, int(inflight[r.slot]))
        d["idle_s"] = round(min(d["idle_s"], max(0.0, (now_ns - used) / NS)), 3)
        for k, v in r.held.items():
            d["held"][k] = d["held"].get(k, 0) + int(v)
        d["replicas"] += 1
    return out


def own_record(st: State, url: str, draining: bool, now_ns: int) -> dict:
    """This node's heartbeat record (see the module docstring); ``url`` is
    its advertised address."""
    entries = st.registry.entries
    has = {}
    failed = {}
    for i, e in enumerate(entries):
        if e.kind not in LOCAL_KINDS or i in st.removed:
            continue
        m = st.models[i]
        has[e.name] = m.mem_min or None
        if m.failed and m.retry_at_ns > now_ns and m.error:
            failed[e.name] = {"error": m.error, "retry_in_s": round((m.retry_at_ns - now_ns) / NS, 1)}
    running = sum(1 for r in st.replicas.values() if r.status != L.ReplicaStatus.STOPPING)
    devices = [{"key": d.key, "total": d.total, "free": d.free, "held": d.held}
               for d in st.ledger.devices]
    return {"url": url, "version": __version__, "draining": draining,
            "slots_free": max(0, st.cfg.models_max - running),
            "headroom": st.ledger.headroom(st.held()), "has": has,
            "models": held_models(st, now_ns), "devices": devices, "failed": failed}


def where(me: str, mine: dict[str, dict], others: dict[str, dict]) -> dict[str, list[dict]]:
    """Model name -> ``[{"node", "state"}]`` for every node holding it
    (``mine``: this node's :func:`held_models`; ``others``: name -> record;
    draining nodes left out)."""
    out: dict[str, list[dict]] = {}
    for name, d in mine.items():
        out.setdefault(name, []).append({"node": me, "state": d["state"]})
    for node, rec in sorted(others.items()):
        if rec.get("draining"):
            continue  # a draining node serves nothing new
        for name, d in (rec.get("models") or {}).items():
            if isinstance(d, dict):
                out.setdefault(name, []).append({"node": node, "state": d.get("state")})
    return out


def remote_wanted(st: State, others: dict[str, dict]) -> dict[tuple[str, int], str]:
    """``(node, model index) -> advertised URL`` of the remote replicas this
    node should have: every model another live, non-draining node holds
    loaded or asleep, that this node's registry knows."""
    out: dict[tuple[str, int], str] = {}
    for node, rec in others.items():
        if rec.get("draining") or not rec.get("url"):
            continue
        for name, d in (rec.get("models") or {}).items():
            if not isinstance(d, dict) or d.get("state") not in SERVING_STATES:
                continue
            i = st.registry.resolve(name)
            if i is not None and i not in st.removed:
                out[(node, i)] = str(rec["url"])
    return out


def proxy_doc(me: str, token: str, url: str, connected: bool, draining: bool, mine: dict,
              others: dict[str, tuple[dict, int]], loads: dict[str, dict]) -> dict:
    """The registry blob's ``cluster`` object (:mod:`ggmux.proxy.cluster`);
    ``others``: name -> (record, arrived_ns). The bulky ``has`` maps stay
    out; their sizes go in (``available``: models the node can load,
    ``measured``: how many of them have a measured ``min``)."""
    def slim(rec: dict) -> dict:
        has = rec.get("has") or {}
        out = {k: v for k, v in rec.items() if k != "has"}
        out["available"] = len(has)
        out["measured"] = sum(1 for v in has.values() if v)
        return out

    nodes = {n: {"record": slim(rec), "arrived_ns": t} for n, (rec, t) in others.items()}
    return {"node": me, "token": token, "url": url, "connected": connected,
            "draining": draining, "self": slim(mine),
            "nodes": nodes, "loads": loads,
            "models": where(me, mine.get("models") or {}, {n: r for n, (r, _) in others.items()})}
