"""KV tiers measured (issue 29): a prefix's prefill paid once, across swaps,
restarts and more conversations than slots; tiers on against tiers off (what
llama.cpp's router, llama-swap and Ollama do) and against llama-server's
``--cache-ram``, side by side in one run.

``python -m bench.swap_cache [--scenarios swap,restart,sessions]
[--rounds 2] [--sessions 12] [--session-words 900] [--turns 3]
[--threads 2] [--out FILE]``

Scenarios (every ``ggmux serve`` runs both demo models from one preset,
``ctx-size`` large enough for the prompt, ``--proxies 1``):

``swap``
    ``--models-max 1``; smollm2-135m and gemma3-270m take turns, each turn
    Codex's captured first request (``tests/agent_requests/codex_first.json``:
    about 9.7k tokens of instructions and tools, through ``/v1/responses``)
    with a new last user line, so every turn evicts the other model and
    every turn after a model's first comes back to a swapped-out replica.
    Figure: the time to a one-token answer (prefill + one token: TTFT) of
    each model's first (cold) turn and of its swapped-back turns, tiers on
    (``--cache-disk DIR``) against off (``--cache-ram 0``, no disk).
``restart``
    The same prompt to smollm2-135m, ggmux stopped (SIGTERM: the instance
    saves its slots) and started again, the prompt again: the restarted
    turn's TTFT against the cold one, tiers on against off.
``sessions``
    ``--sessions`` conversations (distinct system prompts of
    ``--session-words`` words of tools text) over 4 slots of smollm2-135m,
    ``--turns`` turns each, visited round robin by 4 clients at once, so
    without a tier beyond the slots every turn finds its slot taken by
    another conversation. Figure: TTFT p50/p99 of turns after the first,
    and the prompt tokens answered from cache, for tiers off, tiers on
    (RAM) and llama-server ``--cache-ram`` (``bench/llama_server.py``'s
    binary; left out when it is not built).

The steady state (the tiers cost nothing when not hit) is
``bench/slots.py --builtin-key 'cache-ram = 0'`` against the default.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server
from bench.agentic import tools_text
from bench.prefix_routing import end_process
from bench.targets import demo_model_paths, free_port

REPO = Path(__file__).resolve().parents[1]
CODEX = REPO / "tests" / "agent_requests" / "codex_first.json"
CTX = 12288  # holds Codex's first request (9.7k tokens on smollm2's vocabulary)
QUESTIONS = ["Which tool reads a file?", "Summarise the last answer.", "What is step two?",
             "Name one risk.", "Which tool would you call next?", "Say it shorter."]


def _request(port: int, path: str, body: dict, timeout: float = 1800.0) -> tuple[float, dict]:
    """Seconds to the whole (non-streamed) answer, and the answer."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.loads(r.read())
    return time.perf_counter() - t0, doc


def _cached(doc: dict) -> int:
    """Prompt tokens the answer says came from a cache (any API's usage)."""
    u = doc.get("usage") or {}
    for key in ("prompt_tokens_details", "input_tokens_details"):
        if isinstance(u.get(key), dict):
            return int(u[key].get("cached_tokens") or 0)
    t = doc.get("timings") or {}
    return int(t.get("cache_n") or 0)


def turn(model: str, k: int, words: int) -> tuple[str, dict]:
    """The route and body of turn ``k``: Codex's first request
    (:func:`codex_turn`) when ``words`` is 0, else a chat whose system
    prompt is ``words`` words of tools text (about 2 tokens a word) and
    whose user line is new each turn; one output token."""
    if not words:
        return "/v1/responses", codex_turn(model, k)
    return "/v1/chat/completions", {
        "model": model, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": tools_text("swap", words)},
                     {"role": "user", "content": f"{QUESTIONS[k % len(QUESTIONS)]} ({k})"}]}


def codex_turn(model: str, k: int) -> dict:
    """Codex's first request for ``model``, its last user line made new by
    ``k``, asking for one output token (the answer's time is the TTFT)."""
    body = copy.deepcopy(json.loads(CODEX.read_text()))
    body.update(model=model, stream=False, max_output_tokens=1, store=False)
    body.pop("prompt_cache_key", None)  # no session affinity: one replica anyway
    last = body["input"][-1]
    if isinstance(last.get("content"), list):
        last["content"].append({"type": "input_text", "text": f"(turn {k})"})
    else:
        last["content"] = f"{last.get('content', '')} (turn {k})"
    return body


class Ggmux:
    """One ``ggmux serve`` over a preset of both demo models."""

    def __init__(self, workdir: Path, name: str, tiers: list[str], models_max: int,
                 threads: int, parallel: int, port: int | None = None) -> None:
        self.name, self.workdir, self.tiers = name, workdir, tiers
        self.models_max, self.threads, self.parallel = models_max, threads, parallel
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None
        self.log = None

    def start(self) -> None:
        paths = demo_model_paths()
        ini = self.workdir / f"{self.name}.ini"
        ini.write_text("".join(
            f"[{m}]\nmodel = {p}\nctx-size = {CTX}\nparallel = {self.parallel}\n"
            f"threads = {self.threads}\nthreads-batch = {self.threads}\n"
            for m, p in paths.items()))
        self.log = open(self.workdir / f"{self.name}.log", "ab")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(self.port),
             "--models-preset", str(ini), "--no-hf-cache", "--proxies", "1",
             "--models-max", str(self.models_max), "--spares", "0", *self.tiers],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name}: ggmux exited (see {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name}: ggmux did not answer /health")

    def stop(self) -> None:
        if self.proc is None:
            return
        end_process(self.proc, 120.0)
        self.proc = None
        self.log.close()


class LlamaServer:
    """llama-server on smollm2-135m with 4 slots and ``--cache-ram``."""

    def __init__(self, binary: Path, workdir: Path, threads: int, cache_ram_mib: int) -> None:
        self.port = free_port()
        path = demo_model_paths()["smollm2-135m"]
        self.log = open(workdir / "llama-server.log", "ab")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(
            [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(self.port),
             "--threads", str(threads), "--threads-batch", str(threads), "-np", "4",
             "-c", str(4 * CTX), "--cache-ram", str(cache_ram_mib)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except (OSError, urllib.error.HTTPError):
                if self.proc.poll() is not None:
                    raise RuntimeError("llama-server exited") from None
                time.sleep(0.3)
        raise RuntimeError("llama-server did not answer /health")

    def stop(self) -> None:
        end_process(self.proc)
        self.log.close()


def tiers_args(mode: str, cache_dir: Path) -> list[str]:
    """``ggmux serve`` options of a mode: ``off`` no tier beyond the slots,
    ``on`` RAM and disk."""
    if mode == "off":
        return ["--cache-ram", "0"]
    return ["--cache-ram", "2048", "--cache-disk", str(cache_dir)]


def append_turn(model: str, k: int, words: int, history: list[dict]) -> tuple[str, dict]:
    """Turn ``k`` of a growing conversation (``--swap-shape append``, an
    agent's): the system prompt of ``words`` words, every earlier turn's
    question and answer in ``history``, and a new question; one output
    token. Each turn's prompt extends the last one's whole, which a
    sliding-window model's saved state needs (it holds the last window
    only: see docs/kv-tiers.md)."""
    return "/v1/chat/completions", {
        "model": model, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": tools_text("swap", words)}, *history,
                     {"role": "user", "content": f"{QUESTIONS[k % len(QUESTIONS)]} ({k})"}]}


def scenario_swap(work: Path, rounds: int, threads: int, modes: list[str], words: int,
                  shape: str = "replace") -> dict:
    """``shape`` ``replace``: every turn the same prefix and a new last user
    line; ``append``: a conversation that grows by each turn's question and
    answer (``words`` must be given)."""
    out: dict = {}
    models = ("smollm2-135m", "gemma3-270m")
    for mode in modes:
        cache = work / f"swap-{mode}-cache"
        shutil.rmtree(cache, ignore_errors=True)
        srv = Ggmux(work, f"swap-{mode}", tiers_args(mode, cache), 1, threads, 1)
        srv.start()
        rows = []
        try:
            k = 0
            history: dict[str, list[dict]] = {m: [] for m in models}
            for r in range(rounds + 1):
                for m in models:
                    k += 1
                    route = (append_turn(m, k, words, history[m]) if shape == "append"
                             else turn(m, k, words))
                    dt, doc = _request(srv.port, *route)
                    if shape == "append":
                        asked = route[1]["messages"][-1]
                        said = doc["choices"][0]["message"].get("content") or ""
                        history[m] += [asked, {"role": "assistant", "content": said}]
                    u = doc.get("usage") or {}
                    rows.append({"model": m, "turn": r, "seconds": round(dt, 3),
                                 "cached": _cached(doc),
                                 "prompt": u.get("input_tokens") or u.get("prompt_tokens")})
                    print(f"swap {mode} {m} turn {r}: {dt:.2f} s cached {rows[-1]['cached']}",
                          flush=True)
        finally:
            srv.stop()
        out[mode] = rows
    return out


def scenario_restart(work: Path, threads: int, modes: list[str], words: int) -> dict:
    out: dict = {}
    for mode in modes:
        cache = work / f"restart-{mode}-cache"
        shutil.rmtree(cache, ignore_errors=True)
        rows = []
        port = free_port()
        for phase in ("cold", "restarted"):
            srv = Ggmux(work, f"restart-{mode}", tiers_args(mode, cache), 2, threads, 1, port)
            srv.start()
            try:
                dt, doc = _request(srv.port, *turn("smollm2-135m", 1, words))
                rows.append({"phase": phase, "seconds": round(dt, 3), "cached": _cached(doc)})
                print(f"restart {mode} {phase}: {dt:.2f} s cached {rows[-1]['cached']}",
                      flush=True)
            finally:
                srv.stop()
        out[mode] = rows
    return out


def _sessions_run(port: int, model: str, sessions: int, words: int, turns: int) -> list[dict]:
    """``sessions`` conversations, ``turns`` turns each, round robin over 4
    clients; one row per turn."""
    history = {s: [{"role": "system", "content": tools_text(f"s{s}", words)}]
               for s in range(sessions)}
    rows: list[dict] = []
    lock = threading.Lock()

    def turn(s: int, t: int) -> None:
        msgs = history[s] + [{"role": "user", "content": QUESTIONS[(s + t) % len(QUESTIONS)]}]
        body = {"model": model, "messages": msgs, "max_tokens": 1, "temperature": 0}
        dt, doc = _request(port, "/v1/chat/completions", body)
        answer = doc["choices"][0]["message"].get("content") or ""
        with lock:
            history[s] = msgs + [{"role": "assistant", "content": answer}]
            rows.append({"session": s, "turn": t, "seconds": round(dt, 3),
                         "cached": _cached(doc),
                         "prompt": (doc.get("usage") or {}).get("prompt_tokens")})

    with ThreadPoolExecutor(4) as pool:
        for t in range(turns):
            list(pool.map(lambda s, t=t: turn(s, t), range(sessions)))
    return rows


def scenario_sessions(work: Path, threads: int, sessions: int, words: int, turns: int,
                      modes: list[str]) -> dict:
    out: dict = {}
    for mode in modes:
        if mode == "llama-server":
            binary = llama_server.find()
            if binary is None:
                out[mode] = {"skipped": llama_server.HOW_TO_GET}
                continue
            srv = LlamaServer(binary, work, threads, 2048)
            try:
                rows = _sessions_run(srv.port, "smollm2-135m", sessions, words, turns)
            finally:
                srv.stop()
        else:
            cache = work / f"sessions-{mode}-cache"
            shutil.rmtree(cache, ignore_errors=True)
            args = ["--cache-ram", "0"] if mode == "off" else ["--cache-ram", "2048"]
            srv = Ggmux(work, f"sessions-{mode}", args, 1, threads, 4)
            srv.start()
            try:
                rows = _sessions_run(srv.port, "smollm2-135m", sessions, words, turns)
            finally:
                srv.stop()
        later = [r["seconds"] for r in rows if r["turn"] > 0]
        out[mode] = {"rows": rows, "ttft_p50": statistics.median(later) if later else None,
                     "ttft_p99": max(later) if later else None,
                     "cached_share": (sum(r["cached"] for r in rows if r["turn"] > 0)
                                      / max(1, sum(r["prompt"] or 0 for r in rows
                                                   if r["turn"] > 0)))}
        print(f"sessions {mode}: TTFT p50 {out[mode]['ttft_p50']} s, cached share "
              f"{out[mode]['cached_share']:.2f}", flush=True)
    return out


def summary(report: dict) -> dict:
    """The figures the issue's targets are stated in."""
    s: dict = {}
    sw = report.get("swap") or {}
    for mode, rows in sw.items():
        cold = [r["seconds"] for r in rows if r["turn"] == 0]
        back = [r["seconds"] for r in rows if r["turn"] > 0]
        s[f"swap_{mode}"] = {"cold_s": cold, "swapped_back_median_s":
                             statistics.median(back) if back else None}
    for mode, rows in (report.get("restart") or {}).items():
        s[f"restart_{mode}"] = {r["phase"]: r["seconds"] for r in rows}
    for mode, v in (report.get("sessions") or {}).items():
        if "ttft_p50" in v:
            s[f"sessions_{mode}"] = {"ttft_p50_s": v["ttft_p50"], "ttft_max_s": v["ttft_p99"],
                                     "cached_share": round(v["cached_share"], 3)}
    return s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.swap_cache",
                                description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default="swap,restart,sessions")
    p.add_argument("--modes", default="off,on", help="ggmux modes: off (no tiers), on")
    p.add_argument("--rounds", type=int, default=2, help="swapped-back turns per model")
    p.add_argument("--swap-shape", choices=("replace", "append"), default="replace",
                   help="swap: the same prefix and a new last line, or a growing conversation")
    p.add_argument("--swap-words", type=int, default=0,
                   help="swap: a synthetic prefix of this many words (0: Codex's request)")
    p.add_argument("--restart-words", type=int, default=0,
                   help="restart: a synthetic prefix of this many words (0: Codex's request)")
    p.add_argument("--restart-modes", help="modes of the restart scenario (default --modes)")
    p.add_argument("--sessions", type=int, default=12)
    p.add_argument("--session-words", type=int, default=900,
                   help="words of tools text per session (about 2 tokens a word)")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-llama-server", action="store_true")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    started = time.time()
    modes = args.modes.split(",")
    report: dict = {"command": " ".join(["python -m bench.swap_cache", *(argv or sys.argv[1:])]),
                    "machine": f"{platform.node()} {os.cpu_count()} cores",
                    "load_before": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started))}
    with tempfile.TemporaryDirectory(prefix="swap-cache-") as tmp:
        work = Path(tmp)
        sc = args.scenarios.split(",")
        if "swap" in sc:
            report["swap"] = scenario_swap(work, args.rounds, args.threads, modes,
                                           args.swap_words, args.swap_shape)
        if "restart" in sc:
            report["restart"] = scenario_restart(
                work, args.threads, (args.restart_modes or args.modes).split(","),
                args.restart_words)
        if "sessions" in sc:
            smodes = modes + ([] if args.no_llama_server else ["llama-server"])
            report["sessions"] = scenario_sessions(work, args.threads, args.sessions,
                                                   args.session_words, args.turns, smodes)
    report["load_after"] = os.getloadavg()
    report["seconds"] = round(time.time() - started)
    report["summary"] = summary(report)
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
