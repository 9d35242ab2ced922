"""Cluster visibility (issue 22 item 2) with two real nodes, fake models and
a real nats-server: ``/models/sse`` events carry ``status.node`` and
``nodes`` as ``/v1/models`` does, so the page's node column fills and stays
filled, and ``ggmux ps`` has a NODE column."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import CHROMIUM, wait_for, write_fake
from test_cluster import HB, STALE, TOKEN, converge, node_of
from test_page import row

pytestmark = pytest.mark.slow  # two nodes and the page; quick cluster tests: test_cluster.py


@pytest.fixture
def cluster(nats_server, serve, tmp_path):
    """``cluster(name, models={name: behaviour}) -> Server``: a node of one
    cluster (as test_cluster.py's)."""
    ns = nats_server()

    def node(name: str, models: dict) -> object:
        d = tmp_path / f"models-{name}"
        for m, behaviour in models.items():
            write_fake(d, m, **behaviour)
        s = serve("--fake-models-dir", str(d), "--no-hf-cache", "--proxies", "1",
                  "--spares", "0", "--cluster", ns.url, "--node-name", name,
                  "--heartbeat", str(HB), "--node-stale", str(STALE), "--cluster-token", TOKEN)
        s.name = name
        return s

    return node


def sse_models(s, until, timeout: float = 20.0) -> list[dict]:
    """``/models/sse`` events of ``s`` until ``until(events)`` holds."""
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=timeout)
    got, events = b"", []
    try:
        sock.sendall(b"GET /models/sse HTTP/1.1\r\nhost: x\r\n\r\n")
        while not until(events):
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
            events = [json.loads(line[6:]) for line in got.split(b"\n")
                      if line.startswith(b"data: ")]
    finally:
        sock.close()
    return events


def test_events_the_page_and_ggmux_ps_name_the_node_that_serves_a_model(cluster, request):
    a = cluster("a", models={"here": {}})
    b = cluster("b", models={"onlyb": {"load_s": 0.2}})
    converge(a, b)
    wait_for(lambda: "onlyb" in a.models(), 10, 0.05, "onlyb registered on a")
    assert b.request("POST", "/models/load", {"model": "onlyb"})[0] == 200
    held = [{"node": "b", "state": "loaded"}]
    wait_for(lambda: a.models()["onlyb"].get("nodes") == held, 15, 0.05, "a sees onlyb on b")
    listed = a.models()["onlyb"]
    assert node_of("onlyb", a) == "b"

    # the events say what the list says: the node and every node holding it
    events = sse_models(a, lambda evs: any(e["id"] == "onlyb" for e in evs))
    ev = next(e for e in events if e["id"] == "onlyb")
    assert ev["status"]["node"] == "b" and ev["status"]["value"] == "loaded"
    assert ev["nodes"] == listed["nodes"]
    here = next(e for e in events if e["id"] == "here")
    assert here["nodes"] == [] and "node" not in here["status"]

    # ggmux ps on a: a NODE column, b for onlyb
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
    r = subprocess.run([sys.executable, "-m", "ggmux", "ps", "--url", a.base],
                       capture_output=True, text=True, timeout=30, env=env, check=False)
    assert r.returncode == 0, r.stderr
    head, *lines = r.stdout.splitlines()
    assert head.split()[:3] == ["NAME", "STATE", "NODE"]
    line = next(x for x in lines if x.startswith("onlyb"))
    assert line.split()[1:3] == ["loaded", "b"]
    _, ps = a.json("GET", "/ps")
    assert ps["node"] == "a"
    assert next(m for m in ps["models"] if m["id"] == "onlyb")["node"] == "b"

    # the page on a: the node column shows and fills from the list and the events
    if not os.path.exists(CHROMIUM):
        return
    from playwright.sync_api import expect

    page = request.getfixturevalue("browser_page")
    page.goto(a.base + "/")
    cell = row(page, "onlyb").locator("td.col-node")
    expect(cell).to_be_visible()
    expect(cell).to_have_text("b")
    expect(page.locator("#live")).to_have_text("live")  # the events came, and kept it
    # a status change on b reaches a's page as an event, with the node still there
    assert b.request("POST", "/models/unload", {"model": "onlyb"})[0] == 200
    expect(row(page, "onlyb").locator(".state")).to_have_text("unloaded", timeout=20_000)
    expect(cell).to_have_text("")
    assert b.request("POST", "/models/load", {"model": "onlyb"})[0] == 200
    expect(row(page, "onlyb").locator(".state")).to_have_text("loaded", timeout=20_000)
    expect(cell).to_have_text("b")
    assert page.errors == []
