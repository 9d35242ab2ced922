"""Micro-benchmarks of the hot path (pytest-benchmark).

    python -m pytest bench/test_micro.py --benchmark-enable --benchmark-columns=median,iqr,ops

Not part of the test suite (``testpaths`` is ``tests``); figures go to
bench/RESULTS.md with the command and the machine.
"""

from __future__ import annotations

import asyncio
import os
import random
import socket
import time

import numpy as np
import orjson
import pytest
from ggmux.http1 import HttpConnection, HttpLimits, Request
from ggmux.http1.exchange import Exchange
from ggmux.proxy.accounting import Accounting
from ggmux.proxy.activity import Activity
from ggmux.proxy.balancer import candidates_from_shm, choose
from ggmux.shm import layout as L
from ggmux.shm.requestring import RequestRing, RingShape
from ggmux.shm.segment import Segment
from ggmux.shm.seqlock import read_row, read_table, write_fields, write_row
from ggmux.supervisor.registry import ModelEntry, Registry


@pytest.fixture(scope="module")
def seg():
    name = f"/ggmux-bench-{os.getpid()}"
    s = Segment.create(name, L.Sizes(models=64, replicas=32, proxies=4, devices=1))
    yield s
    s.close()
    s.unlink()


def test_seqlock_row_read(benchmark, seg):
    write_row(seg.replicas, 3, np.arange(1, L.R_WORDS, dtype=np.int64))
    row = benchmark(read_row, seg.replicas, 3)
    assert row[1] == 1


def test_seqlock_row_write(benchmark, seg):
    benchmark(write_fields, seg.replicas, 4, {L.R_STATUS: 2, L.R_PORT: 1234, L.R_PID: 42})


def test_seqlock_table_read_32_rows(benchmark, seg):
    benchmark(read_table, seg.replicas)


def test_model_name_resolution(benchmark):
    reg = Registry(
        [
            ModelEntry(name=f"org/model-{i}:Q4_K_M", path=f"/m/{i}.gguf", aliases=[f"m{i}"])
            for i in range(200)
        ]
    )
    assert benchmark(reg.resolve, "m150") == 150


def test_replica_choice_among_4(benchmark, seg):
    for slot in range(4):
        write_fields(
            seg.replicas,
            slot,
            {
                L.R_MODEL: 7,
                L.R_STATUS: L.ReplicaStatus.READY,
                L.R_PORT: 10000 + slot,
                L.R_INCARNATION: slot + 1,
                L.R_WEIGHT: 1000,
            },
        )
        seg.counters[0, slot, L.C_INCARNATION] = slot + 1
        seg.counters[0, slot, L.C_TTFT_EWMA_US] = 1000 * (slot + 1)
        seg.counters[0, slot, L.C_TTFT_COUNT] = 10
    rows = read_table(seg.replicas)
    rng = random.Random(1)

    def pick():
        return choose(candidates_from_shm(rows, seg.counters, 7, 0), (), None, rng)

    assert benchmark(pick) is not None


def test_request_parse_and_body_model(benchmark):
    """Parse one small chat request on a real HttpConnection and read its
    body's model, as the proxy does before forwarding."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    got = []

    async def handler(conn, req):
        got.append(orjson.loads(req.body)["model"])
        conn.send_response(req, 200, b"{}")

    conn = HttpConnection(handler, HttpLimits())
    a, b = socket.socketpair()

    class T(asyncio.Transport):
        def write(self, data):
            pass

        def is_closing(self):
            return False

        def get_extra_info(self, name, default=None):
            return default

    conn.connection_made(T())
    body = orjson.dumps(
        {"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    )
    data = (
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )

    def once():
        conn.data_received(data)
        loop.run_until_complete(asyncio.sleep(0))

    benchmark(once)
    assert got and got[0] == "smollm2-135m"
    a.close()
    b.close()
    loop.close()


# ---- the end of a forwarded request: its counters and its record (issue 22) ----
class _Accounting(Accounting):
    """Just what ``Accounting._account`` reads: this proxy's model rows."""

    def __init__(self, seg: Segment) -> None:
        self.mcw = [memoryview(row) for row in seg.mcounters[0]]


def _exchange() -> Exchange:
    t = time.monotonic_ns()
    return Exchange(status=200, sent_ns=t - 900_000, first_byte_ns=t - 800_000,
                    bytes_out=1135, usage=b"12 0 8", sse=True, events=9,
                    tail=b'data: {"choices":[]}\n\ndata: [DONE]\n\n')


def test_request_counters(benchmark, seg):
    """``_account`` of one answered request: requests, TTFT EWMA, the
    histogram and the recent-samples ring (what /ps's p50 reads)."""
    acc, cw, ex = _Accounting(seg), memoryview(seg.counters[0][0]), _exchange()
    benchmark(acc._account, cw, 1, ex)


@pytest.fixture
def ring_activity(seg):
    name = seg.name + "-req"
    ring = RequestRing.create(name, RingShape(proxies=4, rows=1000))
    act = Activity(name, 0)
    yield act
    act.ring.close()
    ring.unlink()
    ring.close()


def _request() -> Request:
    req = Request()
    req.path = b"/v1/chat/completions"
    req.started_ns = time.monotonic_ns() - 1_000_000
    req.request_id = b"0123456789abcdef"
    return req


def test_request_record_with_the_replicas_usage_line(benchmark, ring_activity):
    """``Activity.record`` of one request the built-in instance answered
    (its usage line read from the trailer): the request ring's cost."""
    benchmark(ring_activity.record, _request(), 1, 0, _exchange(), 0)


def test_request_record_from_the_answers_tail(benchmark, ring_activity):
    """The same for a replica without the usage line (llama-server): its
    ``timings`` read from the last body read."""
    ex = _exchange()
    ex.usage = None
    ex.tail = (b'data: {"choices":[{"finish_reason":"stop","delta":{}}],"timings":'
               b'{"cache_n":0,"prompt_n":12,"predicted_n":8,"predicted_ms":80.1}}\n\n'
               b"data: [DONE]\n\n")
    benchmark(ring_activity.record, _request(), 1, 0, ex, 0)
