"""The harness of the HTTP core's tests (http1/): real uvloop servers in a
background thread (:class:`LoopThread`, :func:`http_server`), a strict
blocking client (:class:`Client`), an application that echoes what it got
(:class:`App`), and a replica behind a forwarding proxy (:class:`Replica`,
:class:`Proxy`); the fixtures ``lt``, ``serve`` and ``proxied``.

Every server a test starts is closed with all its connections at the end of
the test, and the test checks none is left open.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Self

import pytest
import uvloop
from conftest import wait_for
from ggmux.http1 import (
    HttpConnection,
    HttpLimits,
    Request,
    error_code,
)
from ggmux.http1.exchange import Exchange, UpstreamError
from ggmux.http1.heads import request_head
from ggmux.http1.pool import UpstreamPool

# ---------------------------------------------------------------------------
# harness: an event loop thread, servers in it, a strict blocking client


class LoopThread:
    """A uvloop event loop running in a daemon thread."""

    def __init__(self) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        """Run ``coro`` in the loop; its result (or exception)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Callable, timeout: float = 10.0):
        """Call ``fn()`` in the loop thread; its result."""

        async def wrap():
            return fn()

        return self.run(wrap(), timeout)

    def stop(self) -> None:
        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        self.run(cancel_all())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        assert not self.thread.is_alive(), "event loop thread did not stop"
        self.loop.close()


class Served:
    """An asyncio server on 127.0.0.1 (port 0) in a :class:`LoopThread`,
    each connection made by ``factory``; ``conns`` holds the live ones."""

    def __init__(
        self,
        lt: LoopThread,
        factory: Callable[[], asyncio.Protocol],
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.lt = lt
        self.conns: list[asyncio.Protocol] = []
        self.made = 0  # connections accepted so far

        def make():
            proto = factory()
            self.made += 1
            self.conns.append(proto)
            return proto

        async def start():
            return await lt.loop.create_server(make, host, port)

        self.server = lt.run(start())
        self.port = self.server.sockets[0].getsockname()[1]

    def open_count(self) -> int:
        return self.lt.call(
            lambda: sum(
                1 for c in self.conns if c.transport is not None and not c.transport.is_closing()
            )
        )

    def close(self) -> None:
        async def close():
            self.server.close()
            for c in self.conns:
                if c.transport is not None:
                    c.transport.abort()
            await self.server.wait_closed()
            await asyncio.sleep(0)  # let connection_lost callbacks run

        self.lt.run(close())


def http_server(
    lt: LoopThread, handler, limits: HttpLimits, host: str = "127.0.0.1", port: int = 0,
    fast=None,
) -> Served:
    """A server of :class:`HttpConnection` with ``handler`` (and ``fast``)."""
    s = Served(lt, lambda: HttpConnection(handler, limits, fast=fast), host, port)
    s.limits = limits  # type: ignore[attr-defined]
    return s


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    raw: bytes = b""

    def get(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name]

    def one(self, name: str) -> str:
        vals = self.get(name)
        assert len(vals) == 1, f"{name}: {vals} in {self.headers}"
        return vals[0]

    def json(self):
        return json.loads(self.body)


class ProtocolError(AssertionError):
    """The server sent something that is not a well-formed HTTP/1.1 response."""


class Client:
    """A blocking HTTP/1.1 client on one socket that checks every response
    strictly (status line, exactly one framing header, one x-request-id,
    complete body). Every wait has a deadline."""

    def __init__(self, port: int, timeout: float = 5.0, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket()
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        self.timeout = timeout
        self.buf = b""
        self.eof = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self, deadline: float) -> bool:
        """Read more into ``buf``; False at EOF (or reset)."""
        if self.eof:
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no data from the server before the deadline")
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        except TimeoutError:
            raise TimeoutError("no data from the server before the deadline") from None
        if not data:
            self.eof = True
            return False
        self.buf += data
        return True

    def _line(self, deadline: float) -> bytes:
        while b"\r\n" not in self.buf:
            if not self._fill(deadline):
                raise ProtocolError(f"connection closed inside a line: {self.buf[:200]!r}")
            if len(self.buf) > 1 << 20:
                raise ProtocolError("line too long")
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _exact(self, n: int, deadline: float) -> bytes:
        while len(self.buf) < n:
            if not self._fill(deadline):
                raise ProtocolError(f"connection closed with {len(self.buf)} of {n} body bytes")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def response(
        self, head: bool = False, timeout: float | None = None, interim: bool = False
    ) -> Response:
        """The next response (interim 1xx ones are skipped unless
        ``interim``); ``head``: it answers a HEAD request."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            line = self._line(deadline)
            parts = line.split(b" ", 2)
            if (
                len(parts) < 2
                or parts[0] != b"HTTP/1.1"
                or len(parts[1]) != 3
                or not parts[1].isdigit()
            ):
                raise ProtocolError(f"bad status line {line!r}")
            status = int(parts[1])
            headers = []
            while True:
                h = self._line(deadline)
                if not h:
                    break
                if b":" not in h:
                    raise ProtocolError(f"bad header line {h!r}")
                k, v = h.split(b":", 1)
                headers.append((k.decode().lower(), v.strip().decode("latin-1")))
            if 100 <= status < 200:
                if interim:
                    return Response(status, headers, b"")
                continue
            break
        r = Response(status, headers, b"")
        framing = r.get("content-length") + r.get("transfer-encoding")
        if status in (204, 304):
            if framing:
                raise ProtocolError(f"{status} with framing {framing}")
        elif len(framing) > 1 or (not framing and r.get("connection") != ["close"]):
            raise ProtocolError(f"framing headers {framing} in {headers}")
        if len(r.get("x-request-id")) != 1:
            raise ProtocolError(f"x-request-id {r.get('x-request-id')}")
        if head or status in (204, 304):
            return r
        if r.get("content-length"):
            r.body = self._exact(int(r.one("content-length")), deadline)
        elif r.get("transfer-encoding"):
            if r.one("transfer-encoding") != "chunked":
                raise ProtocolError(f"transfer-encoding {r.get('transfer-encoding')}")
            chunks = []
            while True:
                size = int(self._line(deadline), 16)
                if size == 0:
                    if self._line(deadline) != b"":
                        raise ProtocolError("trailers are not expected")
                    break
                chunks.append(self._exact(size, deadline))
                if self._line(deadline) != b"":
                    raise ProtocolError("chunk not followed by CRLF")
            r.body = b"".join(chunks)
        else:  # close-delimited
            while self._fill(deadline):
                pass
            r.body, self.buf = self.buf, b""
        return r

    def closed(self, timeout: float | None = None) -> bool:
        """Wait until the server closes (True) or ``timeout`` passes (False);
        bytes that arrive meanwhile stay in ``buf``."""
        deadline = time.monotonic() + (timeout or self.timeout)
        try:
            while self._fill(deadline):
                pass
        except TimeoutError:
            return False
        return True

    def read_until_eof(self, timeout: float | None = None) -> bytes:
        deadline = time.monotonic() + (timeout or self.timeout)
        while self._fill(deadline):
            pass
        out, self.buf = self.buf, b""
        return out


def get(path: str = "/ok", extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode()
        + body
    )


def assert_served(port: int) -> None:
    """A normal client on its own connection gets a normal answer."""
    with Client(port) as c:
        c.send(get("/ok"))
        r = c.response(timeout=5)
        assert r.status == 200, r
        assert r.json()["path"] == "/ok"


# ---------------------------------------------------------------------------
# the application under the core: echoes what it got, records what ran


@dataclass
class App:
    executed: list[tuple[str, str]] = field(default_factory=list)
    disconnected: threading.Event = field(default_factory=threading.Event)

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        path = req.path.decode("latin-1")
        self.executed.append((req.method.decode(), path))
        if path == "/slow":
            await asyncio.sleep(float(req.query or b"0.2"))
        elif path == "/stream":
            conn.start_stream(req)
            conn.send_chunk(b"data: 1\n\n")
            conn.send_chunk(b"data: 2\n\n")
            conn.end_stream(req)
            return
        elif path == "/boom":
            raise RuntimeError("boom")
        elif path == "/fixed":
            conn.send_response(req, 200, b'{"fixed": true}')
            return
        elif path == "/empty":
            conn.send_response(req, 204, b"")
            return
        elif path == "/hold":  # answers when the client goes away
            fut = conn.loop.create_future()
            req.on_disconnect = lambda: fut.done() or fut.set_result(None)
            await fut
            self.disconnected.set()
            conn.finish(req)
            return
        conn.send_json(
            req,
            200,
            {
                "method": req.method.decode(),
                "path": path,
                "query": req.query.decode("latin-1"),
                "body": bytes(req.body).decode("latin-1"),
                "request_id": req.request_id.decode(),
            },
        )


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.stop()


@pytest.fixture
def serve(lt):
    """``serve(**limits) -> (Served, App)``: an HttpConnection server with
    an echo app; closed after the test, which fails if a connection stays
    counted."""
    started: list[Served] = []

    def start(**limits) -> tuple[Served, App]:
        app = App()
        s = http_server(lt, app.handle, HttpLimits(**limits))
        s.app = app  # type: ignore[attr-defined]
        started.append(s)
        return s, app

    yield start
    for s in started:
        s.close()
        wait_for(
            lambda s=s: lt.call(lambda: s.limits.open_connections) == 0,
            5,
            what="connections closed",
        )


def expect_error(c: Client, status: int, closed: bool = True) -> Response:
    r = c.response()
    assert r.status == status, (r.status, r.body)
    err = r.json()["error"]
    assert err["code"] == error_code(status) and err["message"] and err["type"]
    assert r.one("content-type") == "application/json"
    if closed:
        assert r.one("connection") == "close"
        assert c.closed(), "connection left open after a framing error"
    return r


@dataclass
class Replica:
    """A fake replica: the HTTP core with a handler per path, recording the
    requests it got and the connections it saw close."""

    lt: LoopThread
    seen: list[Request] = field(default_factory=list)
    per_conn: dict[int, int] = field(default_factory=dict)
    gone: threading.Event = field(default_factory=threading.Event)
    server: Served | None = None

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        self.seen.append(req)
        n = self.per_conn[id(conn)] = self.per_conn.get(id(conn), 0) + 1
        path = req.path
        if path == b"/headers":
            conn.send_json(
                req,
                200,
                {k.decode(): v.decode() for k, v in req.headers},
                headers=[
                    (b"connection", b"x-internal"),
                    (b"x-internal", b"secret"),
                    (b"keep-alive", b"timeout=5"),
                    (b"x-request-id", b"replica-made-this-up"),
                ],
            )
        elif path == b"/big":  # a fast producer: as much as the proxy takes
            mb = int(req.query or b"8")
            conn.start_stream(req, content_type=b"application/octet-stream")
            block = bytes(range(256)) * 256  # 64 KiB
            for _ in range(mb * 16):
                if req.disconnected:
                    return
                conn.send_chunk(block)
                await conn.drain()
            conn.end_stream(req)
        elif path == b"/sse-then-die":
            conn.start_stream(req)
            conn.send_chunk(b'data: {"n": 1}\n\n')
            conn.send_chunk(b'data: {"n": 2}\n\n')
            await asyncio.sleep(0.05)
            conn.transport.abort()
            conn.close()
        elif path == b"/die":
            conn.transport.abort()
            conn.close()
        elif path == b"/close-on-reuse" and n > 1:
            # the keep-alive race: the replica closed a connection the proxy
            # still had in its pool; the request meets a closed socket, which
            # answers with a reset (SO_LINGER 0 makes this close one)
            sock = conn.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.transport.abort()
            conn.close()
        elif path == b"/hold":
            fut = conn.loop.create_future()
            req.on_disconnect = lambda: fut.done() or fut.set_result(None)
            if req.query == b"stream":
                conn.start_stream(req)
                while not fut.done():
                    conn.send_chunk(b"data: tick\n\n")
                    await asyncio.wait([fut], timeout=0.02)
            await fut
            self.gone.set()
            conn.finish(req)
        elif path == b"/junk":
            # a confused replica: its answer, then an answer nobody asked for
            conn.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
                                 b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nevil")
            conn.finish(req)
        elif path == b"/ok-close":
            req.keep_alive = False
            conn.send_json(req, 200, {"n": n})
        else:
            conn.send_json(req, 200, {"path": path.decode(), "n": n, "method": req.method.decode()})


@dataclass
class Proxy:
    """The proxy under test: like proxy/forward.py's _forward, simplified."""

    lt: LoopThread
    replica_port: int
    exchanges: list[Exchange] = field(default_factory=list)
    max_buffer: int = 0
    saw_paused: bool = False
    pool: UpstreamPool | None = None

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        if req.path == b"/local":
            conn.send_json(req, 200, {"local": True})
            return
        data = request_head(req, self.replica_port, len(req.body)) + bytes(req.body)
        try:
            ex = await self.pool.forward(self.replica_port, conn, req, data)
        except UpstreamError as e:
            conn.send_error(req, 502, f"replica failed: {e}")
            return
        self.exchanges.append(ex)


@pytest.fixture
def proxied(lt):
    """``(proxy Served, Proxy, Replica)``; all closed after the test."""
    replica = Replica(lt)
    rs = http_server(lt, replica.handle, HttpLimits())
    replica.server = rs
    proxy = Proxy(lt, rs.port)
    proxy.pool = lt.call(lambda: UpstreamPool(lt.loop))
    ps = http_server(lt, proxy.handle, HttpLimits())
    yield ps, proxy, replica
    ps.close()

    lt.call(proxy.pool.close)
    rs.close()
    for s in (ps, rs):
        wait_for(
            lambda s=s: lt.call(lambda: s.limits.open_connections) == 0,
            5,
            what="connections closed",
        )


