"""The log ring (shm/logring.py): records survive wrapping, a reader never
gets a torn record, and an overtaken reader is told it lost lines."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
from ggmux.shm.logring import MAX_RECORD, LogRing


@pytest.fixture
def ring():
    r = LogRing.create(f"/ggmux-test-log-{os.getpid()}", 4 * MAX_RECORD)
    yield r
    r.unlink()
    r.close()


def test_records_read_back_in_order_across_many_wraps(ring):
    reader = LogRing.attach(ring.name)
    try:
        cursor = None
        got = []
        for i in range(5000):
            ring.append(b"line %d " % i + b"x" * (i % 300))
            if i % 7 == 0:
                recs, cursor, lost = reader.read(cursor)
                assert not lost
                got += recs
        recs, cursor, lost = reader.read(cursor)
        got += recs
        assert [g.split(b" ")[1] for g in got] == [b"%d" % i for i in range(5000)]
    finally:
        reader.close()


def test_a_reader_overtaken_by_the_writer_is_told_and_gets_only_intact_records(ring):
    _, cursor, _ = ring.read(None)
    for i in range(2000):  # far more than the ring holds
        ring.append(b"%06d" % i + b"." * 100)
    recs, _, lost = ring.read(cursor)
    assert lost
    nums = [int(r[:6]) for r in recs]
    assert nums == list(range(nums[0], 2000))  # the newest, contiguous
    assert all(r[6:] == b"." * 100 for r in recs)
    assert sum(len(r) + 4 for r in recs) <= ring.capacity


def test_every_record_the_ring_holds_comes_back_without_a_cursor(ring):
    ring.append(b"a")
    ring.append(b"b")
    recs, end, lost = ring.read(None)
    assert recs == [b"a", b"b"] and end == ring.head and not lost
    assert ring.read(end) == ([], end, False)
    assert ring.read(None, until=end - 5)[0] == [b"a"]  # up to a position read before


def test_a_record_over_the_limit_is_refused(ring):
    with pytest.raises(ValueError):
        ring.append(b"x" * MAX_RECORD)


def _intact(recs: list[bytes]) -> bool:
    return all(len(r) % 9 == 0 and r == r[:9] * (len(r) // 9) for r in recs)


def test_a_reader_between_a_writers_half_records_gets_only_whole_ones(ring):
    """The worst interleaving, made deterministic: the reader runs while the
    writer has written half of a record over older ones (the order of the
    tail store, the bytes and the head store is what keeps it safe)."""
    reader = LogRing.attach(ring.name)
    put = ring._put
    seen: list[bytes] = []

    def half_then_read(pos: int, data: bytes) -> None:
        half = len(data) // 2
        put(pos, data[:half])
        recs, _, _ = reader.read(None)
        assert _intact(recs), "torn record"
        seen.extend(recs)
        put(pos + half, data[half:])

    ring._put = half_then_read
    try:
        for i in range(600):  # many wraps of the 32 KiB ring
            body = b"%08d:" % i
            ring.append(body * (1 + i % 60))
    finally:
        del ring._put
        reader.close()
    assert seen and _intact(ring.read(None)[0])


def _writer(name: str, n: int) -> None:
    w = LogRing.attach(name)
    for i in range(n):
        body = b"%08d:" % i
        w.append(body + body * (i % 50))  # self-checking: every part repeats the number
    w.close()


def test_a_concurrent_reader_never_sees_a_torn_record(ring):
    n = 30000
    p = mp.get_context("fork").Process(target=_writer, args=(ring.name, n))
    p.start()
    cursor = None
    last = -1
    deadline = time.monotonic() + 60
    try:
        while last < n - 1:
            assert time.monotonic() < deadline, "writer too slow"
            recs, cursor, lost = ring.read(cursor)
            for r in recs:
                head = r[:9]
                assert r == head * (len(r) // 9) and len(r) % 9 == 0, r[:40]
                i = int(head[:8])
                assert i > last  # in order, never twice
                assert i == last + 1 or lost or last == -1
                last = i
                lost = False
    finally:
        p.join(30)
    assert p.exitcode == 0
