"""The HTTP/1.1 core (http1/) and forwarding (http1/upstream.py),
served by real uvloop servers in a background thread and driven by plain
blocking sockets (issue 5: the complete HTTP surface, hardened).

Every server a test starts is closed with all its connections at the end of
the test, and the test checks none is left open.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import select
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
    add_http_limit_options,
    error_code,
    fit_fd_limit,
    http_limit_argv,
    limits_from_args,
)
from ggmux.http1.exchange import Exchange, UpstreamError
from ggmux.http1.pool import UpstreamPool
from ggmux.http1.upstream import request_head

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


# ---------------------------------------------------------------------------
# HTTP/1.1 behaviour


def test_keepalive_connection_serves_many_requests(serve):
    s, _app = serve()
    with Client(s.port) as c:
        for i in range(20):
            c.send(get(f"/n{i}"))
            r = c.response()
            assert r.status == 200 and r.json()["path"] == f"/n{i}"
            assert r.get("connection") == []
    assert s.made == 1


def test_pipelined_requests_are_answered_in_order_even_when_the_first_is_slowest(serve):
    s, app = serve()
    with Client(s.port) as c:
        c.send(get("/slow?0.3") + get("/slow?0.01") + post("/p", b"xyz") + get("/last"))
        paths = [c.response().json()["path"] for _ in range(4)]
    assert paths == ["/slow", "/slow", "/p", "/last"]
    assert [p for _, p in app.executed] == paths


def test_many_pipelined_requests_pause_reading_and_all_get_answers(serve):
    s, _app = serve(max_pipelined=4)
    with Client(s.port) as c:
        c.send(b"".join(get(f"/q{i}") for i in range(60)))
        assert [c.response().json()["path"] for _ in range(60)] == [f"/q{i}" for i in range(60)]


def test_chunked_request_body_is_reassembled(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(
            b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n10\r\n0123456789abcdef\r\n0\r\n\r\n"
        )
        assert c.response().json()["body"] == "abc0123456789abcdef"


def test_chunked_body_arriving_in_pieces_is_reassembled(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nab")
        wait_for(lambda: s.open_count() == 1, 5, what="connection accepted")
        c.send(b"cd\r\n2\r\nef\r\n0\r\n\r\n")
        assert c.response().json()["body"] == "abcdef"


def test_expect_100_continue_gets_100_before_the_body_is_sent(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
        r = c.response(interim=True)
        assert r.status == 100
        c.send(b"hello")
        r = c.response()
        assert r.status == 200 and r.json()["body"] == "hello"


def test_expect_100_continue_behind_a_pipelined_request_waits_its_turn(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(
            get("/slow?0.2")
            + b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n"
        )
        assert c.response(interim=True).json()["path"] == "/slow"  # not a 100 in the middle
        assert c.response(interim=True).status == 100
        c.send(b"ok")
        assert c.response().json()["body"] == "ok"


def test_expect_100_continue_with_a_body_over_the_limit_gets_413_and_no_100(serve):
    s, app = serve(max_body_bytes=1000)
    with Client(s.port) as c:
        c.send(
            b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
        )
        r = c.response(interim=True)
        assert r.status == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert c.closed()
    assert app.executed == []


def test_unknown_expectation_gets_417_and_close(serve):
    s, app = serve()
    with Client(s.port) as c:
        c.send(b"POST /e HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: teapot\r\n\r\nhello")
        r = c.response()
        assert r.status == 417 and r.one("connection") == "close"
        assert c.closed()
    assert app.executed == []


def test_head_gets_the_get_headers_and_no_body(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(get("/fixed"))
        g = c.response()
        c.send(b"HEAD /fixed HTTP/1.1\r\nHost: t\r\n\r\n")
        h = c.response(head=True)
        assert h.status == 200
        assert h.one("content-length") == g.one("content-length")
        assert h.one("content-type") == g.one("content-type")
        c.send(b"HEAD /stream HTTP/1.1\r\nHost: t\r\n\r\n")
        h = c.response(head=True)
        assert h.one("transfer-encoding") == "chunked"
        c.send(get("/after"))  # nothing of a body was left on the wire
        assert c.response().json()["path"] == "/after"


def test_every_response_has_exactly_one_framing_header(serve):
    # Client.response() rejects zero or two framing headers; cover each kind
    s, _ = serve()
    with Client(s.port) as c:
        for req, status in [
            (get("/ok"), 200),
            (get("/stream"), 200),
            (get("/boom"), 500),
            (post("/p", b"{}"), 200),
        ]:
            c.send(req)
            r = c.response()
            assert r.status == status
        c.send(get("/empty"))
        r = c.response()
        assert (
            r.status == 204 and r.get("content-length") == [] and r.get("transfer-encoding") == []
        )
        assert r.body == b""
        c.send(get("/stream"))
        assert c.response().body == b"data: 1\n\ndata: 2\n\n"


def test_request_id_is_echoed_when_given_and_generated_otherwise(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(get("/ok", "X-Request-Id: my-id.42\r\n"))
        r = c.response()
        assert r.one("x-request-id") == "my-id.42" and r.json()["request_id"] == "my-id.42"
        c.send(get("/ok"))
        r = c.response()
        rid = r.one("x-request-id")
        assert len(rid) == 16 and int(rid, 16) >= 0 and r.json()["request_id"] == rid
        c.send(get("/ok"))
        assert c.response().one("x-request-id") != rid
        c.send(get("/boom", "x-request-id: failing-one\r\n"))
        r = c.response()
        assert r.status == 500 and r.one("x-request-id") == "failing-one"
        assert r.json()["error"]["type"] == "server_error"


def test_request_id_that_is_too_long_or_has_spaces_is_replaced(serve):
    s, _ = serve()
    with Client(s.port) as c:
        for bad in ("a" * 200, "two words"):
            c.send(get("/ok", f"X-Request-Id: {bad}\r\n"))
            rid = c.response().one("x-request-id")
            assert rid != bad and len(rid) == 16


def test_request_id_is_echoed_on_a_framing_error(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(
            b"POST / HTTP/1.1\r\nX-Request-Id: bad-one\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n"
        )
        r = c.response()
        assert r.status == 400
        assert r.one("x-request-id")  # generated: the head was not complete


def test_connection_close_request_is_answered_then_closed_and_nothing_after_runs(serve):
    s, app = serve()
    with Client(s.port) as c:
        c.send(get("/first", "Connection: close\r\n") + get("/second"))
        r = c.response()
        assert r.json()["path"] == "/first" and r.one("connection") == "close"
        assert c.closed()
        assert c.buf == b""
    assert [p for _, p in app.executed] == ["/first"]


def test_http10_client_gets_keepalive_on_request_and_a_close_delimited_stream(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(b"GET /ok HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        r = c.response()
        assert r.status == 200 and r.one("connection") == "keep-alive"
        c.send(b"GET /stream HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
        r = c.response()  # no framing header: a close-delimited body
        assert r.get("transfer-encoding") == [] and r.one("connection") == "close"
        assert r.body == b"data: 1\n\ndata: 2\n\n"
    with Client(s.port) as c:
        c.send(b"GET /ok HTTP/1.0\r\n\r\n")
        assert c.response().one("connection") == "close"
        assert c.closed()


def test_declined_h2c_upgrade_is_answered_in_http11_then_closed(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(
            get(
                "/ok",
                "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n",
            )
        )
        r = c.response()
        assert r.status == 200 and r.one("connection") == "close"
        assert c.closed()


def test_connect_method_is_refused(serve):
    s, app = serve()
    with Client(s.port) as c:
        c.send(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        r = c.response()
        assert r.status == 405 and c.closed()
    assert app.executed == []


def test_handler_error_after_a_pipelined_request_does_not_break_order(serve):
    s, _ = serve()
    with Client(s.port) as c:
        c.send(get("/boom") + get("/ok"))
        assert c.response().status == 500
        assert c.response().json()["path"] == "/ok"


def test_idle_keepalive_connection_is_closed_after_the_timeout(serve):
    s, _ = serve(keepalive_timeout=0.3)
    with Client(s.port) as c:
        c.send(get("/ok"))
        assert c.response().status == 200
        t0 = time.monotonic()
        assert c.closed(timeout=5)
        assert time.monotonic() - t0 >= 0.2


def test_client_disconnect_reaches_the_handler(serve):
    s, app = serve()
    c = Client(s.port)
    c.send(get("/hold"))
    wait_for(lambda: ("GET", "/hold") in app.executed, 5, what="handler running")
    c.close()
    assert app.disconnected.wait(5)


def test_limit_options_round_trip_through_argparse():
    ap = argparse.ArgumentParser()
    add_http_limit_options(ap)
    defaults = limits_from_args(ap.parse_args([]))
    assert defaults == HttpLimits()
    args = ap.parse_args(
        [
            "--max-header-bytes", "1000",
            "--max-body-bytes", "2000",
            "--header-timeout", "1.5",
            "--body-timeout", "2.5",
            "--keepalive-timeout", "3",
            "--max-connections", "7",
        ]
    )  # fmt: skip
    lim = limits_from_args(args)
    assert (lim.max_header_bytes, lim.max_body_bytes, lim.max_connections) == (1000, 2000, 7)
    assert (lim.header_timeout, lim.body_timeout, lim.keepalive_timeout) == (1.5, 2.5, 3.0)
    with pytest.raises(SystemExit):
        ap.parse_args(["--max-connections", "0"])


def test_limits_pass_to_a_child_process_as_arguments():
    ap = argparse.ArgumentParser()
    add_http_limit_options(ap)
    lim = HttpLimits(max_body_bytes=123, body_timeout=0.25, max_connections=9)
    assert limits_from_args(ap.parse_args(http_limit_argv(lim))) == lim


def test_fd_limit_is_raised_for_max_connections_or_max_connections_lowered(monkeypatch):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 100 * 2 + 256
    if hard != resource.RLIM_INFINITY and hard < want:
        pytest.skip("hard open-file limit too low to test raising it")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        lim = fit_fd_limit(HttpLimits(max_connections=100))
        assert lim.max_connections == 100
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= want
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    # a hard limit that cannot be raised: fewer connections instead (the
    # limit it sets is recorded, not applied: a real (1000, 1000) would stay
    # on this test process and every server it starts after)
    monkeypatch.setattr(resource, "getrlimit", lambda _: (1000, 1000))
    applied = []
    monkeypatch.setattr(resource, "setrlimit", lambda _, lim: applied.append(lim))
    lim = fit_fd_limit(HttpLimits(max_connections=4096))
    assert lim.max_connections == (1000 - 256) // 2
    assert all(a == (1000, 1000) for a in applied)


# ---------------------------------------------------------------------------
# bad input: a clear error, the connection closed, other clients untouched


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


@pytest.mark.parametrize(
    "raw, status",
    [
        pytest.param(
            b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
            400,
            id="content_length_with_transfer_encoding",
        ),
        pytest.param(
            b"POST /x HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
            400,
            id="two_content_lengths",
        ),
        pytest.param(
            b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
            400,
            id="bad_chunk_size",
        ),
        pytest.param(
            b"GET /x HTTP/1.1\r\nHost: t\r\nno colon here\r\n\r\n",
            400,
            id="header_line_without_colon",
        ),
        pytest.param(b"GET /\xff\xfe HTTP/1.1\r\nHost: t\r\n\r\n", 400, id="invalid_utf8_in_url"),
        pytest.param(
            b"GET /x HTTP/1.1\r\nHost: t\r\nX-Name: \xff\xfe\xfd\r\n\r\n",
            400,
            id="invalid_utf8_in_header",
        ),
        pytest.param(
            b"GET /x HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
            400,
            id="unknown_transfer_encoding",
        ),
        pytest.param(b"BREW /x HTTP/1.1\r\n\r\n", 400, id="unknown_method"),
        pytest.param(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 400, id="tls_handshake"),
    ],
)
def test_malformed_request_gets_400_and_close_while_others_are_served(serve, raw, status):
    s, app = serve()
    with Client(s.port) as bad:
        bad.send(raw + get("/after"))  # a pipelined second request that must not run
        assert_served(s.port)
        expect_error(bad, status)
    assert ("GET", "/after") not in app.executed
    assert all(p == "/ok" for _, p in app.executed)


def test_one_mebibyte_header_gets_431_while_others_are_served(serve):
    s, app = serve(max_header_bytes=16 * 1024)
    with Client(s.port) as bad:
        # sent whole: the server drains it after answering, so no reset
        bad.send(
            b"GET /x HTTP/1.1\r\nHost: t\r\nX-Big: "
            + b"a" * (1 << 20)
            + b"\r\n\r\n"
            + get("/after")
        )
        assert_served(s.port)
        r = expect_error(bad, 431)
        assert "16384" in r.json()["error"]["message"]
    assert [p for _, p in app.executed] == ["/ok"]


def test_many_small_headers_over_the_limit_get_431(serve):
    s, _app = serve(max_header_bytes=4096)
    with Client(s.port) as bad:
        bad.send(
            b"GET /x HTTP/1.1\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(1000)) + b"\r\n"
        )
        assert_served(s.port)
        expect_error(bad, 431)


def test_long_url_gets_414(serve):
    s, _app = serve(max_header_bytes=4096)
    with Client(s.port) as bad:
        bad.send(b"GET /" + b"u" * 5000 + b" HTTP/1.1\r\n\r\n")
        assert_served(s.port)
        expect_error(bad, 414)


def test_body_over_the_limit_by_content_length_gets_413_without_reading_it(serve):
    s, app = serve(max_body_bytes=1024)
    with Client(s.port) as bad:
        bad.send(post("/x", b"b" * 300_000) + get("/after"))
        assert_served(s.port)
        expect_error(bad, 413)
    assert [p for _, p in app.executed] == ["/ok"]


def test_chunked_body_over_the_limit_gets_413(serve):
    s, app = serve(max_body_bytes=1024)
    with Client(s.port) as bad:
        chunk = b"400\r\n" + b"c" * 1024 + b"\r\n"
        bad.send(
            b"POST /x HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 3 + b"0\r\n\r\n"
        )
        assert_served(s.port)
        expect_error(bad, 413)
    assert [p for _, p in app.executed] == ["/ok"]


def test_head_sent_one_byte_at_a_time_gets_408_after_the_header_timeout(serve):
    s, app = serve(header_timeout=0.5)
    head = b"GET /slowloris HTTP/1.1\r\nHost: t\r\nX-Padding: " + b"p" * 100 + b"\r\n\r\n"
    with Client(s.port) as bad:
        t0 = time.monotonic()
        deadline = t0 + 5
        sent = 0
        # one byte, then wait up to 0.1 s for an answer; stop when one comes
        while time.monotonic() < deadline:
            bad.send(head[sent : sent + 1])
            sent += 1
            if select.select([bad.sock], [], [], 0.1)[0]:
                break
            if sent == 3:
                assert_served(s.port)  # others are served during the trickle
        assert sent < len(head), "the whole head went through before the timeout"
        expect_error(bad, 408)
        assert time.monotonic() - t0 >= 0.45
    assert [p for _, p in app.executed] == ["/ok"]


def test_body_that_stops_arriving_gets_408_after_the_body_timeout(serve):
    s, app = serve(body_timeout=0.4)
    with Client(s.port) as bad:
        bad.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly part")
        assert_served(s.port)
        expect_error(bad, 408)
    assert [p for _, p in app.executed] == ["/ok"]


def test_pipelined_request_after_a_bad_one_is_never_executed(serve):
    s, app = serve()
    with Client(s.port) as bad:
        bad.send(
            b"GET /bad HTTP/1.1\r\nbroken header\r\n\r\n" + post("/second", b"{}") + get("/third")
        )
        assert_served(s.port)
        expect_error(bad, 400)
        assert bad.buf == b""  # exactly one answer
    assert [p for _, p in app.executed] == ["/ok"]


def test_bad_request_pipelined_behind_good_ones_is_answered_after_them(serve):
    s, app = serve()
    with Client(s.port) as c:
        c.send(
            get("/slow?0.2")
            + get("/ok2")
            + b"GET /bad HTTP/1.1\r\nContent-Length: x\r\n\r\n"
            + get("/never")
        )
        assert c.response().json()["path"] == "/slow"
        assert c.response().json()["path"] == "/ok2"
        expect_error(c, 400)
    assert [p for _, p in app.executed] == ["/slow", "/ok2"]


def test_connection_over_max_connections_gets_503_and_close(lt):
    # both open connections are being answered, so neither can be shed
    # (idle ones would be: tests/test_http_hardening.py)
    gate = lt.call(asyncio.Event)
    executed = []

    async def handler(conn, req):
        executed.append(req.path)
        if req.path == b"/busy":
            await gate.wait()
        conn.send_json(req, 200, {"path": req.path.decode()})

    s = http_server(lt, handler, HttpLimits(max_connections=2))
    try:
        with Client(s.port) as a:
            a.send(get("/busy"))
            wait_for(lambda: len(executed) == 1, 5, what="the first request being answered")
            b = Client(s.port)
            b.send(get("/busy"))
            wait_for(lambda: len(executed) == 2, 5, what="both requests being answered")
            with Client(s.port) as third:
                third.send(get("/third"))
                r = expect_error(third, 503)
                assert r.one("retry-after") == "1"
            lt.call(gate.set)
            for c in (a, b):
                assert c.response().status == 200
            a.send(get("/still"))  # the open ones keep working
            assert a.response().status == 200
            b.close()
        wait_for(lambda: s.lt.call(lambda: s.limits.open_connections) == 0, 5, what="all closed")
        assert b"/third" not in executed
    finally:
        s.close()


def test_slow_reader_is_cut_off_after_the_send_timeout(lt):
    big = b"x" * (8 << 20)

    async def handler(conn, req):
        conn.send_response(req, 200, big, b"application/octet-stream")

    s = http_server(lt, handler, HttpLimits(send_timeout=0.3))
    try:
        with Client(s.port, rcvbuf=4096) as c:
            c.send(get("/big"))
            wait_for(
                lambda: s.lt.call(lambda: s.limits.open_connections) == 0,
                5,
                what="slow reader cut off",
            )
    finally:
        s.close()


# ---------------------------------------------------------------------------
# forwarding: a proxy (HttpConnection + UpstreamPool) in front of a replica


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


def test_pooled_upstream_connection_is_reused(proxied):
    ps, _proxy, replica = proxied
    with Client(ps.port) as c:
        for i in range(5):
            c.send(get(f"/r{i}"))
            assert c.response().json()["n"] == i + 1  # the same replica connection
    with Client(ps.port) as c:
        c.send(get("/again"))
        assert c.response().json()["n"] == 6
    assert replica.server.made == 1


def test_upstream_connection_closed_by_replica_is_not_reused(proxied):
    ps, proxy, replica = proxied
    with Client(ps.port) as c:
        c.send(get("/ok-close"))
        assert c.response().json()["n"] == 1
        c.send(get("/next"))
        assert c.response().json()["n"] == 1
    assert replica.server.made == 2
    wait_for(lambda: len(proxy.exchanges) == 2, 5, what="exchanges recorded")
    assert not any(ex.retried for ex in proxy.exchanges)


def test_stale_pooled_connection_is_retried_once_on_a_fresh_one(proxied):
    ps, proxy, replica = proxied
    with Client(ps.port) as c:
        c.send(get("/close-on-reuse"))
        assert c.response().status == 200
        c.send(get("/close-on-reuse"))
        r = c.response()
        assert r.status == 200 and r.json()["n"] == 1  # answered on a new connection
    assert replica.server.made == 2
    # the handler records the exchange just after the client got its answer
    wait_for(lambda: len(proxy.exchanges) == 2, 5, what="second exchange recorded")
    assert proxy.exchanges[-1].retried


def test_bytes_after_a_response_never_reach_the_next_request(proxied):
    ps, proxy, replica = proxied
    with Client(ps.port) as c:
        c.send(get("/junk") + get("/next"))  # pipelined: the next one is ready at once
        first, second = c.response(), c.response()
    assert first.status == 200 and first.body == b"ok"
    assert second.status == 200 and second.json()["path"] == "/next"
    assert replica.server.made == 2  # the confused connection was not reused
    wait_for(lambda: len(proxy.exchanges) == 2, 5, what="exchanges recorded")
    assert [ex.status for ex in proxy.exchanges] == [200, 200]


def test_replica_that_dies_before_answering_gives_502(proxied):
    ps, _proxy, _replica = proxied
    with Client(ps.port) as c:
        c.send(get("/die", "X-Request-Id: dying\r\n"))
        r = c.response()
        assert r.status == 502 and r.one("x-request-id") == "dying"
        assert r.json()["error"]["type"] == "server_error"
        c.send(get("/after"))  # the client connection is fine
        assert c.response().status == 200


def test_hop_by_hop_headers_are_dropped_both_ways_and_request_id_forwarded(proxied):
    ps, _proxy, _replica = proxied
    with Client(ps.port) as c:
        c.send(
            get(
                "/headers",
                "Connection: keep-alive, X-Secret\r\nX-Secret: 1\r\nKeep-Alive: 5\r\nTE: trailers\r\n"
                "Proxy-Authorization: basic x\r\nX-Request-Id: rid-7\r\nX-Kept: yes\r\n",
            )
        )
        r = c.response()
    got = r.json()
    for name in ("connection", "x-secret", "keep-alive", "te", "proxy-authorization"):
        assert name not in got, name
    assert got["x-kept"] == "yes" and got["x-request-id"] == "rid-7"
    assert r.one("x-request-id") == "rid-7"
    for name in ("x-internal", "keep-alive", "connection"):
        assert r.get(name) == [], name


def test_generated_request_id_reaches_the_replica(proxied):
    ps, _proxy, _replica = proxied
    with Client(ps.port) as c:
        c.send(get("/headers"))
        r = c.response()
    assert r.json()["x-request-id"] == r.one("x-request-id")
    assert len(r.one("x-request-id")) == 16


def test_head_through_the_proxy_does_not_wait_for_a_body(proxied):
    ps, _proxy, replica = proxied
    with Client(ps.port) as c:
        c.send(b"HEAD /h HTTP/1.1\r\nHost: t\r\n\r\n")
        r = c.response(head=True, timeout=3)
        assert r.status == 200 and int(r.one("content-length")) > 0
        c.send(get("/after"))
        assert c.response().json()["n"] == 2  # same upstream connection, still in step
    assert replica.server.made == 1


def test_slow_client_pauses_the_replica_and_proxy_memory_stays_bounded(proxied):
    ps, proxy, _replica = proxied
    lt = proxy.lt
    mb = 8
    stop = threading.Event()

    def sample():  # in the loop: the proxy's buffers towards its clients
        for conn in ps.conns:
            t = conn.transport
            if t is not None and not t.is_closing():
                proxy.max_buffer = max(proxy.max_buffer, t.get_write_buffer_size())
                proxy.saw_paused |= conn.write_paused
        if not stop.is_set():
            lt.loop.call_later(0.002, sample)

    def shrink_socket_buffers():
        for conn in ps.conns:  # a small kernel buffer so the proxy sees the slow reader
            conn.transport.get_extra_info("socket").setsockopt(
                socket.SOL_SOCKET, socket.SO_SNDBUF, 32768
            )

    with Client(ps.port, rcvbuf=32768, timeout=20) as c:
        c.send(get("/local"))
        c.response()
        lt.call(shrink_socket_buffers)
        lt.call(sample)
        c.send(get(f"/big?{mb}"))
        # a slow start: wait until the proxy is paused by this client
        wait_for(lambda: proxy.saw_paused, 10, what="proxy paused writing to the slow client")
        r = c.response(timeout=30)
    stop.set()
    assert r.status == 200
    assert len(r.body) == mb << 20
    assert r.body[:512] == bytes(range(256)) * 2 and r.body[-256:] == bytes(range(256))
    assert proxy.max_buffer < 1 << 20, proxy.max_buffer
    wait_for(lambda: len(proxy.exchanges) == 1, 5, what="exchange recorded")
    assert proxy.exchanges[-1].bytes_out == mb << 20


def test_client_that_disconnects_while_waiting_ends_the_upstream_request(proxied):
    ps, _proxy, replica = proxied
    c = Client(ps.port)
    c.send(get("/hold"))
    wait_for(
        lambda: any(r.path == b"/hold" for r in replica.seen), 5, what="request at the replica"
    )
    c.close()
    assert replica.gone.wait(5), "the replica never saw its connection close"


def test_client_that_disconnects_mid_stream_ends_the_upstream_request(proxied):
    ps, _proxy, replica = proxied
    c = Client(ps.port)
    c.send(get("/hold?stream"))
    deadline = time.monotonic() + 5
    while b"data: tick" not in c.buf:
        assert c._fill(deadline)
    c.close()
    assert replica.gone.wait(5), "the replica never saw its connection close"


def test_replica_dying_mid_stream_ends_the_client_stream_with_an_error_event(proxied):
    ps, _proxy, _replica = proxied
    with Client(ps.port) as c:
        c.send(get("/sse-then-die"))
        raw = c.read_until_eof(timeout=5)
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
    assert b'data: {"n": 1}' in body and b'data: {"n": 2}' in body
    events = [line for line in body.split(b"\r\n") if line.startswith(b'data: {"error"')]
    assert len(events) == 1
    assert json.loads(events[0][6:])["error"]["code"] == "replica_died"
    assert not body.endswith(b"0\r\n\r\n"), "a dead replica must not look like a clean end"


def test_backend_unreachable_gives_502(lt):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]
    proxy = Proxy(lt, dead_port)
    proxy.pool = lt.call(lambda: UpstreamPool(lt.loop))
    ps = http_server(lt, proxy.handle, HttpLimits())
    try:
        with Client(ps.port) as c:
            c.send(get("/x"))
            r = c.response()
            assert r.status == 502 and "cannot connect" in r.json()["error"]["message"]
    finally:
        ps.close()


def test_remote_upstreams_on_one_port_never_share_a_pooled_connection(lt):
    # two "remote" replicas on the same port of different loopback addresses
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        port = probe.getsockname()[1]

    def named(name):
        async def handle(conn, req):
            conn.send_json(req, 200, {"replica": name})

        return handle

    a = http_server(lt, named("a"), HttpLimits(), "127.0.0.2", port)
    b = http_server(lt, named("b"), HttpLimits(), "127.0.0.3", port)
    pool = lt.call(lambda: UpstreamPool(lt.loop))

    async def handle(conn, req):
        host = req.query.decode()
        data = request_head(req, port, 0, host=host.encode())
        try:
            await pool.forward(port, conn, req, data, host)
        except UpstreamError as e:
            conn.send_error(req, 502, str(e))

    ps = http_server(lt, handle, HttpLimits())
    try:
        with Client(ps.port) as c:
            for host in ["127.0.0.2", "127.0.0.3"] * 3:
                c.send(get(f"/x?{host}"))
                assert c.response().json()["replica"] == {"127.0.0.2": "a", "127.0.0.3": "b"}[host]
        assert (a.made, b.made) == (1, 1)  # each pooled and reused
    finally:
        ps.close()
        lt.call(pool.close)
        a.close()
        b.close()


# ---------------------------------------------------------------------------
# the fast hook: requests taken from the parser callback, without a task


def test_fast_hook_takes_requests_and_hands_back_the_rest(lt):
    handled: list[bytes] = []

    async def handler(conn, req):
        handled.append(req.path)
        conn.send_json(req, 200, {"by": "task", "path": req.path.decode()})

    def fast(conn, req):
        if req.path == b"/fast":
            conn.send_json(req, 200, {"by": "fast"})
            return True
        if req.path == b"/later":  # taken, then handed back (a failed forward)
            conn.loop.call_soon(conn.run_handler, req)
            return True
        if req.path == b"/boom":
            raise RuntimeError("a bug before anything was sent")
        if req.path == b"/boom-after":
            req.on_disconnect = lambda: None  # what Upstream.send sets before writing
            raise RuntimeError("a bug after the request may have gone upstream")
        return False

    s = http_server(lt, handler, HttpLimits(), fast=fast)
    try:
        with Client(s.port) as c:
            # pipelined: answered in order whichever path takes each
            c.send(get("/fast") + get("/slow") + get("/later") + get("/fast") + get("/boom"))
            got = [c.response().json() for _ in range(5)]
        assert [g["by"] for g in got] == ["fast", "task", "task", "fast", "task"]
        assert handled == [b"/slow", b"/later", b"/boom"]
        with Client(s.port) as c:
            c.send(get("/boom-after"))
            assert c.read_until_eof(timeout=5) == b""  # closed, never answered twice
        assert handled == [b"/slow", b"/later", b"/boom"]
    finally:
        s.close()
