"""Speculative decoding side by side: ggmux's built-in engine with
speculation off and on, and llama-server with the same ``--spec-type`` and
sizes (issue 30).

Workloads (every request its own prompt, the same for every target; a
round's seed makes them):

``edit``
    a Python file of generated functions (``--edit-functions``, 300-800
    tokens; ``--edit-style area``: a regular one smollm2 copies without
    slips) to be written back with one change; ``/v1/completions`` on the
    ChatML text with the assistant's answer opened by a code fence (the
    same tokens for every target): the answer copies the prompt, so n-gram
    drafts are accepted in long runs.
``tool``
    an agent's request to save a text with a ``write_file`` tool,
    ``tool_choice: required``: the call's arguments quote the text
    (``/v1/chat/completions`` with ``tools``).
``chat``
    a short story on a random subject (``/v1/completions`` on ChatML): free
    text, few drafts accepted.

Each is run at temperature 0 and 0.8 (seeded) where the matrix asks
(``--matrix``), at the levels' concurrent streams (a closed loop, each
stream sending ``--per-stream`` requests), in alternating rounds (for every
round, for every cell: each target in turn).

Targets (``T`` = ``--threads``, ``S`` = ``--slots``):

``ggmux-off`` / ``ggmux-spec``
    ``ggmux serve`` with the built-in instance over a preset: ``model``,
    ``threads = T``, ``threads-batch = T``, ``ctx-size = 2048``,
    ``parallel = S``, and for ``-spec`` the ``--spec`` options as preset
    keys (``spec-type = ngram-simple``, ...).
``llama-server-spec`` (and ``llama-server-off``)
    ``BIN -m PATH --threads T --threads-batch T -np S -c 2048*S`` and the
    ``--spec`` options.

Figures per cell and target: aggregate output tokens/s (tokens over the
run's wall time; the best round's), per-stream decode tokens/s (tokens
after the first over the time after the first, median), TTFT p50, ITL p50
and p99 (gaps between streamed chunks, every round's pooled), the drafts'
acceptance (``timings.draft_n_accepted / draft_n`` summed), and ratios to
``ggmux-off`` and ``llama-server-spec``.

Usage (from the repository root)::

    python -m bench.spec --rounds 2 --out bench/out/spec.json
    python -m bench.spec --report bench/out/spec.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import random
import shlex
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import itertools

from bench import llama_server
from bench.processes import ProcessSet, cleanup_on_exit, ggmux_env, remove_ggmux_ipc
from bench.report import machine_info, publish
from bench.stats import percentile
from bench.targets import (
    Context,
    Target,
    TargetError,
    demo_model_paths,
    free_port,
    settle,
    wait_ready,
)

logger = logging.getLogger(__name__)

CTX = 2048
DEFAULT_MATRIX = "edit:0:1,4,8;tool:0:1;chat:0:1,4;edit:0.8:1;chat:0.8:1"
MAX_TOKENS = {"edit": 256, "tool": 200, "chat": 128}
ANIMALS = ("otter", "fox", "heron", "badger", "lynx", "crow", "seal", "moth", "newt", "yak")
DEEDS = ("learns to sail", "loses a key", "opens a bakery", "finds a map", "builds a bridge",
         "fears the rain", "paints the moon", "counts the stars")
WORDS = ("river", "stone", "lamp", "garden", "window", "letter", "bridge", "market", "candle",
         "harbour", "orchard", "meadow", "anchor", "compass", "lantern")


def chatml(user: str) -> str:
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"


def area_prompt(rng: random.Random, functions: int) -> tuple[str, str]:
    """``--edit-style area``: a regular file (``PREFIX_area_0`` .. with
    constants 0 ..; a random prefix per request) that smollm2-135m copies
    back faithfully; the bench's default file it copies with slips."""
    prefix = rng.choice(WORDS)
    code = "".join(f"def {prefix}_area_{i}(width, height):\n    total = width * height + "
                   f"{i}\n    return total\n\n" for i in range(functions))
    text = chatml("Here is a Python file:\n\n```python\n" + code + "```\n\nRewrite the "
                  f"whole file, unchanged except that {prefix}_area_3 returns total * 2. "
                  "Output only the code.") + "```python\n"
    return "/v1/completions", text


def edit_prompt(rng: random.Random, functions: int) -> tuple[str, str]:
    names = [f"{rng.choice(WORDS)}_{rng.choice(WORDS)}_{i}" for i in range(functions)]
    code = "".join(
        f"def {n}(width, height):\n    total = width * height + {rng.randint(1, 99)}\n"
        f"    return total - {rng.randint(1, 9)}\n\n" for n in names)
    target = rng.choice(names)
    text = chatml("Here is a Python file:\n\n```python\n" + code + "```\n\nRewrite the whole "
                  f"file, unchanged except that {target} returns total * 2. Output only the "
                  "code.") + "```python\n"
    return "/v1/completions", text


def tool_body(rng: random.Random) -> dict:
    sentences = " ".join(f"The {rng.choice(WORDS)} by the {rng.choice(WORDS)} was "
                         f"{rng.choice(('quiet', 'bright', 'old', 'new', 'wet'))}."
                         for _ in range(12))
    return {"messages": [{"role": "user", "content": "Save this text to notes.txt with the "
                          f"write_file tool, exactly as written:\n\n{sentences}"}],
            "tools": [{"type": "function", "function": {
                "name": "write_file", "description": "Write text to a file.",
                "parameters": {"type": "object", "properties": {
                    "path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}}}],
            "tool_choice": "required"}


def request_for(workload: str, rng: random.Random, args) -> tuple[str, dict]:
    if workload == "edit":
        make = area_prompt if getattr(args, "edit_style", "random") == "area" else edit_prompt
        path, prompt = make(rng, args.edit_functions)
        return path, {"prompt": prompt}
    if workload == "chat":
        return "/v1/completions", {"prompt": chatml(
            f"Write a short story about a {rng.choice(ANIMALS)} who {rng.choice(DEEDS)}.")}
    return "/v1/chat/completions", tool_body(rng)


def stream(base_url: str, path: str, body: dict, timeout: float) -> dict:
    """One streamed request: chunk arrival times, tokens, timings."""
    host, port = base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    t0 = time.perf_counter()
    times: list[float] = []
    usage = timings = None
    error = None
    try:
        conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"ok": False, "error": f"HTTP {resp.status}: {resp.read()[:200]!r}"}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            usage = ev.get("usage") or usage
            timings = ev.get("timings") or timings
            for ch in ev.get("choices") or []:
                d = ch.get("delta") or {}
                text = ch.get("text") or d.get("content") or d.get("tool_calls") \
                    or d.get("reasoning_content")
                if text:
                    times.append(time.perf_counter())
    except (OSError, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    if error or not times:
        return {"ok": False, "error": error or "no tokens"}
    tokens = (usage or {}).get("completion_tokens") or (timings or {}).get("predicted_n") \
        or len(times)
    return {"ok": True, "t0": t0, "ttft": times[0] - t0, "end": times[-1], "tokens": tokens,
            "itl": [b - a for a, b in itertools.pairwise(times)],
            "decode_tps": (tokens - 1) / (times[-1] - times[0]) if times[-1] > times[0] else None,
            "draft_n": (timings or {}).get("draft_n", 0),
            "draft_n_accepted": (timings or {}).get("draft_n_accepted", 0)}


def run_cell(target: Target, workload: str, temp: float, level: int, seed: int, args) -> dict:
    """``level`` streams, ``per_stream`` requests each, against ``target``."""
    rng = random.Random(seed)
    jobs = []
    for i in range(level * args.per_stream):
        path, body = request_for(workload, rng, args)
        body.update(model="m", stream=True, max_tokens=MAX_TOKENS[workload], temperature=temp,
                    seed=seed + i, stream_options={"include_usage": True})
        jobs.append((path, body))
    results: list[dict] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for path, body in jobs[k::level]:
            r = stream(target.base_url, path, body, args.timeout)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(level)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    return {"wall": wall, "ok": len(ok), "failed": len(results) - len(ok),
            "errors": [r["error"] for r in results if not r["ok"]][:3],
            "tokens": sum(r["tokens"] for r in ok),
            "tok_s": sum(r["tokens"] for r in ok) / wall if wall else None,
            "requests": ok}


def start_ggmux(ctx: Context, name: str, model: Path, spec: list[str], args) -> Target:
    tmp = ctx.procs.workdir / name
    tmp.mkdir(parents=True, exist_ok=True)
    lines = [f"model = {model}", f"threads = {args.threads}", f"threads-batch = {args.threads}",
             f"ctx-size = {CTX}", f"parallel = {args.slots}"]
    it = iter(spec)
    for opt in it:  # --spec-type X -> spec-type = X
        lines.append(f"{opt.lstrip('-')} = {next(it)}")
    (tmp / "models.ini").write_text("version = 1\n\n[m]\n" + "".join(f"{x}\n" for x in lines))
    port = free_port()
    exe = shutil.which("ggmux", path=str(Path(args.python).parent)) or shutil.which("ggmux")
    launcher = [exe] if exe else [args.python, "-c", ("import sys; from ggmux.supervisor.cli "
                                  "import main; sys.exit(main())")]
    cmd = [*launcher, "serve", "--host", "127.0.0.1", "--port", str(port), "--models-preset",
           str(tmp / "models.ini"), "--no-hf-cache", "--models-max", "1"]
    proc = ctx.procs.spawn(name, cmd, env=ctx.env, cleanup=lambda: remove_ggmux_ipc(port))
    base = f"http://127.0.0.1:{port}"
    wait_ready(base, "/health", proc, args.start_timeout)
    ctx.skipped.setdefault("_commands", {})[name] = shlex.join(cmd) + "  # preset: " + \
        "; ".join(lines)
    return Target(name, base, processes=(name,))


def start_llama(ctx: Context, name: str, binary: Path, model: Path, spec: list[str],
                args) -> Target:
    port = free_port()
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(args.threads), "--threads-batch", str(args.threads),
           "-np", str(args.slots), "-c", str(CTX * args.slots), "--jinja", *spec]
    proc = ctx.procs.spawn(name, cmd)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, "/health", proc, args.start_timeout)
    except TargetError as e:
        raise TargetError(f"{e}\n{ctx.procs.log_tail(name)}") from None
    ctx.skipped.setdefault("_commands", {})[name] = shlex.join(cmd)
    return Target(name, base, processes=(name,))


def parse_matrix(text: str) -> list[tuple[str, float, int]]:
    cells = []
    for part in text.split(";"):
        w, t, levels = part.split(":")
        cells += [(w, float(t), int(n)) for n in levels.split(",")]
    return cells


def figures(runs: dict) -> dict:
    out: dict = {}
    for cell, by_target in runs.items():
        for name, rounds in by_target.items():
            reqs = [q for r in rounds for q in r["requests"]]
            drafted = sum(q["draft_n"] for q in reqs)
            out.setdefault(cell, {})[name] = {
                "tok_s": max((r["tok_s"] or 0.0 for r in rounds), default=None),
                "decode_tps": percentile([q["decode_tps"] for q in reqs
                                          if q["decode_tps"]], 50),
                "ttft_p50": percentile([q["ttft"] for q in reqs], 50),
                "itl_p50": percentile([g for q in reqs for g in q["itl"]], 50),
                "itl_p99": percentile([g for q in reqs for g in q["itl"]], 99),
                "accept": (sum(q["draft_n_accepted"] for q in reqs) / drafted) if drafted
                else None,
                "tokens": percentile([q["tokens"] for q in reqs], 50),
                "failed": sum(r["failed"] for r in rounds),
            }
    return out


def format_report(report: dict) -> str:
    names = report["targets"]
    figs = report["figures"]
    lines = []
    head = f"{'cell':<16}{'figure':<16}" + "".join(f"{n:>30}" for n in names)
    lines += [head, "-" * len(head)]
    for cell, by in figs.items():
        off = by.get("ggmux-off", {})
        ref = by.get("llama-server-spec", {})
        for key, label in (("tok_s", "tok/s"), ("decode_tps", "decode tok/s p50"),
                           ("ttft_p50", "TTFT p50 ms"), ("itl_p50", "ITL p50 ms"),
                           ("itl_p99", "ITL p99 ms"), ("accept", "accepted"),
                           ("tokens", "tokens/answer"), ("failed", "failed")):
            cells = []
            for n in names:
                v = by.get(n, {}).get(key)
                if v is None:
                    cells.append("-")
                    continue
                ms = key.startswith(("ttft", "itl"))
                text = f"{v * 1000:.0f}" if ms else f"{v:.2f}" if key == "accept" else f"{v:.1f}"
                if key in ("tok_s", "decode_tps") and n == "ggmux-spec":
                    parts = [f"{v / off[key]:.2f}x off" if off.get(key) else "",
                             f"{v / ref[key]:.2f}x ls" if ref.get(key) else ""]
                    text += " (" + ", ".join(p for p in parts if p) + ")"
                if key == "itl_p99" and n == "ggmux-spec" and ref.get(key):
                    text += f" ({v / ref[key]:.2f}x ls)"
                cells.append(text)
            lines.append(f"{cell if key == 'tok_s' else '':<16}{label:<16}"
                         + "".join(f"{c:>30}" for c in cells))
    lines.append("x off: ggmux-spec / ggmux-off; x ls: ggmux-spec / llama-server-spec")
    for n, cmd in report["commands"].items():
        lines.append(f"  {n}: {cmd}")
    for n, why in report["skipped"].items():
        lines.append(f"  skipped {n}: {why.splitlines()[0]}")
    return "\n".join(lines)


def format_header(report: dict) -> str:
    m = report["machine"]
    return (f"{m['date']}  {m['nproc']} cores  {m['cpu']}  commit {m['git_commit']}  "
            f"llama-cpp-python {m['llama_cpp_python']}  {report.get('llama_server_version')}\n"
            f"{report['seconds']:.0f} s; load average {report['load_before']} before, "
            f"{report['load_after']} after\n{report['command']}")


def in_process(args) -> int:
    """``--in-process``: the engine alone (no HTTP), speculation off and on
    in alternating rounds over the same prompts, one slot: decode tokens/s
    of each answer (``predicted_n / predicted_ms``) and the drafts."""
    from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
    from ggmux.instance.engine.spec_options import SpecConfig

    model = str(demo_model_paths()[args.model])
    spec = shlex.split(args.spec)
    types = tuple(spec[spec.index("--spec-type") + 1].split(","))
    engines = {name: Engine(EngineConfig(model, ctx_size=CTX, parallel=1,
                                         n_threads=args.threads, spec=sp))
               for name, sp in (("off", None), ("spec", SpecConfig(types=types)))}
    for e in engines.values():
        e.load()
    out: dict[str, list] = {name: [] for name in engines}
    try:
        for rnd in range(args.rounds):
            rng = random.Random(rnd)
            make = area_prompt if args.edit_style == "area" else edit_prompt
            text = make(rng, args.edit_functions)[1]
            for name, e in engines.items():
                g = Generation(e.tokenize(text), Sampling(temperature=0), max_tokens=256)
                t = e.submit(g).result(args.timeout)["timings"]
                out[name].append(t)
                logger.info("round %d %-4s %5.1f tok/s draft %s/%s", rnd + 1, name,
                            1e3 * t["predicted_n"] / t["predicted_ms"], t.get("draft_n"),
                            t.get("draft_n_accepted"))
    finally:
        for e in engines.values():
            e.close()
    for name, ts in out.items():
        n = sum(t["predicted_n"] for t in ts)
        ms = sum(t["predicted_ms"] for t in ts)
        d, a = sum(t.get("draft_n", 0) for t in ts), sum(t.get("draft_n_accepted", 0) for t in ts)
        print(f"{name:5} {1e3 * n / ms:6.1f} decode tok/s over {len(ts)} answers, "
              f"drafts {a}/{d} accepted")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.spec", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m or gemma3-270m")
    p.add_argument("--targets", default="ggmux-off,ggmux-spec,llama-server-spec")
    p.add_argument("--spec", default="--spec-type ngram-simple",
                   help="llama-server's speculative options, the same for both engines")
    p.add_argument("--matrix", default=DEFAULT_MATRIX,
                   help="WORKLOAD:TEMP:LEVELS;... (default %(default)s)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-stream", type=int, default=1)
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--edit-functions", type=int, default=16,
                   help="functions in an edit prompt (16: ~550 tokens)")
    p.add_argument("--in-process", action="store_true",
                   help="the engine alone, off vs on (edit workload, one slot)")
    p.add_argument("--edit-style", choices=("random", "area"), default="random",
                   help="edit prompts: the default random file, or PREFIX_area_0 .. _N")
    p.add_argument("--llama-server", help="the binary (default: bench.llama_server.find)")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path)
    p.add_argument("--report", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if args.in_process:
        return in_process(args)
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["figures"] = figures(saved["runs"])
        print(format_header(saved))
        print(format_report(saved))
        return 0
    spec = shlex.split(args.spec)
    wanted = [t for t in args.targets.split(",") if t]
    cells = parse_matrix(args.matrix)
    started_at, load_before = time.perf_counter(), os.getloadavg()
    workdir = Path(tempfile.mkdtemp(prefix="ggmux-spec-"))
    procs = ProcessSet(workdir)
    ctx = Context(args, procs, {}, {})
    binary = llama_server.find(args.llama_server)
    version = llama_server.version(binary) if binary else None
    targets: list[Target] = []
    runs: dict[str, dict[str, list]] = {}
    try:
        with cleanup_on_exit(procs):
            model = demo_model_paths()[args.model]
            ctx.env = ggmux_env(args.python, workdir)
            for name in wanted:
                try:
                    if name.startswith("ggmux"):
                        targets.append(start_ggmux(ctx, name, model,
                                                   spec if name == "ggmux-spec" else [], args))
                    elif binary is None:
                        ctx.skipped[name] = f"no llama-server: {llama_server.HOW_TO_GET}"
                    else:
                        targets.append(start_llama(ctx, name, binary, model,
                                                   spec if name.endswith("-spec") else [], args))
                except TargetError as e:
                    logger.warning("skipping %s: %s", name, e)
                    ctx.skipped[name] = str(e)
            for t in targets:  # warm: the model loaded, a first prompt read
                run_cell(t, "chat", 0.0, 1, 1, argparse.Namespace(**{**vars(args),
                                                                     "per_stream": 1}))
            for rnd in range(args.rounds):
                for w, temp, level in cells:
                    key = f"{w} t={temp:g} x{level}"
                    seed = (1000 * (rnd + 1) + 10 * level + int(temp * 10)
                            + {"edit": 1, "tool": 2, "chat": 3}[w])
                    for t in targets:
                        settle(ctx, t)
                        r = run_cell(t, w, temp, level, seed, args)
                        runs.setdefault(key, {}).setdefault(t.name, []).append(r)
                        logger.info("round %d %-16s %-18s %5.1f tok/s ok %d failed %d %s",
                                    rnd + 1, key, t.name, r["tok_s"] or 0, r["ok"],
                                    r["failed"], r["errors"])
                    if args.out:  # what is measured so far survives an interrupted run
                        partial = {"runs": runs, "rounds_done": rnd, "cell": key}
                        args.out.with_suffix(".partial.json").write_text(json.dumps(partial))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    commands = ctx.skipped.pop("_commands", {})
    report = {"machine": machine_info(), "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()],
              "llama_server_version": version,
              "command": shlex.join([sys.executable, "-m", "bench.spec",
                                     *(argv or sys.argv[1:])]),
              "seconds": time.perf_counter() - started_at,
              "targets": [t.name for t in targets], "commands": commands,
              "skipped": ctx.skipped, "figures": figures(runs), "runs": runs}
    publish(report, format_header(report), format_report(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
