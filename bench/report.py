"""Human-readable reports of :mod:`bench.serving` runs: tables of one run,
one line per level of a concurrency sweep, and PNG charts (matplotlib,
when installed); and what every harness's report carries: the machine it
ran on (:func:`machine_info`) and its publication (:func:`publish`: printed,
and saved as JSON)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.processes import REPO_ROOT
from bench.stats import PERCENTILES

logger = logging.getLogger(__name__)



def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_summary(results: dict[str, Any]) -> str:
    """Human-readable tables of one run's results (milliseconds)."""
    summary = results["summary"]
    lines = [
        (
            f"requests {summary['requests']}  ok {summary['ok']}  failed {summary['failed']}  "
            f"statuses {summary['status_counts']}  elapsed {summary['elapsed_s']:.2f} s"
        ),
        (
            f"throughput {summary['request_throughput'] or 0:.2f} req/s, "
            f"{summary['output_token_throughput'] or 0:.1f} output tok/s, "
            f"connections opened {results['connections_opened']}"
        ),
    ]
    if "goodput" in summary:
        slo = ", ".join(f"{k} <= {_ms(v)} ms" for k, v in summary["slo"].items())
        lines.append(f"goodput {summary['goodput'] or 0:.2f} req/s "
                     f"({(summary['slo_attained'] or 0) * 100:.0f}% of requests met {slo})")
    for error, count in summary["errors"].items():
        lines.append(f"  error x{count}: {error}")
    header = f"{'metric (ms)':<14}{'model':<24}{'n':>6}{'mean':>10}" + "".join(
        f"{'p' + format(q, 'g'):>10}" for q in PERCENTILES
    )
    lines += ["", header, "-" * len(header)]
    groups = [("all", summary)] + (
        list(results["per_model"].items()) if len(results["per_model"]) > 1 else []
    )
    for metric in ("ttft", "tpot", "itl", "e2e", "ttfb"):
        for name, group in groups:
            stats = group["metrics"][metric]
            if not stats["count"]:
                continue
            lines.append(
                f"{metric:<14}{name[:23]:<24}{stats['count']:>6}{_ms(stats['mean']):>10}"
                + "".join(f"{_ms(stats['p' + format(q, 'g')]):>10}" for q in PERCENTILES)
            )
    return "\n".join(lines)


def format_sweep(results: dict[str, Any]) -> str:
    """One line per concurrency level of a :func:`sweep` (milliseconds)."""
    head = (f"{'conc':>5}{'ok':>6}{'fail':>5}{'tok/s':>9}{'req/s':>7}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'TPOT p50':>10}{'ITL p50':>9}{'ITL p99':>9}{'E2E p50':>9}")
    has_slo = any("goodput" in lv["summary"] for lv in results["levels"])
    lines = [head + (f"{'goodput':>9}" if has_slo else ""), "-" * (len(head) + 9 * has_slo)]
    for lv in results["levels"]:
        s, m = lv["summary"], lv["summary"]["metrics"]
        row = (f"{lv['concurrency']:>5}{s['ok']:>6}{s['failed']:>5}"
               f"{s['output_token_throughput'] or 0:>9.1f}{s['request_throughput'] or 0:>7.2f}"
               f"{_ms(m['ttft']['p50']):>10}{_ms(m['ttft']['p99']):>10}{_ms(m['tpot']['p50']):>10}"
               f"{_ms(m['itl']['p50']):>9}{_ms(m['itl']['p99']):>9}{_ms(m['e2e']['p50']):>9}")
        if has_slo:
            row += f"{s.get('goodput') or 0:>9.2f}"
        lines.append(row)
    return "\n".join(lines)


def plot(results: dict[str, Any], directory: Path, label: str = "") -> list[Path]:
    """Write PNG charts of ``results`` under ``directory``; returns their paths.

    Charts: the CDF of e2e latency and of TTFT per model, and TTFT against
    send time. Returns ``[]`` (and logs) when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not installed: no charts (pip install matplotlib)")
        return []
    directory.mkdir(parents=True, exist_ok=True)
    prefix = f"{label}-" if label else ""
    good = [r for r in results["requests"] if r["ok"]]
    models = sorted({r["model"] for r in good})
    written: list[Path] = []

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("e2e", "ttft"), strict=True):
        for model in models:
            values = sorted(r[metric] * 1000 for r in good if r["model"] == model and r[metric])
            if values:
                ys = [(i + 1) / len(values) for i in range(len(values))]
                ax.step(values, ys, where="post", label=model)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{metric} CDF")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    fig.tight_layout()
    written.append(directory / f"{prefix}latency_cdf.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 4))
    for model in models:
        points = [
            (r["t_sent"], r["ttft"] * 1000) for r in good if r["model"] == model and r["ttft"]
        ]
        if points:
            ax.scatter(*zip(*points, strict=True), s=8, label=model)
    ax.set_xlabel("send time (s since start)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("TTFT over time")
    ax.grid(alpha=0.3)
    if ax.has_data():
        ax.legend()
    fig.tight_layout()
    written.append(directory / f"{prefix}ttft_over_time.png")
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    return written


def publish(report: dict[str, Any], header: str, table: str, out: Path | None) -> None:
    """Print a harness's ``header`` and ``table``; with ``out``, write the
    whole ``report`` there as JSON (folders made as needed)."""
    print()
    print(header)
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"results: {out}")


def machine_info() -> dict[str, Any]:
    """CPU model, core count, OS, Python, llama-cpp-python version, git commit, UTC time.

    ``loadavg_1m`` is taken when called: a load far above the core count
    means other work shared the machine and the figures are noisy.
    """
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    ).stdout.strip()
    llama_version = None
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        llama_version = version("llama-cpp-python")
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_version,
        "git_commit": commit or None,
        "loadavg_1m": os.getloadavg()[0],
    }
