"""Side-by-side comparison of ggmux with one instance, nginx and llama.cpp's router.

Every target serves the demo model ``smollm2-135m`` on its own port; the
same requests run against each in alternating rounds (A B C A B C ...;
new requests each round, so no prompt cache answers round 2), so slow drift
of the machine spreads over all targets instead of landing on one. Figures
are reported with their ratio to ``direct``.

Targets:

``direct``
    one ggmux instance process serving one model:
    ``python -m ggmux.instance --model PATH --name NAME --host 127.0.0.1
    --port P --ctx-size 2048`` (``--direct-cmd`` replaces it).
``nginx``
    nginx (when installed) proxying to the direct instance with upstream
    keepalive: the cost of a mature C reverse proxy, for scale.
``ggmux``
    ``ggmux serve --host 127.0.0.1 --port P --models-max 2 --proxies 2``
    serving the demo models ``smollm2-135m`` and ``gemma3-270m``.
``llama-router``
    llama.cpp's ``llama-server`` in router mode (``--models-preset`` with
    both demo models, ``--models-max 2``), when :func:`bench.llama_server.find`
    finds the binary (``--llama-server``, ``$GGMUX_LLAMA_SERVER``, PATH, or
    ``python -m bench.llama_server --build``'s). A different engine: its
    ratios mix router overhead with engine differences.

Figures (``--quick`` runs each briefly, under 5 minutes on 2 cores):

* overhead at 1 connection: p50/p99 end-to-end latency of a tiny chat
  request (``max_tokens=1``, not streamed) and of a cheap forwarded GET
  (the instance's ``/health``), and their difference to ``direct``;
* requests per second in a closed loop of 16 and 64 connections, for the
  same two requests: completions inside a fixed window, what is in flight
  when it closes is cancelled and left out;
* streaming TTFT p50 (and TPOT) at 1 connection;
* cold switch: a request for an unloaded model until its first token
  (ggmux and the router, after ``POST /models/unload``; ``direct`` by
  spawning a fresh instance), against the raw llama-cpp-python load time of
  that model measured in the same run (``Llama(model_path=..., n_ctx=2048,
  verbose=False)`` in a fresh interpreter, and that interpreter's spawn to
  first token).

Every process started here runs in its own process group and is stopped on
exit, on Ctrl-C, on SIGTERM/SIGHUP and on errors (SIGTERM to the leader,
then SIGKILL to the group).

This module holds the measurements (the hot phases in alternating rounds,
the cold switch) and the command line; the targets and how each starts are
:mod:`bench.compare_targets`, the tables :mod:`bench.compare_report`, the
processes and servers under test :mod:`bench.processes` and
:mod:`bench.targets` (which the other harnesses share).

Usage (from the repository root)::

    python -m bench.compare --quick --out bench/out/compare.json
    python -m bench.compare --targets direct,nginx --rounds 5
    python -m bench.compare --fake --quick       # harness self-check, no model
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare_report import figures, fmt_ms, format_header, format_report
from bench.compare_targets import (
    ALL_TARGETS,
    CTX_SIZE,
    DEMO_MODELS,
    DIRECT_CMD,
    GGMUX_SERVE_ARGS,
    HOT_MODEL,
    STARTERS,
    direct_cmd,
    first_token,
)
from bench.processes import ProcessSet, cleanup_on_exit, ggmux_env
from bench.report import machine_info, publish
from bench.serving import BenchConfig, run
from bench.targets import (
    Context,
    Target,
    TargetError,
    check_alive,
    demo_model_paths,
    free_port,
    http_request,
    model_status,
    settle,
    wait_ready,
)

logger = logging.getLogger(__name__)

# Raw llama-cpp-python load, in a fresh interpreter like an instance's; one
# JSON line on stdout; durations in seconds, ``first_token_at`` on the
# system-wide monotonic clock (comparable with the parent's).
RAW_LOAD_SCRIPT = """
import json, sys, time
t0 = time.monotonic()
from llama_cpp import Llama
t1 = time.monotonic()
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), verbose=False)
t2 = time.monotonic()
first = None
for chunk in llm.create_completion("Hello", max_tokens=4, stream=True):
    if chunk["choices"][0]["text"]:
        first = time.monotonic()
        break
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_at": first,
                  "first_token_s": None if first is None else first - t2}), flush=True)
"""


# --------------------------------------------------------------------------
# workload sizes


@dataclass(slots=True, frozen=True)
class Settings:
    """How much of each figure to measure; counts are per target per round."""

    rounds: int
    overhead_requests: int
    cheap_requests: int
    throughput_seconds: float
    concurrencies: tuple[int, ...]
    ttft_requests: int
    ttft_max_tokens: int
    ttft_prompt_words: int
    cold_rounds: int
    warmup: int = 2


QUICK = Settings(
    rounds=2,
    overhead_requests=20,
    cheap_requests=100,
    throughput_seconds=2.0,
    concurrencies=(16, 64),
    ttft_requests=5,
    ttft_max_tokens=8,
    ttft_prompt_words=32,
    cold_rounds=3,
    warmup=1,
)
FULL = Settings(
    rounds=5,
    overhead_requests=100,
    cheap_requests=500,
    throughput_seconds=5.0,
    concurrencies=(16, 64),
    ttft_requests=20,
    ttft_max_tokens=32,
    ttft_prompt_words=96,
    cold_rounds=5,
)


# --------------------------------------------------------------------------
# measurements


@dataclass(slots=True)
class Phase:
    """One figure's workload; ``make`` builds the config for a target."""

    key: str
    title: str
    make: Callable[[Target], BenchConfig]


def hot_phases(settings: Settings, template: BenchConfig) -> list[Phase]:
    """The warm-model figures, in the order they run.

    ``template`` carries the options common to every request (endpoint,
    timeout); the rest is set here per figure.
    """
    base = replace(
        template,
        models=[(HOT_MODEL, 1.0)],
        rate=math.inf,
        warmup=settings.warmup,
        progress=False,
        seed=1,
    )
    kind = template.endpoint
    tiny = replace(base, stream=False, max_tokens=(1, 1), prompt_words=(1, 1))

    def tiny_cfg(**kw: Any) -> Callable[[Target], BenchConfig]:
        return lambda t: replace(tiny, base_url=t.base_url, **kw)

    def cheap_cfg(**kw: Any) -> Callable[[Target], BenchConfig]:
        return lambda t: replace(base, base_url=t.base_url, endpoint="get", path=t.cheap_path, **kw)

    phases = [
        Phase(
            "tiny_c1",
            f"{kind} max_tokens=1, 1 conn",
            tiny_cfg(requests=settings.overhead_requests, max_concurrency=1),
        ),
        Phase(
            "cheap_c1",
            "cheap GET, 1 conn",
            cheap_cfg(requests=settings.cheap_requests, max_concurrency=1),
        ),
    ]
    for c in settings.concurrencies:
        phases.append(
            Phase(
                f"cheap_c{c}",
                f"cheap GET, {c} conns",
                cheap_cfg(
                    duration=settings.throughput_seconds, max_concurrency=c, warmup=c, drain=False
                ),
            )
        )
        phases.append(
            Phase(
                f"tiny_c{c}",
                f"{kind} max_tokens=1, {c} conns",
                tiny_cfg(
                    duration=settings.throughput_seconds,
                    max_concurrency=c,
                    warmup=settings.warmup,
                    drain=False,
                ),
            )
        )
    phases.append(
        Phase(
            "stream_c1",
            f"streaming {kind}, 1 conn",
            lambda t: replace(
                base,
                base_url=t.base_url,
                requests=settings.ttft_requests,
                max_concurrency=1,
                max_tokens=(settings.ttft_max_tokens, settings.ttft_max_tokens),
                prompt_words=(settings.ttft_prompt_words, settings.ttft_prompt_words),
            ),
        )
    )
    return phases


def measure_hot(
    ctx: Context, targets: list[Target], settings: Settings, template: BenchConfig
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Run every hot phase over ``settings.rounds`` rounds of all targets in turn.

    A target whose process exits is dropped from ``targets`` (and reported
    in ``ctx.skipped``). Returns ``{phase: {target: [run summary + records,
    one per round]}}``.
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for target in targets:  # done starting up and warming
        settle(ctx, target)
    for phase in hot_phases(settings, template):
        out[phase.key] = {t.name: [] for t in targets}
        for round_no in range(settings.rounds):
            check_alive(ctx, targets, phase.title)
            for target in targets:
                # the same requests for every target within a round, new
                # ones each round: a prompt cache must not serve round 2
                config = phase.make(target)
                result = run(replace(config, seed=config.seed + round_no))
                s = result["summary"]
                logger.info(
                    "%-28s round %d %-13s ok %4d failed %3d  %.1f req/s  p50 %s ms",
                    phase.title,
                    round_no + 1,
                    target.name,
                    s["ok"],
                    s["failed"],
                    s["request_throughput"] or 0.0,
                    fmt_ms(s["metrics"]["e2e"]["p50"]),
                )
                out[phase.key][target.name].append(
                    {"summary": s, "requests": result["requests"], "settle_s": settle(ctx, target)}
                )
    return out


def raw_load(python: str, model_path: Path) -> dict[str, float | None]:
    """Time a fresh interpreter loading ``model_path`` with llama-cpp-python.

    Returns seconds: ``import_s``, ``load_s`` (the ``Llama(...)`` call),
    ``first_token_s`` (after load), ``spawn_to_first_token_s`` (from just
    before the spawn to the first token, on the monotonic clock both
    processes share) and ``wall_s`` (until the process exited). Raises
    ``TargetError``.
    """
    start = time.monotonic()
    proc = subprocess.run(
        [python, "-c", RAW_LOAD_SCRIPT, str(model_path), str(CTX_SIZE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise TargetError(f"raw load failed: {proc.stderr.strip()[-500:]}")
    timings = json.loads(proc.stdout.strip().splitlines()[-1])
    first_at = timings.pop("first_token_at")
    timings["wall_s"] = wall
    timings["spawn_to_first_token_s"] = None if first_at is None else first_at - start
    return timings


def cold_via_unload(target: Target, model: str, template: BenchConfig) -> dict[str, Any]:
    """Unload ``model`` on ``target``, wait until it reports unloaded, time a request.

    Returns ``{"seconds": spawn-free request-to-first-token or None, "error"}``.
    """
    status, payload = http_request(
        target.base_url, "POST", "/models/unload", {"model": model}, timeout=30.0
    )
    if status not in (200, 400):  # 400: already unloaded on llama.cpp's router
        return {"seconds": None, "error": f"unload: HTTP {status} {str(payload)[:200]}"}
    deadline = time.perf_counter() + 60.0
    while (state := model_status(target.base_url, model)) not in ("unloaded", None):
        if time.perf_counter() > deadline:
            return {"seconds": None, "error": f"still {state!r} 60 s after unload"}
        time.sleep(0.05)
    record = first_token(target.base_url, model, template)
    return {"seconds": record["ttft"], "e2e": record["e2e"], "error": record["error"]}


def cold_via_respawn(ctx: Context, model: str, template: BenchConfig) -> dict[str, Any]:
    """Spawn a fresh direct instance of ``model``; seconds from spawn to first token."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = ctx.procs.spawn(f"direct-{model}", direct_cmd(ctx, model, port), env=ctx.env)
    try:
        wait_ready(base_url, "/health", proc, ctx.args.start_timeout, interval=0.01)
        sent = time.perf_counter() - start
        record = first_token(base_url, model, template)
        seconds = None if record["ttft"] is None else sent + record["ttft"]
        return {"seconds": seconds, "ready_s": sent, "error": record["error"]}
    except TargetError as exc:
        return {"seconds": None, "error": str(exc)}
    finally:
        ctx.procs.stop(proc)


def measure_cold(
    ctx: Context, targets: Sequence[Target], settings: Settings, template: BenchConfig
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Cold switch per model, alternating raw load, direct respawn and unloading targets.

    Returns ``{model: {"raw": [...], "direct": [...], target: [...]}}``, one
    entry per round.
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    unloading = [t for t in targets if t.can_unload and t.name != "direct"]
    models = [m for m in DEMO_MODELS if m in ctx.model_paths or ctx.args.fake]
    for model in models:
        out[model] = {}
        for round_no in range(settings.cold_rounds):
            if not ctx.args.fake:
                try:
                    out[model].setdefault("raw", []).append(
                        raw_load(ctx.args.python, ctx.model_paths[model])
                    )
                except (TargetError, subprocess.TimeoutExpired, ValueError) as exc:
                    out[model].setdefault("raw", []).append({"error": str(exc)})
            if "direct" in {t.name for t in targets}:
                out[model].setdefault("direct", []).append(cold_via_respawn(ctx, model, template))
            for target in unloading:
                try:
                    entry = cold_via_unload(target, model, template)
                except OSError as exc:
                    entry = {"seconds": None, "error": f"{type(exc).__name__}: {exc}"}
                out[model].setdefault(target.name, []).append(entry)
            logger.info(
                "cold %s round %d: %s",
                model,
                round_no + 1,
                {k: _cold_value(v[-1]) for k, v in out[model].items()},
            )
    return out


def _cold_value(entry: dict[str, Any]) -> float | None:
    return entry.get("seconds", entry.get("spawn_to_first_token_s"))


# --------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The ``bench.compare`` command line."""
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--targets",
        default=",".join(ALL_TARGETS),
        help="comma-separated, from " + ", ".join(ALL_TARGETS) + " (unavailable ones are skipped)",
    )
    p.add_argument("--quick", action="store_true", help="short runs: under 5 minutes on 2 cores")
    p.add_argument("--rounds", type=int, help="rounds of every hot figure (overrides the preset)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: hot, cold")
    p.add_argument("--python", default=sys.executable, help="interpreter for instances")
    p.add_argument(
        "--direct-cmd",
        default=DIRECT_CMD,
        help="direct target command; {python} {model} {model_path} {port}",
    )
    p.add_argument(
        "--ggmux-cmd",
        help="ggmux target command; {python} {port} (default: ggmux " + GGMUX_SERVE_ARGS + ")",
    )
    p.add_argument("--proxies", type=int, default=2, help="ggmux proxies and nginx workers")
    p.add_argument("--nginx", help="nginx binary (default: on PATH)")
    p.add_argument(
        "--llama-server",
        help="llama-server binary (default: $GGMUX_LLAMA_SERVER, PATH, "
        "then python -m bench.llama_server --build's)",
    )
    p.add_argument(
        "--llama-server-args",
        default=_default_llama_server_args(),
        help="extra router arguments, passed on to its model instances",
    )
    p.add_argument(
        "--fake",
        action="store_true",
        help="use bench.fake_openai as the direct target (harness self-check)",
    )
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds per target start")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="inference endpoint of every figure",
    )
    p.add_argument("--out", type=Path, help="write every figure and request as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="print the tables of a saved --out file and exit",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _default_llama_server_args() -> str:
    # llama-cpp-python's defaults (n_threads = cores // 2, n_threads_batch =
    # cores) and one sequence at a time, as a ggmux instance serves.
    cores = os.cpu_count() or 1
    return f"--threads {max(cores // 2, 1)} --threads-batch {cores} --parallel 1"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: start targets, measure in alternating rounds, print and save."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["figures"] = figures(saved["hot"])  # as this version computes them
        print(format_header(saved))
        print(format_report(saved))
        return 0
    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    wanted = [t for t in args.targets.split(",") if t]
    unknown = set(wanted) - set(STARTERS)
    if unknown:
        print(f"error: unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    template = BenchConfig(endpoint=args.endpoint, timeout=args.timeout, progress=False)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="ggmux-bench-"))
    procs = ProcessSet(workdir)
    ctx = Context(args, procs, {}, {})
    targets: list[Target] = []
    try:
        with cleanup_on_exit(procs):
            if not args.fake:
                ctx.model_paths = demo_model_paths()
            ctx.env = ggmux_env(args.python, workdir)
            # direct first: nginx proxies to it
            for name in sorted(wanted, key=lambda n: n != "direct"):
                if args.fake and name in ("ggmux", "llama-router"):
                    ctx.skipped[name] = "not with --fake"
                    continue
                try:
                    targets.append(STARTERS[name](ctx))
                except TargetError as exc:
                    logger.warning("skipping %s: %s", name, exc)
                    ctx.skipped[name] = str(exc)
            if not targets:
                print("error: no target could be started", file=sys.stderr)
                return 1
            hot = {} if "hot" in skip else measure_hot(ctx, targets, settings, template)
            cold = {} if "cold" in skip else measure_cold(ctx, targets, settings, template)
    except KeyboardInterrupt:
        print("interrupted; every target was stopped", file=sys.stderr)
        return 130
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep_logs:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "machine": {**machine_info(), "loadavg_1m_before": load_before},
        "command": shlex.join([sys.executable, "-m", "bench.compare", *(argv or sys.argv[1:])]),
        "settings": asdict(settings),
        "seconds": time.perf_counter() - started,
        "targets": [asdict(t) for t in targets],
        "skipped": ctx.skipped,
        "titles": {p.key: p.title for p in hot_phases(settings, template)},
        "figures": figures(hot),
        "cold": cold,
        "hot": hot,
    }
    publish(report, format_header(report), format_report(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
