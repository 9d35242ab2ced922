"""A replica that records what it was sent (tests of what reaches a replica).

Run as ``python tests/recorder.py --port N --log FILE [--api-key-file F]``
(a ``cmd`` replica, or an ``upstream`` started by the test). Every request
is appended to FILE as one JSON line ``{"method", "path", "headers"}``
(header names lower-case) and answered 200 with a small chat completion,
or a ``/props``-like object for ``GET .../props``. With ``--api-key-file``
it acts like llama-server's ``--api-key-file``: every route but ``/health``
needs ``Authorization: Bearer <the file's first line>`` (401 otherwise).
``--delay S``: each answer (but ``/health``, ``/props``) takes S seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(log_path: str, key: str | None, delay: float = 0.0):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _answer(self, status: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _serve(self) -> None:
            n = int(self.headers.get("content-length") or 0)
            if n:
                self.rfile.read(n)
            with open(log_path, "a") as f:
                f.write(json.dumps({"method": self.command, "path": self.path,
                                    "headers": {k.lower(): v for k, v in self.headers.items()}})
                        + "\n")
            if self.path.endswith("/health"):
                self._answer(200, {"status": "ok"})
                return
            if key is not None and self.headers.get("authorization") != f"Bearer {key}":
                self._answer(401, {"error": {"message": "bad key", "code": 401}})
                return
            if self.path.endswith("/props"):
                self._answer(200, {"model_path": "/srv/models/secret-dir/rec.gguf",
                                   "n_ctx": 512})
                return
            if delay:
                time.sleep(delay)  # a busy replica (tests of contention)
            self._answer(200, {"object": "chat.completion", "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "[rec:0] ok"},
                 "finish_reason": "stop"}]})

        do_GET = do_POST = do_PUT = do_DELETE = _serve

        def log_message(self, *args) -> None:  # quiet
            pass

    return Handler


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--api-key-file", default=None)
    ap.add_argument("--delay", type=float, default=0.0)
    args = ap.parse_args(argv)
    key = None
    if args.api_key_file:
        with open(args.api_key_file) as f:
            key = f.readline().strip()
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(args.log, key, args.delay))
    try:
        srv.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
