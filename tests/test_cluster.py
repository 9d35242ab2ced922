"""Cluster mode end to end (issue 13, "Done when" 1-7): three ggmux nodes on
loopback with fake models and a real nats-server; every node a real
``ggmux serve --cluster`` process."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import (
    chat_body,
    children_of,
    descendants,
    open_stream,
    secrets_shown,
    served_by,
    unlink_server_objects,
    wait_for,
    write_fake,
)

HB, STALE = 0.5, 1.5  # --heartbeat, --node-stale
TOKEN = "cluster-secret"
MiB = 1 << 20


@pytest.fixture
def cluster(nats_server, serve, tmp_path):
    """``cluster(name, *args, models={name: behaviour}) -> Server``: a node
    of one cluster (one nats-server for the test)."""
    ns = nats_server()

    def node(name: str, *args: str, models: dict | None = None, ready: bool = True):
        d = tmp_path / f"models-{name}"
        d.mkdir(exist_ok=True)
        for m, behaviour in (models or {}).items():
            write_fake(d, m, **behaviour)
        s = serve("--fake-models-dir", str(d), "--no-hf-cache", "--proxies", "1",
                  "--spares", "0", "--cluster", ns.url, "--node-name", name,
                  "--heartbeat", str(HB), "--node-stale", str(STALE), "--cluster-token", TOKEN,
                  *args, ready=ready)
        s.name = name
        return s

    node.nats = ns
    return node


def view(s) -> dict:
    status, doc = s.json("GET", "/cluster")
    assert status == 200, doc
    return doc


def sees(s, names: set[str]) -> bool:
    try:
        return {n["name"] for n in view(s)["nodes"]} == names
    except OSError:
        return False


def converge(*servers, timeout: float = 15.0) -> None:
    names = {s.name for s in servers}
    for s in servers:
        wait_for(lambda s=s: sees(s, names), timeout, 0.05, f"{s.name} to see {names}")


def loads(servers, model: str) -> int:
    """Loads of ``model`` started (instance processes spawned for it), over
    the nodes' logs; a wake from sleep is no load."""
    return sum(s.logs().count(f"loading {model} in slot") for s in servers)


def node_of(model: str, s) -> str | None:
    try:
        return s.models().get(model, {}).get("status", {}).get("node")
    except OSError:
        return None


def ask(s, model: str, **extra):
    status, _, body = s.request("POST", "/v1/chat/completions",
                                chat_body(model, max_tokens=2, **extra))
    return status, body


def ask_until_served(s, model: str, timeout: float = 60.0):
    """``ask`` again while the answer is 503 ``model_loading`` (the load
    outlasts a short ``--load-wait``: a client retries, as Retry-After
    says), until ``timeout``; returns the last ``(status, body)``. Issue
    37, item 15: a load takes longer than 3 s at load 6-9."""
    deadline = time.monotonic() + timeout
    while True:
        status, body = ask(s, model)
        if status != 503 or b"model_loading" not in body or time.monotonic() > deadline:
            return status, body


def served_on(body: bytes, *servers) -> str:
    _, pid = served_by(body)
    for s in servers:
        if pid in children_of(s.proc.pid):
            return s.name
    raise AssertionError(f"pid {pid} is no node's child")


def read_stream(sock: socket.socket, timeout: float = 30.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while b"[DONE]" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


# 1 -------------------------------------------------------------------------------
def test_a_model_only_one_node_has_loads_there_once_and_is_served_through_another(cluster):
    a = cluster("a", models={"shared": {}})
    b = cluster("b", models={"shared": {}})
    c = cluster("c", models={"onlyc": {"load_s": 0.2}})
    converge(a, b, c)
    wait_for(lambda: "onlyc" in a.models(), 10, 0.05, "onlyc registered on a")
    status, body = ask(a, "onlyc")
    assert status == 200, body
    assert served_on(body, a, b, c) == "c"
    for s in (a, b):
        wait_for(lambda s=s: node_of("onlyc", s) == "c", 10, 0.05, f"{s.name} shows onlyc on c")
        assert s.models()["onlyc"]["nodes"] == [{"node": "c", "state": "loaded"}]
        assert s.models()["onlyc"]["status"]["value"] == "loaded"
    status, body = ask(b, "onlyc")
    assert status == 200 and served_on(body, a, b, c) == "c"
    assert loads([a, b, c], "onlyc") == 1
    # /metrics has one series per node
    status, _, text = a.request("GET", "/metrics")
    assert status == 200
    assert b'ggmux_cluster_node_models{node="c"} 1' in text
    assert b'ggmux_cluster_node_models{node="a"} 0' in text
    assert b'ggmux_cluster_connected{node="a"} 1' in text


# 2 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_twenty_concurrent_cold_requests_over_three_nodes_make_exactly_one_load(cluster):
    beh = {"m": {"load_s": 0.5}}
    nodes = [cluster(n, models=beh) for n in "abc"]
    converge(*nodes)
    with ThreadPoolExecutor(20) as pool:
        results = list(pool.map(lambda k: ask(nodes[k % 3], "m"), range(20)))
    assert [s for s, _ in results] == [200] * 20, [b for _, b in results]
    assert loads(nodes, "m") == 1
    assert len({served_on(b, *nodes) for _, b in results}) == 1


# 3 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_model_loads_on_the_only_node_with_room_for_it(cluster):
    big = {"big": {"min_bytes": 600 * MiB, "max_bytes": 600 * MiB, "mem_bytes": 600 * MiB}}
    a = cluster("a", "--host-memory", "512", models=big)
    b = cluster("b", "--host-memory", "1024", models=big)
    c = cluster("c", "--host-memory", "512", models=big)
    converge(a, b, c)
    for s in (a, b, c):
        wait_for(lambda s=s: "measured big" in s.logs(), 15, 0.05, f"{s.name} measured big")
    # the measured min reaches the others with the next beat
    wait_for(lambda: _has_measured(a, {"a", "b", "c"}), 10, 0.05, "measured records at a")
    status, body = ask(a, "big")
    assert status == 200, body
    assert served_on(body, a, b, c) == "b"
    assert loads([a, b, c], "big") == 1


def _has_measured(s, names) -> bool:
    """Every node's record with its model measured reached ``s``."""
    doc = view(s)
    return {n["name"] for n in doc["nodes"] if n.get("measured")} >= names


@pytest.mark.slow
def test_full_nodes_evict_the_cluster_lru_idle_model_and_busy_ones_make_requests_wait(cluster):
    # a stream without max_tokens lasts ~40 s (sleeps: as long at any load),
    # past the wait for every node to look busy and the 3 s load-wait
    slow = {"tokens": 2000, "token_s": 0.02}
    common = ("--models-max", "1", "--load-wait", "3")
    a = cluster("a", *common, models={"ia": slow, "m": slow, "m2": {}})
    b = cluster("b", *common, models={"ib": slow, "m": slow, "m2": {}})
    c = cluster("c", *common, models={"ic": slow, "m": slow, "m2": {}})
    converge(a, b, c)
    # fill every node with one idle model; b's is used first, so it is the LRU one
    for s, model in ((b, "ib"), (a, "ia"), (c, "ic")):
        status, body = ask_until_served(s, model)
        assert status == 200 and served_on(body, a, b, c) == s.name
        time.sleep(0.3)  # distinct last-use times (the scenario, not a synchronisation)
    for s in (a, b, c):
        wait_for(lambda s=s: all(node_of(x, s) for x in ("ia", "ib", "ic")), 40, 0.05,
                 f"{s.name} sees every idle model")
    status, body = ask_until_served(a, "m")
    assert status == 200, body
    assert served_on(body, a, b, c) == "b"
    wait_for(lambda: "ib" not in {n for n in view(b)["nodes"][0]["models"]}, 40, 0.05,
             "ib evicted on b")
    # now every node's one replica is busy: a cold model waits, then 503 with loading
    socks = [open_stream(a.port, chat_body("ia", stream=True)),
             open_stream(b.port, chat_body("m", stream=True)),
             open_stream(c.port, chat_body("ic", stream=True))]
    try:
        wait_for(lambda: all(_busy_entry(n) for n in view(a)["nodes"]), 10, 0.02,
                 "a sees every node busy")
        status, _, raw = a.request("POST", "/v1/chat/completions", chat_body("m2", max_tokens=2))
        assert status == 503, raw
        err = json.loads(raw)["error"]
        assert err["code"] == "model_loading"
        assert "limit" not in err["message"]
        assert err["loading"]["node"] is None and err["loading"]["state"]
    finally:
        for k in socks:
            k.close()
    assert loads([a, b, c], "m2") == 0


def _busy_entry(n: dict) -> bool:
    return any(d["in_flight"] > 0 for d in n["models"].values())


def _busy(s) -> bool:
    return _busy_entry(view(s)["nodes"][0])


# 4 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_killed_node_disappears_within_node_stale_and_its_model_loads_elsewhere(cluster):
    slow = {"tokens": 60, "token_s": 0.05}  # a stream lasts ~3 s
    a = cluster("a", models={"m": {}, "la": slow})
    b = cluster("b", models={"m": {}, "lb": slow})
    c = cluster("c", models={"m": {}})
    converge(a, b, c)
    status, body = ask(c, "m")
    assert status == 200 and served_on(body, a, b, c) == "c"
    for s in (a, b):
        wait_for(lambda s=s: node_of("m", s) == "c", 10, 0.05, f"{s.name} sees m on c")
    streams = [open_stream(a.port, chat_body("la", stream=True)),
               open_stream(b.port, chat_body("lb", stream=True))]
    os.kill(c.proc.pid, signal.SIGKILL)
    c.proc.wait(10)
    t0 = time.monotonic()
    for s in (a, b):
        wait_for(lambda s=s: node_of("m", s) is None and not sees(s, {"a", "b", "c"}),
                 STALE + 2 * HB + 1.0, 0.02, f"{s.name} drops c")
    gone_after = time.monotonic() - t0
    status, body = ask(a, "m")
    assert status == 200, body
    assert served_on(body, a, b) in ("a", "b")
    for k in streams:
        assert b"[DONE]" in read_stream(k)
        k.close()
    # judged --node-stale after its last beat arrived (before the kill), on a
    # tick of a quarter beat, then published to the proxies
    assert gone_after < STALE + HB, f"c dropped {gone_after:.3f} s after the kill"
    # what a SIGKILLed supervisor could not remove: its segment, log ring and queue
    wait_for(lambda: not children_of(c.proc.pid), 10, 0.05, "c's children gone")
    unlink_server_objects(c.port)


# 5 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_nats_down_for_ten_seconds_under_traffic_loses_no_request(cluster):
    a = cluster("a", models={"la": {}})
    b = cluster("b", models={"rb": {}})
    converge(a, b)
    status, body = ask(a, "rb")
    assert status == 200 and served_on(body, a, b) == "b"
    stop = threading.Event()
    results: list[int] = []

    def traffic() -> None:
        while not stop.is_set():
            for model in ("la", "rb"):
                try:
                    results.append(ask(a, model)[0])
                except OSError as e:
                    results.append(repr(e))
            time.sleep(0.02)

    t = threading.Thread(target=traffic, daemon=True)
    t.start()
    try:
        wait_for(lambda: len(results) > 10, 10, 0.05, "traffic")
        cluster.nats.stop(kill=True)
        wait_for(lambda: not view(a)["connected"] and not view(b)["connected"], 10, 0.05,
                 "both nodes notice NATS is gone")
        time.sleep(10)  # the outage itself (the scenario, not a synchronisation)
        during = len(results)
        cluster.nats.start()
        t0 = time.monotonic()
        for s in (a, b):
            wait_for(lambda s=s: view(s)["connected"], 10, 0.02, f"{s.name} reconnects")
        converge(a, b, timeout=2 * HB + 5.0)
        wait_for(lambda: node_of("rb", a) == "b", 2 * HB + 5.0, 0.02, "a sees rb on b")
        converged_after = time.monotonic() - t0
        wait_for(lambda: len(results) > during + 10, 10, 0.05, "traffic after NATS returned")
    finally:
        stop.set()
        t.join(30)
    assert results and all(r == 200 for r in results), [r for r in results if r != 200][:5]
    assert converged_after < 2 * HB, f"views converged {converged_after:.3f} s after NATS returned"


# 6 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_drained_node_finishes_its_stream_takes_no_placement_and_exits_0(cluster):
    slow = {"tokens": 40, "token_s": 0.05}  # a stream lasts ~2 s
    keys = ("--admin-key", "adm")
    a = cluster("a", *keys, models={"z": {}, "w": {}})
    b = cluster("b", *keys, models={"z": {}, "w": {}, "s": slow})
    c = cluster("c", *keys, models={"x": {}})
    converge(a, b, c)
    status, body = ask(b, "z")  # z loads on b (the node that asked), and stays idle
    assert status == 200 and served_on(body, a, b, c) == "b"
    wait_for(lambda: node_of("z", a) == "b", 10, 0.05, "a sees z on b")
    stream = open_stream(b.port, chat_body("s", stream=True))
    wait_for(lambda: view(b)["nodes"][0]["models"].get("s", {}).get("in_flight"), 10, 0.02,
             "b streams")
    status, _ = b.json("POST", "/cluster/drain")
    assert status == 401  # the admin key is needed
    status, doc = b.json("POST", "/cluster/drain", headers={"authorization": "Bearer adm"})
    assert status == 202, doc
    wait_for(lambda: node_of("z", a) is None, 10, 0.02, "a stops using b for z")
    status, body = ask(c, "w")  # only a and b have w; b drains
    assert status == 200 and served_on(body, a, b, c) == "a"
    status, body = ask(a, "z")  # b's idle model is served from elsewhere
    assert status == 200 and served_on(body, a, b, c) in ("a", "c")
    data = read_stream(stream)
    stream.close()
    assert b"[DONE]" in data
    assert b.proc.wait(30) == 0
    wait_for(lambda: not sees(a, {"a", "b", "c"}), 10, 0.05, "b left")


# 7 -------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_hop_header_needs_the_token_and_forwarding_works_with_an_api_key(cluster):
    key = {"authorization": "Bearer K"}
    a = cluster("a", "--api-key", "K", models={"la": {}})
    b = cluster("b", "--api-key", "K", models={"rb": {}})
    converge_keyed(a, b, key)
    status, body = ask_keyed(a, "rb", key)
    assert status == 200, body
    assert served_on(body, a, b) == "b"
    assert ask_keyed(a, "rb", {})[0] == 401
    # the hop header without the token is an ordinary client: no way around the key...
    assert ask_keyed(b, "rb", {"x-ggmux-hop": "a"})[0] == 401
    assert ask_keyed(b, "rb", {"x-ggmux-hop": "a", "x-ggmux-cluster-token": "wrong"})[0] == 401
    # ...and it may be forwarded (a node trusting it would answer 503 "not on this node")
    status, body = ask_keyed(a, "rb", {**key, "x-ggmux-hop": "b"})
    assert status == 200 and served_on(body, a, b) == "b"
    # with the token it is a forwarded request: no key needed, never forwarded again
    hop = {"x-ggmux-hop": "b", "x-ggmux-cluster-token": TOKEN}
    status, body = ask_keyed(b, "rb", hop)
    assert status == 200 and served_on(body, a, b) == "b"
    status, raw = ask_keyed(a, "rb", hop)
    assert status == 503 and json.loads(raw)["error"]["code"] == "not_on_this_node"


@pytest.mark.slow
def test_neither_the_hop_header_nor_the_cluster_token_reaches_a_local_instance_or_upstream(
        cluster, serve, tmp_path, recorder):
    """A forwarded request (hop header and token) is served by a local
    replica, on the fast path too once a pooled connection is idle; what the
    replica gets carries neither header, in cluster mode or not."""
    up_port, up_requests = recorder
    log = tmp_path / "local.jsonl"
    log.touch()
    rec = Path(__file__).with_name("recorder.py")
    ini = tmp_path / "hop.ini"
    ini.write_text(f"[c]\ncmd = {sys.executable} {rec} --port ${{PORT}} --log {log}\n"
                   f"[up]\nupstream = http://127.0.0.1:{up_port}\n")
    a = cluster("a", "--models-preset", str(ini))
    plain = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1",
                  "--spares", "0")
    hop = {"x-ggmux-hop": "b", "x-ggmux-cluster-token": TOKEN}
    for s in (a, plain):
        wait_for(lambda s=s: s.request("GET", "/upstream/up/health")[0] == 200, 20, 0.1,
                 "the upstream healthy")
        for model in ("c", "up"):
            # an ordinary request loads it (a node serves a forwarded request only
            # with a model it holds), the next ones go over a pooled connection
            for headers in ({}, hop, {"x-ggmux-hop": "b"}, {"x-ggmux-cluster-token": TOKEN}):
                for _ in range(3):
                    status, body = ask_keyed(s, model, headers)
                    assert status == 200, body
    local = [json.loads(line) for line in log.read_text().splitlines()]
    seen = [r for r in local + up_requests() if not r["path"].endswith("/health")]
    assert len(seen) == 2 * 2 * 4 * 3, seen
    for r in seen:
        assert "x-ggmux-hop" not in r["headers"], r
        assert "x-ggmux-cluster-token" not in r["headers"], r
        assert TOKEN not in json.dumps(r["headers"]), r


@pytest.mark.slow
def test_cluster_and_nats_secrets_are_on_no_child_command_line_nor_in_any_environment(
        nats_server, serve, tmp_path, monkeypatch):
    """``--cluster-token`` and ``--nats-password`` on node a's command line,
    ``$GGMUX_CLUSTER_TOKEN`` and ``$GGMUX_NATS_PASSWORD`` in node b's
    environment: both join and forward, and no child of either (proxies,
    instance, spare, cluster agent) has a secret or its variable in its
    command line or environment."""
    token, password = "cluster-token-on-argv-1234", "nats-password-5678"
    ns = nats_server(auth=["--user", "u", "--pass", password])
    common = ("--no-hf-cache", "--proxies", "1", "--spares", "1", "--cluster", ns.url,
              "--nats-user", "u", "--heartbeat", str(HB), "--node-stale", str(STALE))
    da, db = tmp_path / "models-a", tmp_path / "models-b"
    write_fake(da, "la")
    write_fake(db, "rb")
    a = serve("--fake-models-dir", str(da), "--node-name", "a", *common,
              "--cluster-token", token, "--nats-password", password)
    monkeypatch.setenv("GGMUX_CLUSTER_TOKEN", token)
    monkeypatch.setenv("GGMUX_NATS_PASSWORD", password)
    b = serve("--fake-models-dir", str(db), "--node-name", "b", *common)
    a.name, b.name = "a", "b"
    converge(a, b)
    status, body = ask(a, "rb")  # forwarded to b with the token, which b takes
    assert status == 200, body
    assert served_on(body, a, b) == "b"
    assert ask(a, "la")[0] == 200
    for s in (a, b):
        # proxy, spare, cluster agent, and a's instance of la or b's of rb
        wait_for(lambda s=s: len(descendants(s.proc.pid)) >= 4, 20, what="children started")
        secrets = (token, password, "GGMUX_CLUSTER_TOKEN", "GGMUX_NATS_PASSWORD")
        assert secrets_shown(s.proc.pid, secrets) == [], s.name


def ask_keyed(s, model: str, headers: dict):
    status, _, body = s.request("POST", "/v1/chat/completions", chat_body(model, max_tokens=2),
                                headers=headers)
    return status, body


def converge_keyed(*servers_and_key) -> None:
    *servers, key = servers_and_key
    names = {s.name for s in servers}
    for s in servers:
        def ok(s=s) -> bool:
            status, doc = s.json("GET", "/cluster", headers=key)
            return status == 200 and {n["name"] for n in doc["nodes"]} == names

        wait_for(ok, 15, 0.05, f"{s.name} to see {names}")


# bad input and faults at start ----------------------------------------------------
@pytest.mark.slow
def test_nats_unreachable_at_start_the_node_serves_alone_says_so_once_and_joins_later(
        cluster):
    cluster.nats.stop()  # its port is known; nothing listens there now
    a = cluster("a", models={"la": {}})
    status, body = ask(a, "la")
    assert status == 200 and served_on(body, a) == "a"
    assert view(a)["connected"] is False
    time.sleep(4 * HB)  # retries go on meanwhile (the scenario, not a synchronisation)
    assert a.logs().count("serving this node's models alone, retrying") == 1, a.logs()
    cluster.nats.start()
    wait_for(lambda: view(a)["connected"], 10, 0.05, "a joins once NATS is up")


@pytest.mark.slow
def test_a_loading_model_503_names_the_node_and_state(cluster):
    a = cluster("a", "--load-wait", "1", models={"la": {}})
    c = cluster("c", models={"slow": {"load_s": 4.0}})
    converge(a, c)
    wait_for(lambda: "slow" in a.models(), 10, 0.05, "slow registered on a")
    status, _, raw = a.request("POST", "/v1/chat/completions", chat_body("slow", max_tokens=2))
    assert status == 503, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "model_loading"
    assert err["loading"]["node"] == "c"
    assert err["loading"]["state"] in ("placing", "loading")


def test_bad_cluster_urls_and_options_stop_the_start_naming_the_option(tmp_path):
    import subprocess
    import sys

    write_fake(tmp_path, "m")
    for args, needle in ((["--cluster", "http://127.0.0.1:4222"], "--cluster"),
                         (["--cluster", "nats://127.0.0.1:4222", "--node-name", "a.b"],
                          "--node-name"),
                         (["--cluster", "nats://127.0.0.1:4222", "--node-stale", "1"],
                          "--node-stale")):
        p = subprocess.run([sys.executable, "-m", "ggmux.supervisor", "serve", "--port", "1",
                            "--fake-models-dir", str(tmp_path), "--no-hf-cache", *args],
                           check=False, capture_output=True, text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert needle in p.stderr


@pytest.mark.slow
def test_bad_nats_credentials_stop_the_start_naming_the_options(nats_server, serve, fakes):
    ns = nats_server(auth=["--user", "u", "--pass", "p"])
    fakes.add("m")
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--cluster", ns.url.replace("nats://", "nats://u:wrong@"), "--node-name", "a",
              ready=False)
    assert s.proc.wait(30) == 1
    assert "NATS refused the credentials" in s.logs()
    assert "--cluster URL" in s.logs()


@pytest.mark.slow
def test_a_second_node_with_a_live_nodes_name_refuses_to_start(cluster):
    a = cluster("a", models={"m": {}})
    again = cluster("a", models={"m": {}}, ready=False)
    assert again.proc.wait(STALE + 20) == 1
    assert "--node-name a is taken by a live node" in again.logs()
    assert view(a)["connected"]


def test_nothing_of_nats_is_imported_without_cluster():
    import subprocess
    import sys

    code = ("import sys, ggmux.supervisor.cli, ggmux.supervisor.main, ggmux.proxy.server; "
            "sys.exit('nats' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0


@pytest.mark.slow
def test_a_failed_load_on_another_node_answers_503_with_its_cause(cluster):
    a = cluster("a", models={"la": {}})
    c = cluster("c", models={"broken": {"fail_load": "no such tensor", "load_s": 0.1}})
    converge(a, c)
    wait_for(lambda: "broken" in a.models(), 10, 0.05, "broken registered on a")
    status, headers, raw = a.request("POST", "/v1/chat/completions",
                                     chat_body("broken", max_tokens=2))
    assert status == 503, raw
    err = json.loads(raw)["error"]
    assert err["code"] == "model_load_failed"
    assert "node c" in err["message"] and "no such tensor" in err["message"]
    assert int(headers["retry-after"]) >= 1


@pytest.mark.slow
def test_a_model_asleep_on_another_node_is_woken_there_by_a_forwarded_request(cluster):
    a = cluster("a", models={"la": {}})
    b = cluster("b", "--sleep-idle-seconds", "0.5", models={"rb": {"wake_s": 0.1}})
    converge(a, b)
    status, body = ask(a, "rb")
    assert status == 200 and served_on(body, a, b) == "b"
    wait_for(lambda: a.models()["rb"]["nodes"] == [{"node": "b", "state": "sleeping"}], 15,
             0.05, "a sees rb asleep on b")
    status, body = ask(a, "rb")
    assert status == 200, body
    assert served_on(body, a, b) == "b"
    assert loads([a, b], "rb") == 1


@pytest.mark.slow
def test_a_cold_model_waiting_past_its_bound_on_a_busy_cluster_drains_a_model_on_its_node(
        cluster):
    # issue 34: both nodes' one replica busy; a cold model waits its bound
    # (1 s here), then loads on the node that asked, where its busy model drains
    slow = {"tokens": 100, "token_s": 0.03}  # a stream lasts ~3 s
    common = ("--models-max", "1", "--load-wait", "60", "--max-wait", "1",
              "--min-residency", "0")
    a = cluster("a", *common, models={"ia": slow, "cold": {}})
    b = cluster("b", *common, models={"ib": slow, "cold": {}})
    converge(a, b)
    for s, model in ((a, "ia"), (b, "ib")):
        assert ask(s, model)[0] == 200
    socks = [open_stream(a.port, chat_body("ia", stream=True)),
             open_stream(b.port, chat_body("ib", stream=True))]
    try:
        wait_for(lambda: all(_busy_entry(n) for n in view(a)["nodes"]), 10, 0.02,
                 "a sees every node busy")
        status, body = ask(a, "cold")
        assert status == 200, body
        assert served_on(body, a, b) == "a"
        got = [read_stream(k) for k in socks]
    finally:
        for k in socks:
            k.close()
    assert all(b"data: [DONE]" in g for g in got)  # the drained stream was not cut
    assert "past its bound" in a.logs() and "draining ia" in a.logs()
