"""What translation adds: a ``/v1/messages`` stream (Anthropic, rewritten by
the proxy) next to the same ``/v1/chat/completions`` stream, through ggmux,
on one fake instance (issue 14's "Measured").

One ``ggmux serve`` with one fake model (``tokens`` chunks, the first after
``ttft_s``, then one every ``token_s``); one keep-alive client connection
per API; requests alternate chat, messages, chat, ... so drift of the
machine lands on both. Per request: TTFT (request written -> first text
chunk read) and the time per chunk after it ((last text chunk - first) /
(chunks - 1)). Reported: p50 and p90 of each, per API, and the difference
(messages - chat). A second, in-process figure: the CPU time of the
translation alone (:class:`~ggmux.proxy.apis.adapters.anthropic.MessagesStream`
and the SSE parser over a recorded chat stream), microseconds per chunk.

Usage, from the repository root::

    python -m bench.adapter_cost                   # 400 requests per API
    python -m bench.adapter_cost --requests 1000 --tokens 32 --out bench/out/adapter_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HI = [{"role": "user", "content": "hi"}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Client:
    """One keep-alive connection; :meth:`stream` posts and times one stream."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def stream(self, path: str, body: dict, marker: bytes, end: bytes):
        """``(ttft_s, per_chunk_s, chunks)``: ``marker`` starts each text
        chunk in the body, ``end`` is the last chunk of chunked framing."""
        data = json.dumps(body).encode()
        self.sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        t0 = time.perf_counter()
        first = last = 0.0
        n = 0
        buf = b""
        while not buf.endswith(end):
            got = self.sock.recv(65536)
            if not got:
                raise ConnectionError("server closed the connection")
            now = time.perf_counter()
            k = got.count(marker)
            if k:
                if not n:
                    first = now
                n += k
                last = now
            buf = buf[-16:] + got
        return first - t0, (last - first) / max(1, n - 1), n


def translation_cpu_us(tokens: int, rounds: int = 2000) -> float:
    """CPU microseconds per chunk of the Anthropic translation alone."""
    from ggmux.proxy.apis.adapters.anthropic import MessagesStream
    from ggmux.proxy.apis.adapters.common import SseEvents

    chunks = []
    for i in range(tokens):
        delta = {"content": " tok"} if i else {"role": "assistant", "content": "[m:1]"}
        chunks.append(b"data: " + json.dumps({
            "id": "fake-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta,
                         "finish_reason": "stop" if i == tokens - 1 else None}]}).encode()
            + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    t0 = time.process_time()
    for _ in range(rounds):
        st, sse = MessagesStream("m"), SseEvents()
        for c in chunks:
            for ev in sse.feed(c):
                if ev == b"[DONE]":
                    st.end()
                else:
                    st.event(ev)
    return (time.process_time() - t0) / (rounds * tokens) * 1e6


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.adapter_cost")
    ap.add_argument("--requests", type=int, default=400, help="requests per API")
    ap.add_argument("--tokens", type=int, default=16, help="chunks per answer")
    ap.add_argument("--ttft", type=float, default=0.002, help="fake instance TTFT, s")
    ap.add_argument("--token-s", type=float, default=0.001, help="fake instance s per chunk")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="ggmux-adapter-cost-"))
    (tmp / "fakes").mkdir()
    (tmp / "fakes" / "m.json").write_text(json.dumps(
        {"load_s": 0.01, "ttft_s": args.ttft, "token_s": args.token_s, "tokens": args.tokens}))
    port = free_port()
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - for the server's life
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(port), "--proxies", "1",
         "--fake-models-dir", str(tmp / "fakes"), "--no-hf-cache", "--log-level", "WARNING"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"server did not start; see {tmp / 'server.log'}") from None
                time.sleep(0.1)
        chat, msgs = Client(port), Client(port)
        jobs = {
            "chat": (chat, "/v1/chat/completions",
                     {"model": "m", "messages": HI, "stream": True, "max_tokens": args.tokens},
                     b'"content":"', b"\r\n0\r\n\r\n"),
            "messages": (msgs, "/v1/messages",
                         {"model": "m", "messages": HI, "stream": True,
                          "max_tokens": args.tokens}, b"text_delta", b"\r\n0\r\n\r\n"),
        }
        for name, (c, path, body, marker, end) in jobs.items():  # warm-up: load, pools
            for _ in range(20):
                c.stream(path, body, marker, end)
        res: dict[str, dict[str, list[float]]] = {k: {"ttft": [], "chunk": []} for k in jobs}
        skipped = 0
        for _ in range(args.requests):
            for name, (c, path, body, marker, end) in jobs.items():
                ttft, per, n = c.stream(path, body, marker, end)
                if n != args.tokens:  # a marker split between two reads: not timed
                    skipped += 1
                    continue
                res[name]["ttft"].append(ttft)
                res[name]["chunk"].append(per)
        cpu = translation_cpu_us(args.tokens)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log.close()

    out: dict = {"requests": args.requests, "tokens": args.tokens, "ttft_s": args.ttft,
                 "token_s": args.token_s, "cpu_count": os.cpu_count(),
                 "translation_cpu_us_per_chunk": round(cpu, 2), "skipped": skipped}
    print(f"{args.requests} requests per API, {args.tokens} chunks, alternating; fake TTFT "
          f"{args.ttft * 1e3:g} ms, {args.token_s * 1e3:g} ms per chunk")
    print(f"{'':10s} {'TTFT p50':>10s} {'TTFT p90':>10s} {'chunk p50':>10s} {'chunk p90':>10s}"
          "  (ms)")
    for name, r in res.items():
        row = [pct(r["ttft"], 0.5), pct(r["ttft"], 0.9), pct(r["chunk"], 0.5),
               pct(r["chunk"], 0.9)]
        out[name] = dict(zip(("ttft_p50_ms", "ttft_p90_ms", "chunk_p50_ms", "chunk_p90_ms"),
                             [round(x * 1e3, 4) for x in row], strict=True))
        print(f"{name:10s} " + " ".join(f"{x * 1e3:10.3f}" for x in row))
    d_ttft = statistics.median(res["messages"]["ttft"]) - statistics.median(res["chat"]["ttft"])
    d_chunk = (statistics.median(res["messages"]["chunk"])
               - statistics.median(res["chat"]["chunk"]))
    out["added_ttft_p50_ms"] = round(d_ttft * 1e3, 4)
    out["added_chunk_p50_ms"] = round(d_chunk * 1e3, 4)
    print(f"added by translation: TTFT p50 {d_ttft * 1e3:+.3f} ms, per chunk p50 "
          f"{d_chunk * 1e3:+.4f} ms; translation CPU alone {cpu:.2f} us per chunk")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
