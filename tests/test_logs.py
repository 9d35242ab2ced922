"""Logs (issue 15): the supervisor keeps the last lines of itself and every
child in the log ring, tagged with model and replica; ``GET /logs`` serves
them as text (``?model=``, ``?lines=``), ``GET /logs/stream`` live, and
``ggmux logs [-f] [NAME]`` prints them."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import posix_ipc
import pytest
from conftest import chat_body, wait_for
from ggmux.proxy.operator.logs import model_filter
from ggmux.shm.logring import LogRing
from ggmux.supervisor.logs import RingHandler, child_level, tag_fields


# ---- the handler, in process -----------------------------------------------------------
def test_child_tags_say_model_and_replica():
    assert tag_fields("smollm2-135m#0") == ("smollm2-135m", 0)
    assert tag_fields("org/repo:Q4_K_M#12") == ("org/repo:Q4_K_M", 12)
    assert tag_fields("measure:gemma3-270m") == ("gemma3-270m", None)
    assert tag_fields("spare") == (None, None) and tag_fields("proxy-1") == (None, None)
    assert child_level("WARNING ggmux.instance: slow") == (logging.WARNING, "ggmux.instance: slow")
    assert child_level("llama_context: n_ctx 4096") == (logging.INFO, "llama_context: n_ctx 4096")


def test_the_handler_keeps_start_up_lines_until_the_ring_exists(tmp_path):
    h = RingHandler()
    logger = logging.getLogger(f"ggmux.test-{os.getpid()}")
    logger.addHandler(h)
    logger.setLevel(logging.INFO)
    try:
        logger.info("model %s: %s", "a", "/x.gguf")
        logger.warning("[%s] %s", "a#3", "raw", extra={"child": "a#3", "line": "boom"})
        ring = h.open(f"/ggmux-test-handler-{os.getpid()}", 1 << 16)
        logger.info("x" * 10_000)  # cut to fit one record
        recs = [json.loads(p) for p in ring.read(None)[0]]
    finally:
        logger.removeHandler(h)
        h.close_ring()
    assert [(r["src"], r["model"], r["replica"], r["level"]) for r in recs] == [
        ("supervisor", None, None, "INFO"), ("a#3", "a", 3, "WARNING"),
        ("supervisor", None, None, "INFO")]
    assert recs[0]["msg"] == "model a: /x.gguf" and recs[1]["msg"] == "boom"
    assert recs[2]["msg"].endswith(" [...]") and len(recs[2]["msg"]) < 2100


def test_the_model_filter_keeps_its_children_and_the_supervisors_lines_naming_it():
    keep = model_filter("a")
    assert keep({"model": "a", "msg": "x"})
    assert not keep({"model": "a-b", "msg": "about a"})
    assert keep({"model": None, "msg": "loading a in slot 0 (pid 1)"})
    assert keep({"model": None, "msg": "model a: /models/a.gguf"})
    assert not keep({"model": None, "msg": "loading a-b in slot 0"})
    assert not keep({"model": None, "msg": "loading ab in slot 0"})


# ---- a real server -----------------------------------------------------------------------
def test_logs_hold_the_supervisors_and_the_instances_lines_tagged(serve, fakes):
    fakes.add("alpha", tokens=2)
    fakes.add("beta", fail_requests=True)  # its instance logs the failure on its stderr
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2")
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
    assert s.request("POST", "/v1/chat/completions", chat_body("beta"))[0] == 500

    def text(q: str = "") -> str:
        st, h, body = s.request("GET", "/logs" + q)
        assert st == 200 and h["content-type"].startswith("text/plain")
        return body.decode()

    wait_for(lambda: "ERROR [beta#" in text(), 10, what="beta's instance error in /logs")
    every = text()
    assert "INFO [supervisor] listening on http://127.0.0.1:" in every
    assert "INFO [supervisor] model alpha: " in every  # a start-up line, before the ring
    line = next(x for x in every.splitlines() if "ERROR [beta#" in x)
    # the level parsed off the child's line; its traceback is in the same
    # record, one line (issue 31, item 3)
    assert "ggmux.instance: generation failed\\nTraceback (most recent call last):" in line
    alpha = text("?model=alpha")
    assert "loading alpha in slot" in alpha and "ready on port" in alpha
    assert "beta" not in alpha
    beta = text("?model=beta")
    assert "ERROR [beta#" in beta and "Traceback" in beta and "alpha" not in beta
    assert len(text("?model=alpha&lines=2").splitlines()) == 2
    st, _, _ = s.request("GET", "/logs?model=nope")
    assert st == 404
    assert s.request("GET", "/logs?lines=x")[0] == 400


def test_proxy_lines_reach_the_ring_too(serve, fakes):
    fakes.add("alpha", crash_marker="CRASH-NOW")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
    # the replica dies while it serves this request: the proxy's forward
    # fails, and it says so (a SIGKILL before the request raced the
    # supervisor, which may take the dead replica out of the table first)
    crash = chat_body("alpha", messages=[{"role": "user", "content": "CRASH-NOW"}])
    assert s.request("POST", "/v1/chat/completions", crash)[0] == 502
    wait_for(lambda: b"WARNING [proxy-0]" in s.request("GET", "/logs")[2], 10,
             what="a proxy-0 warning")
    assert b"(attempt 1)" in s.request("GET", "/logs")[2]


def _read_events(sock: socket.socket, want, timeout: float = 15.0) -> bytes:
    got = b""
    sock.settimeout(timeout)
    while not want(got):
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def test_logs_stream_sends_the_tail_then_new_lines_as_they_come(serve, fakes):
    fakes.add("alpha", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    sock = socket.create_connection(("127.0.0.1", s.port))
    try:
        sock.sendall(b"GET /logs/stream?model=alpha&lines=5 HTTP/1.1\r\nhost: x\r\n\r\n")
        head = _read_events(sock, lambda b: b"\r\n\r\n" in b)
        assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
        got = _read_events(sock, lambda b: b"ready on port" in b)
        recs = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: ")]
        assert any("loading alpha in slot" in r["msg"] for r in recs)
        assert all(r["model"] in (None, "alpha") for r in recs)
    finally:
        sock.close()


@pytest.mark.slow
def test_ggmux_logs_prints_and_follows(serve, fakes):
    fakes.add("alpha", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    env = {**os.environ, "GGMUX_URL": s.base}
    r = subprocess.run([sys.executable, "-m", "ggmux", "logs"], capture_output=True, text=True,
                       timeout=30, env=env, check=False)
    assert r.returncode == 0 and "[supervisor] listening on" in r.stdout
    follow = subprocess.Popen([sys.executable, "-m", "ggmux", "logs", "-f", "alpha"],
                              stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
        lines = []
        while not any("ready on port" in x for x in lines):
            line = follow.stdout.readline()
            assert line, lines
            lines.append(line)
        assert any("loading alpha in slot" in x for x in lines)
    finally:
        follow.kill()
        follow.wait()


def test_the_ring_is_removed_when_the_server_stops(serve, fakes):
    fakes.add("alpha")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    name = f"/ggmux-{s.port}-log"
    LogRing.attach(name).close()  # exists while serving
    s.stop()
    with pytest.raises(posix_ipc.ExistentialError):
        LogRing.attach(name)
