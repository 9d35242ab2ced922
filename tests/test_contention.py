"""More demand than capacity (issue 34), end to end on fake instances: the
bounded wait drains a busy model, drains lose nothing in flight and take
nothing new, pins and eviction priorities hold, bursts are grouped, a
waiter that leaves is neither served nor counted, a drain that crashes
still makes room, and a memory margin gets a victim set."""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import chat_body, open_stream, served_by, wait_for
from ggmux.shm import layout as L
from ggmux.shm.seqlock import SeqlockBusy, read_table

CHAT = "/v1/chat/completions"
MiB = 1 << 20


def post(port: int, model: str, timeout: float = 120.0, **extra):
    """One chat request: ``(send time, status, headers, body)``."""
    t = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", CHAT, body=json.dumps(chat_body(model, **extra)),
                     headers={"content-type": "application/json"})
        r = conn.getresponse()
        return t, r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


class Clients:
    """``n`` clients that keep model ``model`` busy (one request after the
    other each) until :meth:`stop`; ``results``: every answer of
    :func:`post`."""

    def __init__(self, port: int, model: str, n: int = 3, **extra) -> None:
        self.port, self.model, self.extra = port, model, extra
        self.results: list[tuple] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _run(self) -> None:
        while not self.done.is_set():
            self.results.append(post(self.port, self.model, **self.extra))

    def stop(self) -> list[tuple]:
        self.done.set()
        for t in self.threads:
            t.join(120)
        return self.results


def index(s, name: str) -> int:
    return s.seg.read_registry()[1]["names"][name]


def draining_slot(s) -> tuple[int, int] | None:
    """``(slot, pid)`` of a draining replica, read once the supervisor's
    publish is whole (generation even), so every proxy's next request sees
    it too (a proxy checks the generation before each pick)."""
    g = s.seg.generation
    if g % 2:
        return None
    rows = read_table(s.seg.replicas)
    hit = [(int(i), int(r[L.R_PID])) for i, r in enumerate(rows) if r[L.R_DRAINING]]
    return hit[0] if hit and s.seg.generation == g else None


@pytest.mark.parametrize("proxies", [pytest.param("1", marks=pytest.mark.slow), "2"])
def test_a_model_waiting_past_its_bound_drains_the_busy_one_which_takes_no_new_request_and_cuts_none(
        serve, fakes, proxies):
    # three clients keep hog busy (each answer about 1 s); today a request
    # for one would wait as long as they keep at it (issue 34: 40 s of 40)
    fakes.add("hog", token_s=0.05, tokens=20, parallel=4, load_s=0.2)
    fakes.add("one", load_s=0.2)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", proxies,
              "--max-wait", "1.5", "--min-residency", "0", "--load-wait", "120")
    hog = Clients(s.port, "hog")
    try:
        wait_for(lambda: any(r[1] == 200 for r in hog.results), 60, 0.02, "hog serving")
        old_pid = served_by(hog.results[0][3])[1]
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(post, s.port, "one")

            def drain_seen():
                seen = draining_slot(s)
                # an answer before any drain was seen says why (not a 60 s timeout)
                assert seen or not fut.done(), (fut.result()[1:], s.logs()[-3000:])
                return seen

            seen = wait_for(drain_seen, 60, 0.005, "hog to drain")
            seen_at = time.monotonic()
            assert seen[1] == old_pid
            _, status, headers, body = fut.result()
        # served while hog's clients still keep it busy (they stop only below):
        # the bound, not their end, ended its wait
        assert status == 200 and served_by(body)[0] == "one"
        assert int(headers["x-ggmux-wait-ms"]) >= 1500  # it waited out its bound first
    finally:
        results = hog.stop()
    # none of hog's requests was cut, and none sent after the drain went to it
    assert results and all(r[1] == 200 and b"[hog:" in r[3] for r in results), \
        [r[:2] for r in results if r[1] != 200]
    late = [r for r in results if r[0] > seen_at]
    assert late and all(served_by(r[3])[1] != old_pid for r in late)
    log = s.logs()
    assert "draining hog" in log and "drained (its requests finished)" in log
    rows = read_table(s.seg.models)
    assert rows[index(s, "hog"), L.M_DRAINS] == 1 and rows[index(s, "one"), L.M_SWAPS] == 1
    _, _, metrics = s.request("GET", "/metrics")
    assert b'ggmux_wait_seconds_count{model="one"} 1' in metrics


def test_the_queue_says_why_a_model_waits_and_the_503_after_load_wait_carries_it(
        serve, fakes):
    fakes.add("hog", token_s=0.05, tokens=40, parallel=4, load_s=0.1)
    fakes.add("one", load_s=0.1)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "1",
              "--max-wait", "600", "--load-wait", "4")
    hog = Clients(s.port, "hog", n=2)
    try:
        wait_for(lambda: any(r[1] == 200 for r in hog.results), 60, 0.02, "hog serving")
        with ThreadPoolExecutor(1) as ex:
            fut = ex.submit(post, s.port, "one")
            q = wait_for(lambda: s.models()["one"]["status"].get("queue"), 30, 0.02, "a queue")
            assert q["waiters"] == 1 and q["holder"] == "hog" and q["reason"] == "slice"
            assert q["why"].startswith("waiting for capacity held by hog, which drains in ")
            _, ps = s.json("GET", "/ps")
            one = next(m for m in ps["models"] if m["id"] == "one")
            assert one["queue"]["holder"] == "hog"
            _, status, headers, body = fut.result()
    finally:
        hog.stop()
    # Retry-After: when the holder is drained for it (its bound of 600 s)
    assert status == 503 and int(headers["retry-after"]) > 500
    err = json.loads(body)["error"]
    assert "waited 4 s (--load-wait) for capacity: waiting for capacity held by hog" \
        in err["message"]
    assert err["loading"]["why"].startswith("waiting for capacity held by hog")


def test_a_pinned_model_is_never_evicted_and_a_request_for_its_capacity_gets_503(
        serve, fakes, tmp_path):
    fakes.add("p", load_s=0.1)
    fakes.add("q", load_s=0.1)
    ini = tmp_path / "p.ini"
    ini.write_text("[p]\npin = true\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(ini), "--no-hf-cache",
              "--models-max", "1", "--proxies", "1", "--max-wait", "0.5")
    st, _, body = s.request("POST", CHAT, chat_body("p"))
    assert st == 200
    pid = served_by(body)[1]
    st, headers, body = s.request("POST", CHAT, chat_body("q"))
    assert st == 503 and headers["retry-after"]
    err = json.loads(body)["error"]
    assert err["code"] == "capacity_pinned" and "'p'" in err["message"]
    assert "(pin = true), which is never evicted; unload it or raise --models-max" in err["message"]
    # in the client API's own envelope: Anthropic's here
    st, _, body = s.request("POST", "/v1/messages", {
        "model": "q", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    doc = json.loads(body)
    assert st == 503 and doc["type"] == "error" and "pin = true" in doc["error"]["message"]
    st, _, body = s.request("POST", CHAT, chat_body("p"))
    assert st == 200 and served_by(body)[1] == pid  # the same process: never evicted


def test_the_lowest_eviction_priority_is_evicted_first(serve, fakes, tmp_path):
    for n in "abc":
        fakes.add(n, load_s=0.05)
    ini = tmp_path / "p.ini"
    ini.write_text("[a]\neviction-priority = 5\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(ini), "--no-hf-cache",
              "--models-max", "2", "--proxies", "1")
    for n in "abc":  # a is the least recently used when c comes: LRU alone would evict it
        assert s.request("POST", CHAT, chat_body(n))[0] == 200
    loaded = {k for k, v in s.models().items() if v["status"]["value"] == "loaded"}
    assert loaded == {"a", "c"}
    assert "stopping b" in s.logs()


def test_a_burst_of_interleaved_requests_is_served_grouped_by_model(serve, fakes):
    # a loads long enough for the whole burst to arrive meanwhile, even on a loaded machine
    fakes.add("a", load_s=2.0, token_s=0.02, tokens=10, parallel=8)
    fakes.add("b", load_s=0.3, token_s=0.02, tokens=10, parallel=8)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "2")
    order = ["a", "a", "b", "a", "b", "a", "b", "b", "a", "b"]
    with ThreadPoolExecutor(len(order)) as ex:
        futs = []
        for n in order:
            futs.append(ex.submit(post, s.port, n))
            # each request reaches a proxy before the next leaves (the burst's order)
            k = len(futs)
            wait_for(lambda k=k: int(s.seg.waiters[:, :, L.W_COUNT].sum())
                     + int(s.seg.counters[:, :, L.C_IN_FLIGHT].sum())
                     + int(s.seg.mcounters[:, :, L.MC_REQUESTS].sum()) >= k, 30, 0.002,
                     "the request to arrive")
        rs = [f.result() for f in futs]
    assert all(r[1] == 200 for r in rs)
    log = s.logs()
    # five requests each, one load each: the waiters of a model are served together
    assert log.count("loading a in slot") == 1 and log.count("loading b in slot") == 1


def test_a_client_that_leaves_while_waiting_is_neither_served_nor_counted(serve, fakes):
    fakes.add("hog", token_s=0.05, tokens=40, parallel=4, load_s=0.1)
    fakes.add("gone", load_s=0.1)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "1",
              "--max-wait", "1", "--min-residency", "0")
    hog = Clients(s.port, "hog", n=2)
    try:
        wait_for(lambda: any(r[1] == 200 for r in hog.results), 60, 0.02, "hog serving")
        g = index(s, "gone")
        sock = open_stream(s.port, chat_body("gone"))
        wait_for(lambda: s.seg.waiters[:, g, L.W_COUNT].sum() == 1, 30, 0.005, "a waiter")
        sock.close()
        wait_for(lambda: s.seg.waiters[:, g, L.W_COUNT].sum() == 0, 30, 0.005, "it to leave")
        # past the bound it would have had: nothing drains for a model nobody waits for
        n = len(hog.results)
        wait_for(lambda: len(hog.results) >= n + 4, 60, 0.02, "hog to serve on")
    finally:
        hog.stop()
    rows = read_table(s.seg.models)
    assert rows[g, L.M_LOADS] == 0 and rows[g, L.M_STATUS] == L.ModelStatus.UNLOADED
    assert "draining hog" not in s.logs()
    assert s.seg.mcounters[:, g, L.MC_WAIT_COUNT].sum() == 0
    assert s.seg.mcounters[:, g, L.MC_REQUESTS].sum() == 0


def test_a_draining_replica_that_crashes_mid_drain_still_makes_room(serve, fakes):
    # hog dies 5 s after it is ready, while its long answers (10 s) drain
    fakes.add("hog", token_s=0.05, tokens=200, parallel=4, load_s=0.1, crash_after_s=5)
    fakes.add("one", load_s=0.1)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "2",
              "--max-wait", "1", "--min-residency", "0", "--load-wait", "120")
    hog = Clients(s.port, "hog", n=2)
    try:
        wait_for(lambda: s.seg.counters[:, :, L.C_IN_FLIGHT].sum() >= 2, 60, 0.01, "hog busy")
        _, status, _, body = post(s.port, "one")
        assert status == 200 and served_by(body)[0] == "one"
    finally:
        hog.stop()
    log = s.logs()
    assert "draining hog" in log and "hog crashed" in log
    assert s.request("GET", "/health")[0] == 200


def test_two_busy_models_are_drained_together_when_the_memory_margin_needs_both(
        serve, fakes):
    for n in "ab":
        fakes.add(n, min_bytes=400 * MiB, max_bytes=400 * MiB, mem_bytes=400 * MiB,
                  token_s=0.05, tokens=30, parallel=4, load_s=0.1)
    fakes.add("big", min_bytes=800 * MiB, max_bytes=800 * MiB, mem_bytes=800 * MiB,
              load_s=0.1)
    s = serve("--fake-models-dir", str(fakes), "--models-max", "2", "--proxies", "2",
              "--host-memory", "1024", "--models-memory-margin", "100",
              "--max-wait", "1", "--min-residency", "0", "--load-wait", "120")
    ca, cb = Clients(s.port, "a", n=2), Clients(s.port, "b", n=2)
    try:
        wait_for(lambda: any(r[1] == 200 for r in ca.results)
                 and any(r[1] == 200 for r in cb.results), 60, 0.02, "a and b serving")
        _, status, _, body = post(s.port, "big")
        assert status == 200 and served_by(body)[0] == "big"
    finally:
        ra, rb = ca.stop(), cb.stop()
    assert all(r[1] == 200 for r in ra + rb), [r[:2] for r in ra + rb if r[1] != 200]
    log = s.logs()
    assert "draining a" in log and "draining b" in log


def test_ps_prints_why_each_waiting_model_waits_under_its_table():
    from ggmux.client.ps import ps_table

    q = {"waiters": 2, "oldest_wait_s": 12.0, "reason": "slice", "holder": "a", "eta_s": 4.0,
         "why": "waiting for capacity held by a, which drains in 4 s"}
    doc = {"models": [{"id": "a", "state": "loaded", "replicas": [
        {"state": "ready", "draining": True}]}, {"id": "b", "state": "unloaded", "queue": q}]}
    lines = ps_table(doc).splitlines()
    assert lines[1].split()[:3] == ["a", "loaded", "(draining)"]
    assert lines[-1] == "b: waiting for capacity held by a, which drains in 4 s (2 waiting, " \
                        "oldest 12 s)"


def test_the_queue_object_reads_the_schedulers_reason_from_the_models_row():
    import numpy as np
    from ggmux.proxy.contention import queue_status

    row = np.zeros(L.M_WORDS, dtype=np.int64)
    assert queue_status(row, str, 10**12) is None
    row[[L.M_WAITERS, L.M_WAIT_FIRST_NS, L.M_WAIT_REASON, L.M_WAIT_HOLDER, L.M_WAIT_ETA_NS]] = (
        3, 10**12 - 5 * 10**9, L.WaitReason.SLICE, 1 + 7, 10**12 + 4 * 10**9)
    q = queue_status(row, lambda i: f"m{i}", 10**12)
    assert q == {"waiters": 3, "oldest_wait_s": 5.0, "reason": "slice", "holder": "m7",
                 "eta_s": 4.0, "why": "waiting for capacity held by m7, which drains in 4 s"}
    row[L.M_WAIT_REASON] = L.WaitReason.PINNED
    assert "pinned model m7" in queue_status(row, lambda i: f"m{i}", 10**12)["why"]


@pytest.mark.slow
def test_a_busy_cmd_replica_drains_like_an_instance(serve, fakes, tmp_path):
    log = tmp_path / "cmd.jsonl"
    log.touch()
    recorder = Path(__file__).with_name("recorder.py")
    ini = tmp_path / "p.ini"
    ini.write_text(f"[c]\ncmd = {sys.executable} {recorder} --port ${{PORT}} --log {log} "
                   "--delay 0.5\n")
    fakes.add("one", load_s=0.1)
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(ini), "--no-hf-cache",
              "--models-max", "1", "--proxies", "2", "--max-wait", "1", "--min-residency", "0",
              "--load-wait", "120")
    busy = Clients(s.port, "c")
    try:
        wait_for(lambda: any(r[1] == 200 for r in busy.results), 60, 0.02, "c serving")
        _, status, _, body = post(s.port, "one")
        assert status == 200 and served_by(body)[0] == "one"
    finally:
        results = busy.stop()
    assert results and all(r[1] == 200 for r in results), [r[:2] for r in results]
    assert "draining c" in s.logs()


@pytest.mark.slow
def test_one_of_two_busy_replicas_drains_and_the_other_keeps_serving_its_model(
        serve, fakes, tmp_path):
    fakes.add("two", token_s=0.05, tokens=20, parallel=4, load_s=0.1)
    fakes.add("one", load_s=0.1)
    ini = tmp_path / "p.ini"
    ini.write_text("[two]\nreplicas = 2\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(ini), "--no-hf-cache",
              "--models-max", "2", "--proxies", "2", "--max-wait", "1", "--min-residency", "0",
              "--load-wait", "120")
    busy = Clients(s.port, "two", n=4)
    try:
        t = index(s, "two")
        wait_for(lambda: s.seg.models[t, L.M_REPLICAS] == 2 and all(
            s.seg.counters[:, slot, L.C_IN_FLIGHT].sum() > 0
            for slot in range(len(s.seg.replicas)) if s.seg.replicas[slot, L.R_MODEL] == t),
            60, 0.02, "both replicas of two busy")
        _, status, _, body = post(s.port, "one")
        assert status == 200 and served_by(body)[0] == "one"
        n = len(busy.results)
        wait_for(lambda: len(busy.results) >= n + 2, 60, 0.02, "two to serve on")
    finally:
        results = busy.stop()
    assert all(r[1] == 200 for r in results), [r[:2] for r in results]
    log = s.logs()
    assert log.count("draining two") == 1  # one replica made room; the other served on


def test_a_key_that_drained_another_tenants_model_waits_its_penalty_before_the_next_drain(
        serve, fakes, tmp_path, private_files):
    fakes.add("hog", token_s=0.05, tokens=20, parallel=4, load_s=0.05)
    fakes.add("one", load_s=0.05)
    keys = tmp_path / "keys.ini"
    keys.write_text("[owner]\nkey = sk-owner\nmodels = hog\n[eve]\nkey = sk-eve\nmodels = one\n"
                    "[bob]\nkey = sk-bob\nmodels = one\n")
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "1",
              "--max-wait", "1", "--min-residency", "0", "--load-wait", "6",
              "--drain-penalty", "30", "--keys", str(keys), "--admin-key", "adm")

    def ask(model: str, key: str):  # (hog's answers take 1 s: 20 tokens)
        return s.request("POST", CHAT, chat_body(model), timeout=60,
                         headers={"authorization": f"Bearer {key}"})

    stop = threading.Event()
    codes: list[int] = []

    def keep_busy() -> None:
        while not stop.is_set():
            codes.append(ask("hog", "sk-owner")[0])

    # six clients on hog's four slots: two always wait for a slot, so hog is never idle
    # (three in lockstep all stood between requests at once after a reload, and a
    # loaded machine's pause past hog's hold let "one" load for eve without a drain)
    busy = [threading.Thread(target=keep_busy, daemon=True) for _ in range(6)]
    for t in busy:
        t.start()
    hog = index(s, "hog")

    def drains() -> int:  # (a read retried while the supervisor, descheduled, holds the row)
        def read():
            try:
                return int(read_table(s.seg.models)[hog, L.M_DRAINS])
            except SeqlockBusy:
                return None
        return wait_for(lambda: (n := read()) is not None and n + 1, 10, 0.01, "a read") - 1

    def hog_serving() -> bool:
        n = codes.count(200)
        return wait_for(lambda: codes.count(200) >= n + 2, 60, 0.02, "hog serving")

    try:
        hog_serving()
        assert ask("one", "sk-eve")[0] == 200  # waited out --max-wait, drained hog
        assert drains() == 1
        st, doc = s.json("GET", "/keys/eve", headers={"authorization": "Bearer adm"})
        assert doc["usage"]["drains_caused"] == pytest.approx(1, abs=0.01)
        hog_serving()  # back (one, idle, was evicted for hog's waiters: no drain)
        # eve's next wait counts only after her 30 s penalty: no drain within --load-wait
        st, _, raw = ask("one", "sk-eve")
        assert st == 503, (raw, codes)
        assert drains() == 1
        # the penalty is eve's, not the model's: bob's request drains hog after --max-wait
        assert ask("one", "sk-bob")[0] == 200
        assert drains() == 2
    finally:
        stop.set()
        for t in busy:
            t.join(60)
    assert set(codes) == {200}


def test_a_drain_penalty_doubles_per_recent_drain_and_decays():
    from ggmux.proxy.drain_penalty import HALF_LIFE_S, PENALTY_CAP_S, decayed, penalty_s

    assert [penalty_s(30, n) for n in (0, 1, 2, 3)] == [0, 30, 90, 210]
    assert penalty_s(30, 40) == PENALTY_CAP_S and penalty_s(0, 5) == 0
    assert decayed(2000, 0, int(HALF_LIFE_S * 1000)) == pytest.approx(1.0)
    # one drain counts whole for one half-life, then not at all
    assert penalty_s(30, decayed(1000, 0, 1000)) == 30
    assert penalty_s(30, decayed(1000, 0, int(HALF_LIFE_S * 1000) + 1000)) == 0
