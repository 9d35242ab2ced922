"""How a relayed stream ends when its replica or the proxy stops (issue 18,
finding 11): exactly one error event, and "the server is stopping" with
one code, ``shutting_down``, whichever path ends the stream.

The relay runs on the harness of tests/test_http_core.py (a replica and a
proxy of :class:`~ggmux.http1.upstream.Upstream` on real sockets in a
loop thread); the first finding is also reproduced end to end on a fake
model that is unloaded mid-stream.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import chat_body, open_stream, wait_for
from ggmux.http1 import HttpConnection, HttpLimits, Request
from ggmux.http1.pool import UpstreamPool
from http_harness import Client, LoopThread, Proxy, get, http_server

STOPPING = "the server is stopping"
INSTANCE_STOPPING = (b'data: {"error":{"message":"the instance is stopping",'
                     b'"type":"server_error","code":503}}\n\n')


@pytest.fixture(scope="module")
def lt():
    t = LoopThread()
    yield t
    t.stop()


class Replica:
    """Streams that end the ways an instance's do."""

    def __init__(self) -> None:
        self.streaming = asyncio.Event()

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        conn.start_stream(req)
        conn.send_chunk(b'data: {"n": 1}\n\n')
        if req.path == b"/error-then-close":  # the built-in instance stopping mid-stream
            conn.send_chunk(INSTANCE_STOPPING)
        elif req.path == b"/split-error-then-close":  # the same event in two reads
            conn.send_chunk(INSTANCE_STOPPING[:9])
            await asyncio.sleep(0.05)
            conn.send_chunk(INSTANCE_STOPPING[9:])
        elif req.path == b"/hold":  # until the proxy ends it
            self.streaming.set()
            while not req.disconnected:
                await asyncio.sleep(0.02)
            conn.finish(req)
            return
        await asyncio.sleep(0.05)
        conn.close()  # no terminating chunk, as the instance does after an error event


@pytest.fixture
def relay(lt):
    """``(proxy port, Proxy, Replica)``; closed after the test."""
    replica = Replica()
    rs = http_server(lt, replica.handle, HttpLimits())
    proxy = Proxy(lt, rs.port)
    proxy.pool = lt.call(lambda: UpstreamPool(lt.loop))
    ps = http_server(lt, proxy.handle, HttpLimits())
    yield ps.port, proxy, replica
    ps.close()
    lt.call(proxy.pool.close)
    rs.close()
    for s in (ps, rs):
        wait_for(lambda s=s: lt.call(lambda: s.limits.open_connections) == 0, 5,
                 what="connections closed")


def error_events(raw: bytes) -> list[dict]:
    """The SSE error events of a chunked answer that may be cut short."""
    rest, body = raw.partition(b"\r\n\r\n")[2], b""
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        body, rest = body + rest[:n], rest[n + 2:]
    return [json.loads(ev[6:]) for ev in body.split(b"\n\n")
            if ev.startswith(b'data: {"error"')]


def test_a_replica_that_ends_its_stream_with_an_error_event_gets_no_second_one(relay):
    port, _proxy, _replica = relay
    for path in ("/error-then-close", "/split-error-then-close"):
        with Client(port) as c:
            c.send(get(path))
            raw = c.read_until_eof(timeout=5)
        assert raw.startswith(b"HTTP/1.1 200"), raw
        # the instance's event alone: no "replica closed the connection" after it
        events = error_events(raw)
        assert [e["error"]["message"] for e in events] == ["the instance is stopping"], raw
        assert not raw.endswith(b"0\r\n\r\n"), "a cut stream must not look like a clean end"


def test_a_stream_the_stopping_proxy_ends_says_shutting_down(lt, relay):
    port, proxy, replica = relay
    with Client(port) as c:
        c.send(get("/hold"))
        wait_for(replica.streaming.is_set, 5, what="the stream to start")

        def stop() -> int:
            proxy.pool.closing = STOPPING
            return proxy.pool.abort_all(STOPPING)

        assert lt.call(stop) == 1
        raw = c.read_until_eof(timeout=5)
    events = error_events(raw)
    assert len(events) == 1, raw
    assert events[0]["error"]["message"] == STOPPING
    assert events[0]["error"]["code"] == "shutting_down"


def test_a_replica_that_goes_with_the_stopping_server_says_shutting_down(lt, relay):
    port, proxy, _replica = relay
    lt.call(lambda: setattr(proxy.pool, "closing", STOPPING))
    with Client(port) as c:
        c.send(get("/cut"))  # {"n": 1}, then the replica's connection closes
        raw = c.read_until_eof(timeout=5)
    events = error_events(raw)
    assert len(events) == 1, raw
    assert events[0]["error"]["code"] == "shutting_down", events


def test_an_unload_mid_stream_gives_the_openai_stream_one_error_event(serve, fakes):
    """The finding's reproduction: a chat stream on a fake model, the model
    unloaded under it; the instance ends the stream with 'the instance is
    stopping' and the proxy adds nothing after it."""
    fakes.add("m", tokens=400, ttft_s=0.01, token_s=0.02)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--stop-timeout", "1")
    sock = open_stream(s.port, chat_body("m", stream=True), timeout=30)
    try:
        raw = b""
        while raw.count(b"data: ") < 3:
            raw += sock.recv(65536)
        assert s.request("POST", "/models/unload", {"model": "m"})[0] == 200
        while chunk := sock.recv(65536):
            raw += chunk
    finally:
        sock.close()
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    errors = [line for line in raw.split(b"\n") if line.startswith(b'data: {"error"')]
    assert len(errors) == 1, errors
    assert b"the instance is stopping" in errors[0]
    assert b"[DONE]" not in raw
