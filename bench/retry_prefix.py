"""A retry after the client left mid-prefill, beside a cold read of the same
prompt: how much of the prompt the retry reads again, and its prompt time.

An agent whose client gives up on a long first request (Claude Code after
its own timeout) sends the same prompt again; the slot keeps what it read
before the client left, so the retry reads only the rest. Rounds alternate
a cold read (``POST /cache/clear`` first) and a leave-then-retry (the cache
cleared, a streamed request read until ``leave_after`` of its prompt is in
the slot, the connection closed, then the same prompt again), on one
``ggmux serve`` of the demo model with one slot and one thread::

    python -m bench.retry_prefix --rounds 3 --lines 140

Prints per round the prompt tokens, those cached, and the engine's own
``timings.prompt_ms`` (the prefill; no HTTP in it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", path, json.dumps(body), {"content-type": "application/json"})
        r = c.getresponse()
        return json.loads(r.read() or b"{}")
    finally:
        c.close()


def _leave_after(port: int, body: dict, share: float) -> int:
    """Stream ``body`` until ``share`` of its prompt is read, then close:
    the tokens read when the client left."""
    s = socket.create_connection(("127.0.0.1", port))
    data = json.dumps({**body, "stream": True, "return_progress": True}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
              b"\r\nconnection: close\r\ncontent-length: %d\r\n\r\n" % len(data) + data)
    got = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return 0
            got += chunk
            for line in got.split(b"\n"):
                if line.startswith(b"data: {") and b"prompt_progress" in line:
                    p = json.loads(line[6:])["prompt_progress"]
                    if p["processed"] >= share * p["total"]:
                        return p["processed"]
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lines", type=int, default=140, help="prompt lines (about 14 tokens each)")
    ap.add_argument("--leave-after", type=float, default=0.5,
                    help="share of the prompt read when the client leaves")
    args = ap.parse_args(argv)
    port = _free_port()
    state = tempfile.mkdtemp(prefix="ggmux-retry-")
    env = {**os.environ, "GGMUX_STATE_DIR": state}
    proc = subprocess.Popen([sys.executable, "-m", "ggmux", "serve", "--port", str(port),
                             "--proxies", "1", "--threads", "1", "--parallel", "1",
                             "--ctx-size", "4096", "--spares", "0"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    text = " ".join(f"Line {i}: the router keeps what it read, and the client comes back."
                    for i in range(args.lines))
    body = {"model": "smollm2-135m", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": text + "\nSummarise in one sentence."}]}
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                _post(port, "/cache/clear", {"model": "smollm2-135m"}, timeout=5)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        _post(port, "/v1/chat/completions", body)  # the load, and a warm-up
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
              f"{os.getloadavg()[0]:.1f}")
        print("round  kind    prompt  cached  read-before-leaving  prompt_ms")
        for i in range(args.rounds):
            for kind in ("cold", "retry"):
                _post(port, "/cache/clear", {"model": "smollm2-135m"})
                read = _leave_after(port, body, args.leave_after) if kind == "retry" else 0
                doc = _post(port, "/v1/chat/completions", body)
                u, t = doc["usage"], doc["timings"]
                print(f"{i:5d}  {kind:6s}  {u['prompt_tokens']:6d}  "
                      f"{u['prompt_tokens_details']['cached_tokens']:6d}  {read:19d}  "
                      f"{t['prompt_ms']:9.0f}")
        print(f"# load after: {os.getloadavg()[0]:.1f}")
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
