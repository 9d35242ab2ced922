"""Parallel slots side by side: concurrent streaming chats, ggmux against llama-server.

The measurement of issue 12: one model (``smollm2-135m``, the demo model),
the same threads everywhere, streaming chats of ``max_tokens`` tokens with
prompts of ``prompt_tokens`` tokens, at 1, 4 and 8 concurrent streams, in
one run of alternating rounds (for every round, for every level: each
target in turn), so slow drift of a shared machine spreads over all
targets. Ratios are to ``llama-server``.

Targets (``T`` = ``--threads``; ``BIN`` = the llama-server that
:func:`bench.llama_server.find` finds):

``llama-server``
    llama.cpp's server on the model file, its defaults otherwise (4 slots,
    unified KV cache, continuous batching, the model's context):
    ``BIN -m PATH --host 127.0.0.1 --port P --threads T --threads-batch T``.
``llama-router``
    llama.cpp's router over a preset naming the one model:
    ``BIN --models-preset FILE --models-max 1 --host 127.0.0.1 --port P
    --threads T --threads-batch T`` (the options go on to its model process).
``ggmux``
    ``ggmux serve --host 127.0.0.1 --port P --models-preset FILE
    --no-hf-cache --models-max 1`` with the built-in instance
    (llama-cpp-python): ``model = PATH``, ``threads = T``,
    ``threads-batch = T``, ``ctx-size = 2048`` and any ``--builtin-key``.
``ggmux-cmd``
    the same ``ggmux serve`` over a preset whose model runs llama-server:
    ``cmd = BIN --host 127.0.0.1 --port ${PORT} -m PATH --threads T
    --threads-batch T``, ``check-endpoint = /health``.

Workload of a level ``c``: ``c`` streams in a closed loop sending
``max(c * per_stream, min_requests)`` requests in all; temperature 0;
every end-of-generation token of the model's vocabulary suppressed
(``ignore_eos`` for llama-server, ``logit_bias`` -100 for everyone), so
every answer is ``max_tokens`` long; ``stream_options.include_usage``
asked. Every (round, level) has its own seed: new prompts, the same for
every target, so no prompt cache answers a prompt it saw before.

Figures per level and target: aggregate output tokens/s (all streams'
tokens over the wall time of the level's run), TTFT p50, ITL p50 (each the
best round's: other work only ever slows a round down) and ITL p99 (every
round's gaps pooled), and their ratios to ``llama-server``.

Usage (from the repository root)::

    python -m bench.slots --quick --out bench/out/slots.json
    python -m bench.slots --targets llama-server,ggmux --levels 1,4
    python -m bench.slots --report bench/out/slots.json
"""

from __future__ import annotations

import argparse
import json
import logging
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

from bench import llama_server
from bench.processes import ProcessSet, cleanup_on_exit, ggmux_env, remove_ggmux_ipc
from bench.prompts import gguf_vocabulary
from bench.report import machine_info, publish
from bench.serving import BenchConfig, run
from bench.stats import percentile
from bench.targets import (
    Context,
    Target,
    TargetError,
    check_alive,
    demo_model_paths,
    free_port,
    http_request,
    settle,
    wait_ready,
)

logger = logging.getLogger(__name__)

MODEL = "smollm2-135m"
ALL_TARGETS = ("llama-server", "llama-router", "ggmux", "ggmux-cmd")
REFERENCE = "llama-server"
BUILTIN_CTX_SIZE = 2048


@dataclass(slots=True, frozen=True)
class Settings:
    """The workload; counts are per target, level and round.

    Attributes:
        rounds: rounds of every level and target.
        levels: concurrent streams of each level.
        per_stream: requests each stream sends in a level's run.
        min_requests: at least this many requests per run (one stream
            sending one request would give one TTFT).
        max_tokens: output tokens of every answer.
        prompt_tokens: tokens of every prompt's text (chat template not
            counted), by the model's own tokenizer.
        threads: generation and batch threads of every engine.
    """

    rounds: int
    levels: tuple[int, ...] = (1, 4, 8)
    per_stream: int = 3
    min_requests: int = 3
    max_tokens: int = 128
    prompt_tokens: int = 100
    threads: int = 2

    def requests(self, level: int) -> int:
        """Requests of one run at ``level`` streams."""
        return max(level * self.per_stream, self.min_requests)


QUICK = Settings(rounds=2, per_stream=1, min_requests=2)
FULL = Settings(rounds=3, per_stream=3, min_requests=3)


# --------------------------------------------------------------------------
# targets


@dataclass(slots=True)
class Started:
    """A started target and how it was started (for the report)."""

    target: Target
    command: list[str]
    preset: str = ""


def _spawn_ready(
    ctx: Context, name: str, cmd: list[str], port: int, env: dict[str, str] | None = None,
    cleanup: Callable[[], None] | None = None,
) -> str:
    proc = ctx.procs.spawn(name, cmd, env=env, cleanup=cleanup)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail(name)}") from None
    return base_url


def _threads(settings: Settings) -> list[str]:
    return ["--threads", str(settings.threads), "--threads-batch", str(settings.threads)]


def start_llama_server(ctx: Context, settings: Settings, binary: Path) -> Started:
    """llama-server on the model file, its defaults but the threads."""
    port = free_port()
    cmd = [str(binary), "-m", str(ctx.model_paths[MODEL]), "--host", "127.0.0.1",
           "--port", str(port), *_threads(settings), *shlex.split(ctx.args.llama_server_args)]
    base_url = _spawn_ready(ctx, "llama-server", cmd, port)
    return Started(Target("llama-server", base_url, processes=("llama-server",)), cmd)


def start_llama_router(ctx: Context, settings: Settings, binary: Path) -> Started:
    """llama.cpp's router over a preset naming the model."""
    tmp = ctx.procs.workdir / "llama-router"
    (tmp / "cache").mkdir(parents=True, exist_ok=True)
    preset = f"version = 1\n\n[{MODEL}]\nmodel = {ctx.model_paths[MODEL]}\n"
    (tmp / "models.ini").write_text(preset)
    port = free_port()
    cmd = [str(binary), "--models-preset", str(tmp / "models.ini"), "--models-max", "1",
           "--host", "127.0.0.1", "--port", str(port), *_threads(settings),
           *shlex.split(ctx.args.llama_server_args)]
    env = dict(os.environ, LLAMA_CACHE=str(tmp / "cache"))  # no cached models listed
    base_url = _spawn_ready(ctx, "llama-router", cmd, port, env=env)
    return Started(Target("llama-router", base_url, processes=("llama-router",)), cmd, preset)


def _start_ggmux(ctx: Context, name: str, section: str) -> Started:
    tmp = ctx.procs.workdir / name
    tmp.mkdir(parents=True, exist_ok=True)
    preset = f"version = 1\n\n[{MODEL}]\n{section}"
    (tmp / "models.ini").write_text(preset)
    port = free_port()
    exe = shutil.which("ggmux", path=str(Path(ctx.args.python).parent)) or shutil.which("ggmux")
    launcher = [exe] if exe else [
        ctx.args.python, "-c", "import sys; from ggmux.supervisor.cli import main; sys.exit(main())"
    ]
    cmd = [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port), "--models-preset",
           str(tmp / "models.ini"), "--no-hf-cache", "--models-max", "1",
           *shlex.split(ctx.args.ggmux_args)]
    base_url = _spawn_ready(ctx, name, cmd, port, env=ctx.env,
                            cleanup=lambda: remove_ggmux_ipc(port))
    return Started(Target(name, base_url, processes=(name,)), cmd, preset)


def start_ggmux(ctx: Context, settings: Settings, _binary: Path | None) -> Started:
    """ggmux with its built-in instance (llama-cpp-python)."""
    lines = [f"model = {ctx.model_paths[MODEL]}", f"threads = {settings.threads}",
             f"threads-batch = {settings.threads}", f"ctx-size = {BUILTIN_CTX_SIZE}",
             *ctx.args.builtin_key]
    return _start_ggmux(ctx, "ggmux", "".join(f"{line}\n" for line in lines))


def start_ggmux_cmd(ctx: Context, settings: Settings, binary: Path) -> Started:
    """ggmux whose model runs llama-server (a ``cmd`` preset)."""
    server = shlex.join([str(binary), "--host", "127.0.0.1", "--port", "PORT", "-m",
                         str(ctx.model_paths[MODEL]), *_threads(settings),
                         *shlex.split(ctx.args.llama_server_args)])
    section = f"cmd = {server.replace(' PORT ', ' ${PORT} ')}\ncheck-endpoint = /health\n"
    return _start_ggmux(ctx, "ggmux-cmd", section)


STARTERS: dict[str, Callable[[Context, Settings, Path], Started]] = {
    "llama-server": start_llama_server,
    "llama-router": start_llama_router,
    "ggmux": start_ggmux,
    "ggmux-cmd": start_ggmux_cmd,
}
NEEDS_LLAMA_SERVER = frozenset(("llama-server", "llama-router", "ggmux-cmd"))


def slot_count(target: Target) -> int | None:
    """``total_slots`` of the target's ``/props`` (``?model=`` for routers), None if not said."""
    for path in ("/props", f"/props?model={MODEL}"):
        try:
            status, payload = http_request(target.base_url, "GET", path, timeout=10.0)
        except OSError:
            continue
        if status == 200 and isinstance(payload, dict) and "total_slots" in payload:
            return payload["total_slots"]
    return None


# --------------------------------------------------------------------------
# workload


def end_of_generation_tokens(model_path: Path) -> list[int]:
    """Every token id the model's vocabulary marks end-of-generation (``llama_vocab_is_eog``)."""
    import llama_cpp

    llm = gguf_vocabulary(str(model_path))
    vocab = llm._model.vocab
    return [i for i in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, i)]


def base_config(settings: Settings, model_path: Path, timeout: float) -> BenchConfig:
    """The request options every run shares (no target, level or seed yet)."""
    bias = {str(i): -100 for i in end_of_generation_tokens(model_path)}
    return BenchConfig(
        models=[(MODEL, 1.0)],
        rate=float("inf"),
        max_tokens=(settings.max_tokens, settings.max_tokens),
        prompt_tokens=settings.prompt_tokens,
        tokenizer=str(model_path),
        stream=True,
        temperature=0.0,
        ignore_eos=True,
        extra_body={"logit_bias": bias, "stream_options": {"include_usage": True}},
        timeout=timeout,
        progress=False,
    )


def level_config(
    base: BenchConfig, settings: Settings, target: Target, level: int, round_no: int
) -> BenchConfig:
    """One run: ``level`` streams against ``target``; the seed is the round's and level's."""
    return replace(
        base,
        base_url=target.base_url,
        requests=settings.requests(level),
        max_concurrency=level,
        seed=1000 * (round_no + 1) + level,
    )


def warm(target: Target, base: BenchConfig) -> None:
    """One short request (it loads the model where the target loads on demand).

    Raises ``TargetError`` when it fails.
    """
    result = run(replace(base, base_url=target.base_url, requests=1, max_concurrency=1,
                         max_tokens=(4, 4), seed=1))
    record = result["requests"][0]
    if not record["ok"]:
        raise TargetError(f"first request failed: {record['error']}")


def measure(
    ctx: Context, targets: list[Target], settings: Settings, base: BenchConfig
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every level of every round, each target in turn; ``{level: {target: [run, ...]}}``.

    A run is its summary and its requests (``itl`` gaps included). A target
    whose process exits is dropped (into ``ctx.skipped``).
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(level): {t.name: [] for t in targets} for level in settings.levels
    }
    for target in targets:
        settle(ctx, target)
    for round_no in range(settings.rounds):
        for level in settings.levels:
            check_alive(ctx, targets, f"{level} streams")
            for target in targets:
                result = run(level_config(base, settings, target, level, round_no))
                s = result["summary"]
                logger.info(
                    "round %d, %d streams, %-12s ok %2d failed %d  %.1f tok/s  TTFT p50 %s ms",
                    round_no + 1, level, target.name, s["ok"], s["failed"],
                    s["output_token_throughput"] or 0.0, _ms(s["metrics"]["ttft"]["p50"]),
                )
                out[str(level)][target.name].append({
                    "summary": s,
                    "requests": result["requests"],
                    "settle_s": settle(ctx, target),
                })
    return out


# --------------------------------------------------------------------------
# figures and report


FIGURES = (
    ("tok_s", "aggregate tok/s"),
    ("ttft_p50", "TTFT p50 (ms)"),
    ("itl_p50", "ITL p50 (ms)"),
    ("itl_p99", "ITL p99 (ms)"),
)
"""Figure keys and labels, in table order."""


def figures(runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """``{level: {target: {figure: value}}}`` (seconds, tokens/s) from :func:`measure`'s output.

    ``tok_s``, ``ttft_p50`` and ``itl_p50``: the best round's (the most
    tokens/s, the least latency); ``itl_p99``: over every round's gaps;
    ``failed``: requests that failed in all rounds; ``prompt_tokens``: the
    median of the servers' own counts (chat template included), to show
    that every target got the same input; ``output_tokens``: tokens per
    answer, median.
    """
    out: dict[str, dict[str, Any]] = {}
    for level, by_target in runs.items():
        for target, rounds in by_target.items():
            summaries = [r["summary"] for r in rounds]
            good = [q for r in rounds for q in r["requests"] if q["ok"]]
            out.setdefault(level, {})[target] = {
                "tok_s": max((s["output_token_throughput"] or 0.0 for s in summaries),
                             default=None),
                "ttft_p50": _least(s["metrics"]["ttft"]["p50"] for s in summaries),
                "itl_p50": _least(s["metrics"]["itl"]["p50"] for s in summaries),
                "itl_p99": percentile([g for q in good for g in q["itl"]], 99),
                "failed": sum(s["failed"] for s in summaries),
                "prompt_tokens": percentile(
                    [q["prompt_tokens"] for q in good if q["prompt_tokens"] is not None], 50
                ),
                "output_tokens": percentile([q["output_tokens"] for q in good], 50),
            }
    return out


def _least(values: Any) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _cell(key: str, value: float | None, ref: float | None) -> str:
    if value is None:
        return "-"
    text = f"{value:.1f}" if key == "tok_s" else _ms(value)
    if ref:
        text += f" ({value / ref:.2f}x)"
    return text


def format_report(report: dict[str, Any]) -> str:
    """The table: one block of rows per level, one column per target, ratios to the reference."""
    names = [t["name"] for t in report["targets"]]
    ref_name = REFERENCE if REFERENCE in names else names[0] if names else None
    rows: list[tuple[str, str, list[str]]] = []
    for level, by_target in report["figures"].items():
        ref = by_target.get(ref_name, {})
        for key, label in FIGURES:
            cells = [
                _cell(key, by_target.get(n, {}).get(key), None if n == ref_name else ref.get(key))
                for n in names
            ]
            rows.append((level, label, cells))
        for extra, label in (("failed", "failed requests"), ("prompt_tokens", "prompt tokens"),
                             ("output_tokens", "output tokens")):
            values = [by_target.get(n, {}).get(extra) for n in names]
            if extra != "failed" or any(values):
                rows.append((level, label, ["-" if v is None else f"{v:g}" for v in values]))
    width = 2 + max([len(n) for n in names] + [len(c) for _, _, cells in rows for c in cells])
    head = f"{'streams':<9}{'figure':<18}" + "".join(f"{n:>{width}}" for n in names)
    lines = [head, "-" * len(head)]
    previous = None
    for level, label, cells in rows:
        shown = level if level != previous else ""
        previous = level
        lines.append(f"{shown:<9}{label:<18}" + "".join(f"{c:>{width}}" for c in cells))
    lines.append(
        f"ratios to {ref_name}; tok/s, TTFT p50, ITL p50: each target's best round; "
        "ITL p99: every round's gaps pooled; prompt and output tokens: per request, "
        "as the server counted them (median)"
    )
    for t in report["targets"]:
        slots = report.get("slots", {}).get(t["name"])
        lines.append(f"  {t['name']}: {'?' if slots is None else slots} slots (/props); "
                     f"{shlex.join(report['commands'][t['name']])}")
    for name, reason in report["skipped"].items():
        lines.append(f"  skipped {name}: {reason.splitlines()[0]}")
    return "\n".join(lines)


def format_header(report: dict[str, Any]) -> str:
    """When, where and how the run was measured, with the machine's load."""
    m = report["machine"]
    before = " ".join(f"{x:.1f}" for x in report["loadavg_before"])
    after = " ".join(f"{x:.1f}" for x in report["loadavg_after"])
    return (
        f"{m['date']}  {m['nproc']} cores  {m['cpu']}  commit {m['git_commit']}  "
        f"llama-cpp-python {m['llama_cpp_python']}  {report.get('llama_server_version') or ''}\n"
        f"{report['seconds']:.0f} s; load average (1, 5, 15 min) {before} before, {after} after\n"
        f"{report['command']}"
        + (f"\ntargets' environment: {' '.join(report['env'])}" if report.get("env") else "")
    )


# --------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The ``bench.slots`` command line."""
    p = argparse.ArgumentParser(prog="python -m bench.slots", description=__doc__.split("\n")[0])
    p.add_argument("--targets", default=",".join(ALL_TARGETS),
                   help="comma-separated, from " + ", ".join(ALL_TARGETS))
    p.add_argument("--quick", action="store_true",
                   help=f"short: {QUICK.rounds} rounds, {QUICK.per_stream} request per stream")
    p.add_argument("--rounds", type=int, help="rounds (overrides the preset)")
    p.add_argument("--levels", help="concurrent streams per level, e.g. 1,4,8")
    p.add_argument("--per-stream", type=int, help="requests per stream and run")
    p.add_argument("--max-tokens", type=int, help=f"output tokens (default {FULL.max_tokens})")
    p.add_argument("--prompt-tokens", type=int,
                   help=f"prompt text tokens (default {FULL.prompt_tokens})")
    p.add_argument("--threads", type=int, help=f"threads of every engine (default {FULL.threads})")
    p.add_argument("--llama-server", help="llama-server binary (default: bench.llama_server.find)")
    p.add_argument("--llama-server-args", default="",
                   help="extra options of every llama-server (direct, router, cmd)")
    p.add_argument("--ggmux-args", default="", help="extra options of both ggmux serve")
    p.add_argument("--builtin-key", action="append", default=[], metavar="'KEY = VALUE'",
                   help="a preset line for the built-in instance's model (repeatable), "
                        "e.g. 'parallel = 4'")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="environment of every target (repeatable); on a loaded machine "
                        "OMP_WAIT_POLICY=PASSIVE (see bench/RESULTS.md)")
    p.add_argument("--python", default=sys.executable, help="interpreter of ggmux")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds per target start")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", type=Path, help="write every figure and request as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the servers' logs")
    p.add_argument("--report", type=Path, metavar="JSON", help="print a saved --out file's table")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def settings_from_args(args: argparse.Namespace) -> Settings:
    """``--quick`` or the full preset, with the options given over it."""
    settings = QUICK if args.quick else FULL
    changes: dict[str, Any] = {}
    for name in ("rounds", "per_stream", "max_tokens", "prompt_tokens", "threads"):
        if getattr(args, name) is not None:
            changes[name] = getattr(args, name)
    if args.levels:
        changes["levels"] = tuple(int(x) for x in args.levels.split(",") if x.strip())
    return replace(settings, **changes)


def main(argv: Sequence[str] | None = None) -> int:
    """Start the targets, measure every level in alternating rounds, print and save."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["figures"] = figures(saved["runs"])
        print(format_header(saved))
        print(format_report(saved))
        return 0
    settings = settings_from_args(args)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"error: --env wants NAME=VALUE, not {item!r}", file=sys.stderr)
            return 2
        os.environ[name] = value  # every target inherits it
    wanted = [t for t in args.targets.split(",") if t]
    if unknown := set(wanted) - set(STARTERS):
        print(f"error: unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    started_at = time.perf_counter()
    load_before = os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="ggmux-slots-"))
    procs = ProcessSet(workdir)
    ctx = Context(args, procs, {}, {})
    started: list[Started] = []
    binary = llama_server.find(args.llama_server)
    server_version = None
    if binary is not None:
        try:
            server_version = llama_server.version(binary)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            logger.warning("llama-server does not run: %s", exc)
            binary = None
    try:
        with cleanup_on_exit(procs):
            ctx.model_paths = demo_model_paths()
            ctx.env = ggmux_env(args.python, workdir)
            base = base_config(settings, ctx.model_paths[MODEL], args.timeout)
            for name in wanted:
                if name in NEEDS_LLAMA_SERVER and binary is None:
                    ctx.skipped[name] = f"no llama-server: {llama_server.HOW_TO_GET}"
                    continue
                try:
                    one = STARTERS[name](ctx, settings, binary)
                    warm(one.target, base)
                    started.append(one)
                except TargetError as exc:
                    logger.warning("skipping %s: %s", name, exc)
                    ctx.skipped[name] = str(exc)
            targets = [s.target for s in started]
            if not targets:
                print("error: no target could be started", file=sys.stderr)
                return 1
            slots = {t.name: slot_count(t) for t in targets}
            runs = measure(ctx, targets, settings, base)
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
    alive = {t.name for t in targets}
    report = {
        "machine": machine_info(),
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "llama_server": str(binary) if binary else None,
        "llama_server_version": server_version,
        "command": shlex.join([sys.executable, "-m", "bench.slots", *(argv or sys.argv[1:])]),
        "env": args.env,
        "settings": asdict(settings),
        "seconds": time.perf_counter() - started_at,
        "targets": [asdict(s.target) for s in started if s.target.name in alive],
        "commands": {s.target.name: s.command for s in started},
        "presets": {s.target.name: s.preset for s in started if s.preset},
        "slots": slots,
        "skipped": ctx.skipped,
        "figures": figures(runs),
        "runs": runs,
    }
    publish(report, format_header(report), format_report(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
