"""``GET /ps``: what runs now, per model and device, for ``ggmux ps`` and the web page.

Everything comes from the shared-memory tables as this proxy sees them
(counters summed over every proxy's rows), so any proxy answers the same.
"""

from __future__ import annotations

import time

import numpy as np

from ... import __version__
from ...shm import layout as L
from ...shm.segment import Segment
from ...shm.seqlock import read_table
from ..cluster import annotate_model
from ..contention import queue_status
from ..listing import Scope

NS = 1_000_000_000


def recent_ttft_us(mc: np.ndarray) -> np.ndarray:
    """The recent TTFT samples (microseconds) of one model over every
    proxy, from ``mc`` = ``mcounters[:, model]`` (proxies, MC_WORDS): each
    proxy's last :data:`~ggmux.shm.layout.TTFT_RECENT` at most (fewer
    when it served fewer)."""
    out = []
    for row in mc:
        n = min(int(row[L.MC_RECENT_N]), L.TTFT_RECENT)
        if n:
            out.append(row[L.MC_RECENT0 : L.MC_RECENT0 + n])
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def ttft_p50_ms(mc: np.ndarray) -> float | None:
    """The median (ms) of :func:`recent_ttft_us` (numpy's median: the
    mean of the two middle samples for an even count); None without
    samples. What the page and ``ggmux ps`` show: the recent samples
    themselves, not a histogram's bucket edges (issue 22), so it follows a
    model that got faster or slower."""
    us = recent_ttft_us(mc)
    return float(np.median(us)) / 1000 if len(us) else None


def _device_name(row: np.ndarray) -> str:
    return "host" if int(row[L.D_KIND]) == 0 else f"gpu{int(row[L.D_INDEX])}"


def overview(seg: Segment, reg_models: list[dict], model_rows: np.ndarray,
             replica_rows: np.ndarray, remotes: dict[int, dict], errors: dict[str, str],
             now_ns: int | None = None, cluster: dict | None = None,
             scope: Scope | None = None) -> dict:
    """``{"object": "ps", "version", "models": [...], "devices": [...], "models_max": N}``,
    and in cluster mode ``node`` (this node's name).

    Per model (registry order, removed ones left out): ``id``, ``aliases``,
    ``kind``, ``state``, ``failed``/``error``, ``progress`` (0..1) while
    loading, ``replicas`` (a list: ``slot``, ``state``, ``pid``, ``where``
    ("local" or the upstream's ``host:port``), ``in_flight``, ``requests``,
    ``ttft_ms`` (EWMA), ``draining``), ``in_flight``, ``waiting``, ``queue``
    (issue 34: why its requests wait, :func:`~ggmux.proxy.contention.queue_status`;
    None when none waits), ``swaps`` and ``drains``, ``requests``,
    ``errors``, ``ttft_p50_ms`` (the median of the recent samples:
    :func:`ttft_p50_ms`),
    ``memory`` (bytes: ``min``, ``max``, ``effective``), ``modalities``
    (``{"vision", "audio"}`` of a model with a projector, else None), ``cache`` (bytes
    of its KV tiers, issue 29: ``ram`` in its running replicas, ``disk`` on
    this node), ``ttl`` (s),
    ``idle_s`` (since the last request ended, while loaded and idle; else
    None) and ``unload_in_s`` (``ttl`` - ``idle_s`` when a ttl applies).
    In cluster mode (``cluster``: the registry blob's cluster object) also
    ``node`` (the node that serves it, as ``/v1/models``'s ``status.node``;
    None when none holds it) and ``nodes`` (``[{"node", "state"}]``, every
    node holding or loading it).
    Per device: ``name`` (host, gpuN) and ``total``, ``external``, ``held``,
    ``free`` bytes at the last calibration. With a ``scope`` (a keys-file
    key's, :class:`~..listing.Scope`) only the models it sees, a waiting
    model's holder as it may read it."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    cnt = seg.counters  # (proxies, replicas, C_WORDS)
    mc = seg.mcounters.sum(axis=0)
    waiting = seg.waiters[:, :, L.W_COUNT].sum(axis=0)
    models_out = []
    def name_of(h: int) -> str:
        if scope is not None:
            return scope.name(h)
        return reg_models[h]["name"] if 0 <= h < len(reg_models) else ""

    for i, mdl in enumerate(reg_models):
        if mdl.get("removed") or (scope is not None and not scope.sees(i)):
            continue
        row = model_rows[i]
        st = int(row[L.M_STATUS])
        reps = []
        last_used = 0
        ready_ns = 0
        for slot in np.flatnonzero(replica_rows[:, L.R_MODEL] == i):
            r = replica_rows[slot]
            rs = int(r[L.R_STATUS])
            if rs == L.ReplicaStatus.FREE:
                continue
            mine = cnt[:, slot][cnt[:, slot, L.C_INCARNATION] == r[L.R_INCARNATION]]
            ewma = mine[:, L.C_TTFT_EWMA_US]
            ewma = ewma[ewma > 0]
            remote = remotes.get(int(slot))
            reps.append({
                "slot": int(slot),
                "state": L.ReplicaStatus.NAMES[rs],
                "pid": int(r[L.R_PID]) or None,
                "where": "local" if remote is None else f"{remote['host']}:{remote['port']}",
                "in_flight": max(0, int(mine[:, L.C_IN_FLIGHT].sum())),
                "requests": int(mine[:, L.C_REQUESTS].sum()),
                "ttft_ms": round(float(ewma.mean()) / 1000, 1) if len(ewma) else None,
                "draining": bool(r[L.R_DRAINING]),
            })
            if remote is None and rs in (L.ReplicaStatus.READY, L.ReplicaStatus.SLEEPING):
                last_used = max(last_used, int(mine[:, L.C_LAST_USED_NS].max(initial=0)))
                ready_ns = max(ready_ns, int(r[L.R_READY_NS]))
        in_flight = sum(r["in_flight"] for r in reps)
        ttl = mdl.get("ttl") or 0
        idle = None
        if ready_ns and not in_flight:
            idle = round(max(0, now - max(last_used, ready_ns)) / NS, 1)
        p50 = ttft_p50_ms(seg.mcounters[:, i])
        doc = {
            "id": mdl["name"],
            "aliases": mdl.get("aliases", []),
            "kind": mdl.get("kind"),
            "state": L.ModelStatus.NAMES[st],
            "failed": bool(row[L.M_FAILED]),
            "replicas": reps,
            "in_flight": in_flight,
            "waiting": int(waiting[i]),
            "requests": int(mc[i, L.MC_REQUESTS]),
            "errors": int(mc[i, L.MC_ERRORS]),
            "ttft_p50_ms": None if p50 is None else round(p50, 1),
            "memory": {"min": int(row[L.M_MEM_MIN]), "max": int(row[L.M_MEM_MAX]),
                       "effective": int(row[L.M_MEM_EFFECTIVE])},
            "cache": {"ram": int(row[L.M_CACHE_RAM_BYTES]),
                      "disk": int(row[L.M_CACHE_DISK_BYTES])},
            "ttl": ttl or None,
            # measured: what its multimodal projector reads beside text (vision, audio)
            "modalities": mdl.get("modalities") if isinstance(mdl.get("modalities"), dict)
            else None,
            "idle_s": idle,
            "unload_in_s": (round(max(0.0, ttl - idle), 1)
                            if idle is not None and ttl and ttl > 0 else None),
        }
        doc["queue"] = queue_status(row, name_of, now)
        doc["swaps"], doc["drains"] = int(row[L.M_SWAPS]), int(row[L.M_DRAINS])
        if row[L.M_FAILED] and str(i) in errors:
            doc["error"] = errors[str(i)]
        if st == L.ModelStatus.LOADING:
            doc["progress"] = int(row[L.M_PROGRESS]) / 1000
        if cluster is not None:
            where = annotate_model({"id": mdl["name"], "status": {"value": doc["state"]}},
                                   cluster)
            doc["state"] = where["status"]["value"]  # loaded elsewhere: served at once
            doc["node"] = where["status"].get("node")
            doc["nodes"] = where["nodes"]
        models_out.append(doc)
    devices = [{"name": _device_name(d), "total": int(d[L.D_TOTAL]),
                "external": int(d[L.D_EXTERNAL]), "held": int(d[L.D_HELD]),
                "free": int(d[L.D_FREE])}
               for d in read_table(seg.devices) if int(d[L.D_TOTAL]) > 0]
    out = {"object": "ps", "version": __version__, "models": models_out, "devices": devices,
           "models_max": int(seg.header[L.H_MODELS_MAX])}
    if cluster is not None:
        out["node"] = cluster.get("node")
    return out


DRAFT_FAMILIES = ("llamacpp:spec_decode_num_draft_tokens_total",
                  "llamacpp:spec_decode_num_accepted_tokens_total")


def drafting_models(reg_models: list[dict]) -> set[int]:
    """Indices of the models whose arguments turn speculative decoding on
    (``--spec-type`` other than ``none``)."""
    out = set()
    for i, mdl in enumerate(reg_models):
        args = mdl.get("args") or []
        for k, a in enumerate(args):
            if a == "--spec-type" and k + 1 < len(args) and args[k + 1] != "none":
                out.add(i)
    return out


def add_drafts(doc: dict, reg_models: list[dict], sums: dict[int, dict]) -> None:
    """Give each model of ``doc`` (``/ps``) whose replicas reported drafts
    (``sums``: per model index, the replicas' metric families summed, as
    :func:`~ggmux.proxy.metrics.scrape_replicas` gives them) a ``drafts``
    object: ``drafted`` and ``accepted`` tokens since its replicas started,
    and ``acceptance`` (accepted / drafted, None before any draft). So
    ``ggmux ps`` and the page show that speculation is on and what it
    accepts (issue 37: only ``/metrics`` did)."""
    by_name = {mdl.get("name"): i for i, mdl in enumerate(reg_models)}
    for m in doc.get("models", []):
        got = sums.get(by_name.get(m.get("id"), -1))
        if not got or DRAFT_FAMILIES[0] not in got:
            continue
        drafted = int(got.get(DRAFT_FAMILIES[0], 0))
        accepted = int(got.get(DRAFT_FAMILIES[1], 0))
        m["drafts"] = {"drafted": drafted, "accepted": accepted,
                       "acceptance": round(accepted / drafted, 3) if drafted else None}

