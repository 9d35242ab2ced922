"""The cluster agent alone against a real nats-server: node registry and
heartbeats (judged by arrival), load keys, request-reply commands,
reconnects, name refusal, credentials (DESIGN.md "Cluster", issue 13)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import wait_for
from ggmux.supervisor.cluster import names, options

HB = 0.5  # --heartbeat for these tests
STALE = 1.5  # --node-stale


class AgentProc:
    """``python -m ggmux.supervisor.cluster.agent`` fed a config line; its
    state lines are collected by a reader thread (``expect`` waits for one)."""

    def __init__(self, url: str, node: str, **extra) -> None:
        cfg = {"cmd": "config", "url": url, "node": node,
               "advertise": f"http://127.0.0.1:{9000 + len(node)}", "heartbeat": HB,
               "node_stale": STALE, **extra}
        self.node = node
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor.cluster.agent"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ})
        self.lines: queue.Queue = queue.Queue()
        self.seen: list[dict] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()
        self.send(cfg)

    def _read(self) -> None:
        for raw in self.proc.stdout:
            if raw.startswith(b"state:"):
                self.lines.put(json.loads(raw[6:]))

    def _read_err(self) -> None:
        for raw in self.proc.stderr:
            self.err.append(raw.decode(errors="replace"))

    def send(self, obj) -> None:
        line = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def expect(self, state: str, timeout: float = 10.0, **match) -> dict:
        """The first line (seen before or arriving within ``timeout``) in
        ``state`` whose fields equal ``match``; consumed."""
        def ok(d: dict) -> bool:
            return d.get("state") == state and all(d.get(k) == v for k, v in match.items())

        for i, d in enumerate(self.seen):
            if ok(d):
                return self.seen.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.node}: no {state} {match} in {timeout} s; saw "
                                     f"{self.seen[-12:]}; stderr {''.join(self.err)[-2000:]}")
            try:
                d = self.lines.get(timeout=min(left, 0.1))
            except queue.Empty:
                continue
            if ok(d):
                return d
            self.seen.append(d)

    def none_of(self, state: str, seconds: float, **match) -> None:
        """No line in ``state`` (matching) arrives for ``seconds`` (by deadline)."""
        with pytest.raises(AssertionError):
            self.expect(state, seconds, **match)

    def publish(self, record: dict, now: bool = True) -> None:
        self.send({"cmd": "publish", "record": record, "now": now})

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def agents():
    started: list[AgentProc] = []

    def start(url: str, node: str, **extra) -> AgentProc:
        a = AgentProc(url, node, **extra)
        started.append(a)
        return a

    yield start
    for a in started:
        if a.proc.poll() is None:
            try:
                os.kill(a.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        a.stop()


def test_two_agents_see_each_others_records_and_a_leaving_node_goes_at_once(nats_server, agents):
    ns = nats_server()
    a = agents(ns.url, "a")
    b = agents(ns.url, "b")
    a.expect("joined", node="a", reconnect=False)
    b.expect("joined", node="b")
    a.publish({"url": "http://a", "models": {"m1": {"state": "loaded"}}})
    b.publish({"url": "http://b", "models": {}})
    seen = b.expect("node", name="a")
    wait_for(lambda: seen["record"].get("models") or (seen.update(b.expect("node", name="a"))
                                                      or seen["record"].get("models")),
             10, 0.0, "a's record with its models at b")
    assert seen["record"]["models"] == {"m1": {"state": "loaded"}}
    assert seen["record"]["url"] == "http://a"
    assert isinstance(seen["arrived_ns"], int)
    a.expect("node", name="b")
    # beats keep arriving, one per heartbeat
    first = b.expect("node", name="a")["record"]["beat"]
    later = b.expect("node", name="a")["record"]["beat"]
    assert later > first
    # stdin EOF (the supervisor died): a deletes its key, b hears it at once
    t0 = time.monotonic()
    a.stop()
    assert a.proc.returncode == 0
    b.expect("gone", timeout=STALE, name="a", why="left")
    assert time.monotonic() - t0 < STALE


@pytest.mark.slow
def test_a_node_whose_beats_stop_is_stale_after_node_stale_and_back_when_they_resume(
        nats_server, agents):
    ns = nats_server()
    a, b = agents(ns.url, "a"), agents(ns.url, "b")
    a.expect("joined")
    b.expect("joined")
    b.publish({"url": "http://b"})
    a.expect("node", name="b")
    os.kill(b.proc.pid, signal.SIGSTOP)  # b's beats stop, its key stays until its TTL
    t0 = time.monotonic()
    gone = a.expect("gone", timeout=STALE + 3, name="b", why="stale")
    assert gone["age_s"] >= STALE
    assert time.monotonic() - t0 < STALE + 2 * HB + 1.0
    os.kill(b.proc.pid, signal.SIGCONT)  # its key expired meanwhile: it writes it anew
    a.expect("node", timeout=STALE + 3, name="b")


@pytest.mark.slow
def test_a_node_whose_clock_is_off_stays_alive_while_its_beats_arrive(nats_server, agents):
    """Judged by arrival: beats stamped an hour in the past (a clock that is
    off) keep the node alive, and it goes stale only once they stop."""
    import nats

    ns = nats_server()
    a = agents(ns.url, "a")
    a.expect("joined")
    stop = threading.Event()

    async def beats() -> None:
        nc = await nats.connect(ns.url)
        kv = await nc.jetstream().key_value(names.NODES_BUCKET)
        n = 0
        while not stop.is_set():
            n += 1
            rec = {"url": "http://skew", "node": "skew", "beat": n, "sent": time.time() - 3600}
            await kv.put("skew", json.dumps(rec).encode())
            await asyncio.sleep(HB)
        await nc.close()

    t = threading.Thread(target=lambda: asyncio.run(beats()), daemon=True)
    t.start()
    try:
        a.expect("node", name="skew")
        a.none_of("gone", 3 * STALE, name="skew")
    finally:
        stop.set()
        t.join(10)
    a.expect("gone", timeout=STALE + 2, name="skew", why="stale")


def test_a_second_node_with_a_live_name_refuses_and_a_dead_ones_name_is_free(
        nats_server, agents):
    ns = nats_server()
    a = agents(ns.url, "same")
    a.expect("joined")
    a.publish({"url": "http://first"})
    b = agents(ns.url, "same")
    r = b.expect("refused", timeout=STALE + 5)
    assert "--node-name same is taken" in r["error"]
    assert "http://first" in r["error"]
    assert b.proc.wait(10) == 2
    # a node killed outright leaves its key until the TTL; a new one of the
    # same name waits it out and joins
    a.proc.kill()
    a.proc.wait()
    c = agents(ns.url, "same")
    c.expect("joined", timeout=STALE + 5)


def test_one_load_key_per_model_renewed_by_its_holder_and_released(nats_server, agents):
    ns = nats_server()
    a, b, c = agents(ns.url, "a"), agents(ns.url, "b"), agents(ns.url, "c")
    for x in (a, b, c):
        x.expect("joined")
    model = "org/repo:Q4_K_M"
    a.send({"cmd": "claim", "model": model, "node": "b", "ref": 1})
    c.send({"cmd": "claim", "model": model, "node": "c", "ref": 7})
    ca = a.expect("claimed", ref=1)
    cc = c.expect("claimed", ref=7)
    assert [ca["ok"], cc["ok"]].count(True) == 1, (ca, cc)  # create is exclusive
    winner = "b" if ca["ok"] else "c"
    loser = cc if ca["ok"] else ca
    assert loser["holder"] == winner
    holder = b if winner == "b" else c
    for x in (a, b, c):
        assert x.expect("load", model=model)["entry"]["node"] == winner
    # the holder renews past the TTL while the load makes progress
    holder.send({"cmd": "hold", "model": model, "progress": 0.5})
    a.none_of("load", 2 * STALE, model=model, entry=None)
    wait_for(lambda: a.expect("load", model=model)["entry"]["progress"] == 0.5, 10, 0,
             "renewed progress")
    holder.send({"cmd": "release", "model": model})
    a.expect("load", model=model, entry=None)
    a.send({"cmd": "claim", "model": model, "node": "a", "ref": 2})
    assert a.expect("claimed", ref=2)["ok"] is True


@pytest.mark.slow
def test_a_load_key_nobody_renews_expires(nats_server, agents):
    ns = nats_server()
    a, b = agents(ns.url, "a"), agents(ns.url, "b")
    a.expect("joined")
    b.expect("joined")
    a.send({"cmd": "claim", "model": "m", "node": "dead-node", "ref": 1})
    assert a.expect("claimed", ref=1)["ok"] is True
    b.expect("load", model="m")
    t0 = time.monotonic()
    b.expect("load", timeout=STALE + 5, model="m", entry=None)
    assert time.monotonic() - t0 >= STALE - 2 * HB
    b.send({"cmd": "claim", "model": "m", "node": "b", "ref": 2})
    assert b.expect("claimed", ref=2)["ok"] is True


def test_commands_are_request_reply_answered_by_the_supervisors_ack(nats_server, agents):
    ns = nats_server()
    a, b = agents(ns.url, "a"), agents(ns.url, "b")
    a.expect("joined")
    b.expect("joined")
    a.send({"cmd": "request", "ref": 5, "node": "b", "op": "load", "model": "m"})
    order = b.expect("order", op="load")
    assert order["model"] == "m" and order["from"] == "a"
    b.send({"cmd": "ack", "id": order["id"], "ok": True, "detail": "loading"})
    reply = a.expect("reply", ref=5)
    assert reply["ok"] is True and reply["node"] == "b" and reply["detail"] == "loading"
    # an order the supervisor does not answer fails with a clear error
    a.send({"cmd": "request", "ref": 6, "node": "b", "op": "unload", "model": "m"})
    b.expect("order", op="unload")
    r = a.expect("reply", ref=6)
    assert r["ok"] is False and "did not answer" in r["error"]
    # a node nobody runs
    a.send({"cmd": "request", "ref": 7, "node": "nobody", "op": "drain"})
    r = a.expect("reply", ref=7)
    assert r["ok"] is False and "nobody" in r["error"]


@pytest.mark.slow
def test_nats_unreachable_at_start_then_up_then_killed_and_back(nats_server, agents, tmp_path):
    ns = nats_server()
    ns.stop()  # the port is known, nothing listens
    a = agents(ns.url, "a")
    u = a.expect("unreachable")
    assert u["error"]
    a.none_of("unreachable", 3 * HB)  # one line per outage, not one per retry
    b = agents(ns.url, "b")
    b.expect("unreachable")
    ns.start()
    a.expect("joined", timeout=5 * HB + 5, reconnect=False)
    b.expect("joined", timeout=5 * HB + 5)
    a.publish({"url": "http://a", "n": 1})
    b.expect("node", name="a")
    ns.stop(kill=True)
    a.expect("unreachable")
    b.expect("unreachable")
    # while NATS is away nobody is judged stale: no beat could arrive
    b.none_of("gone", STALE + HB, name="a")
    ns.start()
    t0 = time.monotonic()
    a.expect("joined", timeout=10, reconnect=True)
    b.expect("joined", timeout=10, reconnect=True)
    b.expect("node", timeout=10, name="a")  # republished
    assert time.monotonic() - t0 < 2 * HB + 3.0
    b.none_of("gone", STALE + HB, name="a")


def test_bad_credentials_refuse_and_good_ones_from_url_or_options_join(nats_server, agents):
    ns = nats_server(auth=["--user", "u", "--pass", "p"])
    bad = agents(ns.url.replace("nats://", "nats://u:wrong@"), "bad")
    r = bad.expect("refused")
    assert "credentials" in r["error"] and "--cluster URL" in r["error"]
    assert bad.proc.wait(10) == 2
    none = agents(ns.url, "none")
    assert "credentials" in none.expect("refused")["error"]
    in_url = agents(ns.url.replace("nats://", "nats://u:p@"), "in-url")
    in_url.expect("joined")
    by_option = agents(ns.url, "by-option", user="u", password="p")
    by_option.expect("joined")


def test_token_auth(nats_server, agents):
    ns = nats_server(auth=["--auth", "s3cret"])
    agents(ns.url, "t1", token="s3cret").expect("joined")
    agents(ns.url.replace("nats://", "nats://s3cret@"), "t2").expect("joined")
    assert "credentials" in agents(ns.url, "t3", token="nope").expect("refused")["error"]


# ---- no NATS: names and options ------------------------------------------------
@pytest.mark.parametrize("model", ["m", "org/repo:Q4_K_M", "a.b c", "é-ü_1", "x=y"])
def test_load_keys_are_valid_nats_keys_and_reversible(model):
    key = names.load_key(model)
    assert names.model_from_key(key) == model
    assert all(ch.isalnum() and ch.isascii() or ch in "-_=." for ch in key)


def _args(**kw) -> argparse.Namespace:
    base = argparse.Namespace(
        cluster="nats://127.0.0.1:4222", node_name="n1", advertise=None, cluster_token=None,
        heartbeat=2.0, node_stale=6.0, nats_user=None, nats_password=None, nats_token=None,
        nats_creds=None, nats_tls_ca=None, host="127.0.0.1", port=8080)
    vars(base).update(kw)
    return base


@pytest.mark.parametrize(("kw", "needle"), [
    ({"cluster": "http://x:4222"}, "--cluster"),
    ({"cluster": "nats://"}, "--cluster"),
    ({"cluster": "nats://h:99999"}, "--cluster"),
    ({"cluster": "nats://h:4222/path"}, "--cluster"),
    ({"cluster": "nats://u:p@h:4222", "nats_user": "x", "nats_password": "y"}, "not both"),
    ({"nats_user": "x"}, "--nats-user and --nats-password"),
    ({"node_name": "a.b"}, "--node-name"),
    ({"heartbeat": 0.0}, "--heartbeat"),
    ({"node_stale": 1.0}, "--node-stale"),
    ({"advertise": "ftp://h"}, "--advertise"),
    ({"nats_tls_ca": "/nonexistent.pem"}, "--nats-tls-ca"),
])
def test_bad_cluster_options_are_errors_naming_the_option(kw, needle):
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        options.from_args(_args(**kw))


def test_cluster_options_defaults_and_redaction():
    o = options.from_args(_args(cluster="nats://u:pw@10.0.0.1", host="0.0.0.0"))
    assert o.url == "nats://u:pw@10.0.0.1:4222"
    assert o.advertise.startswith("http://") and o.advertise.endswith(":8080")
    assert "0.0.0.0" not in o.advertise
    assert options.redact(o.url) == "nats://u:***@10.0.0.1:4222"
    assert options.redact("nats://tok@h:1") == "nats://***@h:1"
    assert "cluster_token" not in o.agent_config()
    assert options.from_args(_args(cluster=None)) is None
