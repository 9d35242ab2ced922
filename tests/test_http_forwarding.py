"""Forwarding through the HTTP core (http1/upstream.py, http1/pool.py): a
proxy (HttpConnection + UpstreamPool) in front of a replica, and the fast
hook that takes requests from the parser callback (the harness:
tests/http_harness.py).
"""

from __future__ import annotations

import json
import socket
import threading
import time

from conftest import wait_for
from ggmux.http1 import (
    HttpLimits,
)
from ggmux.http1.exchange import UpstreamError
from ggmux.http1.heads import request_head
from ggmux.http1.pool import UpstreamPool
from http_harness import (  # noqa: F401 (fixtures: lt, proxied)
    Client,
    Proxy,
    Replica,
    get,
    http_server,
    lt,
    post,
    proxied,
)

# ---------------------------------------------------------------------------
# forwarding: a proxy (HttpConnection + UpstreamPool) in front of a replica


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
