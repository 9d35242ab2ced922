"""Walking-skeleton behaviour on fake instances (issue 2)."""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import alive, chat_body, children_of, open_stream, segment_exists, served_by, wait_for
from ggmux.shm import layout as L


def test_eight_concurrent_first_requests_start_exactly_one_instance(serve, fakes):
    fakes.add("a", load_s=0.5)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2")
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda _: s.request("POST", "/v1/chat/completions", chat_body("a")),
                              range(8)))
    assert [r[0] for r in results] == [200] * 8
    pids = {served_by(r[2])[1] for r in results}
    assert len(pids) == 1
    assert s.logs().count("loading a in slot") == 1
    assert int(s.seg.models[0, L.M_LOADS]) == 1


def test_models_max_1_switches_models_and_lists_status(serve, fakes):
    fakes.add("a")
    fakes.add("b")
    s = serve("--fake-models-dir", str(fakes), "--models-max", "1", "--proxies", "2")
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("b"))
    assert st == 200 and served_by(body)[0] == "b"
    models = wait_for(lambda: (m := s.models())["a"]["status"]["value"] == "unloaded" and m,
                      5, what="a unloaded")
    assert models["b"]["status"]["value"] == "loaded"
    assert "failed" not in models["a"]["status"]  # a deliberate unload is not a failure
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"


def test_streaming_client_that_disconnects_frees_the_replica(serve, fakes):
    fakes.add("slow", ttft_s=0.01, token_s=0.1, tokens=200)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    sock = open_stream(s.port, chat_body("slow", stream=True))
    got = b""
    while got.count(b"data: ") < 3:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    inflight = s.seg.counters[:, :, L.C_IN_FLIGHT]
    assert inflight.sum() == 1
    sock.close()  # halfway through a 200-token stream
    t0 = time.monotonic()
    wait_for(lambda: inflight.sum() == 0, 2.0, what="in-flight back to 0")
    assert time.monotonic() - t0 < 2.0
    # the instance stopped generating: the next request is answered at once
    st, _, out = s.request("POST", "/v1/chat/completions", chat_body("slow", max_tokens=2),
                           timeout=5)
    assert st == 200 and served_by(out)[0] == "slow"


@pytest.mark.slow
def test_kill_9_of_supervisor_leaves_no_children_and_port_is_reusable(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "1")
    assert s.request("POST", "/v1/chat/completions", chat_body("a"))[0] == 200
    # two proxies, one instance, and the spare started once the load ended
    kids = wait_for(lambda: len(k := children_of(s.proc.pid)) == 4 and k, 10, what="4 children")
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait()
    for pid in kids:
        wait_for(lambda p=pid: not alive(p), 5.0, what=f"child {pid} gone")
    assert segment_exists(s.port)  # stale: a SIGKILLed supervisor cannot clean up
    s2 = serve("--fake-models-dir", str(fakes), "--proxies", "2", port=s.port)
    st, _, body = s2.request("POST", "/v1/chat/completions", chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"
    # the first server's stale segment was replaced; its stop check would fail
    # on the second server's segment, so detach it from the cleanup
    s.log.close()
    s.stop = lambda *a, **k: None


BAD_BODIES = [
    (b'{"model": "a", "messages": [', 400, "not valid JSON"),
    (b'{"messages": []}', 400, "missing 'model'"),
    (b'{"model": "nope", "messages": []}', 404, "not found"),
    (b'{"model": 7, "messages": []}', 400, "must be a string"),
    (b"[1, 2]", 400, "JSON object"),
    (b'{"model": "\xff\xfe"}', 400, "not valid JSON"),
]


def test_bad_input_gets_openai_error_and_server_keeps_serving(serve, fakes):
    fakes.add("a")
    fakes.add("b")  # two models: a body without one is refused (one model would take it)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    for body, status, fragment in BAD_BODIES:
        st, headers, data = s.request("POST", "/v1/chat/completions", body,
                                      headers={"content-type": "application/json"})
        assert st == status, body
        err = json.loads(data)["error"]
        assert fragment in err["message"] and {"message", "type", "code"} <= set(err), body
        assert headers["content-type"] == "application/json"
        st, _, out = s.request("POST", "/v1/chat/completions", chat_body("a"))
        assert st == 200 and served_by(out)[0] == "a"


@pytest.mark.slow
def test_second_server_on_a_taken_port_refuses_to_start(serve, fakes, tmp_path):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    s2 = serve("--fake-models-dir", str(fakes), "--proxies", "1", port=s.port, ready=False)
    assert s2.proc.wait(30) == 1
    assert "cannot listen" in s2.logs()
    # the first server is untouched, its segment included
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"


def cmdline(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


@pytest.mark.slow
def test_a_killed_proxy_is_replaced_and_its_rows_zeroed(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    assert s.request("POST", "/v1/chat/completions", chat_body("a"))[0] == 200
    proxies = [p for p in children_of(s.proc.pid) if b"ggmux: proxy " in cmdline(p)]
    assert len(proxies) == 2
    idx = 0 if b"ggmux: proxy 0 " in cmdline(proxies[0]) else 1
    s.seg.waiters[idx, 0, L.W_COUNT] = 5  # stale demand a dead proxy must not leave behind
    os.kill(proxies[0], signal.SIGKILL)
    wait_for(lambda: len([p for p in children_of(s.proc.pid) if p not in proxies
                          and b"ggmux: proxy " in cmdline(p)]) == 1, 10, what="replacement proxy")
    wait_for(lambda: s.seg.waiters[idx, 0, L.W_COUNT] == 0, 5, what="rows zeroed")
    for _ in range(10):  # both listeners serve again
        st, _, body = s.request("POST", "/v1/chat/completions", chat_body("a"))
        assert st == 200 and served_by(body)[0] == "a"


@pytest.mark.slow
def test_instance_killed_mid_stream_ends_the_stream_with_an_error_not_a_clean_end(serve, fakes):
    fakes.add("a", token_s=0.1, tokens=100)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    sock = open_stream(s.port, chat_body("a", stream=True), 10)
    got = b""
    while got.count(b"data: ") < 3:
        got += sock.recv(65536)
    pid = served_by(got)[1]
    os.kill(pid, signal.SIGKILL)
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    sock.close()
    assert b'"error"' in got.split(b"data: ")[-1]  # the last event is an error
    assert not got.endswith(b"0\r\n\r\n")
    st = wait_for(lambda: (m := s.models()["a"]["status"]).get("failed") and m, 5, what="failed")
    assert st["exit_code"] == -signal.SIGKILL
    st, _, out = s.request("POST", "/v1/chat/completions", chat_body("a", max_tokens=2))
    assert st == 200 and served_by(out)[1] != pid  # loaded again on demand


@pytest.mark.slow
def test_sigterm_lets_a_stream_in_progress_finish(serve, fakes):
    fakes.add("a", token_s=0.1, tokens=20)  # a 2 s stream
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    sock = open_stream(s.port, chat_body("a", stream=True), 20)
    got = b""
    while got.count(b"data: ") < 2:
        got += sock.recv(65536)
    s.proc.send_signal(signal.SIGTERM)
    while not got.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, got[-300:]
        got += chunk
    sock.close()
    assert got.count(b"data: ") == 21 and b"data: [DONE]" in got
    assert s.proc.wait(30) == 0
