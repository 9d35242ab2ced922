"""Concurrent streams on one model: ggmux's built-in instance against
llama-server (issue 12).

Each target serves ``smollm2-135m`` alone on its own port, with the same
threads; the same streaming chats (about 100 prompt tokens, 128 answer
tokens with ``ignore_eos``, new prompts every round so no prompt cache
answers them) run at each concurrency level against each target, in
alternating rounds (targets rotate each round), so that drift of a shared
machine spreads over all of them. Figures per level: aggregate output
tokens/s, TTFT, TPOT, ITL (p50/p99), E2E and goodput under ``--slo``, with
their ratio to ``llama-server``.

Targets:

``ggmux``
    ``ggmux serve`` (this checkout) with the built-in instance:
    ``--parallel 4``, ``kv-size`` ctx-size x 4.
``llama-server``
    llama.cpp's server run directly: ``llama-server -m PATH -c 8192`` (its
    default: 4 slots, one unified KV cache, continuous batching).
``llama-router``
    llama.cpp's server in router mode over a preset of the model.
``ggmux-cmd``
    ``ggmux serve`` whose preset runs ``cmd = llama-server ...`` (as
    ``llama-server``) behind ggmux's proxies.
``ggmux-main``
    ``ggmux serve`` from the ``main`` branch (``git archive``): today's
    instance, for the single-stream target.

Usage (from the repository root)::

    python -m bench.streams --llama-server PATH --concurrency 1,4,8 --rounds 3 \\
        --out bench/out/streams.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import (
    REPO_ROOT,
    ProcessSet,
    TargetError,
    demo_model_paths,
    free_port,
    ggmux_env,
    http_request,
    remove_ggmux_ipc,
    wait_ready,
)
from bench.serving import BenchConfig, run
from bench.stats import parse_slo

logger = logging.getLogger(__name__)

MODEL = "smollm2-135m"
TARGETS = ("ggmux", "llama-server", "llama-router", "ggmux-cmd", "ggmux-main")
CTX = 2048  # tokens per request
SLOTS = 4


def _llama_args(threads: int) -> list[str]:
    return ["-t", str(threads), "-tb", str(threads), "-c", str(CTX * SLOTS)]


def _ggmux(procs: ProcessSet, name: str, python: str, preset: Path, env: dict,
           threads: int, start_timeout: float) -> str:
    port = free_port()
    cmd = [python, "-m", "ggmux.supervisor", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--proxies", "2", "--models-max", "1", "--threads", str(threads),
           "--models-preset", str(preset), "--no-hf-cache"]
    proc = procs.spawn(name, cmd, env=env, cleanup=lambda: remove_ggmux_ipc(port))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, "/health", proc, start_timeout)
    return base


def start(name: str, a: argparse.Namespace, procs: ProcessSet, path: Path) -> str:
    """Start target ``name``; its base URL once the model answers."""
    work = procs.workdir / name
    work.mkdir(parents=True, exist_ok=True)
    llama = a.llama_server
    if name in ("llama-server", "llama-router", "ggmux-cmd") and not llama:
        raise TargetError("needs --llama-server PATH")
    if name == "ggmux":
        preset = work / "p.ini"
        preset.write_text(f"[{MODEL}]\nmodel = {path}\nctx-size = {CTX}\nparallel = {SLOTS}\n")
        base = _ggmux(procs, name, a.python, preset, ggmux_env(a.python, procs.workdir),
                      a.threads, a.start_timeout)
    elif name == "ggmux-main":
        snap = work / "pkgs" / "ggmux"
        if not snap.exists():
            snap.mkdir(parents=True)
            data = subprocess.run(["git", "archive", a.main_ref], cwd=REPO_ROOT, check=True,
                                  capture_output=True).stdout
            with tarfile.open(fileobj=BytesIO(data)) as tar:
                tar.extractall(snap, filter="data")
        env = dict(os.environ, PYTHONPATH=str(snap.parent))
        probe = subprocess.run([a.python, "-c", "import ggmux; print(ggmux.__file__)"],
                               check=False, env=env, capture_output=True, text=True,
                               cwd=work)
        if str(snap) not in probe.stdout:
            raise TargetError(f"{a.python} imports ggmux from {probe.stdout.strip()!r}, not the "
                              "main snapshot (an editable install wins over PYTHONPATH)")
        preset = work / "p.ini"
        preset.write_text(f"[{MODEL}]\nmodel = {path}\nctx-size = {CTX}\n")
        base = _ggmux(procs, name, a.python, preset, env, a.threads, a.start_timeout)
    elif name == "llama-server":
        port = free_port()
        proc = procs.spawn(name, [llama, "-m", str(path), "--host", "127.0.0.1", "--port",
                                  str(port), "-a", MODEL, *_llama_args(a.threads)])
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, "/health", proc, a.start_timeout)
    elif name == "llama-router":
        preset = work / "models.ini"
        preset.write_text(f"version = 1\n\n[{MODEL}]\nmodel = {path}\n")
        (work / "cache").mkdir(exist_ok=True)
        port = free_port()
        proc = procs.spawn(name, [llama, "--models-preset", str(preset), "--models-max", "1",
                                  "--host", "127.0.0.1", "--port", str(port),
                                  *_llama_args(a.threads)],
                           env=dict(os.environ, LLAMA_CACHE=str(work / "cache")))
        base = f"http://127.0.0.1:{port}"
        wait_ready(base, "/health", proc, a.start_timeout)
    elif name == "ggmux-cmd":
        cmd = shlex.join([llama, "-m", str(path), "--host", "127.0.0.1", "--port", "PORTX",
                          "-a", MODEL, *_llama_args(a.threads)]).replace("PORTX", "${PORT}")
        preset = work / "p.ini"
        preset.write_text(f"[{MODEL}]\ncmd = {cmd}\n")
        base = _ggmux(procs, name, a.python, preset, ggmux_env(a.python, procs.workdir),
                      a.threads, a.start_timeout)
    else:
        raise TargetError(f"unknown target {name!r}")
    deadline = time.monotonic() + a.start_timeout
    while True:  # the first answer loads the model (ggmux, the router)
        try:
            status, doc = http_request(base, "POST", "/v1/chat/completions", {
                "model": MODEL, "max_tokens": 1,
                "messages": [{"role": "user", "content": "Hi"}]}, timeout=120)
            if status == 200:
                return base
        except OSError as e:
            doc = str(e)
        if time.monotonic() > deadline:
            raise TargetError(f"{name}: no answer: {str(doc)[:300]}")
        time.sleep(0.5)


def settle(procs: ProcessSet, names: list[str], idle: float = 0.1, window: float = 0.25,
           timeout: float = 30.0) -> None:
    """Wait until every target's processes together use under ``idle`` of
    a core (a spare importing, a model being measured, a request whose
    client left), so the next run is charged for none of it."""
    used = procs.cpu_seconds(names)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(window)
        now = procs.cpu_seconds(names)
        if now - used < idle * window:
            return
        used = now
    logger.warning("targets still busy after %g s", timeout)


def config(base: str, c: int, a: argparse.Namespace, seed: int) -> BenchConfig:
    return BenchConfig(base_url=base, models=[(MODEL, 1.0)], rate=float("inf"),
                       requests=max(a.min_requests, a.requests_per_stream * c),
                       max_concurrency=c, max_tokens=(a.max_tokens, a.max_tokens),
                       prompt_words=(a.prompt_words, a.prompt_words), stream=True,
                       temperature=0.0, ignore_eos=True, seed=seed, timeout=600.0,
                       progress=False, slo=a.slo)


def figures(runs: list[dict]) -> dict[str, Any]:
    """Pooled figures of one target at one level over its rounds: the
    median of per-round aggregate tok/s, and TTFT/TPOT/ITL/E2E percentiles
    over every request of every round."""
    from bench.stats import percentile

    tps = sorted(r["summary"]["output_token_throughput"] or 0 for r in runs)
    reqs = [q for r in runs for q in r["requests"] if q["ok"]]
    gaps = [g for q in reqs for g in q["itl"]]

    def pct(values: list[float], p: float) -> float | None:
        return percentile(values, p)

    out = {"tok_s": tps[len(tps) // 2], "tok_s_rounds": tps, "requests": len(reqs),
           "failed": sum(r["summary"]["failed"] for r in runs),
           "ttft_p50": pct([q["ttft"] for q in reqs if q["ttft"] is not None], 50),
           "ttft_p99": pct([q["ttft"] for q in reqs if q["ttft"] is not None], 99),
           "tpot_p50": pct([q["tpot"] for q in reqs if q["tpot"] is not None], 50),
           "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
           "e2e_p50": pct([q["e2e"] for q in reqs if q["e2e"] is not None], 50)}
    if runs and "goodput" in runs[0]["summary"]:
        out["goodput"] = sorted(r["summary"]["goodput"] or 0 for r in runs)[len(runs) // 2]
    return out


def table(report: dict) -> str:
    """Markdown table: one row per level, one column group per target."""
    targets = report["targets"]
    ref = "llama-server" if "llama-server" in targets else targets[0]
    lines = ["| streams | " + " | ".join(targets) + " |",
             "|---|" + "---|" * len(targets)]
    for lv, per in report["figures"].items():
        cells = []
        for t in targets:
            f = per.get(t)
            if f is None:
                cells.append("-")
                continue
            r = per.get(ref)
            ratio = ""
            if r and t != ref and r["tok_s"] and r["ttft_p50"]:
                ratio = (f" ({f['tok_s'] / r['tok_s']:.2f}x, "
                         f"{f['ttft_p50'] / r['ttft_p50']:.2f}x)")
            cells.append(f"{f['tok_s']:.1f} tok/s, TTFT {f['ttft_p50']:.2f} s, ITL p50/p99 "
                         f"{f['itl_p50'] * 1000:.0f}/{f['itl_p99'] * 1000:.0f} ms{ratio}")
        lines.append(f"| {lv} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")  # through every finally: children stopped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.streams", description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", default=shutil.which("llama-server"))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-words", type=int, default=75, help="about 100 tokens")
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--min-requests", type=int, default=4)
    ap.add_argument("--slo", type=parse_slo, default=parse_slo("ttft=1s,tpot=50ms"))
    ap.add_argument("--main-ref", default="main", help="git ref of the ggmux-main target")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    levels = [int(x) for x in a.concurrency.split(",")]
    names = [t for t in a.targets.split(",") if t]
    path = demo_model_paths()[MODEL]
    work = Path(tempfile.mkdtemp(prefix="ggmux-streams-"))
    procs = ProcessSet(work)
    signal.signal(signal.SIGTERM, _interrupt)
    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    loads: list[float] = []
    runs: dict[str, dict[int, list[dict]]] = {n: {c: [] for c in levels} for n in names}
    bases: dict[str, str] = {}
    skipped: dict[str, str] = {}
    try:
        for n in names:
            try:
                bases[n] = start(n, a, procs, path)
            except TargetError as e:
                logger.error("skipping %s: %s", n, e)
                skipped[n] = str(e)
        live = [n for n in names if n in bases]
        for n in live:  # one unmeasured pass: graph reservations, caches, spares
            settle(procs, live)
            run(replace(config(bases[n], max(levels), a, seed=99), max_tokens=(16, 16)))
        for rnd in range(a.rounds):
            order = live[rnd % len(live):] + live[:rnd % len(live)] if live else []
            for c in levels:
                for n in order:
                    settle(procs, live)
                    loads.append(os.getloadavg()[0])
                    res = run(config(bases[n], c, a, seed=1000 * rnd + c))
                    s = res["summary"]
                    logger.info("round %d, %d streams, %s: %.1f tok/s, TTFT p50 %s, %d failed",
                                rnd, c, n, s["output_token_throughput"] or 0,
                                s["metrics"]["ttft"]["p50"], s["failed"])
                    runs[n][c].append(res)
    except KeyboardInterrupt:
        logger.warning("interrupted")
    finally:
        procs.stop_all()
    report = {
        "started_at": started_at,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "load_avg_1m": loads},
        "settings": {k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(a).items()},
        "targets": [n for n in names if n in bases], "skipped": skipped,
        "figures": {str(c): {n: figures(runs[n][c]) for n in names if runs[n][c]}
                    for c in levels},
        "runs": {n: {str(c): [{k: v for k, v in r.items() if k != "requests"} for r in rs]
                     for c, rs in per.items()} for n, per in runs.items()},
    }
    print(table(report))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(report, indent=1))
        print(f"results: {a.out}")
    with contextlib.suppress(OSError):
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
