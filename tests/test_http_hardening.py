"""Hardening of the HTTP core (issue 11, findings 8, 10 and 11): chunked
trailers are not headers, idle connections cannot lock clients out, and
RFC 9112's edges (chunk sizes, versions, Host, absolute-form targets).

Most tests run the core on real sockets in a loop thread (the harness of
tests/test_http_core.py); where the point is a read boundary the kernel
would choose, the connection is fed its reads directly. The reproductions
of the issue run through ``ggmux serve`` with a fake model.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from conftest import chat_body, wait_for
from ggmux.http1 import HttpConnection, HttpLimits
from ggmux.http1.connections import ConnectionRegistry
from ggmux.http1.limits import proxy_share
from http_harness import App, Client, LoopThread, expect_error, get, http_server

CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.stop()


@pytest.fixture
def serve_core(lt):
    """``serve_core(handler=None, **limits) -> Served``: an HttpConnection
    server (the echo App unless ``handler``); closed after the test, which
    fails if a connection stays counted."""
    started = []

    def start(handler=None, **limits):
        app = App()
        s = http_server(lt, handler or app.handle, HttpLimits(**limits))
        s.app = app
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()
        wait_for(lambda s=s: s.lt.call(lambda: s.limits.open_connections) == 0, 5,
                 what="connections closed")


def headers_app():
    """A handler that answers with the headers it was given."""

    async def handle(conn, req):
        conn.send_json(req, 200, {"headers": [[k.decode(), v.decode()] for k, v in req.headers],
                                  "body": bytes(req.body).decode()})

    return handle


def chunked(path: str, chunks: list[bytes], trailers: str = "", headers: str = "") -> bytes:
    body = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks)
    return (f"POST {path} HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n{headers}\r\n"
            .encode() + body + b"0\r\n" + trailers.encode() + b"\r\n")


def connect_from(port: int, source: str, timeout: float = 5.0) -> socket.socket:
    """A connection to 127.0.0.1:``port`` from the loopback address ``source``
    (every 127.0.0.0/8 address is local on Linux: another "client address")."""
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((source, 0))
    s.connect(("127.0.0.1", port))
    return s


def closed_by_server(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the server closes ``sock`` (EOF or reset) within ``timeout``."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


# ---------------------------------------------------------------------------
# finding 8: chunked trailers are not headers


def test_chunked_trailer_fields_never_reach_the_handler(serve_core):
    s = serve_core(headers_app())
    with Client(s.port) as c:
        c.send(chunked("/t", [b"ab", b"cd"], "X-Api-Key: junk\r\nAuthorization: Bearer k\r\n",
                       "X-Kept: 1\r\n"))
        r = c.response()
        assert r.status == 200
        doc = r.json()
        names = [k for k, _ in doc["headers"]]
        assert "x-kept" in names
        assert "x-api-key" not in names and "authorization" not in names
        assert doc["body"] == "abcd"
        c.send(get("/next"))  # the connection is still in step
        assert c.response().status == 200


def test_a_trailer_section_over_the_header_limit_gets_431(serve_core):
    s = serve_core(headers_app(), max_header_bytes=2048)
    with Client(s.port) as c:
        c.send(chunked("/t", [b"ab"], "".join(f"X-T{i}: {'v' * 100}\r\n" for i in range(40))))
        expect_error(c, 431)


def _chunked_chat(port: int, model: str, headers: str, trailers: str):
    body = json.dumps(chat_body(model)).encode()
    with Client(port, timeout=30) as c:
        c.send(chunked(CHAT, [body[:10], body[10:]], trailers,
                       f"Content-Type: application/json\r\n{headers}"))
        return c.response()


def test_a_key_only_in_a_chunked_trailer_neither_authenticates_nor_rejects(serve, fakes):
    # issue 11, finding 8: a trailer `Authorization` authenticated, and a
    # trailer `x-api-key: junk` rejected a request whose header key was valid
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--api-key", "sk-right")
    r = _chunked_chat(s.port, "m", "Authorization: Bearer sk-right\r\n", "x-api-key: junk\r\n")
    assert r.status == 200, r.body
    r = _chunked_chat(s.port, "m", "", "Authorization: Bearer sk-right\r\n")
    assert r.status == 401, r.body
    r = _chunked_chat(s.port, "m", "", "x-api-key: sk-right\r\n")
    assert r.status == 401, r.body


# ---------------------------------------------------------------------------
# finding 10: idle connections cannot lock clients out


def test_idle_connections_are_shed_oldest_first_and_new_clients_are_served(lt, serve_core):
    gate = lt.call(asyncio.Event)
    started = []

    async def handler(conn, req):
        started.append(req.path)
        if req.path == b"/busy":
            await gate.wait()
        conn.send_json(req, 200, {"path": req.path.decode()})

    s = serve_core(handler, max_connections=20, max_connections_per_ip=0)
    idle: list[socket.socket] = []
    busy = Client(s.port)
    try:
        busy.send(get("/busy"))  # being answered: never shed
        wait_for(lambda: started, 5, what="the busy request to start")
        for i in range(60):
            sock = connect_from(s.port, "127.0.0.2")
            if i % 3 == 0:
                sock.sendall(b"GET /never-finished HTTP/1.1\r\nHost: t\r\n")  # no whole head
            elif i % 3 == 1:
                sock.sendall(get("/kept-alive"))  # answered, then idle
            idle.append(sock)
        for i in range(30):
            with Client(s.port) as c:
                c.send(get(f"/n{i}"))
                r = c.response()
                assert r.status == 200, r
        open_now = s.lt.call(lambda: s.limits.open_connections)
        assert open_now <= 20 * 0.8 + 1, open_now
        assert closed_by_server(idle[0]) and closed_by_server(idle[1])  # the oldest went
        lt.call(gate.set)
        r = busy.response()
        assert r.status == 200 and r.json()["path"] == "/busy"
        assert s.lt.call(lambda: s.limits.connections.shed) >= 60 - 16
    finally:
        busy.close()
        for sock in idle:
            sock.close()


def test_connections_over_the_per_address_cap_get_429_and_other_addresses_are_served(serve_core):
    s = serve_core(max_connections_per_ip=3)
    held = [connect_from(s.port, "127.0.0.2") for _ in range(3)]
    try:
        for sock in held:
            sock.sendall(get("/hold"))  # being answered: not sheddable
        wait_for(lambda: s.app.executed.count(("GET", "/hold")) == 3,
                 5, what="three busy connections from 127.0.0.2")
        fourth = connect_from(s.port, "127.0.0.2")
        try:
            fourth.sendall(get("/over"))
            data = b""
            while b"\r\n\r\n" not in data:
                data += fourth.recv(4096)
            assert data.startswith(b"HTTP/1.1 429 "), data
            assert b"retry-after: 1\r\n" in data and b"connection: close\r\n" in data
        finally:
            fourth.close()
        with Client(s.port) as c:  # 127.0.0.1: its own count
            c.send(get("/other"))
            assert c.response().status == 200
    finally:
        for sock in held:
            sock.close()
    assert ("GET", "/over") not in s.app.executed


def test_an_address_at_its_cap_sheds_its_own_oldest_idle_connection_first(serve_core):
    """Issue 18, finding 11: idle connections of one address (a client
    behind the same reverse proxy, holding many) are closed oldest first
    for a new connection of that address, which is served; the busy one
    and other addresses' idle ones stay."""
    s = serve_core(max_connections_per_ip=4)
    other = connect_from(s.port, "127.0.0.3")  # another address, idle: never this cap's
    busy = connect_from(s.port, "127.0.0.2")
    busy.sendall(get("/hold"))
    wait_for(lambda: ("GET", "/hold") in s.app.executed, 5, what="the busy request")
    idle, fresh = [], []
    for i in range(3):
        sock = connect_from(s.port, "127.0.0.2")
        if i == 1:  # answered, then idle between keep-alive requests
            sock.sendall(get("/kept-alive"))
            data = b""
            while not data.endswith(b"}"):  # the whole answer: idle since
                data += sock.recv(4096)
        idle.append(sock)
    try:
        for i in range(3):  # each new one from 127.0.0.2 takes the place of the oldest idle
            new = connect_from(s.port, "127.0.0.2")  # kept open: the cap stays full
            fresh.append(new)
            new.sendall(get(f"/new{i}"))
            data = b""
            while not data.endswith(b"}"):
                data += new.recv(4096)
            assert data.startswith(b"HTTP/1.1 200 "), data
            assert closed_by_server(idle[i]), i
        assert s.lt.call(lambda: s.limits.connections.shed) >= 3
        assert not closed_by_server(other, 0.3)
        busy.close()
        wait_for(lambda: s.app.disconnected.is_set(), 5, what="the busy request to end")
    finally:
        for sock in (other, busy, *idle, *fresh):
            sock.close()


def test_each_proxy_allows_its_share_of_the_per_address_cap():
    lim = HttpLimits(max_connections_per_ip=1000)
    assert proxy_share(lim, 3).max_connections_per_ip == 334
    assert proxy_share(lim, 1).max_connections_per_ip == 1000
    assert proxy_share(HttpLimits(max_connections_per_ip=0), 4).max_connections_per_ip == 0
    assert lim.max_connections_per_ip == 1000  # a copy


def test_the_registry_sheds_lingering_connections_before_idle_ones():
    shed = []

    class Conn:
        def __init__(self, name):
            self.name = name
            self.sheddable = True

        def shed(self):
            shed.append(self.name)
            reg.leave(self, None)

    reg = ConnectionRegistry()
    conns = {n: Conn(n) for n in ("old-idle", "new-idle", "lingering")}
    for c in conns.values():
        assert reg.admit(None, 10, 0, 2) == 0
    reg.sheddable[conns["old-idle"]] = None
    reg.sheddable[conns["new-idle"]] = None
    reg.sheddable[conns["lingering"]] = None
    reg.sheddable.move_to_end(conns["lingering"], last=False)
    busy = Conn("became-busy")  # a stale entry: its flag was cleared
    busy.sheddable = False
    reg.sheddable[busy] = None
    reg.sheddable.move_to_end(busy, last=False)
    # above 2 open: each new connection closes one
    for _ in range(3):
        assert reg.admit(None, 10, 0, 2) == 0
    assert shed == ["lingering", "old-idle", "new-idle"]
    assert busy not in reg.sheddable and not reg.shed_one()
    assert reg.count == 3


def test_an_idle_connection_flood_does_not_lock_clients_out_of_ggmux(serve, fakes):
    # issue 11, finding 10: connections that send nothing filled every slot
    # and a normal client got 503 for as long as they stayed
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--max-connections", "40")
    flood = []
    try:
        for _ in range(120):
            flood.append(connect_from(s.port, "127.0.0.2"))
        statuses = [s.request("POST", CHAT, chat_body("m"))[0] for _ in range(20)]
        assert statuses == [200] * 20, statuses
    finally:
        for sock in flood:
            sock.close()


# ---------------------------------------------------------------------------
# finding 11: HTTP edges (RFC 9112)


class Transport(asyncio.Transport):
    """Records what a connection writes; reads are fed by the test."""

    def __init__(self):
        super().__init__()
        self.out = bytearray()
        self.closing = False

    def write(self, data):
        self.out += data

    def writelines(self, lines):
        for x in lines:
            self.out += x

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def abort(self):
        self.closing = True

    def can_write_eof(self):
        return True

    def write_eof(self):
        self.closing = True

    def get_write_buffer_size(self):
        return 0

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


@pytest.fixture
def fed():
    """``fed(**limits) -> (connection, transport, loop)``: an HttpConnection
    whose reads the test gives one by one (each ``data_received`` call is
    one read, as the kernel might split them)."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    made = []

    async def handler(conn, req):
        conn.send_json(req, 200, {"body": len(req.body)})

    def make(**limits):
        conn = HttpConnection(handler, HttpLimits(**limits))
        t = Transport()
        conn.connection_made(t)
        made.append(conn)
        return conn, t, loop

    yield make
    for conn in made:
        conn.connection_lost(None)
    loop.run_until_complete(asyncio.sleep(0))
    loop.close()
    asyncio.set_event_loop(None)


HEAD = b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"


@pytest.mark.parametrize(
    "reads",
    [
        pytest.param([HEAD + b"ffffffffffffffff\r\n"], id="whole"),
        pytest.param([HEAD, b"ffffffff", b"ffffffff\r\n"], id="size_line_split"),
        pytest.param([HEAD + b"ffffffffffffffff;ext=1\r\nabc"], id="extension_and_data"),
        pytest.param([HEAD + b"4\r\nabcd\r\n", b"100000\r\nxy"], id="second_chunk"),
        pytest.param([HEAD + b"1ffffffffffffffff\r\n"], id="overflow"),
        pytest.param([HEAD + b"f" * 5000], id="overlong_size"),
    ],
)
def test_a_chunk_size_over_the_body_limit_gets_413_at_once(fed, reads):
    # issue 11, finding 11: a size of ffffffffffffffff waited body_timeout
    # (300 s) for bytes that never come
    conn, t, _loop = fed(max_body_bytes=1 << 20, body_timeout=300)
    for data in reads:
        conn.data_received(data)
    assert t.out.startswith(b"HTTP/1.1 413 "), bytes(t.out[:200])
    assert b"connection: close" in t.out and t.closing


def test_chunks_within_the_body_limit_are_read_across_reads(fed):
    conn, t, loop = fed(max_body_bytes=1 << 20)
    size = 300_000
    conn.data_received(HEAD + b"%x;name=value\r\n" % size + b"x" * 1000)
    assert not t.out  # the chunk fits: it is still being received
    for _ in range(299):
        conn.data_received(b"x" * 1000)
    conn.data_received(b"\r\n3\r\nabc\r\n0\r\nx-t: 1\r\n\r\n")
    loop.run_until_complete(asyncio.sleep(0.01))
    assert t.out.startswith(b"HTTP/1.1 200 "), bytes(t.out[:200])
    assert t.out.endswith(b'{"body":%d}' % (size + 3))


@pytest.mark.parametrize(
    "line",
    [b"GET /x HTTP/2.0", b"GET /x HTTP/0.9", b"GET /x HTTP/1.2", b"GET /x HTTP/3.0"],
)
def test_http_versions_other_than_1_0_and_1_1_get_505(serve_core, line):
    s = serve_core()
    with Client(s.port) as c:
        c.send(line + b"\r\nHost: t\r\n\r\n")
        expect_error(c, 505)
    assert not s.app.executed


def test_an_http_0_9_simple_request_gets_505(serve_core):
    s = serve_core()
    with Client(s.port) as c:
        c.send(b"GET /\r\n\r\n")
        expect_error(c, 505)


@pytest.mark.parametrize(
    ("target", "path", "query"),
    [
        ("http://example.com/ok?a=1", "/ok", "a=1"),
        ("HTTP://example.com:8080/v1/models", "/v1/models", ""),
        ("http://example.com", "/", ""),
        ("http://example.com?x", "/", "x"),
        ("https://user@example.com/p/q", "/p/q", ""),
    ],
)
def test_absolute_form_targets_are_served_as_their_path(serve_core, target, path, query):
    s = serve_core()
    with Client(s.port) as c:
        c.send(f"GET {target} HTTP/1.1\r\nHost: other\r\n\r\n".encode())
        r = c.response()
        assert r.status == 200, r
        assert (r.json()["path"], r.json()["query"]) == (path, query)


def test_an_absolute_form_target_reaches_the_model_list_through_ggmux(serve, fakes):
    fakes.add("m")
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
    with Client(s.port) as c:
        c.send(f"GET http://127.0.0.1:{s.port}/v1/models HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        r = c.response()
        assert r.status == 200 and r.json()["data"][0]["id"] == "m"


@pytest.mark.parametrize(
    "request_bytes",
    [
        pytest.param(b"GET /x HTTP/1.1\r\n\r\n", id="missing"),
        pytest.param(b"GET /x HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n", id="twice"),
        pytest.param(b"GET /x HTTP/1.1\r\nHost: a\r\nX: 1\r\nhost: b\r\n\r\n", id="twice_apart"),
        pytest.param(b"GET /x HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n", id="twice_http10"),
    ],
)
def test_a_missing_or_repeated_host_gets_400(serve_core, request_bytes):
    s = serve_core()
    with Client(s.port) as c:
        c.send(request_bytes)
        r = expect_error(c, 400)
        assert "Host" in r.json()["error"]["message"]
    assert not s.app.executed


def test_an_http_1_0_request_needs_no_host(serve_core):
    s = serve_core()
    with Client(s.port) as c:
        c.send(b"GET /x HTTP/1.0\r\n\r\n")
        assert c.response().status == 200


def _head_at(limit: int, body: bytes) -> bytes:
    """A chat request whose head is ``limit - 8`` bytes as the proxy counts
    it (target + each header's name, value and 4 bytes), padded by one
    header: just under the proxy's --max-header-bytes."""
    fixed = [("Host", "x"), ("Content-Type", "application/json"),
             ("Content-Length", str(len(body)))]
    used = len(CHAT) + sum(len(k) + len(v) + 4 for k, v in fixed) + len("x-pad") + 4
    pad = "p" * (limit - 8 - used)
    lines = "".join(f"{k}: {v}\r\n" for k, v in [*fixed, ("x-pad", pad)])
    return f"POST {CHAT} HTTP/1.1\r\n{lines}\r\n".encode() + body


@pytest.mark.parametrize("limit", [None, 131072])
def test_a_head_the_proxy_accepts_is_never_refused_by_the_instance(serve, fakes, limit):
    # issue 11, finding 11: the proxy's forwarded head (its own Host,
    # x-request-id, content-length) could exceed what the instance accepts,
    # and the client got the instance's 431 for a head the proxy took
    fakes.add("m", tokens=2)
    args = ["--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1"]
    if limit is not None:
        args += ["--max-header-bytes", str(limit)]
    s = serve(*args)
    body = json.dumps(chat_body("m")).encode()
    with Client(s.port, timeout=30) as c:
        c.send(_head_at(limit or HttpLimits().max_header_bytes, body))
        r = c.response()
        assert r.status == 200, (r.status, r.body[:300])


# ---------------------------------------------------------------------------
# issue 31, item 7: connections that are mid-body cannot lock clients out


def _mid_body(sock: socket.socket, path: str) -> None:
    """Announce a 10^6-byte body and send 10 bytes of it (the issue's
    reproduction)."""
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: 1000000\r\n\r\n"
                 .encode() + b"0123456789")


def _head_of(sock: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_stalled_bodies_at_the_per_address_cap_are_shed_stalled_longest_first(serve_core):
    s = serve_core(max_connections_per_ip=14)
    reg = s.limits.connections
    stalled, fresh = [], []
    try:
        for i in range(14):
            sock = connect_from(s.port, "127.0.0.1")
            _mid_body(sock, f"/upload{i}")
            stalled.append(sock)
        # every one is past its head: none is idle, so none sheddable as idle
        wait_for(lambda: s.lt.call(lambda: len(reg.receiving)) == 14, 5,
                 what="14 connections receiving a body")
        stalled[0].sendall(b"more bytes")  # progress: now the last to go
        wait_for(lambda: s.lt.call(lambda: next(reversed(reg.receiving))._cur.url)
                 == b"/upload0", 5, what="the first connection's progress")
        held = Client(s.port)  # 127.0.0.1 too: at its cap, and kept busy
        fresh.append(held)
        held.send(get("/hold"))
        wait_for(lambda: ("GET", "/hold") in s.app.executed, 5, what="the held request")
        with Client(s.port) as c:  # the cap is full again
            c.send(get("/new"))
            r = c.response()
            assert r.status == 200, (r.status, r.body)
        # the shed ones were answered 408; the one that made progress stays
        for sock in stalled[1:3]:
            head = _head_of(sock)
            assert head.startswith(b"HTTP/1.1 408 "), head
        assert not closed_by_server(stalled[0], 0.3)
        assert s.lt.call(lambda: reg.shed) == 2
    finally:
        for sock in stalled:
            sock.close()
        for c in fresh:
            c.close()
    assert not any(p.startswith("/upload") for _, p in s.app.executed)


def test_a_stalled_body_gets_408_after_the_body_read_timeout(serve_core):
    s = serve_core(body_read_timeout=0.5, body_timeout=60)
    with Client(s.port) as bad:
        bad.send(b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nonly part")
        r = expect_error(bad, 408)
        assert "--body-read-timeout" in r.json()["error"]["message"]
    assert not s.app.executed


def test_a_body_arriving_slower_than_the_read_timeout_in_all_is_served(serve_core):
    # the read timeout is the gap between two reads (nginx's
    # client_body_timeout), not the time the whole body takes
    s = serve_core(body_read_timeout=1.0, body_timeout=60)
    parts = [b"x" * 10] * 16
    with Client(s.port) as c:
        c.send(b"POST /slow HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n"
               % sum(map(len, parts)))
        for part in parts:  # 1.6 s in all, a read every 0.1 s
            c.send(part)
            time.sleep(0.1)
        r = c.response()
        assert r.status == 200, (r.status, r.body)
    assert ("POST", "/slow") in s.app.executed


def test_the_registry_sheds_the_longest_stalled_body_at_the_cap_and_never_a_busy_one():
    shed = []

    class Conn:
        def __init__(self, name):
            self.name = name
            self.sheddable = False
            self.receiving = True

        def shed(self):
            shed.append(self.name)
            reg.leave(self, "a")

    reg = ConnectionRegistry()
    conns = [Conn(n) for n in ("first", "second", "answered", "busy")]
    for c in conns:
        assert reg.admit("a", 4, 0, 4) == 0
        reg.progress(c, "a")
    conns[2].receiving = False  # its body is in: being answered (a stale entry)
    conns[3].receiving = False
    reg.progress(conns[0], "a")  # bytes came: now the last to go
    assert reg.admit("b", 4, 0, 4) == 0  # at the cap: the longest stalled goes
    assert shed == ["second"]
    assert reg.admit("b", 4, 0, 4) == 0
    assert shed == ["second", "first"]
    assert reg.admit("b", 4, 0, 4) == 503  # the rest are being answered
    assert reg.count == 5  # the refused one stays counted until it closes


def test_mid_body_connections_do_not_lock_local_clients_out_of_ggmux(serve, fakes):
    # the reproduction through ggmux serve: 14 connections announcing
    # 10^6-byte bodies at a per-address cap of 14 made every other client of
    # 127.0.0.1 get 429
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--max-connections-per-ip", "14")
    stalled = []
    try:
        for i in range(14):
            sock = connect_from(s.port, "127.0.0.1")
            _mid_body(sock, CHAT)
            stalled.append(sock)
        statuses = [s.request("POST", CHAT, chat_body("m"))[0] for _ in range(5)]
        assert statuses == [200] * 5, statuses
    finally:
        for sock in stalled:
            sock.close()
