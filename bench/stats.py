"""Statistics of a serving benchmark run: percentiles, per-metric
summaries, inter-token latency and goodput under SLOs, as ``vllm bench
serve`` reports them.

* ITL (inter-token latency): the gaps between successive content events
  of a stream, pooled over all requests (vLLM's ``itl``), so a stall while
  another request's prompt is read shows in its p99;
* TPOT: per request, ``(e2e - ttft) / (output_tokens - 1)``;
* goodput: requests per second that succeeded *and* met every SLO given
  (``--slo ttft=1s,tpot=50ms``; vLLM's ``--goodput``), with the fraction of
  requests that did.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

PERCENTILES = (50.0, 90.0, 99.0)

SLO_METRICS = ("ttft", "tpot", "itl", "e2e", "ttfb")
"""Metrics an SLO may bound; ``itl`` bounds a request's worst gap."""

_UNITS = {"ms": 1e-3, "s": 1.0, "": 1.0}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation, as numpy's default."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def describe(values: Sequence[float]) -> dict[str, float | int | None]:
    """Count, mean, min, max and :data:`PERCENTILES` of ``values`` (seconds in, seconds out)."""
    summary: dict[str, float | int | None] = {
        "count": len(values),
        "mean": sum(values) / len(values) if values else None,
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }
    for q in PERCENTILES:
        summary[f"p{q:g}"] = percentile(values, q)
    return summary


def inter_token_gaps(arrivals: Sequence[float]) -> list[float]:
    """Seconds between successive content events of one stream.

    ``arrivals``: when each event carrying content arrived (seconds, any
    origin, in order); the first one's time from the request is the TTFT,
    so ``n`` events give ``n - 1`` gaps. An event that carries several
    tokens is one gap, as the client saw it (vLLM counts the same way).
    """
    return [later - earlier for earlier, later in itertools.pairwise(arrivals)]


def tpot(ttft: float | None, e2e: float | None, output_tokens: int) -> float | None:
    """Time per output token after the first, ``(e2e - ttft) / (output_tokens - 1)``.

    Seconds; None without a TTFT or an end, or with fewer than two tokens
    (vLLM's definition).
    """
    if ttft is None or e2e is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def parse_slo(text: str) -> dict[str, float]:
    """``"ttft=1s,tpot=50ms"`` to ``{"ttft": 1.0, "tpot": 0.05}`` (seconds;
    a bare number is seconds). Raises ValueError for an unknown metric or a
    malformed bound."""
    out: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, bound = item.partition("=")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|s)?", bound.strip())
        if name.strip() not in SLO_METRICS or not m:
            raise ValueError(f"SLO {item!r}: want METRIC=NUMBER[ms|s] with METRIC one of "
                             f"{', '.join(SLO_METRICS)}")
        out[name.strip()] = float(m.group(1)) * _UNITS[m.group(2) or ""]
    return out


def meets_slo(record: Any, slo: dict[str, float]) -> bool:
    """Whether a successful ``record`` (a RequestResult) met every bound of
    ``slo``; a metric the request has no value for (TPOT of a one-token
    answer) does not count against it."""
    if not record.ok:
        return False
    for name, bound in slo.items():
        if name == "itl":
            value = max(record.itl) if record.itl else None
        else:
            value = getattr(record, name, None)
        if value is not None and value > bound:
            return False
    return True


def summarize(records: Sequence[Any], elapsed: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """Summary of ``records`` (RequestResults) measured over ``elapsed``
    seconds of wall time.

    Latency statistics use successful requests only (``itl`` pools every
    gap of every successful stream); throughputs are successful requests
    (and their output tokens) per second of ``elapsed``; ``goodput`` (with
    an ``slo``) counts only the requests that met it.
    """
    good = [r for r in records if r.ok]
    tokens = sum(r.output_tokens for r in good)
    metrics = {
        name: describe([v for r in good if (v := getattr(r, name)) is not None])
        for name in ("ttfb", "ttft", "tpot", "e2e", "queue_delay")
    }
    metrics["itl"] = describe([gap for r in good for gap in r.itl])
    prompt_tokens = {
        # what the server counted (chat template included) and what was planned
        name: describe([v for r in good if (v := getattr(r, name, None)) is not None])
        for name in ("prompt_tokens", "prompt_text_tokens")
    }
    out = {
        "requests": len(records),
        "ok": len(good),
        "failed": len(records) - len(good),
        "status_counts": {str(k): v for k, v in sorted(Counter(r.status for r in records).items())},
        "errors": dict(Counter(r.error for r in records if r.error).most_common(5)),
        "elapsed_s": elapsed,
        "request_throughput": len(good) / elapsed if elapsed > 0 else None,
        "output_token_throughput": tokens / elapsed if elapsed > 0 else None,
        "output_tokens": tokens,
        "metrics": metrics,
        "prompt_tokens": prompt_tokens,
    }
    if slo:
        met = [r for r in good if meets_slo(r, slo)]
        out["slo"] = dict(slo)
        out["goodput"] = len(met) / elapsed if elapsed > 0 else None
        out["slo_attained"] = len(met) / len(records) if records else None
    return out
