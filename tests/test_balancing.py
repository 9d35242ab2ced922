"""Balancing across a model's replicas end to end (issue 6), fake replicas."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import chat_body, connectable, free_port, served_by, wait_for
from ggmux.shm import layout as L

CHAT = "/v1/chat/completions"



def preset(tmp_path, text: str):
    p = tmp_path / "replicas.ini"
    p.write_text(text)
    return str(p)


@pytest.mark.slow
def test_two_equal_replicas_share_requests_evenly_across_proxies(serve, fakes, tmp_path):
    f = fakes.add("m", ttft_s=0.003, token_s=0.0, tokens=1)
    s = serve("--models-preset", preset(tmp_path, f"[m]\nmodel = {f}\nreplicas = 2\n"),
              "--no-hf-cache", "--proxies", "2", "--models-max", "2")
    assert s.request("POST", CHAT, chat_body("m"))[0] == 200
    # an even share needs both from the start: the second may still be loading
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 2, 20, what="two replicas ready")
    with ThreadPoolExecutor(8) as ex:
        bodies = list(ex.map(lambda _: s.request("POST", CHAT, chat_body("m"))[2], range(1000)))
    share = Counter(served_by(b)[1] for b in bodies)
    assert len(share) == 2, share
    a, b = share.values()
    assert abs(a - b) / 1000 <= 0.15, share


@pytest.mark.slow
def test_session_key_sticks_to_one_replica_through_any_proxy(serve, fakes, tmp_path):
    f = fakes.add("m", tokens=1)
    s = serve("--models-preset", preset(tmp_path, f"[m]\nmodel = {f}\nreplicas = 3\n"),
              "--no-hf-cache", "--proxies", "2", "--models-max", "3")
    assert s.request("POST", CHAT, chat_body("m"))[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 3, 20, what="three replicas ready")
    for key in ("alice", "bob", "carol", "dave"):
        pids = set()
        for i in range(12):  # new connections: spread over both proxies
            hdr = {"x-session-id": key} if i % 2 else {}
            body = chat_body("m", user=key) if not i % 2 else chat_body("m")
            pids.add(served_by(s.request("POST", CHAT, body, headers=hdr)[2])[1])
        assert len(pids) == 1, (key, pids)


@pytest.mark.slow
def test_failing_replica_is_skipped_and_taken_back_after_it_recovers(serve, fakes, tmp_path):
    f = fakes.add("m", tokens=1)
    s = serve("--models-preset", preset(tmp_path, f"[m]\nmodel = {f}\nreplicas = 2\n"),
              "--no-hf-cache", "--proxies", "1", "--models-max", "2")
    pids = {served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]}
    # both must be ready before the choice can fall on both (the second may
    # take longer to start than 40 requests take to answer)
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 2, 20, what="two replicas ready")
    for _ in range(40):
        pids.add(served_by(s.request("POST", CHAT, chat_body("m"))[2])[1])
        if len(pids) == 2:
            break
    assert len(pids) == 2
    bad = min(pids)
    switch = f.with_name(f.name + f".fail-{bad}")
    switch.touch()
    statuses = Counter(s.request("POST", CHAT, chat_body("m"))[0] for _ in range(40))
    # at most the failures before the circuit opened reach a client
    assert statuses[200] >= 37 and statuses[500] <= 3, statuses
    switch.unlink()

    def back() -> bool:
        return bad in {served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]
                       for _ in range(10)}

    wait_for(back, 30, 0.2, what="recovered replica taken back")


@pytest.mark.slow
def test_full_replicas_queue_then_429_and_nothing_is_sent_twice(serve, fakes, tmp_path):
    f = fakes.add("m", ttft_s=0.5, tokens=1)
    s = serve("--models-preset", preset(tmp_path, f"[m]\nmodel = {f}\nmax-concurrency = 1\n"),
              "--no-hf-cache", "--proxies", "1", "--max-queue", "2", "--queue-timeout", "30")
    assert s.request("POST", CHAT, chat_body("m"))[0] == 200  # loaded
    with ThreadPoolExecutor(6) as ex:
        results = list(ex.map(lambda _: s.request("POST", CHAT, chat_body("m")), range(6)))
    codes = Counter(r[0] for r in results)
    # one in flight, two queued, the rest refused at once
    assert codes[200] == 3 and codes[429] == 3, codes
    assert all(r[1].get("retry-after") for r in results if r[0] == 429)
    _, _, text = s.request("GET", "/metrics")
    assert 'ggmux_requests_total{model="m"} 4' in text.decode()  # none sent twice


def test_remote_upstream_serves_alongside_a_local_replica(serve, fakes, tmp_path):
    remote_behaviour = fakes.add("remote-behaviour", tokens=1)
    port = free_port()
    remote = subprocess.Popen(
        [sys.executable, "-m", "ggmux.instance", "--fake", "--model", str(remote_behaviour),
         "--name", "remote", "--port", str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: connectable(port), 20, 0.05, what="remote server")
        local = fakes.add("m", tokens=1)
        fakes.dir.joinpath("remote-behaviour.json").rename(tmp_path / "remote.json")
        s = serve("--models-preset",
                  preset(tmp_path, f"[m]\nmodel = {local}\nupstream = http://127.0.0.1:{port}\n"),
                  "--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
        seen = Counter()

        def both() -> bool:
            st, _, body = s.request("POST", CHAT, chat_body("m"))
            assert st == 200
            seen["remote" if b"[remote:" in body else "local"] += 1
            return len(seen) == 2

        # the remote answers at once; the local replica loads meanwhile
        wait_for(both, 20, 0.02, what="both replicas serving")
        models = s.models()
        assert models["m"]["status"]["value"] == "loaded"
    finally:
        remote.stdin.close()
        remote.wait(10)


