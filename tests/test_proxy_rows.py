"""The supervisor reads the proxies' rows without trusting them (issue 37,
item 14): random bytes over the proxy-written tables of a live segment are
logged and ignored, and the server keeps serving."""

from __future__ import annotations

import numpy as np
from conftest import chat_body, served_by, wait_for
from ggmux.shm import layout as L
from ggmux.supervisor import proxy_rows

CHAT = "/v1/chat/completions"


def test_demand_reads_only_registered_models_and_drops_bad_cells():
    waiters = np.zeros((2, 6, L.W_WORDS), dtype=np.int64)
    waiters[0, 0] = (2, 1000)
    waiters[1, 0] = (-7, 900)  # a negative count: ignored, time and all
    waiters[1, 1] = (1, 1 << 62)  # a time far past now: ignored
    waiters[0, 5] = (3, 500)  # a model row past the registered ones: not read
    counts, first = proxy_rows.demand(waiters, 3, now_ns=10_000)
    assert counts.tolist() == [2, 0, 0]
    assert first[0] == 1000 and first[1] == first[2] == np.iinfo(np.int64).max


def test_in_flight_and_last_used_drop_out_of_range_cells():
    c = np.zeros((2, 3, L.C_WORDS), dtype=np.int64)
    c[0, :, L.C_IN_FLIGHT] = (1, -3, 1 << 40)
    c[1, :, L.C_IN_FLIGHT] = (2, 1, 0)
    c[0, :, L.C_LAST_USED_NS] = (50, -1, 1 << 62)
    assert proxy_rows.in_flight(c).tolist() == [3, 1, 0]
    assert proxy_rows.last_used(c, now_ns=100).tolist() == [50, 0, 0]


def test_random_bytes_over_the_proxies_rows_are_ignored_and_the_server_keeps_serving(
        serve, fakes):
    fakes.add("a")
    fakes.add("b")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--models-max", "1")
    assert s.request("POST", CHAT, chat_body("a"))[0] == 200
    seg = s.seg
    rng = np.random.default_rng(37)
    tables = [seg.counters, seg.waiters, seg.mcounters, seg.prefix, seg.prefix_forget,
              seg.prefix_forget_disk]
    for t in tables:
        t[...] = rng.integers(np.iinfo(np.int64).min, np.iinfo(np.int64).max, t.shape,
                              dtype=np.int64)
    seg.bump_generation()
    # the supervisor reads them on its next turn: it logs the bad cells
    # instead of indexing past its models (IndexError stopped it before)
    wait_for(lambda: "bad waiter count" in s.logs() or s.proc.poll() is not None, 20,
             what="the supervisor reading the scribbled rows")
    assert s.proc.poll() is None, s.logs()[-3000:]
    for model in ("b", "a"):
        st, _, body = s.request("POST", CHAT, chat_body(model))
        assert st == 200, body
        assert served_by(body)[0] == model
    assert s.proc.poll() is None
