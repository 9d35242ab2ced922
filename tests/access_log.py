"""A recording reverse proxy for tests of real clients: every request a
client sends through it reaches ggmux unchanged, and ``entries`` lists
``(method, path, status)`` of each, so a test can say "every request it
made was answered 200" without ggmux keeping an access log. Bodies, streamed
answers included, are relayed as they arrive. Standard library only."""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

HOP = frozenset(("connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
                 "proxy-connection", "content-length", "host"))


class AccessLog:
    """``AccessLog(port)``: listening on ``base`` (a free loopback port),
    forwarding to 127.0.0.1:``port``, waiting up to ``timeout`` seconds
    for each read from ggmux; :meth:`close` stops it."""

    def __init__(self, port: int, timeout: float = 600.0) -> None:
        self.entries: list[tuple[str, str, int]] = []
        lock = threading.Lock()
        log = self.entries

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes | None:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("content-length") or 0)
                return self.rfile.read(n) if n else None

            def _relay(self) -> None:
                body = self._body()
                up = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
                headers["accept-encoding"] = "identity"
                up.request(self.command, self.path, body=body, headers=headers)
                r = up.getresponse()
                with lock:
                    log.append((self.command, self.path, r.status))
                self.send_response_only(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in HOP:
                        self.send_header(k, v)
                if self.command == "HEAD":
                    self.send_header("content-length", r.getheader("content-length") or "0")
                    self.end_headers()
                    up.close()
                    return
                self.send_header("transfer-encoding", "chunked")
                self.end_headers()
                while True:
                    data = r.read1(65536)
                    if not data:
                        break
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                up.close()

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = do_OPTIONS = _relay

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.srv.shutdown()
        self.srv.server_close()
