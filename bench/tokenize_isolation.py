"""One tenant's big token request against another tenant's stream (issue 31,
item 1): key B's largest inter-chunk gap of a streaming chat, alone and
while key A sends a big ``/tokenize``, ``/detokenize`` or Anthropic
``count_tokens`` to the same model (one replica of smollm2-135m, one
proxy: A and B share the proxy's loop and the instance's).

``python -m bench.tokenize_isolation [--rounds 2] [--tokens 300]
[--bytes N] [--out FILE]``

Cases, run in alternating rounds (``alone`` before each of the others):

* ``alone``: B's stream by itself (the baseline);
* ``tokenize``: A's ``/tokenize`` of ``--bytes`` of English-like text
  (default: just under ``--max-tokenize-bytes``, the largest body taken);
* ``detokenize``: A's ``/detokenize`` of as many ids as fit ``--bytes``
  and ``--max-detokenize-tokens`` (262,144);
* ``count_tokens``: A's ``/v1/messages/count_tokens`` of one message of
  ``--bytes`` of text (the proxy asks the replica's ``/apply-template``,
  then ``/tokenize``);
* ``*-issue``: the issue's sizes (19 MB of text, 3 M ids, a 16 MB
  message), past the limit: answered 413 before anything is parsed;
* ``parts``: A's chat of one message of 99,000 one-letter content parts
  (under ``--max-content-parts``: parsed and forwarded), ``parts-issue``
  of 1.7 M of them (46 MB), answered 413 before the
  proxy parses it.

A starts once B has sent 5 chunks; B asks ``ignore_eos`` and ``--tokens``
tokens, so that it outlasts A (the table says when it did not). The figure
is B's largest gap between two chunks after its first (ms); the ratio is
that over the median of the ``alone`` rounds' largest gaps (the issue's
target: under 2x). ``--base-pkg DIR`` runs the same cases on another
checkout (a folder holding ``ggmux``), e.g. main before the fix.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MODEL = "smollm2-135m"
N_VOCAB = 49152
DEFAULT_LIMIT = 8 * 1024 * 1024  # HttpLimits.max_tokenize_bytes
DEFAULT_IDS = 262144  # HttpLimits.max_detokenize_tokens
WORDS = ["the", "keeper", "climbed", "the", "tower", "every", "night", "to", "light", "the", "lamp", "for", "ships", "that", "passed", "far", "out", "on", "the", "dark", "water", "while", "storms", "broke", "against", "the", "rocks", "below", "and", "gulls", "slept", "under", "the", "eaves", "of", "the", "old", "stone", "house"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def text_of(n: int, seed: int = 1) -> str:
    """About ``n`` bytes of English-like words (ASCII)."""
    rng = random.Random(seed)
    out, size = [], 0
    while size < n:
        w = rng.choice(WORDS)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def request(port: int, path: str, body: bytes, timeout: float = 600.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"content-type": "application/json",
                                                       "anthropic-version": "2023-06-01"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


class Server:
    def __init__(self, pkg: str, args: list[str]) -> None:
        self.port = free_port()
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - the server's life
            prefix="tokiso-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": pkg}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(self.port),
             "--proxies", "1", "--threads", "1", "--spares", "0", "--ctx-size", "1024", *args],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            except OSError:
                time.sleep(0.1)
        else:
            raise SystemExit(f"server did not start: {Path(self.log.name).read_text()[-2000:]}")
        st, body = request(self.port, "/v1/chat/completions", json.dumps(
            {"model": MODEL, "max_tokens": 1,
             "messages": [{"role": "user", "content": "hi"}]}).encode())
        if st != 200:
            raise SystemExit(f"load failed: {st} {body[:300]!r}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(60)


def stream_b(port: int, tokens: int, started: threading.Event, times: list[float]) -> None:
    """B's streaming chat; appends each chunk's arrival time (monotonic s)."""
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": tokens, "ignore_eos": True,
                       "temperature": 0,
                       "messages": [{"role": "user", "content": "Tell me a long story."}]})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    conn.request("POST", "/v1/chat/completions", body=body,
                 headers={"content-type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200, r.read()
    while True:
        line = r.fp.readline()
        if not line:
            break
        if line.startswith(b"data: "):
            if line.strip() == b"data: [DONE]":
                break
            times.append(time.monotonic())
            if len(times) == 5:
                started.set()
    conn.close()
    started.set()


def case_request(case: str, nbytes: int) -> tuple[str, bytes]:
    if case.startswith("parts"):
        n = 1_700_000 if case.endswith("-issue") else 99_000
        return "/v1/chat/completions", json.dumps({"model": MODEL, "max_tokens": 1, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a"}] * n}]}).encode()
    if case.startswith("tokenize"):
        n = 19_000_000 if case.endswith("-issue") else nbytes - 64
        return "/tokenize", json.dumps({"model": MODEL, "content": text_of(n)}).encode()
    if case.startswith("detokenize"):
        rng = random.Random(2)
        if case.endswith("-issue"):
            ids = [rng.randrange(N_VOCAB) for _ in range(3_000_000)]
        else:
            ids, size = [], 64
            while len(ids) < DEFAULT_IDS:
                t = rng.randrange(N_VOCAB)
                size += len(str(t)) + 1
                if size > nbytes:
                    break
                ids.append(t)
        return "/detokenize", json.dumps({"model": MODEL, "tokens": ids},
                                         separators=(",", ":")).encode()
    n = 16_000_000 if case.endswith("-issue") else nbytes - 256
    return "/v1/messages/count_tokens", json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text_of(n)}]}).encode()


def one_round(port: int, case: str, tokens: int, nbytes: int, bodies: dict) -> dict:
    times: list[float] = []
    started = threading.Event()
    b = threading.Thread(target=stream_b, args=(port, tokens, started, times))
    b.start()
    out: dict = {"case": case}
    if case != "alone":
        path, body = bodies[case]
        started.wait(120)
        t0 = time.monotonic()
        status, answer = request(port, path, body)
        t1 = time.monotonic()
        out.update(a_status=status, a_seconds=round(t1 - t0, 3), a_bytes=len(body),
                   a_answer=answer[:80].decode("utf-8", "replace") if status != 200
                   else f"{len(answer)} bytes")
        out["b_outlasted_a"] = None  # filled below
    b.join()
    gaps = [b2 - b1 for b1, b2 in itertools.pairwise(times)]
    out["b_chunks"] = len(times)
    out["b_max_gap_ms"] = round(max(gaps) * 1000, 1) if gaps else None
    out["b_p50_gap_ms"] = round(statistics.median(gaps) * 1000, 1) if gaps else None
    if case != "alone":
        out["b_outlasted_a"] = bool(times) and times[-1] >= t1
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=300, help="B's answer, tokens")
    ap.add_argument("--bytes", type=int, default=DEFAULT_LIMIT,
                    help="A's body size (default: the default --max-tokenize-bytes)")
    ap.add_argument("--cases", default="tokenize,detokenize,count_tokens,tokenize-issue,"
                    "detokenize-issue,count_tokens-issue")
    ap.add_argument("--base-pkg", default=None,
                    help="a folder holding another ggmux checkout to run instead")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    pkg = args.base_pkg or os.environ.get("PYTHONPATH", "")
    cases = args.cases.split(",")
    bodies = {c: case_request(c, args.bytes) for c in cases}
    srv = Server(pkg, [])
    rows = []
    try:
        for r in range(args.rounds):
            for c in cases:
                for case in ("alone", c):
                    row = one_round(srv.port, case, args.tokens, args.bytes, bodies)
                    row["round"] = r
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        srv.stop()
    base = statistics.median(x["b_max_gap_ms"] for x in rows if x["case"] == "alone")
    print(f"\nbaseline (median of the alone rounds' largest gaps): {base} ms")
    print("| case | A's body | A's status | A's seconds | B's largest gap (ms) | ratio |"
          " B outlasted A |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        for x in (x for x in rows if x["case"] == case):
            print(f"| {case} | {x['a_bytes'] / 1e6:.1f} MB | {x['a_status']} | "
                  f"{x['a_seconds']} | {x['b_max_gap_ms']} | "
                  f"{x['b_max_gap_ms'] / base:.2f}x | {x['b_outlasted_a']} |")
    alone = [x["b_max_gap_ms"] for x in rows if x["case"] == "alone"]
    print(f"| alone | - | - | - | {min(alone)}-{max(alone)} | - | - |")
    if args.out:
        Path(args.out).write_text(json.dumps({"baseline_ms": base, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
