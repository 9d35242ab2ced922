"""Tool-call overhead: the same chat request with no tools and with 8 tools
(``tool_choice: "auto"``), on ggmux's built-in instance and on llama.cpp's
``llama-server --jinja``, both serving smollm2 on one slot.

Both targets run side by side on the same machine; the four cases
(target x tools) alternate round by round, so drift spreads over all of
them. Each request is streamed, greedy, ``max_tokens`` 48, with the
prompt cache off (``cache_prompt: false``: every round evaluates the whole
prompt, tools included). Figures per case:

* **TTFT**: seconds from sending the request to the first streamed delta
  (content or a tool call's first piece; a format that must read its
  marker or JSON key first shows later, which is part of the cost);
* **tok/s**: completion tokens (the answer's ``usage``) per second after
  that first delta;
* **prompt**: prompt tokens (``usage.prompt_tokens``), what the tools add;
* what the answer was (text, a tool call, an error).

Usage (from the repository root)::

    python -m bench.tools --rounds 5 --out bench/out/tools.json
    python -m bench.tools --llama-server /path/to/llama-server
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.llama_server import find as find_llama_server
from bench.processes import ProcessSet
from bench.report import machine_info, publish
from bench.targets import demo_model_paths, free_port, wait_ready

logger = logging.getLogger("bench.tools")

MODEL = "smollm2-135m"
PROMPT = "What is the weather in Paris today? Answer briefly."


def _tool(name: str, description: str, **props: str) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": [next(iter(props))],
                       "properties": {k: {"type": v, "description": k} for k, v in
                                      props.items()}}}}


TOOLS = [
    _tool("get_weather", "Current weather of a city", city="string", unit="string"),
    _tool("get_time", "Current time in a time zone", zone="string"),
    _tool("search_web", "Search the web", query="string", count="integer"),
    _tool("read_file", "Read a file", path="string"),
    _tool("write_file", "Write a file", path="string", content="string"),
    _tool("list_dir", "List a folder", path="string"),
    _tool("run_command", "Run a shell command", command="string", timeout="integer"),
    _tool("send_email", "Send an email", to="string", subject="string", body="string"),
]


def one(base: str, tools: bool, max_tokens: int) -> dict[str, Any]:
    """One streamed request: ``{"ttft", "tps", "prompt", "completion", "kind"}``."""
    body: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "cache_prompt": False,
        "stream_options": {"include_usage": True}}
    if tools:
        body["tools"], body["tool_choice"] = TOOLS, "auto"
    host, _, port = base.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    t0 = time.perf_counter()
    first = last = None
    usage: dict = {}
    kind = "text"
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"kind": f"HTTP {resp.status}: {resp.read()[:200].decode(errors='replace')}"}
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for c in chunk.get("choices") or []:
                d = c.get("delta") or {}
                if d.get("tool_calls"):
                    kind = "tool call"
                if d.get("content") or d.get("tool_calls") or d.get("reasoning_content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    finally:
        conn.close()
    if first is None:
        return {"kind": "no delta", "prompt": usage.get("prompt_tokens")}
    n = usage.get("completion_tokens") or 0
    return {"ttft": first - t0, "tps": (n - 1) / (last - first) if last > first and n > 1
            else None, "prompt": usage.get("prompt_tokens"), "completion": n, "kind": kind}


def start_targets(procs: ProcessSet, model: Path, llama_server: Path | None,
                  threads: int) -> dict[str, str]:
    bases: dict[str, str] = {}
    port = free_port()
    proc = procs.spawn("ggmux-instance", [
        sys.executable, "-m", "ggmux.instance", "--model", str(model), "--name", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--ctx-size", "2048",
        "--threads", str(threads), "--llama-args", '["--parallel", "1"]'])
    wait_ready(f"http://127.0.0.1:{port}", "/health", proc, 120)
    bases["ggmux"] = f"http://127.0.0.1:{port}"
    if llama_server is not None:
        port = free_port()
        proc = procs.spawn("llama-server", [
            str(llama_server), "-m", str(model), "--alias", MODEL, "--jinja", "--host",
            "127.0.0.1", "--port", str(port), "-c", "2048", "-np", "1", "-t", str(threads)])
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, 120)
        bases["llama-server --jinja"] = f"http://127.0.0.1:{port}"
    return bases


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ttft = [s["ttft"] for s in samples if s.get("ttft") is not None]
    tps = [s["tps"] for s in samples if s.get("tps") is not None]
    kinds = sorted({s["kind"] for s in samples})
    return {"ttft_p50": statistics.median(ttft) if ttft else None,
            "tps_p50": statistics.median(tps) if tps else None,
            "prompt": next((s["prompt"] for s in samples if s.get("prompt")), None),
            "answers": kinds, "n": len(samples)}


def table(results: dict[str, dict[str, Any]]) -> str:
    rows = ["| target | tools | prompt tokens | TTFT p50 | tok/s p50 | answers |",
            "| --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        target, _, tools = name.rpartition(" / ")
        ttft = f"{r['ttft_p50'] * 1000:.0f} ms" if r["ttft_p50"] is not None else "-"
        tps = f"{r['tps_p50']:.1f}" if r["tps_p50"] is not None else "-"
        rows.append(f"| {target} | {tools} | {r['prompt'] or '-'} | {ttft} | {tps} | "
                    f"{', '.join(r['answers'])} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.tools", description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", default=None, help="llama-server binary (default: find)")
    ap.add_argument("--out", type=Path, default=None, help="write the report here as JSON")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    llama_server = find_llama_server(args.llama_server)
    if llama_server is None:
        logger.warning("no llama-server found: measuring ggmux alone")
    model = demo_model_paths()[MODEL]
    procs = ProcessSet(Path(tempfile.mkdtemp(prefix="bench-tools-")))
    try:
        bases = start_targets(procs, model, llama_server, args.threads)
        samples: dict[str, list[dict[str, Any]]] = {}
        for rnd in range(args.rounds + 1):  # round 0 warms up and is left out
            for name, base in bases.items():
                for tools in (False, True):
                    s = one(base, tools, args.max_tokens)
                    if rnd:
                        samples.setdefault(f"{name} / {'8' if tools else 'none'}", []).append(s)
        results = {k: summarize(v) for k, v in samples.items()}
    finally:
        procs.stop_all()
    report = {"machine": machine_info(), "rounds": args.rounds, "max_tokens": args.max_tokens,
              "results": results, "samples": samples}
    m = report["machine"]
    header = (f"tool-call overhead, smollm2-135m, 1 slot, {args.threads} threads, "
              f"{args.rounds} rounds, {m['nproc']} CPUs, load {m['loadavg_1m']:.1f} at the end")
    publish(report, header, table(results), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
