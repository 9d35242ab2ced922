"""Issue 11, the forwarding side: retries, circuits, keys, stopping, paths,
hung replicas. Real ggmux processes on fake instances (and a recording
replica, tests/recorder.py, where what reaches a replica is the question)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    alive,
    chat_body,
    descendants,
    open_stream,
    secrets_shown,
    served_by,
    wait_for,
)
from ggmux.shm import layout as L

CHAT = "/v1/chat/completions"


def preset(tmp_path, text: str) -> str:
    p = tmp_path / "preset.ini"
    p.write_text(text)
    return str(p)


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            b = sock.recv(65536)
        except OSError:
            break
        if not b:
            break
        out += b
    sock.close()
    return out


# ---- 1: a request that crashes its replica is not re-sent ----------------------

def test_request_that_crashes_its_replica_is_answered_502_and_never_sent_again(serve, fakes):
    """llama.cpp aborts on an out-of-vocabulary token id; the fake does so on
    the marker. Today the proxy re-sends it to each respawned replica (5
    crashes, then a 429 after 36 s); it must get one 502 after one crash."""
    fakes.add("c", crash_marker="999999999", crash_code=3)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    st, _, body = s.request("POST", CHAT, chat_body("c"))
    assert st == 200
    first = served_by(body)[1]
    st, _, body = s.request("POST", "/detokenize", {"model": "c", "tokens": [999999999]},
                            timeout=20)
    assert st == 502, body
    err = json.loads(body)["error"]
    assert err["code"] == "replica_died" and "not sent again" in err["message"]
    assert s.seg.models[0, L.M_LOADS] == 1  # one replica ever served, and it crashed once
    st, _, body = s.request("POST", CHAT, chat_body("c"))  # the model still serves
    assert st == 200 and served_by(body)[1] != first
    assert s.seg.models[0, L.M_LOADS] == 2


# ---- 2: only replica faults count for circuits ----------------------------------

def test_client_mistakes_do_not_open_the_circuit(serve, fakes):
    """Three 501s (a route the instance lacks) or 500s that the request
    caused opened the breaker; every later request then waited
    --queue-timeout and got 429."""
    fakes.add("m", tokens=1, bad_request_marker="BAD-GRAMMAR")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--queue-timeout", "2")
    assert s.request("POST", CHAT, chat_body("m"))[0] == 200
    bad = {"model": "m", "messages": [{"role": "user", "content": "BAD-GRAMMAR"}]}
    for _ in range(4):  # in a row: each kind alone would open a circuit today
        assert s.request("POST", "/infill", {"model": "m", "input_prefix": "x"})[0] == 501
    for _ in range(4):
        assert s.request("POST", CHAT, bad)[0] == 500
    for _ in range(4):
        assert s.request("POST", CHAT, {"model": "m", "messages": "not a list"})[0] == 400
    st, _, body = s.request("POST", CHAT, chat_body("m"), timeout=10)
    assert st == 200, body
    row = s.seg.counters[0, 0]
    assert row[L.C_CIRCUIT] == L.CircuitState.CLOSED and row[L.C_CONSEC_FAILURES] == 0


def _open_circuit(s, f, pid: int) -> None:
    """Break replica ``pid`` (a fake: 500 marked as its own fault) until
    this proxy's circuit for it opens."""
    f.with_name(f"{f.name}.fail-{pid}").touch()
    for _ in range(3):
        st, _, body = s.request("POST", CHAT, chat_body("m"))
        assert st == 500, body
    # the verdict is recorded just after the answer left
    wait_for(lambda: s.seg.counters[0, 0, L.C_CIRCUIT] == L.CircuitState.OPEN, 5,
             what="the circuit to open")


def test_open_circuit_of_the_only_replica_answers_503_with_retry_after_at_once(serve, fakes):
    f = fakes.add("m", tokens=1)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--queue-timeout", "60")
    pid = served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]
    _open_circuit(s, f, pid)
    st, headers, body = s.request("POST", CHAT, chat_body("m"), timeout=10)
    assert st == 503, body
    assert json.loads(body)["error"]["code"] == "replica_unavailable"
    assert 1 <= int(headers["retry-after"]) <= 5  # the cool-down left


@pytest.mark.slow
def test_request_waiting_on_a_half_open_circuit_goes_as_the_next_probe(serve, fakes):
    """A probe is judged at its response head: while it streams on, the
    request behind it is let through as the next probe instead of waiting
    out --queue-timeout (1.5 s here, shorter than the probe's stream)."""
    f = fakes.add("m", tokens=4, ttft_s=0.01, token_s=0.75)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--queue-timeout", "1.5")
    pid = served_by(s.request("POST", CHAT, chat_body("m", max_tokens=1))[2])[1]
    _open_circuit(s, f, pid)
    f.with_name(f"{f.name}.fail-{pid}").unlink()  # mended
    row = s.seg.counters[0, 0]
    wait_for(lambda: time.monotonic_ns() > row[L.C_CIRCUIT_UNTIL_NS], 10, 0.05,
             what="the cool-down to pass")
    probe = open_stream(s.port, chat_body("m", stream=True), timeout=20)
    got = b""
    while b"data:" not in got:
        got += probe.recv(65536)
    assert got.startswith(b"HTTP/1.1 200")
    st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=1), timeout=20)
    assert st == 200, body
    assert _read_all(probe).endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    assert row[L.C_CIRCUIT] == L.CircuitState.CLOSED  # two good probes close it


# ---- 9: a stop drops nothing that was accepted --------------------------------

@pytest.mark.slow
def test_stop_answers_every_accepted_request(serve, fakes):
    """SIGTERM with three 4 s streams to one single-slot fake model (12 s of
    work, 10 s of drain): the running one completes; the two queued inside
    the instance get 503 'stopping' at once instead of a closed connection."""
    fakes.add("m", tokens=8, ttft_s=0.01, token_s=0.5)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    assert s.request("POST", CHAT, chat_body("m", max_tokens=1))[0] == 200
    socks = [open_stream(s.port, chat_body("m", stream=True), timeout=30)]
    first = b""
    while b"data:" not in first:
        first += socks[0].recv(65536)
    socks += [open_stream(s.port, chat_body("m", stream=True), timeout=30) for _ in range(2)]
    wait_for(lambda: s.seg.counters[:, :, L.C_IN_FLIGHT].sum() == 3, 10, what="3 in flight")
    s.proc.send_signal(signal.SIGTERM)
    outs = [first + _read_all(socks[0])] + [_read_all(k) for k in socks[1:]]
    complete = stopped = 0
    for out in outs:
        if out.startswith(b"HTTP/1.1 200") and out.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
            complete += 1
        else:
            assert b"stopping" in out and b"shutting_down" in out, out
            assert out.startswith(b"HTTP/1.1 503") or b"data: {\"error\"" in out, out
            stopped += 1
    assert complete >= 1, outs


# ---- 11: /upstream/ paths never leave the upstream's prefix ---------------------

def test_upstream_paths_are_normalized_inside_the_configured_prefix(serve, tmp_path, recorder):
    port, requests = recorder
    s = serve("--models-preset", preset(tmp_path, f"[r]\nupstream = http://127.0.0.1:{port}/api\n"),
              "--no-hf-cache", "--proxies", "1")
    wait_for(lambda: s.request("GET", "/upstream/r/ping")[0] == 200, 20, 0.1,
             what="upstream healthy")
    for path in ("/upstream/r/../admin", "/upstream/r/%2e%2e/admin", "/upstream/r/%2E./admin",
                 "/upstream/r/v1/../../../x?a=1", "/upstream/r/a/./b/.."):
        st, _, body = s.request("GET", path)
        assert st == 200, (path, body)
    for path in ("/upstream/r/..%2fadmin", "/upstream/r/a\\..\\b"):
        assert s.request("GET", path)[0] == 400, path
    paths = [r["path"] for r in requests() if r["path"] != "/api/ping"]
    assert paths == ["/api/admin", "/api/admin", "/api/admin", "/api/x?a=1", "/api/a/"], paths


# ---- 7 (part): model file paths are not shown to non-admin callers -------------

def test_props_hide_the_model_file_path_unless_the_admin_key_is_given(serve, fakes):
    f = fakes.add("m", tokens=1)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--admin-key", "adm-123")
    assert s.request("POST", CHAT, chat_body("m"))[0] == 200
    for path in ("/props?model=m", "/upstream/m/props"):
        st, _, body = s.request("GET", path)
        assert st == 200, body
        doc = json.loads(body)
        assert doc["model_path"] == f.name and str(f.parent) not in body.decode(), body
        st, _, body = s.request("GET", path, headers={"Authorization": "Bearer adm-123"})
        assert st == 200 and json.loads(body)["model_path"] == str(f), body


# ---- 6 (part): the client's credentials never reach a replica -----------------

def test_client_credentials_never_reach_an_upstream(serve, tmp_path, recorder):
    port, requests = recorder
    text = (f"[open]\nupstream = http://127.0.0.1:{port}/one\n"
            f"[keyed]\nupstream = http://127.0.0.1:{port}/two\napi-key = upstream-key\n")
    s = serve("--models-preset", preset(tmp_path, text), "--no-hf-cache", "--proxies", "1",
              "--api-key", "client-key")
    creds = {"Authorization": "Bearer client-key"}
    both = {"x-api-key": "client-key", "Authorization": "Bearer client-key"}
    for name in ("open", "keyed"):
        wait_for(lambda n=name: s.request("GET", f"/upstream/{n}/ping", headers=creds)[0] == 200,
                 20, 0.1, what=f"{name} healthy")
        assert s.request("POST", CHAT, chat_body(name), headers=creds)[0] == 200
        assert s.request("POST", CHAT, chat_body(name), headers=both)[0] == 200
        assert s.request("GET", f"/upstream/{name}/v1/models", headers=both)[0] == 200
    seen = [r for r in requests() if not r["path"].endswith("/ping")]
    assert len(seen) == 6, seen
    for r in seen:
        h = r["headers"]
        assert "x-api-key" not in h and "client-key" not in json.dumps(h), r
        if r["path"].startswith("/two"):
            assert h["authorization"] == "Bearer upstream-key", r
        else:
            assert "authorization" not in h, r


# ---- 6: keys are on no command line and in no environment ---------------------

@pytest.mark.slow
def test_keys_are_on_no_child_command_line_nor_in_any_child_environment(serve, fakes,
                                                                       monkeypatch):
    fakes.add("m", tokens=1)
    monkeypatch.setenv("GGMUX_API_KEY", "api-key-from-env-1234")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "1",
              "--admin-key", "admin-key-on-argv-5678")
    auth = {"Authorization": "Bearer api-key-from-env-1234"}
    assert s.request("POST", CHAT, chat_body("m"), headers=auth)[0] == 200
    assert s.request("POST", CHAT, chat_body("m"))[0] == 401  # the key is in force
    # a spare, the instance, the proxies (and the measure child, if still there)
    wait_for(lambda: len(descendants(s.proc.pid)) >= 4, 20, what="children started")
    assert secrets_shown(s.proc.pid, ("api-key-from-env-1234", "admin-key-on-argv-5678",
                                      "GGMUX_API_KEY", "GGMUX_ADMIN_KEY")) == []


def test_help_names_the_key_variables_and_never_prints_a_key():
    env = {**os.environ, "GGMUX_API_KEY": "help-leak-1234", "GGMUX_ADMIN_KEY": "help-leak-5678"}
    out = subprocess.run([sys.executable, "-m", "ggmux.supervisor", "serve", "--help"],
                         check=True, capture_output=True, text=True, env=env,
                         timeout=60).stdout
    assert "$GGMUX_API_KEY" in out and "$GGMUX_ADMIN_KEY" in out
    assert "help-leak" not in out


# ---- 7: no way around the key on the same host ---------------------------------

@pytest.mark.slow
def test_an_instance_port_takes_only_its_own_secret(serve, fakes):
    fakes.add("m", tokens=1)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--api-key", "client-key")
    auth = {"Authorization": "Bearer client-key"}
    assert s.request("POST", CHAT, chat_body("m"), headers=auth)[0] == 200
    port = int(s.seg.replicas[0, L.R_PORT])
    direct = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for headers in ({}, auth, {"x-api-key": "client-key"}):
        direct.request("POST", CHAT, json.dumps(chat_body("m")), headers=headers)
        r = direct.getresponse()
        assert r.status == 401, (headers, r.read())
        r.read()
    direct.request("GET", "/health")  # readiness stays open, as llama-server's
    assert direct.getresponse().status == 200
    direct.close()
    assert s.request("POST", CHAT, chat_body("m"), headers=auth)[0] == 200


def test_a_cmd_instance_gets_its_secret_in_an_api_key_file(serve, tmp_path):
    log = tmp_path / "cmd.jsonl"
    log.touch()
    recorder = Path(__file__).with_name("recorder.py")
    cmd = (f"{sys.executable} {recorder} --port ${{PORT}} --log {log} "
           "--api-key-file ${API_KEY_FILE}")
    s = serve("--models-preset", preset(tmp_path, f"[c]\ncmd = {cmd}\n"), "--no-hf-cache",
              "--proxies", "1")
    st, _, body = s.request("POST", CHAT, chat_body("c"), timeout=30)
    assert st == 200, body
    port = int(s.seg.replicas[0, L.R_PORT])
    direct = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    direct.request("POST", CHAT, json.dumps(chat_body("c")))
    assert direct.getresponse().status == 401  # the key file is in force
    direct.close()
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    chats = [r for r in sent if r["path"] == CHAT]
    assert chats and chats[0]["headers"]["authorization"].startswith("Bearer ")
    assert len(chats[0]["headers"]["authorization"]) == len("Bearer ") + 32  # 128 bits, hex


# ---- a hung replica ----------------------------------------------------------------

def _stop_process(pid: int, stopped: list[int]) -> None:
    os.kill(pid, signal.SIGSTOP)
    stopped.append(pid)


@pytest.fixture
def stopped():
    """Pids a test SIGSTOPped: continued at the end, whatever happened."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


@pytest.mark.slow
def test_hung_replica_gets_504_and_the_next_requests_go_to_the_other(serve, fakes, tmp_path,
                                                                      stopped):
    f = fakes.add("m", tokens=1)
    s = serve("--models-preset", preset(tmp_path, f"[m]\nmodel = {f}\nreplicas = 2\n"
                                        "first-byte-timeout = 1\n"),
              "--no-hf-cache", "--proxies", "1", "--models-max", "2", "--spares", "0")
    pids = {served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]}
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 2, 20, what="two replicas ready")

    def both() -> bool:
        pids.add(served_by(s.request("POST", CHAT, chat_body("m"))[2])[1])
        return len(pids) == 2

    wait_for(both, 20, what="both replicas serving")
    # the one that served last is the one the balancer prefers now
    hung = served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]
    _stop_process(hung, stopped)
    statuses = []
    while 504 not in statuses:
        assert len(statuses) < 30, statuses
        st, _, body = s.request("POST", CHAT, chat_body("m"), timeout=20)
        statuses.append(st)
        if st == 200:
            assert served_by(body)[1] != hung
        else:
            assert st == 504 and json.loads(body)["error"]["code"] == "replica_timeout", body
    for _ in range(10):  # one timeout is enough to steer the next ones away
        st, _, body = s.request("POST", CHAT, chat_body("m"), timeout=20)
        assert st == 200 and served_by(body)[1] != hung, body


@pytest.mark.slow
def test_hung_instance_is_restarted_once_nothing_is_in_flight(serve, fakes, stopped):
    fakes.add("m", tokens=1)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--first-byte-timeout", "1")
    pid = served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]
    _stop_process(pid, stopped)
    st, _, body = s.request("POST", CHAT, chat_body("m"), timeout=20)
    assert st == 504, body
    wait_for(lambda: not alive(pid), 20, what="the hung instance killed")
    st, _, body = s.request("POST", CHAT, chat_body("m"), timeout=30)
    assert st == 200 and served_by(body)[1] != pid, body


@pytest.mark.slow
def test_silent_stream_ends_with_an_error_event(serve, fakes, stopped):
    fakes.add("m", tokens=50, ttft_s=0.01, token_s=0.05)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--stream-idle-timeout", "1")
    pid = served_by(s.request("POST", CHAT, chat_body("m", max_tokens=1))[2])[1]
    sock = open_stream(s.port, chat_body("m", stream=True), timeout=20)
    got = b""
    while b"data:" not in got:
        got += sock.recv(65536)
    _stop_process(pid, stopped)
    out = got + _read_all(sock)
    assert out.startswith(b"HTTP/1.1 200")
    assert b'"code":"gateway_timeout"' in out and b"stream-idle-timeout" in out, out[-400:]
    assert not out.endswith(b"0\r\n\r\n")  # an error never ends cleanly
