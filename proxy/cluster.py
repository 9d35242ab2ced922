"""A proxy's share of cluster mode (DESIGN.md "Cluster"): the hop header,
``GET /cluster``, ``POST /cluster/drain``, the node names in ``/v1/models``
and ``/metrics``, and ``loading.node`` in a 503.

The supervisor writes what the proxies need into the registry blob's
``cluster`` object (the segment is mode 0600): ``node`` (this node's name),
``token`` (``--cluster-token``, may be empty), ``url``, ``connected``,
``draining``, ``self`` (this node's last published record), ``nodes``
(name -> ``record`` and ``arrived_ns``, CLOCK_MONOTONIC ns of its last beat's
arrival), ``loads`` (model -> the cluster-wide load key's value) and
``models`` (model -> list of ``{"node", "state"}`` where it is held). Without
``--cluster`` there is no such object and nothing here runs.

Loop safety: a request a node forwards to another carries :data:`HOP`
(the sending node's name) and :data:`TOKEN`. The receiving proxy trusts the
hop header only with the right token (compared in constant time); then the
request needs no API key and is served by local replicas only, never
forwarded again. A hop header without the token is dropped and the request
is an ordinary one. With no ``--cluster-token`` the hop header is still
honoured to stop loops, but never stands in for the API key.
"""

from __future__ import annotations

import hmac
import time

from ..http1 import HttpConnection, Request
from ..http1.request import HOP, TOKEN

HOP_NONE = 0  # an ordinary request
HOP_LOOP = 1  # forwarded by a node, no token configured: served locally, key still needed
HOP_TRUSTED = 2  # forwarded with the right cluster token: served locally, no key needed


def judge_hop(req: Request, cluster: dict | None) -> int:
    """Classify ``req`` (one of ``HOP_*``) by its hop header and cluster
    token, changing nothing. Without cluster mode: :data:`HOP_NONE`."""
    if cluster is None:
        return HOP_NONE
    hop = given = None
    for k, v in req.headers:
        if k == HOP:
            hop = v
        elif k == TOKEN:
            given = v
    if hop is None:
        return HOP_NONE
    token = (cluster.get("token") or "").encode()
    if not token:
        return HOP_LOOP
    if given is not None and hmac.compare_digest(given, token):
        return HOP_TRUSTED
    return HOP_NONE


def take_hop(req: Request, cluster: dict | None) -> int:
    """:func:`judge_hop`, then strip the hop header and token from
    ``req.headers`` (in cluster mode). No replica gets them either way:
    ``heads.request_head`` drops them; only a forward to another node
    adds them, from :func:`hop_headers`."""
    hop = judge_hop(req, cluster)
    if cluster is not None:
        req.headers = [(k, v) for k, v in req.headers if k != HOP and k != TOKEN]
    return hop


def hop_headers(cluster: dict, api_key: bytes | None) -> list[tuple[bytes, bytes]]:
    """Headers of a request this node forwards to another: the hop header
    and the cluster token, or, with no token, this node's own API key (the
    nodes of a cluster share one)."""
    out = [(HOP, str(cluster.get("node", "")).encode())]
    token = cluster.get("token") or ""
    if token:
        out.append((TOKEN, token.encode()))
    elif api_key:
        out.append((b"authorization", b"Bearer " + api_key))
    return out


def cluster_view(cluster: dict, now_ns: int | None = None) -> dict:
    """``GET /cluster``: this node and every live one it knows (name, url,
    ``age_s`` of the last beat, devices, models with state and in-flight,
    draining, how many models it can load and how many are measured), the
    cluster-wide loads, and whether NATS is reachable."""
    now_ns = time.monotonic_ns() if now_ns is None else now_ns

    def entry(name: str, rec: dict, age_s: float, me: bool) -> dict:
        models = {m: {"state": d.get("state"), "in_flight": d.get("in_flight", 0)}
                  for m, d in (rec.get("models") or {}).items() if isinstance(d, dict)}
        return {"name": name, "url": rec.get("url", ""), "self": me,
                "age_s": round(max(0.0, age_s), 3), "devices": rec.get("devices", []),
                "models": models, "draining": bool(rec.get("draining")),
                "available": rec.get("available", 0), "measured": rec.get("measured", 0)}

    me = str(cluster.get("node", ""))
    nodes = [entry(me, cluster.get("self") or {}, 0.0, True)]
    for name, seen in sorted((cluster.get("nodes") or {}).items()):
        age = (now_ns - int(seen.get("arrived_ns", now_ns))) / 1e9
        nodes.append(entry(name, seen.get("record") or {}, age, False))
    return {"node": me, "connected": bool(cluster.get("connected")),
            "draining": bool(cluster.get("draining")), "nodes": nodes,
            "loads": cluster.get("loads") or {}}


def annotate_model(obj: dict, cluster: dict | None) -> dict:
    """Add to one model object of ``/v1/models`` (or a ``/models/sse``
    event: ``id`` and ``status``) ``status.node`` (the node that serves it:
    this one if it holds it, else the first that does, else the one
    loading it; absent when none) and ``nodes`` (every node holding or
    loading it, with its state: ``[{"node", "state"}]``). A model this
    node has not loaded but another node has shows ``status.value``
    ``loaded``: a request is served at once. Unchanged outside cluster
    mode."""
    if cluster is None:
        return obj
    me = cluster.get("node")
    held = list((cluster.get("models") or {}).get(obj["id"], []))
    obj["nodes"] = held
    loaded = [h["node"] for h in held if h.get("state") == "loaded"]
    node = (me if me in loaded else loaded[0] if loaded else
            ((cluster.get("loads") or {}).get(obj["id"]) or {}).get("node") or
            next((h["node"] for h in held), None))
    if node is not None:
        obj["status"]["node"] = node
    if loaded and obj["status"].get("value") == "unloaded":
        # served at once through a node that holds it; the models
        # table's remote replica row may lag the cluster view a publish
        obj["status"]["value"] = "loaded"
    return obj


def annotate_models(listing: dict, cluster: dict | None) -> dict:
    """:func:`annotate_model` for each model of a ``/v1/models`` list."""
    if cluster is not None:
        for m in listing.get("data", []):
            annotate_model(m, cluster)
    return listing


def loading_info(cluster: dict | None, name: str) -> dict:
    """What the 503 after ``--load-wait`` adds to its ``loading`` object in
    cluster mode: ``node`` (the target of the model's cluster-wide load, or
    null when it waits for room anywhere) and that load's ``state`` and
    ``progress``."""
    if cluster is None:
        return {}
    load = (cluster.get("loads") or {}).get(name)
    if not load:
        return {"node": None, "state": "waiting for room on a node"}
    out = {"node": load.get("node"), "state": load.get("state", "loading")}
    if isinstance(load.get("progress"), (int, float)):
        out["progress"] = load["progress"]
    return out


def metrics_lines(cluster: dict | None, now_ns: int | None = None) -> list[str]:
    """Prometheus lines of the cluster, one series per node: beat age,
    models held, requests in flight, draining; and whether NATS is reached."""
    if cluster is None:
        return []
    view = cluster_view(cluster, now_ns)

    def lab(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    out = [("# HELP ggmux_cluster_connected 1 while this node reaches NATS.\n"
           "# TYPE ggmux_cluster_connected gauge\n"),
           f'ggmux_cluster_connected{{node="{lab(view["node"])}"}} {int(view["connected"])}\n']
    fams = (("ggmux_cluster_node_beat_age_seconds", ("Seconds since the node's last beat "
             "arrived."), lambda n: f'{n["age_s"]:.3f}'),
            ("ggmux_cluster_node_models", "Models the node holds (loaded, loading, asleep).",
             lambda n: str(len(n["models"]))),
            ("ggmux_cluster_node_in_flight", "Requests in flight on the node.",
             lambda n: str(sum(int(d.get("in_flight") or 0) for d in n["models"].values()))),
            ("ggmux_cluster_node_draining", "1 while the node drains.",
             lambda n: str(int(n["draining"]))))
    for name, help_, value in fams:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n")
        out.extend(f'{name}{{node="{lab(n["name"])}"}} {value(n)}\n' for n in view["nodes"])
    return out


def drain_route(conn: HttpConnection, req: Request, send_command) -> None:
    """``POST /cluster/drain`` (admin key): ask the supervisor to drain this
    node (no new placements, finish requests, leave, exit 0); answers 202."""
    if req.method != b"POST":
        conn.send_error(req, 405, "/cluster/drain needs POST")
        return
    if send_command(conn, req, {"op": "drain"}):
        conn.send_json(req, 202, {"success": True, "op": "drain"})
