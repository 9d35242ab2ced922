"""A tenant with one key of the keys file, trying what an attacker would:
every route keeps to the key's models and limits, and shows it only its
own models (real servers on fake instances)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from conftest import chat_body, wait_for
from ggmux.shm import layout as L
from ggmux.shm.seqlock import read_table
from test_keys import ADMIN, bearer, keyed, usage_of


def loads_of(s, name: str) -> int:
    m = s.seg.read_registry()[1]["names"][name]
    return int(read_table(s.seg.models)[m, L.M_LOADS])


# ---- item 1: Ollama's load form ---------------------------------------------------------

@pytest.mark.parametrize("route,body", [
    ("/api/generate", {"prompt": ""}),
    ("/api/chat", {"messages": []}),
    ("/api/generate", {"prompt": "", "keep_alive": "10m"}),
])
def test_ollamas_load_form_of_a_model_outside_the_keys_list_is_refused_and_loads_nothing(
        serve, fakes, tmp_path, route, body):
    fakes.add("mine", load_s=0.05)
    fakes.add("theirs", load_s=0.05)
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\nmodels = mine\n")
    for name in ("theirs", "THEIRS", "theirs:latest"):
        st, _, raw = s.request("POST", route, {"model": name, **body},
                               headers=bearer("sk-alice"))
        if name == "THEIRS":  # no such model: 404, as for any route
            assert st == 404, raw
            continue
        assert st == 403, raw
        assert "may not use model" in json.loads(raw)["error"]
    # the same key may load its own model that way
    st, _, raw = s.request("POST", route, {"model": "mine", **body}, headers=bearer("sk-alice"))
    assert st == 200 and json.loads(raw)["done_reason"] == "load", raw
    assert loads_of(s, "theirs") == 0
    assert loads_of(s, "mine") == 1


def test_a_load_form_for_a_model_the_key_may_not_use_never_drains_another_tenants_model(
        serve, fakes, tmp_path):
    # --models-max 1, a short bound: a load that went ahead would drain busy "a"
    fakes.add("a", token_s=0.05, tokens=20, parallel=4, load_s=0.05)
    fakes.add("b", load_s=0.05)
    s = keyed(serve, fakes, tmp_path,
              "[owner]\nkey = sk-owner\nmodels = a\n\n[other]\nkey = sk-other\nmodels = c*\n",
              "--models-max", "1", "--max-wait", "0.5", "--min-residency", "0")
    stop = threading.Event()
    codes: list[int] = []

    def keep_busy() -> None:
        while not stop.is_set():
            codes.append(s.request("POST", "/v1/chat/completions", chat_body("a"),
                                   headers=bearer("sk-owner"))[0])

    threads = [threading.Thread(target=keep_busy, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: 200 in codes, 60, 0.02, "a serving")
        for route, body in (("/api/generate", {"prompt": ""}), ("/api/chat", {"messages": []})):
            for _ in range(3):
                st, _, raw = s.request("POST", route, {"model": "b", **body},
                                       headers=bearer("sk-other"), timeout=30)
                assert st == 403, raw
        # longer than the bound: a waiter would have drained "a" by now
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert set(codes) == {200}
    assert loads_of(s, "b") == 0
    assert "draining a" not in s.logs()
    assert int(read_table(s.seg.models)[s.seg.read_registry()[1]["names"]["a"],
                                        L.M_DRAINS]) == 0


def test_the_load_form_counts_in_the_keys_limits(serve, fakes, tmp_path):
    fakes.add("mine", load_s=0.05)
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\nmodels = mine\nrpm = 2\n")
    minute = int(time.time() // 60)
    got = [s.request("POST", "/api/generate", {"model": "mine", "prompt": ""},
                     headers=bearer("sk-alice"))[0] for _ in range(3)]
    if int(time.time() // 60) != minute:
        pytest.skip("the minute turned during the test")
    assert got == [200, 200, 429]
    u = wait_for(lambda: (u := usage_of(s, "alice"))["in_flight"] == 0 and u, 10, 0.02,
                 "settled")
    # counted as requests, and their token reservations given back (they generate nothing)
    assert u["requests_this_minute"] == 2 and u["refused"] == 1
    assert u["tokens_this_minute"] == 0
    assert s.json("GET", "/keys/alice", headers=ADMIN)[0] == 200
