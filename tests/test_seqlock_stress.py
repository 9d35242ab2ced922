"""Seqlocked rows under concurrent rewrite: no reader accepts a torn row."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest
from ggmux.shm import layout as L
from ggmux.shm.segment import Segment
from ggmux.shm.seqlock import SeqlockBusy, read_row, read_table, write_row

DURATION_S = 3.0


def _writer(name: str, stop_at: float) -> None:
    seg = Segment.attach(name)
    t = seg.models
    n, w = t.shape
    offs = np.arange(w - 1, dtype=np.int64)
    k = 0
    while time.monotonic() < stop_at:
        for i in range(n):
            k += 1
            # self-checking contents: word j holds k * 1000 + j
            write_row(t, i, k * 1000 + offs)
    seg.close()


def _reader(name: str, stop_at: float, q) -> None:
    seg = Segment.attach(name)
    t = seg.models
    n, w = t.shape
    offs = np.arange(w - 1, dtype=np.int64)
    accepted = torn = raw_torn = busy = 0
    i = 0
    while time.monotonic() < stop_at:
        i = (i + 1) % n
        raw = t[i].copy()  # no lock: may be torn, only counted
        if raw[1] != 0 and not np.array_equal(raw[1:], raw[1] // 1000 * 1000 + offs):
            raw_torn += 1
        try:
            row = read_row(t, i)
        except SeqlockBusy:
            busy += 1
            continue
        if row[0] == 0:
            continue  # not written yet
        accepted += 1
        if row[0] & 1 or not np.array_equal(row[1:], row[1] // 1000 * 1000 + offs):
            torn += 1
        if i == 0:
            try:
                whole = read_table(t)
            except SeqlockBusy:
                busy += 1
                continue
            for r in whole:
                if r[0] and not np.array_equal(r[1:], r[1] // 1000 * 1000 + offs):
                    torn += 1
    q.put((accepted, torn, raw_torn, busy))
    seg.close()


@pytest.mark.slow
def test_no_reader_accepts_a_torn_row_under_concurrent_writes():
    name = f"/ggmux-test-{os.getpid()}"
    seg = Segment.create(name, L.Sizes(models=4, replicas=4, proxies=1, devices=1))
    try:
        ctx = mp.get_context("fork")
        stop_at = time.monotonic() + DURATION_S
        q = ctx.Queue()
        procs = [ctx.Process(target=_writer, args=(name, stop_at))]
        procs += [ctx.Process(target=_reader, args=(name, stop_at, q)) for _ in range(3)]
        for p in procs:
            p.start()
        results = [q.get(timeout=DURATION_S + 30) for _ in range(3)]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
        accepted = sum(r[0] for r in results)
        torn = sum(r[1] for r in results)
        raw_torn = sum(r[2] for r in results)
        print(f"accepted {accepted} rows, torn accepted {torn}, torn raw copies {raw_torn}")
        assert accepted > 1000
        assert torn == 0
    finally:
        seg.close()
        seg.unlink()


def test_reader_gives_up_on_a_row_left_odd_by_a_dead_writer():
    name = f"/ggmux-test-odd-{os.getpid()}"
    seg = Segment.create(name, L.Sizes(models=2, replicas=2, proxies=1, devices=1))
    try:
        seg.models[1, 0] = 7  # a writer died between its two sequence stores
        with pytest.raises(SeqlockBusy):
            read_row(seg.models, 1, retries=100)
        assert read_row(seg.models, 0)[0] == 0
    finally:
        seg.close()
        seg.unlink()


def test_attach_rejects_a_segment_that_is_not_ggmux():
    import posix_ipc

    name = f"/ggmux-test-bad-{os.getpid()}"
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, size=4096)
    shm.close_fd()
    try:
        with pytest.raises(ValueError, match="magic"):
            Segment.attach(name)
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_a_registry_read_waits_out_a_writer_stalled_mid_write():
    """A supervisor preempted while it rewrites the registry blob holds its
    sequence word odd for a time slice: a reader waits (it gave up after
    about a millisecond, and its proxy kept an old view)."""
    import threading

    name = f"/ggmux-test-reg-{os.getpid()}"
    seg = Segment.create(name, L.Sizes(models=2, replicas=2, proxies=1, devices=1))
    try:
        seg.write_registry({"names": {"old": 0}})
        seg.header[L.H_REGISTRY_SEQ] += 1  # odd: the write has begun

        def finish() -> None:
            time.sleep(0.05)  # the stalled writer (a scenario, not synchronisation)
            seg.header[L.H_REGISTRY_SEQ] -= 1
            seg.write_registry({"names": {"new": 0}})

        t = threading.Thread(target=finish)
        t.start()
        version, doc = seg.read_registry()
        t.join()
        assert doc == {"names": {"new": 0}} and not version & 1
        seg.header[L.H_REGISTRY_SEQ] += 1  # a writer that died mid-write: bounded
        with pytest.raises(SeqlockBusy):
            seg.read_registry(timeout=0.05)
    finally:
        seg.close()
        seg.unlink()


def test_a_proxy_whose_read_of_a_generation_fails_reads_it_again():
    """refresh() marks a generation seen only once its view is whole: after
    a read that raised, the next call reads again instead of keeping the
    old view until the supervisor publishes once more."""
    from ggmux.proxy.server import Proxy

    class StalledSegment:
        generation = 6

        def read_registry(self):
            raise SeqlockBusy("registry blob stayed busy")

    p = Proxy.__new__(Proxy)  # the refresh alone: no segment, queue or loop
    p.seg, p.gen = StalledSegment(), 4
    for _ in range(2):
        with pytest.raises(SeqlockBusy):
            p.refresh()  # the second call reads again (it returned at once before)
        assert p.gen == 4
