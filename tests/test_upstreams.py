"""``upstream`` lists end to end (issue 11, finding 12): each URL of a
model's ``upstream`` is one remote replica that serves, and a host that
does not resolve is a warning and an unhealthy replica, not a traceback
that stops the server. The remote servers are real fake instances."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from closing_server import ClosingServer
from conftest import chat_body, connectable, free_port, wait_for

CHAT = "/v1/chat/completions"


@pytest.fixture
def remote_servers(fakes):
    """``start(name) -> port``: a fake instance serving on its own port,
    as a remote OpenAI-compatible server; all stopped after the test."""
    procs = []

    def start(name: str) -> int:
        behaviour = fakes.dir.parent / f"{name}.json"
        behaviour.write_text('{"tokens": 1}')
        port = free_port()
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "ggmux.instance", "--fake", "--model", str(behaviour),
             "--name", name, "--port", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        ))
        wait_for(lambda: connectable(port), 20, 0.05, what=f"remote server {name}")
        return port

    yield start
    for p in procs:
        p.stdin.close()
        p.wait(10)


def test_every_url_of_an_upstream_list_is_a_replica_that_serves(serve, tmp_path,
                                                                remote_servers):
    a, b = remote_servers("box-a"), remote_servers("box-b")
    preset = tmp_path / "p.ini"
    preset.write_text(f"[m]\nupstream = http://127.0.0.1:{a}, http://127.0.0.1:{b}/\n")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--proxies", "1")
    seen = Counter()

    def both() -> bool:
        st, _, body = s.request("POST", CHAT, chat_body("m"))
        assert st == 200, body
        seen["a" if b"[box-a:" in body else "b" if b"[box-b:" in body else "?"] += 1
        return seen["a"] and seen["b"]

    wait_for(both, 20, 0.02, what="both upstreams serving")
    assert seen["?"] == 0
    assert s.models()["m"]["status"]["value"] == "loaded"


@pytest.mark.slow
def test_an_unresolvable_upstream_host_is_a_warning_and_an_unhealthy_replica(
    serve, fakes, tmp_path
):
    fakes.add("local", tokens=1)
    preset = tmp_path / "p.ini"
    preset.write_text("[far]\nupstream = http://no-such-host.invalid:8080\n")
    s = serve("--models-preset", str(preset), "--fake-models-dir", str(fakes), "--no-hf-cache",
              "--proxies", "1")
    wait_for(lambda: "cannot resolve host 'no-such-host.invalid'" in s.logs(), 10,
             what="the warning")
    st, doc = s.json("POST", CHAT, chat_body("far"))
    assert st == 503 and doc["error"]["code"] == "upstream_unavailable", doc
    assert s.request("POST", CHAT, chat_body("local"))[0] == 200  # the rest serves
    assert s.proc.poll() is None
    logs = s.logs()
    assert "Traceback" not in logs
    assert "WARNING" in logs.split("cannot resolve host")[0].rsplit("\n", 1)[-1]


@pytest.fixture
def closing_upstream(serve, tmp_path):
    """``start(**kw) -> (upstream, server)``: a :class:`closing_server.ClosingServer` and a
    ``ggmux serve`` (one proxy) with model ``m`` on it, serving; the
    upstream is closed after the test."""
    made = []

    def start(**kw):
        upstream = ClosingServer(**kw)
        made.append(upstream)
        preset = tmp_path / "p.ini"
        preset.write_text(f"[m]\nupstream = http://127.0.0.1:{upstream.port}\n")
        s = serve("--models-preset", str(preset), "--no-hf-cache", "--proxies", "1")
        wait_for(lambda: s.request("POST", CHAT, chat_body("m"))[0] == 200, 20, 0.05,
                 what="the upstream serving")
        return upstream, s

    yield start
    for u in made:
        u.close()


@pytest.mark.slow
def test_a_pooled_connection_the_server_shuts_with_the_request_unread_is_retried(
        closing_upstream):
    # the keep-alive race: the replica's TCP acknowledged the request, then
    # a FIN and a reset came with no answer (it closed with the request
    # unread). It never had the request: send it again on a fresh connection
    _, s = closing_upstream()
    for _ in range(5):  # each one on the connection the one before left in the pool
        status, _, body = s.request("POST", CHAT, chat_body("m"))
        assert status == 200, body


@pytest.mark.slow
def test_a_replica_that_closes_after_chunked_answers_gets_no_request_on_such_a_connection(
        closing_upstream):
    # llama-server (cpp-httplib) answers a stream chunked, then shuts its
    # side, reads and drops whatever came meanwhile, and closes: a request
    # sent on that pooled connection is lost with no sign a retry is safe
    # (bench/slots.py: 4 of 24 requests of a `cmd` llama-server got 502 at 8
    # streams). Once the proxy saw the habit (an idle connection closed just
    # after a chunked answer), it pools no connection after a chunked answer.
    upstream, s = closing_upstream(linger_s=0.05, drain=True)
    wait_for(lambda: "not pooled after one" in s.log_path.read_text(), 10, 0.02,
             what="the proxy learning the upstream's habit")
    before = upstream.connections
    for _ in range(5):  # back to back: each would land on a closing connection
        status, _, body = s.request("POST", CHAT, chat_body("m"))
        assert status == 200, body
    assert upstream.connections - before >= 5  # a fresh connection each


@pytest.mark.slow
def test_a_request_lost_to_a_live_local_replicas_close_after_a_stream_is_sent_again(
        serve, tmp_path):
    # the same server as a local `cmd` model, and no chance to learn its
    # habit first: the second request lands on the connection it is
    # closing. Its process lives on, so it dropped the request unread (a
    # replica that died with the request would be gone): sent again
    script = Path(__file__).parent / "closing_server.py"
    preset = tmp_path / "p.ini"
    preset.write_text(f"[m]\ncmd = {sys.executable} {script} ${{PORT}} --drain --linger 0.05\n"
                      "check-endpoint = /health\n")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--proxies", "1", "--spares", "0")
    for _ in range(4):  # back to back, the first one loads the model
        status, _, body = s.request("POST", CHAT, chat_body("m"), timeout=60)
        assert status == 200, body
    assert "the replica lives on: sending the request again" in s.log_path.read_text()
