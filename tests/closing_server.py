"""A server that closes its connections as llama-server does, for the
pooling tests (tests/test_upstreams.py); also a ``cmd`` for a model:
``python tests/closing_server.py PORT [--drain] [--linger S]``."""

from __future__ import annotations

import argparse
import socket
import threading
import time


class ClosingServer:
    """An OpenAI-compatible server that, like llama-server (cpp-httplib
    after a streamed answer), answers one request per connection with no
    ``Connection: close`` and then shuts the socket down a moment later,
    whatever the client sent meanwhile (a FIN, then a reset for the unread
    request). ``requests``: the requests it answered."""

    def __init__(self, linger_s: float = 0.3, drain: bool = False, port: int = 0) -> None:
        self.linger_s = linger_s
        self.drain = drain  # cpp-httplib's way: chunked answers, then FIN, read and drop, close
        self.connections = 0
        self.requests = 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.running = True
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while self.running:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        data = b""
        conn.settimeout(5)
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                body += conn.recv(65536)
            answer = (b'{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,'
                      b'"message":{"role":"assistant","content":"hi"},"finish_reason":"stop"}]}')
            if self.drain:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                             % (len(answer), answer))
            else:
                conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
            self.requests += 1
            time.sleep(self.linger_s)  # a next request may arrive now: never answered
            if self.drain:
                conn.shutdown(socket.SHUT_WR)
                while conn.recv(65536):  # read and drop: no reset
                    pass
            else:
                conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.running = False
        self.sock.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--drain", action="store_true")
    ap.add_argument("--linger", type=float, default=0.05)
    a = ap.parse_args()
    server = ClosingServer(a.linger, a.drain, a.port)
    threading.Event().wait()  # until the supervisor stops it
