"""The engine under NVIDIA's aiperf, beside llama-server (issue 21, done-when 2).

``python -m bench.engine_aiperf --aiperf PATH [--targets llama-server,ggmux]
[--levels 4,8] [--rounds 3] [--requests 16] [--prompt-tokens 100]
[--max-tokens 128] [--threads 2] [--server-cpus 0 --client-cpus 1]
[--env OMP_WAIT_POLICY=PASSIVE] [--out FILE]``

The targets are bench/slots.py's (the same commands, the same model,
threads and slots); the client is aiperf instead of bench/serving.py, in a
closed loop at each level: ``--requests`` measured requests after 2
unmeasured ones, streamed chat completions of a synthetic
``--prompt-tokens``-token prompt (aiperf's tokenizer made from the GGUF by
:mod:`bench.gguf_tokenizer`), exactly ``--max-tokens`` tokens out
(``ignore_eos``), temperature 0. Rounds alternate the targets' order;
every (round, level) draws new prompts, the same for every target.

aiperf's processes take most of a core while they run (bench/RESULTS.md
section 16: on 2 cores an unpinned aiperf made the server's own time per
token 2.5x what it was under bench/serving.py). ``--server-cpus`` and
``--client-cpus`` give each side its own CPUs with ``taskset`` (this
script and every target it starts run on ``--server-cpus``), so the
engines are compared without the client's noise; give ``--threads`` the
number of server CPUs.

Figures per level and target (median over rounds): output tokens/s, TTFT
p50, aiperf's inter-token latency (a request's ``(e2e - TTFT) / (tokens -
1)``) p50 and p99, and its inter-chunk latency (the gaps between chunks)
p99, with their ratios to ``llama-server``.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server
from bench.aiperf_check import aiperf_profile, tokenizer_dir
from bench.processes import ProcessSet, cleanup_on_exit, ggmux_env
from bench.report import machine_info, publish
from bench.slots import (
    MODEL,
    NEEDS_LLAMA_SERVER,
    REFERENCE,
    STARTERS,
    base_config,
    build_parser,
    settings_from_args,
    warm,
)
from bench.targets import Context, TargetError, check_alive, demo_model_paths

logger = logging.getLogger("bench.engine_aiperf")

FIGURES = (
    ("tok_s", "output tok/s", 1.0),
    ("ttft", "TTFT p50 (ms)", 1e3),
    ("tpot", "ITL p50 (ms)", 1e3),
    ("tpot_p99", "ITL p99 (ms)", 1e3),
    ("gap_p99", "inter-chunk p99 (ms)", 1e3),
)
"""Key in :func:`bench.aiperf_check.aiperf_profile`'s answer, label, scale."""


def parser():
    """bench/slots.py's options, with aiperf's and the CPU split added."""
    p = build_parser()
    p.prog = "python -m bench.engine_aiperf"
    p.description = __doc__.split("\n")[0]
    p.set_defaults(targets="llama-server,ggmux", levels="4,8")
    p.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    p.add_argument("--requests", type=int, default=16, help="measured requests per run")
    p.add_argument("--lean", action="store_true", help="aiperf with one worker (see aiperf_check)")
    p.add_argument("--server-cpus", help="CPU list of the targets (e.g. 0)")
    p.add_argument("--client-cpus", help="CPU list of aiperf (e.g. 1)")
    return p


def table(cells: dict[str, dict[str, list[dict[str, Any]]]]) -> str:
    """The markdown table: one row per level and figure, a column per target."""
    names = list(next(iter(cells.values())))
    lines = ["| streams | figure | " + " | ".join(names) + " |",
             "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
    for level, by_target in cells.items():
        for key, label, scale in FIGURES:
            med = {n: statistics.median(r[key] for r in runs) for n, runs in by_target.items()}
            ref = med.get(REFERENCE)
            row = []
            for n in names:
                cell = f"{med[n] * scale:.1f}"
                if ref and n != REFERENCE:
                    cell += f" ({med[n] / ref:.2f}x)"
                row.append(cell)
            lines.append(f"| {level} | {label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    settings = settings_from_args(args)
    for item in args.env:
        name, _, value = item.partition("=")
        os.environ[name] = value  # every target inherits it
    if args.server_cpus:  # this process and every target it starts
        os.sched_setaffinity(0, {int(c) for c in args.server_cpus.split(",")})
    wanted = [t for t in args.targets.split(",") if t]
    workdir = Path(tempfile.mkdtemp(prefix="ggmux-engine-aiperf-"))
    procs = ProcessSet(workdir)
    ctx = Context(args, procs, {}, {})
    binary = llama_server.find(args.llama_server)
    started_at, load_before = time.time(), os.getloadavg()
    cells: dict[str, dict[str, list[dict[str, Any]]]] = {}
    commands: dict[str, list[str]] = {}
    try:
        with cleanup_on_exit(procs):
            ctx.model_paths = demo_model_paths()
            ctx.env = ggmux_env(args.python, workdir)
            base = base_config(settings, ctx.model_paths[MODEL], args.timeout)
            tok = tokenizer_dir(args.aiperf, str(ctx.model_paths[MODEL]), workdir)
            targets = []
            for name in wanted:
                if name in NEEDS_LLAMA_SERVER and binary is None:
                    raise TargetError(f"no llama-server: {llama_server.HOW_TO_GET}")
                one = STARTERS[name](ctx, settings, binary)
                warm(one.target, base)
                targets.append(one.target)
                commands[name] = one.command
            for rnd in range(settings.rounds):
                order = targets[rnd % len(targets):] + targets[:rnd % len(targets)]
                for level in settings.levels:
                    check_alive(ctx, targets, f"{level} streams")
                    for t in order:
                        r = aiperf_profile(args.aiperf, t.base_url, MODEL, level, args.requests,
                                           settings.prompt_tokens, settings.max_tokens, tok,
                                           workdir / f"{t.name}-{rnd}-{level}", lean=args.lean,
                                           cpus=args.client_cpus, seed=1000 * (rnd + 1) + level)
                        logger.info("round %d, %d streams, %-12s %s", rnd + 1, level, t.name, r)
                        cells.setdefault(str(level), {}).setdefault(t.name, []).append(r)
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = table(cells)
    report = {"command": shlex.join(["python -m bench.engine_aiperf", *(argv or sys.argv[1:])]),
              "machine": machine_info(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                               time.gmtime(started_at)),
              "seconds": round(time.time() - started_at), "loadavg_before": load_before,
              "loadavg_after": os.getloadavg(), "commands": commands, "table": out,
              "cells": cells}
    publish(report, report["command"], out, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
