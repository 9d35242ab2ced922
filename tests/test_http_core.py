"""The HTTP/1.1 core (http1/): its behaviour and its answers to bad input,
served by real uvloop servers in a background thread and driven by plain
blocking sockets (the harness: tests/http_harness.py; forwarding:
tests/test_http_forwarding.py).
"""

from __future__ import annotations

import argparse
import asyncio
import select
import time

import pytest
from conftest import wait_for
from ggmux.http1 import (
    HttpLimits,
    add_http_limit_options,
    fit_fd_limit,
    http_limit_argv,
    limits_from_args,
)
from http_harness import (  # noqa: F401 (fixtures: lt, serve)
    App,
    Client,
    LoopThread,
    Response,
    assert_served,
    expect_error,
    get,
    http_server,
    lt,
    post,
    serve,
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
