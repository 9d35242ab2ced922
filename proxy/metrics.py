"""The router's ``GET /metrics``: Prometheus text for the whole server.

Besides the proxies' and supervisor's figures from shared memory, the
families each local replica exports (llama-server's ``llamacpp:`` names,
which the built-in instance uses too) are scraped from the replicas at
request time (:func:`scrape_replicas`) and summed per model (issue 12), and
so are the figures of their KV tiers (issue 29: each replica's ``GET
/cache``, one more small request per replica; a replica without tiers
answers 404 and adds nothing): hits per tier, misses, restored tokens and
restore seconds, entries saved and rejected. Those are counters of the
running replicas, so a model's total drops when a replica stops (a counter
reset to Prometheus); the tiers' sizes come from the models table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
import orjson

from ..http1.auth import secret_header
from ..shm import layout as L
from ..shm.segment import Segment
from ..shm.seqlock import read_table
from .vllm_metrics import DEFAULT_BLOCK_SIZE, vllm_text

log = logging.getLogger(__name__)

# a replica's family -> (the router's per-model family, kind, help)
REPLICA_FAMILIES = {
    "llamacpp:prompt_tokens_total": ("ggmux_model_prompt_tokens_total", "counter",
                                     "Prompt tokens the model's replicas evaluated."),
    "llamacpp:prompt_tokens_cached_total": ("ggmux_model_cached_tokens_total", "counter",
                                     "Prompt tokens reused from a slot's cache."),
    "llamacpp:tokens_predicted_total": ("ggmux_model_tokens_predicted_total", "counter",
                                        "Tokens the model's replicas generated."),
    "llamacpp:tokens_predicted_seconds_total": (
        "ggmux_model_tokens_predicted_seconds_total", "counter",
        "Seconds of generation, summed over requests (tokens / seconds = tokens/s per stream)."),
    "llamacpp:requests_processing": ("ggmux_model_requests_processing", "gauge",
                                     "Requests in the replicas' slots."),
    "llamacpp:requests_deferred": ("ggmux_model_requests_deferred", "gauge",
                                   "Requests queued inside replicas for a slot or KV room."),
    "llamacpp:slots": ("ggmux_model_slots", "gauge", "Slots of the ready replicas."),
    "llamacpp:kv_cache_tokens": ("ggmux_model_kv_cache_tokens", "gauge",
                                 "KV cache cells reserved or holding a slot's cache."),
    "llamacpp:kv_cache_size": ("ggmux_model_kv_cache_size", "gauge",
                               "KV cache cells of the ready replicas."),
    "ggmux_kv_cache_busy_tokens": ("ggmux_model_kv_cache_busy_tokens", "gauge",
                                   "KV cache cells reserved by running requests."),
    "llamacpp:spec_decode_num_draft_tokens_total": (
        "ggmux_model_draft_tokens_total", "counter",
        "Speculative decoding: draft tokens the model's replicas verified."),
    "llamacpp:spec_decode_num_accepted_tokens_total": (
        "ggmux_model_draft_accepted_tokens_total", "counter",
        "Speculative decoding: draft tokens accepted (accepted / drafted = acceptance rate)."),
}


# a replica's GET /cache figure -> (the router's per-model family, help); "hits" by tier
CACHE_FAMILIES = {
    "hits": ("ggmux_model_cache_hits_total",
             "Requests whose prompt prefix came from a KV tier (slot, ram, disk)."),
    "misses": ("ggmux_model_cache_misses_total",
               "Requests whose prompt prefix no KV tier held."),
    "restored_tokens": ("ggmux_model_cache_restored_tokens_total",
                        "Prompt tokens restored from the RAM or disk tier."),
    "restore_seconds": ("ggmux_model_cache_restore_seconds_total",
                        "Seconds spent restoring prefixes from the RAM or disk tier."),
    "saved": ("ggmux_model_cache_saved_total", "Entries written to the disk tier."),
    "rejected": ("ggmux_model_cache_rejected_total",
                 "Disk entries never loaded (torn, corrupt, another fingerprint)."),
}
TIER_NAMES = ("slot", "ram", "disk")


async def _get(port: int, path: bytes, secret: bytes, timeout: float) -> bytes | None:
    """The body of a 200 answer to ``GET path`` from the replica, else None."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), timeout)
    try:
        writer.write(b"GET %s HTTP/1.1\r\nhost: ggmux\r\nconnection: close\r\n%s\r\n"
                     % (path, secret))
        data = await asyncio.wait_for(reader.read(-1), timeout)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else None


def _cache_figures(body: bytes | None) -> dict[str, float]:
    """``cache:<figure>`` (``cache:hits:<tier>``) -> value of a ``GET /cache``
    answer; {} for none or one of another shape."""
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return {}
    if not isinstance(doc, dict):
        return {}
    out: dict[str, float] = {}
    hits = doc.get("hits")
    for tier in TIER_NAMES:
        v = hits.get(tier) if isinstance(hits, dict) else None
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"cache:hits:{tier}"] = float(v)
    for k in CACHE_FAMILIES:
        v = doc.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[f"cache:{k}"] = float(v)
    return out


async def _scrape(port: int, secret: bytes, timeout: float) -> dict[str, float]:
    body, cache = await asyncio.gather(_get(port, b"/metrics", secret, timeout),
                                       _get(port, b"/cache", secret, timeout),
                                       return_exceptions=True)
    out: dict[str, float] = {} if isinstance(cache, BaseException) else _cache_figures(cache)
    if isinstance(body, BaseException):
        if not out:
            raise body
        return out
    if body is None:
        return out
    for line in body.decode("utf-8", "replace").splitlines():
        name, _, value = line.partition(" ")
        if name in REPLICA_FAMILIES:
            try:
                out[name] = float(value.split()[0])
            except (ValueError, IndexError):
                pass
    return out


async def scrape_replicas(replica_rows: np.ndarray, timeout: float = 1.0) -> dict[int, dict]:
    """Per model index, the sums of :data:`REPLICA_FAMILIES` over its ready
    local replicas (a replica that does not answer within ``timeout``
    seconds, or has no such families, adds nothing). Each is asked with its
    secret (``R_SECRET_HI``/``R_SECRET_LO``) as the bearer token."""
    ready = [(int(r[L.R_MODEL]), int(r[L.R_PORT]),
              secret_header(int(r[L.R_SECRET_HI]), int(r[L.R_SECRET_LO])))
             for r in replica_rows
             if r[L.R_STATUS] == L.ReplicaStatus.READY and r[L.R_PID] > 0 and r[L.R_PORT] > 0]
    results = await asyncio.gather(*(_scrape(port, secret, timeout) for _, port, secret in ready),
                                   return_exceptions=True)
    sums: dict[int, dict] = {}
    for (m, port, _), got in zip(ready, results):
        if isinstance(got, BaseException):
            log.debug("no metrics from the replica on port %d: %s", port, got)
            continue
        acc = sums.setdefault(m, {})
        for k, v in got.items():
            acc[k] = acc.get(k, 0.0) + v
    return sums


def metrics_text(seg: Segment, reg_models: list[dict], model_rows: np.ndarray,
                 replica_rows: np.ndarray, replicas: dict[int, dict] | None = None,
                 sees: Callable[[int], bool] | None = None,
                 router: dict | None = None) -> bytes:
    """Prometheus text exposition (version 0.0.4) for the whole server,
    summed over every proxy's counter rows: per model requests, errors, in
    flight, waiting, the TTFT histogram (seconds), loads, evictions, load
    seconds, memory (bytes) and open circuits; per device memory (bytes);
    and, from ``replicas`` (:func:`scrape_replicas`), the replicas' own
    token, slot, queue and KV figures per model. With ``router``'s
    ``metrics_compat`` ``vllm`` (the default), the same models' figures
    under vLLM's names too (:mod:`.vllm_metrics`: the pod's sums and the
    adapter lists are of the models the caller sees).

    ``sees(i)``: whether the caller may see model ``i`` (a keys-file key
    sees its own models only: :class:`~.keyed.KeyScope`); None: every
    model. It filters ``models``, the one list every per-model series
    (and the server-wide sums of them) is written from, so a series added
    here is filtered as they are."""
    mc = seg.mcounters.sum(axis=0)
    cnt = seg.counters
    inflight = cnt[:, :, L.C_IN_FLIGHT].sum(axis=0)
    reps = replica_rows
    out: list[str] = []

    def fam(name: str, kind: str, help_: str) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n")

    def lab(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    # every per-model series below comes from this list: the caller's models only
    models = [(i, lab(m["name"])) for i, m in enumerate(reg_models)
              if not m.get("removed") and (sees is None or sees(i))]
    rows = model_rows

    def per_model(name: str, kind: str, help_: str, values, fmt: str = "{:d}") -> None:
        fam(name, kind, help_)
        out.extend(f'{name}{{model="{n}"}} {fmt.format(values[i])}\n' for i, n in models)

    in_flight = {i: int(inflight[reps[:, L.R_MODEL] == i].sum()) for i, _ in models}
    per_model("ggmux_requests_total", "counter", "Requests answered by a replica, per model.",
              mc[:, L.MC_REQUESTS])
    per_model("ggmux_request_errors_total", "counter",
              "Requests that failed (5xx, replica errors).", mc[:, L.MC_ERRORS])
    per_model("ggmux_requests_in_flight", "gauge", "Requests being served, per model.",
              in_flight)
    per_model("ggmux_model_waiting", "gauge", "Requests waiting for the model to load.",
              rows[:, L.M_WAITERS])
    # prefix-aware routing (issue 20): choices that weighed a prompt prefix, those
    # sent where the index predicted part of it cached, and the predictions the
    # replica's cached_tokens proved wrong
    per_model("ggmux_prefix_routed_total", "counter",
              "Requests whose replica was chosen with the prefix index.",
              mc[:, L.MC_PREFIX_ROUTED])
    per_model("ggmux_prefix_predicted_total", "counter",
              "Requests sent to a replica the prefix index said holds part of the prompt.",
              mc[:, L.MC_PREFIX_PREDICTED])
    per_model("ggmux_prefix_missed_total", "counter",
              "Predicted requests whose replica reported under half the predicted cached tokens.",
              mc[:, L.MC_PREFIX_MISSED])
    fam("ggmux_ttft_seconds", "histogram", "Time to first token (first body byte), seconds.")
    for i, n in models:
        acc = 0
        for b, le in enumerate(L.TTFT_BUCKETS_MS):
            acc += int(mc[i, L.MC_BUCKET0 + b])
            out.append(f'ggmux_ttft_seconds_bucket{{model="{n}",le="{le / 1000:g}"}} {acc}\n')
        acc += int(mc[i, L.MC_BUCKET_INF])
        out.append(f'ggmux_ttft_seconds_bucket{{model="{n}",le="+Inf"}} {acc}\n')
        out.append(f'ggmux_ttft_seconds_sum{{model="{n}"}} '
                   f'{int(mc[i, L.MC_TTFT_SUM_US]) / 1e6:.6f}\n')
        out.append(f'ggmux_ttft_seconds_count{{model="{n}"}} {int(mc[i, L.MC_TTFT_COUNT])}\n')
    # contention (issue 34): the queue's oldest wait and its reason, swaps,
    # drains, and how long served requests waited for their model
    now = time.monotonic_ns()
    first = rows[:, L.M_WAIT_FIRST_NS]
    per_model("ggmux_model_oldest_wait_seconds", "gauge",
              "How long the model's oldest waiting request has waited.",
              np.where(first > 0, np.maximum(0, now - first), 0) / 1e9, "{:.3f}")
    fam("ggmux_model_wait_reason", "gauge",
        "1 for the reason the model's requests wait (none while none wait).")
    for i, n in models:
        r = int(rows[i, L.M_WAIT_REASON])
        name = L.WaitReason.NAMES[r] if 0 <= r < len(L.WaitReason.NAMES) else "none"
        out.append(f'ggmux_model_wait_reason{{model="{n}",reason="{name}"}} 1\n')
    per_model("ggmux_model_swaps_total", "counter",
              "Loads of the model that stopped or drained another model to make room.",
              rows[:, L.M_SWAPS])
    per_model("ggmux_model_drains_total", "counter",
              "Times a replica of the model was drained for a model waiting past its bound.",
              rows[:, L.M_DRAINS])
    fam("ggmux_swaps_total", "counter", "Loads that stopped or drained another model.")
    out.append(f"ggmux_swaps_total {int(sum(int(rows[i, L.M_SWAPS]) for i, _ in models))}\n")
    fam("ggmux_wait_seconds", "histogram",
        "How long requests waited for their model's capacity or load before a replica "
        "took them (those that left or gave up are not counted).")
    for i, n in models:
        acc = 0
        for b, le in enumerate(L.WAIT_BUCKETS_S):
            acc += int(mc[i, L.MC_WAIT_BUCKET0 + b])
            out.append(f'ggmux_wait_seconds_bucket{{model="{n}",le="{le:g}"}} {acc}\n')
        acc += int(mc[i, L.MC_WAIT_BUCKET_INF])
        out.append(f'ggmux_wait_seconds_bucket{{model="{n}",le="+Inf"}} {acc}\n')
        out.append(f'ggmux_wait_seconds_sum{{model="{n}"}} '
                   f'{int(mc[i, L.MC_WAIT_SUM_US]) / 1e6:.6f}\n')
        out.append(f'ggmux_wait_seconds_count{{model="{n}"}} {int(mc[i, L.MC_WAIT_COUNT])}\n')
    per_model("ggmux_model_loads_total", "counter", "Completed loads.", rows[:, L.M_LOADS])
    per_model("ggmux_model_evictions_total", "counter",
              "Replicas stopped to make room or idle.", rows[:, L.M_EVICTIONS])
    per_model("ggmux_model_load_seconds_total", "counter", "Time spent loading.",
              rows[:, L.M_LOAD_NS_TOTAL] / 1e9, "{:.3f}")
    per_model("ggmux_model_loaded", "gauge", "1 while the model has a ready replica.",
              (rows[:, L.M_STATUS] == L.ModelStatus.LOADED).astype(np.int64))
    # its KV tiers (issue 29): prompt caches its running replicas keep in host RAM, and
    # its disk tier on this node (known while no replica runs too)
    fam("ggmux_model_cache_bytes", "gauge", "Bytes of the model's KV tiers, per tier.")
    for i, n in models:
        out.append(f'ggmux_model_cache_bytes{{model="{n}",tier="ram"}} '
                   f'{int(rows[i, L.M_CACHE_RAM_BYTES])}\n')
        out.append(f'ggmux_model_cache_bytes{{model="{n}",tier="disk"}} '
                   f'{int(rows[i, L.M_CACHE_DISK_BYTES])}\n')
    fam("ggmux_model_memory_bytes", "gauge", "Measured min/max and effective memory.")
    for i, n in models:
        for kind, col in (("min", L.M_MEM_MIN), ("max", L.M_MEM_MAX),
                          ("effective", L.M_MEM_EFFECTIVE)):
            out.append(f'ggmux_model_memory_bytes{{model="{n}",kind="{kind}"}} '
                       f'{int(rows[i, col])}\n')
    fam("ggmux_replica_circuit_open", "gauge", "Replicas whose circuit this proxy opened.")
    for i, n in models:
        slots = np.flatnonzero(reps[:, L.R_MODEL] == i)
        opened = int((cnt[:, slots, L.C_CIRCUIT] == L.CircuitState.OPEN).any(axis=0).sum())
        out.append(f'ggmux_replica_circuit_open{{model="{n}"}} {opened}\n')
    for src, (name, kind, help_) in REPLICA_FAMILIES.items():
        have = [(i, n) for i, n in models if src in (replicas or {}).get(i, {})]
        if have:
            fam(name, kind, help_)
            out.extend(f'{name}{{model="{n}"}} {replicas[i][src]:g}\n' for i, n in have)
    for k, (name, help_) in CACHE_FAMILIES.items():
        have = [(i, n) for i, n in models if any(
            key.startswith(f"cache:{k}") for key in (replicas or {}).get(i, {}))]
        if not have:
            continue
        fam(name, "counter", help_)
        for i, n in have:
            got = replicas[i]
            if k == "hits":
                out.extend(f'{name}{{model="{n}",tier="{t}"}} {got[f"cache:hits:{t}"]:g}\n'
                           for t in TIER_NAMES if f"cache:hits:{t}" in got)
            else:
                out.append(f'{name}{{model="{n}"}} {got[f"cache:{k}"]:g}\n')
    router = router or {}
    if router.get("metrics_compat", "vllm") == "vllm":
        out.extend(vllm_text(models, {i: m["name"] for i, m in enumerate(reg_models)}, rows,
                             in_flight, replicas, models_max=router.get("models_max", 0),
                             block_size=router.get("kv_block_size", DEFAULT_BLOCK_SIZE)))
    fam("ggmux_device_memory_bytes", "gauge", "Memory per device at the last calibration.")
    for d in read_table(seg.devices):
        dev = ("host" if int(d[L.D_KIND]) == 0 else f"gpu{int(d[L.D_INDEX])}")
        for kind, col in (("total", L.D_TOTAL), ("external", L.D_EXTERNAL),
                          ("held", L.D_HELD), ("free", L.D_FREE)):
            out.append(f'ggmux_device_memory_bytes{{device="{dev}",kind="{kind}"}} '
                       f'{int(d[col])}\n')
    return "".join(out).encode()
