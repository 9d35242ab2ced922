"""The tables of :mod:`bench.compare`: its figures from the measured
rounds (:func:`figures`: the best round's p50 and req/s, p99 over every
round pooled), each against ``direct`` (:func:`format_report`), and the line
saying when, where and how they were measured (:func:`format_header`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from bench.stats import percentile


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def pooled(rounds: Sequence[dict[str, Any]], metric: str) -> list[float]:
    """Every successful request's ``metric`` (seconds) across rounds."""
    return [
        r[metric] for rnd in rounds for r in rnd["requests"] if r["ok"] and r[metric] is not None
    ]


def best_round(rounds: Sequence[dict[str, Any]], metric: str, stat: str) -> float | None:
    """The best round's ``stat`` of ``metric``: the least latency, or the most requests/s.

    Work from outside (other jobs on a small machine) only ever slows a
    round down, so the best of a target's rounds is the figure least
    disturbed by it; every target gets the same number of rounds.
    """
    if metric == "rps":
        return max((r["summary"]["request_throughput"] or 0.0 for r in rounds), default=None)
    values = [r["summary"]["metrics"][metric][stat] for r in rounds]
    return _min(values)


def figures(hot: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """``{figure: {target: value}}`` from :func:`measure_hot`'s output (seconds, req/s).

    p50 and req/s are the best round's (:func:`best_round`); p99 pools the
    requests of every round, outliers included.
    """
    out: dict[str, dict[str, Any]] = {}
    for phase, by_target in hot.items():
        for target, rounds in by_target.items():
            failed = sum(r["summary"]["failed"] for r in rounds)
            out.setdefault(f"{phase}.failed", {})[target] = failed
            if phase.endswith("_c1"):
                metric = "ttft" if phase.startswith("stream") else "e2e"
                out.setdefault(f"{phase}.{metric}_p50", {})[target] = best_round(
                    rounds, metric, "p50"
                )
                out.setdefault(f"{phase}.{metric}_p99", {})[target] = percentile(
                    pooled(rounds, metric), 99
                )
                if phase.startswith("stream"):
                    out.setdefault(f"{phase}.tpot_p50", {})[target] = best_round(
                        rounds, "tpot", "p50"
                    )
            else:
                out.setdefault(f"{phase}.rps", {})[target] = best_round(rounds, "rps", "")
    if hot:
        out["all.busy_after_s"] = {
            target: max(
                (r.get("settle_s", 0.0) for by in hot.values() for r in by.get(target, [])),
                default=0.0,
            )
            for target in {t for by in hot.values() for t in by}
        }
    return out


def _cell(value: float | None, ref: float | None, kind: str) -> str:
    """``value`` in ms, s or req/s, with its difference and ratio to ``ref`` when given."""
    if value is None:
        return "-"
    if kind == "s":
        return f"{value:.2f}"
    if kind == "rps":
        return f"{value:.1f}" + (f" ({value / ref:.2f}x)" if ref else "")
    text = f"{value * 1000:.2f}"
    if ref:
        text += f" ({(value - ref) * 1000:+.2f}, {value / ref:.2f}x)"
    return text


def format_report(report: dict[str, Any]) -> str:
    """The comparison tables: hot figures against ``direct``, then cold switch."""
    names = [t["name"] for t in report["targets"]]
    figs = report["figures"]
    rows: list[tuple[str, list[str]]] = []
    for key, values in figs.items():
        phase, metric = key.split(".")
        if metric == "failed":
            if any(values.values()):
                rows.append((f"failed: {phase}", [str(values.get(n, 0)) for n in names]))
            continue
        kind = "rps" if metric == "rps" else "s" if metric.endswith("_s") else "ms"
        if kind == "s":
            label = "busy after a run, longest (s)"
        else:
            label = f"{report['titles'].get(phase, phase)}: {metric.replace('_', ' ')}"
            label += " (req/s)" if kind == "rps" else " (ms)"
        ref = values.get("direct")
        rows.append(
            (label, [_cell(values.get(n), None if n == "direct" else ref, kind) for n in names])
        )
    width = 2 + max([len(n) for n in names] + [len(c) for _, cells in rows for c in cells])
    lines = [f"{'figure':<44}" + "".join(f"{n:>{width}}" for n in names)]
    lines.append("-" * len(lines[0]))
    lines += [f"{label:<44}" + "".join(f"{c:>{width}}" for c in cells) for label, cells in rows]
    lines.append(
        "ms cells: value (added vs direct, ratio); req/s cells: value (ratio to direct); "
        "p50 and req/s: each target's best round; p99: all rounds pooled; "
        "busy after: CPU still used once the client is done"
    )
    for t in report["targets"]:
        if t["note"]:
            lines.append(f"  {t['name']}: {t['note']}")
    for name, reason in report["skipped"].items():
        lines.append(f"  skipped {name}: {reason.splitlines()[0]}")
    lines += [
        "",
        "cold switch: request for an unloaded model to its first token (median s, [min])",
    ]
    for model, by_source in report["cold"].items():
        raw = by_source.get("raw", [])
        raw_load_s = _median([r.get("load_s") for r in raw])
        raw_first = _median([r.get("spawn_to_first_token_s") for r in raw])
        lines.append(
            f"  {model}: raw Llama() load {_fmt_s(raw_load_s)} "
            f"[{_fmt_s(_min([r.get('load_s') for r in raw]))}], raw interpreter spawn to "
            f"first token {_fmt_s(raw_first)} "
            f"[{_fmt_s(_min([r.get('spawn_to_first_token_s') for r in raw]))}]"
        )
        for source, entries in by_source.items():
            if source == "raw":
                continue
            value = _median([e.get("seconds") for e in entries])
            low = _min([e.get("seconds") for e in entries])
            ratio = (
                f" ({value / raw_first:.2f}x raw spawn to first token, "
                f"{value / raw_load_s:.2f}x raw Llama() load)"
                if (value and raw_first and raw_load_s)
                else ""
            )
            errors = [e["error"] for e in entries if e.get("error")]
            how = "respawn" if source == "direct" else "unload + request"
            err = f"  errors: {errors[0][:80]}" if errors else ""
            lines.append(f"    {source:<14}{how:<18}{_fmt_s(value)} [{_fmt_s(low)}]{ratio}{err}")
    return "\n".join(lines)


def format_header(report: dict[str, Any]) -> str:
    """One line: when, where and how a report was measured."""
    m = report["machine"]
    return (
        f"{m['date']}  {m['nproc']} cores  {m['cpu']}  commit {m['git_commit']}  "
        f"({report['seconds']:.0f} s; 1-min load {m.get('loadavg_1m_before', 0):.1f} before, "
        f"{m.get('loadavg_1m', 0):.1f} after)\n{report['command']}"
    )


def _min(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"
