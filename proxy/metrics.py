"""The router's ``GET /metrics``: Prometheus text for the whole server."""

from __future__ import annotations

import numpy as np

from ..shm import layout as L
from ..shm.segment import Segment
from ..shm.seqlock import read_table


def metrics_text(seg: Segment, reg_models: list[dict], model_rows: np.ndarray,
                 replica_rows: np.ndarray) -> bytes:
    """Prometheus text exposition (version 0.0.4) for the whole server,
    summed over every proxy's counter rows: per model requests, errors, in
    flight, waiting, the TTFT histogram (seconds), loads, evictions, load
    seconds, memory (bytes) and open circuits; per device memory (bytes)."""
    mc = seg.mcounters.sum(axis=0)
    cnt = seg.counters
    inflight = cnt[:, :, L.C_IN_FLIGHT].sum(axis=0)
    reps = replica_rows
    out: list[str] = []

    def fam(name: str, kind: str, help_: str) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n")

    def lab(s: str) -> str:
        return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    models = [(i, lab(m["name"])) for i, m in enumerate(reg_models)
              if not m.get("removed")]
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
    per_model("ggmux_model_loads_total", "counter", "Completed loads.", rows[:, L.M_LOADS])
    per_model("ggmux_model_evictions_total", "counter",
              "Replicas stopped to make room or idle.", rows[:, L.M_EVICTIONS])
    per_model("ggmux_model_load_seconds_total", "counter", "Time spent loading.",
              rows[:, L.M_LOAD_NS_TOTAL] / 1e9, "{:.3f}")
    per_model("ggmux_model_loaded", "gauge", "1 while the model has a ready replica.",
              (rows[:, L.M_STATUS] == L.ModelStatus.LOADED).astype(np.int64))
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
    fam("ggmux_device_memory_bytes", "gauge", "Memory per device at the last calibration.")
    for d in read_table(seg.devices):
        dev = ("host" if int(d[L.D_KIND]) == 0 else f"gpu{int(d[L.D_INDEX])}")
        for kind, col in (("total", L.D_TOTAL), ("external", L.D_EXTERNAL),
                          ("held", L.D_HELD), ("free", L.D_FREE)):
            out.append(f'ggmux_device_memory_bytes{{device="{dev}",kind="{kind}"}} '
                       f'{int(d[col])}\n')
    return "".join(out).encode()
