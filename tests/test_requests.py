"""The request activity view end to end (issue 22 item 8): every request to a
model is recorded by the proxy that served it, with its tokens (from the
instance's usage line), TTFT and duration; ``GET /requests`` (newest first,
``?model=``, ``?limit=``), ``GET /requests/stream`` (live), ``ggmux logs
--requests [-f]``; the admin key guards them; no prompt or answer text
without ``--log-requests-bodies``, a bounded excerpt with it. Real servers
on fake models."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from conftest import chat_body, wait_for
from ggmux.shm.requestring import REQUEST_EXCERPT_BYTES


def records(s, query: str = "", **kw) -> list[dict]:
    status, doc = s.json("GET", "/requests" + query, **kw)
    assert status == 200, doc
    return doc["data"]


def test_every_request_is_recorded_with_its_tokens_ttft_and_duration(serve, fakes):
    fakes.add("alpha", tokens=5, ttft_s=0.02, token_s=0.005)
    fakes.add("beta", tokens=3)
    fakes.add("broken", fail_load="no such weights")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    asked = [
        ("/v1/chat/completions", chat_body("alpha", stream=True)),
        ("/v1/chat/completions", chat_body("alpha")),
        ("/v1/completions", {"model": "beta", "prompt": "once upon"}),
        ("/v1/messages", {"model": "beta", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "hi"}]}),
        ("/api/chat", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/chat/completions", chat_body("broken")),
    ]
    for path, body in asked:
        status, _, _ = s.request("POST", path, body)
        assert status == (503 if body["model"] == "broken" else 200), path
    assert s.request("POST", "/v1/chat/completions", chat_body("nope"))[0] == 404
    recs = wait_for(lambda: len(r := records(s)) == len(asked) and r, 10,
                    what="every request recorded")
    times = [r["time"] for r in recs]
    assert times == sorted(times, reverse=True)  # newest first, from both proxies' regions
    broken, ollama, anth, compl, chat, stream = recs
    assert (stream["model"], stream["api"], stream["path"], stream["status"], stream["stream"]) \
        == ("alpha", "openai", "/v1/chat/completions", 200, True)
    # the fake's usage: one prompt token, a token per piece; from its usage line
    assert (stream["prompt_tokens"], stream["cached_tokens"], stream["generated_tokens"],
            stream["tokens_from"]) == (1, 0, 5, "replica")
    assert stream["replica"] == chat["replica"] and stream["where"] == "local"
    assert 0 < stream["ttft_ms"] <= stream["duration_ms"]
    assert stream["tokens_per_s"] > 0 and stream["bytes"] > 0
    assert stream["wait_ms"] > 0  # its model loaded meanwhile
    assert chat["stream"] is False and chat["generated_tokens"] == 5
    assert (compl["model"], compl["path"], compl["generated_tokens"]) == (
        "beta", "/v1/completions", 3)
    assert (anth["api"], anth["path"], anth["generated_tokens"]) == (
        "anthropic", "/v1/messages", 3)
    assert (ollama["api"], ollama["stream"], ollama["generated_tokens"]) == ("ollama", True, 5)
    # answered by the proxy itself: no replica, the status the client got
    assert (broken["model"], broken["status"], broken["replica"], broken["ttft_ms"]) == (
        "broken", 503, None, None)
    assert all("prompt" not in r and "answer" not in r for r in recs)  # no text kept
    assert len({r["request_id"] for r in recs}) == len(recs)

    assert [r["model"] for r in records(s, "?model=beta")] == ["beta", "beta"]
    assert records(s, "?limit=2") == recs[:2]
    assert s.json("GET", "/requests?model=nope")[0] == 404
    assert s.json("GET", "/requests?limit=x")[0] == 400


def test_the_stream_sends_the_newest_then_each_request_as_it_ends(serve, fakes):
    fakes.add("alpha", tokens=2)
    fakes.add("beta", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    for _ in range(3):
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=15)
    try:
        sock.sendall(b"GET /requests/stream?limit=2&model=beta HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while b"no requests yet" not in got:  # none of beta's yet
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert b" 200 " in got.split(b"\r\n")[0] and b"text/event-stream" in got
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
        assert s.request("POST", "/v1/completions", {"model": "beta", "prompt": "x"})[0] == 200
        while b'"model":"beta"' not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        recs = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: ")]
        assert [r["model"] for r in recs] == ["beta"]  # the filter holds live too
    finally:
        sock.close()
    # a subscriber without a filter gets the newest first, oldest of them first
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=15)
    try:
        sock.sendall(b"GET /requests/stream?limit=2 HTTP/1.1\r\nhost: x\r\n\r\n")
        got = b""
        while got.count(b"data: ") < 2:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        recs = [json.loads(line[6:]) for line in got.split(b"\n") if line.startswith(b"data: ")]
        assert [r["model"] for r in recs] == ["alpha", "beta"]
    finally:
        sock.close()


@pytest.mark.slow
def test_ggmux_logs_requests_prints_and_follows(serve, fakes):
    fakes.add("alpha", tokens=4)
    fakes.add("beta", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha", stream=True))[0] == 200
    assert s.request("POST", "/v1/completions", {"model": "beta", "prompt": "x"})[0] == 200
    env = {**os.environ, "GGMUX_URL": s.base}
    r = subprocess.run([sys.executable, "-m", "ggmux", "logs", "--requests"],
                       capture_output=True, text=True, timeout=30, env=env, check=False)
    assert r.returncode == 0, r.stderr
    head, *lines = r.stdout.splitlines()
    assert head.split() == ["TIME", "MODEL", "REPLICA", "API", "STATUS", "PROMPT", "CACHED",
                            "GEN", "TTFT", "TOK/S", "DURATION"]
    assert [x.split()[1] for x in lines] == ["alpha", "beta"]  # oldest first, as logs are
    alpha = lines[0].split()
    assert alpha[3:8] == ["openai", "/v1/chat/completions", "(stream)", "200", "1"]
    assert alpha[9] == "4"  # generated tokens
    r = subprocess.run([sys.executable, "-m", "ggmux", "logs", "--requests", "beta"],
                       capture_output=True, text=True, timeout=30, env=env, check=False)
    assert [x.split()[1] for x in r.stdout.splitlines()[1:]] == ["beta"]
    follow = subprocess.Popen([sys.executable, "-m", "ggmux", "logs", "--requests", "-f",
                               "-n", "1"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert follow.stdout.readline().startswith("TIME")
        # the newest request first: once it shows, the server streams to us
        assert follow.stdout.readline().split()[1] == "beta"
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
        line = follow.stdout.readline().split()
        assert line[1:3] == ["alpha", "#0"] and line[5] == "200"
    finally:
        follow.kill()
        follow.wait()


def test_the_requests_need_the_admin_key_when_one_is_set(serve, fakes):
    fakes.add("alpha", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--api-key", "sk-api", "--admin-key", "sk-admin")
    api = {"authorization": "Bearer sk-api"}
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha"), headers=api)[0] == 200
    for path in ("/requests", "/requests/stream"):
        assert s.request("GET", path, headers=api)[0] == 401
    assert [r["model"] for r in records(s, headers={"authorization": "Bearer sk-admin"})] == [
        "alpha"]


def test_with_log_requests_bodies_a_bounded_excerpt_is_kept(serve, fakes):
    fakes.add("alpha", tokens=3)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--log-requests-bodies")
    body = {"model": "alpha", "stream": True, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "é" * 3000}]}
    assert s.request("POST", "/v1/chat/completions", body)[0] == 200
    assert s.request("POST", "/v1/completions", {"model": "alpha", "prompt": "once upon"})[0] \
        == 200
    compl, chat = wait_for(lambda: len(r := records(s)) == 2 and r, 10, what="two records")
    assert chat["prompt"] == "é" * (REQUEST_EXCERPT_BYTES // 2)  # cut at a character
    assert chat["answer"].startswith("[alpha:") and chat["answer"].endswith(" tok tok")
    assert (compl["prompt"], compl["answer"][:7]) == ("once upon", "[alpha:")
