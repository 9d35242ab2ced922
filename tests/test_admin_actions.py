"""Admin actions need the admin key, whatever the API (issue 18, finding 1).

With ``--api-key k --admin-key a`` the API key used to unload a model
through Ollama's ``keep_alive: 0``, cutting every other client's stream.
Now, from a caller without the admin key, ``keep_alive`` only extends the
model's idle timer, at most to its ``ttl``; Ollama's empty-request unload
gets 403; the admin key keeps the full behaviour, and the supervisor's log
names the route each order came by. With one key (``--api-key`` and no
admin key) that key may do everything, as ``/models/load`` always let it.
All on fake models, with one proxy (its queue keeps the orders' order).
"""

from __future__ import annotations

import pytest
from conftest import chat_body, open_stream, wait_for

K = {"authorization": "Bearer k"}
A = {"authorization": "Bearer a"}


@pytest.fixture
def keyed(serve, fakes, tmp_path):
    fakes.add("m", tokens=60, ttft_s=0.01, token_s=0.02)
    fakes.add("t", tokens=2)
    fakes.add("x", tokens=2)
    preset = tmp_path / "p.ini"
    preset.write_text("[t]\nttl = 1\n\n[x]\nttl = 30\n")
    return serve("--fake-models-dir", str(fakes), "--models-preset", str(preset),
                  "--no-hf-cache", "--proxies", "1", "--api-key", "k", "--admin-key", "a")


def state(s, name: str) -> str:
    status, doc = s.json("GET", "/v1/models", headers=K)
    assert status == 200, doc
    return {m["id"]: m for m in doc["data"]}[name]["status"]["value"]


def generate(s, key: dict, **body):
    return s.json("POST", "/api/generate", {"model": "m", "stream": False, **body},
                  headers=key)


def test_the_api_key_cannot_unload_through_keep_alive_and_streams_run_on(keyed):
    s = keyed
    assert generate(s, K, prompt="hi")[0] == 200  # loads m
    sock = open_stream(s.port, chat_body("m", stream=True), timeout=30, headers=K)
    try:
        raw = b""
        while b"data: " not in raw:
            raw += sock.recv(65536)
        # Ollama's unload idiom (empty prompt, keep_alive 0): the admin key's alone
        status, doc = generate(s, K, keep_alive=0)
        assert status == 403 and list(doc) == ["error"], doc
        assert "admin key" in doc["error"]
        # a generation with keep_alive 0 is served, and unloads nothing
        status, doc = generate(s, K, prompt="hi", keep_alive=0)
        assert status == 200 and doc["done"], doc
        status, doc = s.json("POST", "/api/chat", {"model": "m", "stream": False,
                                                   "messages": [], "keep_alive": "0s"},
                             headers=K)
        assert status == 403, doc
        while chunk := sock.recv(65536):  # the other client's stream ends as it should
            raw += chunk
            if raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
                break
    finally:
        sock.close()
    assert b"[DONE]" in raw and b'"error"' not in raw, raw[-300:]
    # the admin key's order comes after them in the queue: once it is logged,
    # those were read, and m is still loaded
    assert generate(s, A, prompt="hi", keep_alive="1h")[0] == 200
    wait_for(lambda: "m: keep_alive 3600 s from POST /api/generate" in s.logs(), 10,
             what="the admin key's keep_alive")
    assert state(s, "m") == "loaded"
    assert "requested by POST /api/generate" not in s.logs()
    # the admin key keeps the full behaviour, and the log names the route
    assert generate(s, A, keep_alive=0)[1]["done_reason"] == "unload"
    wait_for(lambda: state(s, "m") == "unloaded", 20, what="m unloaded by the admin key")
    assert "requested by POST /api/generate" in s.logs()


@pytest.mark.slow
def test_the_api_keys_keep_alive_never_outlives_the_operators_ttl(keyed):
    s = keyed
    # forever, and an hour, from the API key: t (ttl 1 s) still unloads once idle
    for keep in (-1, "1h"):
        status, doc = s.json("POST", "/api/chat", {
            "model": "t", "stream": False, "keep_alive": keep,
            "messages": [{"role": "user", "content": "hi"}]}, headers=K)
        assert status == 200, doc
        wait_for(lambda: state(s, "t") == "unloaded", 20, what=f"t unloaded by its ttl ({keep})")
    assert "keep_alive forever" not in s.logs()


def test_the_api_key_may_extend_an_idle_timer_up_to_the_ttl(keyed):
    s = keyed
    hi = [{"role": "user", "content": "hi"}]
    assert s.json("POST", "/api/chat", {"model": "x", "stream": False, "keep_alive": "20s",
                                        "messages": hi}, headers=A)[0] == 200
    wait_for(lambda: "x: keep_alive 20 s from POST /api/chat" in s.logs(), 10,
             what="the admin's shorter timer")
    assert s.json("POST", "/api/chat", {"model": "x", "stream": False, "keep_alive": "1h",
                                        "messages": hi}, headers=K)[0] == 200
    # extended, but to the preset's ttl (30 s), not to the hour asked
    wait_for(lambda: "x: keep_alive 30 s from POST /api/chat" in s.logs(), 10,
             what="the API key's extension, capped at the ttl")
    assert "keep_alive 3600 s" not in s.logs()


def test_admin_routes_still_refuse_the_api_key(keyed):
    s = keyed
    for path in ("/models/load", "/models/unload"):
        status, doc = s.json("POST", path, {"model": "t"}, headers=K)
        assert status == 401 and "admin key" in doc["error"]["message"], doc
    for path in ("/logs", "/requests", "/v1/models?reload=1"):
        assert s.request("GET", path, headers=K)[0] == 401, path
    assert s.request("GET", "/logs", headers=A)[0] == 200


def test_with_one_key_it_is_also_the_admin_key_in_every_api(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--api-key", "k")
    assert s.json("POST", "/models/load", {"model": "m"}, headers=K)[0] == 200
    wait_for(lambda: state(s, "m") == "loaded", 20, what="m loaded by the API key")
    status, doc = generate(s, K, keep_alive=0)
    assert status == 200 and doc["done_reason"] == "unload", doc
    wait_for(lambda: state(s, "m") == "unloaded", 20, what="m unloaded by the API key")
    assert generate(s, {}, keep_alive=0)[0] == 401  # no key: nothing at all
    log = s.logs()
    assert "requested by POST /models/load" in log and "requested by POST /api/generate" in log
    assert s.request("GET", "/logs", headers=K)[0] == 200
