"""How a forwarded answer ends (issue 22): the bookkeeping that a client who
saw the end must find done (the in-flight count) runs before the end leaves
the proxy, and the replica's usage line (``x-ggmux-usage``, a header or a
chunked trailer) reaches the Exchange without being relayed. The HTTP core
in-process: a replica and a proxy of ``HttpConnection`` + ``UpstreamPool``
(the harness of test_http_core.py)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest
from conftest import chat_body, wait_for
from ggmux.http1 import HttpConnection, HttpLimits, Request
from ggmux.http1.heads import request_head
from ggmux.http1.pool import UpstreamPool
from ggmux.http1.usage import USAGE_HEADER, usage_trailer
from http_harness import Client, LoopThread, get, http_server

USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 2}}


async def replica(conn: HttpConnection, req: Request) -> None:
    if req.path == b"/stream":
        conn.start_stream(req)
        for i in range(3):
            conn.send_chunk(b'data: {"n": %d}\n\n' % i)
            await asyncio.sleep(0.005)
        conn.send_chunk(b"data: [DONE]\n\n")
        conn.end_stream(req, usage_trailer(USAGE))
    else:
        conn.send_json(req, 200, {"answer": "whole", "end": True},
                       headers=[(USAGE_HEADER, b"7 2 3")])


class Recording:
    """A client transport that records what the proxy wrote to it."""

    def __init__(self, transport) -> None:
        self._t = transport
        self.out = bytearray()

    def write(self, data) -> None:
        self.out += data
        self._t.write(data)

    def writelines(self, parts) -> None:
        for p in parts:
            self.write(p)

    def __getattr__(self, name):
        return getattr(self._t, name)


class EndingProxy:
    """Forwards every request; ``on_end`` notes what the client had been
    sent by then."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.pool: UpstreamPool | None = None
        self.at_end: list[bytes] = []
        self.exchanges = []
        self.sent: list[bytes] = []

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        rec = Recording(conn.transport)
        conn.transport = rec
        data = request_head(req, self.port, 0)
        ex = await self.pool.forward(self.port, conn, req, data,
                                     on_end=lambda ex: self.at_end.append(bytes(rec.out)))
        self.exchanges.append(ex)
        self.sent.append(bytes(rec.out))


@pytest.fixture
def setup():
    lt = LoopThread()
    rs = http_server(lt, replica, HttpLimits())
    proxy = EndingProxy(rs.port)
    proxy.pool = lt.call(lambda: UpstreamPool(lt.loop))
    ps = http_server(lt, proxy.handle, HttpLimits())
    yield ps, proxy
    ps.close()
    lt.call(proxy.pool.close)
    rs.close()
    for s in (ps, rs):
        wait_for(lambda s=s: lt.call(lambda: s.limits.open_connections) == 0, 5,
                 what="connections closed")
    lt.stop()


def test_on_end_runs_before_the_end_of_the_answer_leaves(setup):
    ps, proxy = setup
    with Client(ps.port) as c:
        c.send(get("/stream"))
        r = c.response()
        assert r.status == 200 and b"[DONE]" in r.body
        c.send(get("/json"))
        assert c.response().json() == {"answer": "whole", "end": True}
    wait_for(lambda: len(proxy.sent) == 2, 5, what="both exchanges over")
    stream_then, json_then = proxy.at_end
    # a stream's last chunk, a whole answer's body: not yet sent when on_end ran
    # (looked for in the body: the head ends with CRLF CRLF after a request
    # id that may end with a 0)
    body_then = stream_then.partition(b"\r\n\r\n")[2]
    assert b"0\r\n\r\n" not in body_then and proxy.sent[0].endswith(b"0\r\n\r\n")
    assert b'"end":true' not in json_then and proxy.sent[1].endswith(b'"end":true}')


def test_the_usage_line_reaches_the_exchange_and_never_the_client(setup):
    ps, proxy = setup
    with Client(ps.port) as c:
        c.send(get("/stream"))
        stream = c.response()
        c.send(get("/json"))
        whole = c.response()
    wait_for(lambda: len(proxy.exchanges) == 2, 5, what="both exchanges over")
    ex_stream, ex_json = proxy.exchanges
    assert ex_stream.usage == b"7 2 3" and ex_json.usage == b"7 2 3"  # trailer, header
    assert ex_stream.sse and ex_stream.events == 4 and ex_stream.tail.endswith(b"[DONE]\n\n")
    assert not ex_json.sse and ex_json.tail.endswith(b'"end":true}')
    for r, raw in ((stream, proxy.sent[0]), (whole, proxy.sent[1])):
        assert r.get(USAGE_HEADER.decode()) == []
        assert USAGE_HEADER not in raw.lower()


def test_in_flight_is_zero_for_a_client_that_saw_its_stream_end(serve, fakes):
    """End to end: ``GET /ps`` (any proxy) and ``ggmux ps`` right after a
    stream's last byte never count it in flight (issue 22 item 9: on a busy
    host the count lagged the end)."""
    fakes.add("alpha", tokens=6, token_s=0.002)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    for _ in range(20):
        status, _, body = s.request("POST", "/v1/chat/completions",
                                    chat_body("alpha", stream=True))
        assert status == 200 and body.endswith(b"data: [DONE]\n\n")
        ps = s.json("GET", "/ps")[1]
        assert [m["in_flight"] for m in ps["models"]] == [0]
        assert [r["in_flight"] for r in ps["models"][0]["replicas"]] == [0]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
    r = subprocess.run([sys.executable, "-m", "ggmux", "ps", "--url", s.base],
                       capture_output=True, text=True, timeout=30, env=env, check=False)
    line = next(x for x in r.stdout.splitlines() if x.startswith("alpha"))
    assert line.split()[5] == "0", r.stdout  # IN FLIGHT (after MEMORY and CACHE)
