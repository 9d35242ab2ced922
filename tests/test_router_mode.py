"""llama-server's router-mode answers on fake instances (issue 23; what
llama.cpp's tools/server/tests/unit/test_router.py and the single-model
files found): GET /props without a model, --no-models-autoload's 400, the
/models methods, a request without a model or with an unknown one,
/slots and /metrics without ?model= on a one-model server, --no-metrics,
and llama-server's route names without /v1."""

from __future__ import annotations

import json
import time

import pytest
from conftest import chat_body, served_by, wait_for
from ggmux.shm import layout as L

CHAT = "/v1/chat/completions"


def _error(body: bytes) -> dict:
    return json.loads(body)["error"]


def test_props_without_a_model_are_the_routers_and_autoload_off_refuses_with_400(serve, fakes):
    fakes.add("a")
    fakes.add("b")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--models-max", "3",
              "--no-models-autoload")
    st, doc = s.json("GET", "/props")
    assert st == 200, doc
    assert doc["role"] == "router" and doc["max_instances"] == 3
    assert doc["models_autoload"] is False and doc["build_info"].startswith("b")
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    assert st == 400 and _error(body)["message"] == "model is not loaded", body
    assert s.models()["a"]["status"]["value"] == "unloaded"
    st, _, body = s.request("POST", CHAT + "?autoload=1", chat_body("b"))  # llama.cpp's override
    assert st == 200 and served_by(body)[0] == "b", body
    st, _, _ = s.request("POST", "/models/load", {"model": "a"})
    assert st == 200
    wait_for(lambda: s.models()["a"]["status"]["value"] == "loaded", 20, what="explicit load")
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"
    st, _, body = s.request("GET", "/slots")  # several models: which one?
    assert st == 400 and b"?model=" in body


def test_models_methods_answer_as_llama_servers_router(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--admin-key", "adm")
    admin = {"Authorization": "Bearer adm"}
    st, _, body = s.request("DELETE", "/models?model=a")  # state-changing: the admin key
    assert st == 401, body
    st, _, body = s.request("DELETE", "/models", headers=admin)
    assert st == 400 and "non-empty" in _error(body)["message"]
    st, _, body = s.request("DELETE", "/models?model=nope", headers=admin)
    assert st == 500 and _error(body)["message"] == "model name=nope is not found"
    st, _, body = s.request("DELETE", "/models?model=a", headers=admin)
    assert st == 500 and "not removable (not from cache)" in _error(body)["message"]
    assert "a" in s.models()  # and still listed
    st, _, body = s.request("POST", "/models", {"model": "org/repo"}, headers=admin)
    err = _error(body)  # llama.cpp's shape: its type, the status as code
    assert st == 501 and (err["type"], err["code"]) == ("not_supported_error", 501), body
    st, hs, body = s.request("PUT", "/models", b"{}", headers=admin)
    assert st == 405 and "DELETE" in hs["allow"], body
    st, _, body = s.request("GET", "/models")  # the list, as before
    assert st == 200 and json.loads(body)["data"][0]["id"] == "a"


def test_one_model_takes_requests_without_model_and_answers_props_slots_metrics(serve, fakes):
    fakes.add("only")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    body = chat_body("x")
    del body["model"]
    st, _, out = s.request("POST", CHAT, body)
    assert st == 200 and served_by(out)[0] == "only", out  # as a llama-server of one model
    st, _, out = s.request("POST", "/v1/messages", {"max_tokens": 8, "messages": [
        {"role": "user", "content": "hi"}]})
    assert st == 200 and served_by(out)[0] == "only", out
    st, doc = s.json("GET", "/props")
    assert st == 200 and doc.get("role") != "router" and doc["model_alias"] == "only", doc
    st, doc = s.json("GET", "/slots")
    assert st == 200 and isinstance(doc, list), doc
    st, hs, text = s.request("GET", "/metrics")
    assert st == 200 and b"ggmux_requests_total" in text  # the server's figures ...
    assert b"\nllamacpp:slots 1\n" in text  # ... and the replica's own (llama-server's)
    started = int(hs["process-start-time-unix"])  # llama-server's header: when it started
    assert time.time() - 120 < started <= time.time()
    st, _, out = s.request("POST", CHAT, chat_body("gpt-3.5-turbo"))
    assert st == 404, out  # an unknown name without --model-fallback


def test_model_fallback_serves_unknown_names_and_no_metrics_is_501(serve, fakes):
    fakes.add("a")
    fakes.add("b")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--model-fallback", "b",
              "--no-metrics")
    for path, body in ((CHAT, chat_body("gpt-3.5-turbo")),
                       ("/v1/messages", {"model": "test", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": "hi"}]}),
                       ("/responses", {"model": "gpt-4.1", "input": "hi"})):
        st, _, out = s.request("POST", path, body)
        assert st == 200 and served_by(out)[0] == "b", (path, out)
    st, _, out = s.request("POST", CHAT, chat_body("a"))
    assert st == 200 and served_by(out)[0] == "a"  # a known name is still its own
    nameless = chat_body("x")
    del nameless["model"]
    st, _, out = s.request("POST", CHAT, nameless)  # two models: the fallback's too
    assert st == 200 and served_by(out)[0] == "b", out
    st, _, out = s.request("GET", "/metrics")
    assert st == 501 and _error(out)["type"] == "not_supported_error", out


def test_llama_servers_routes_without_v1_and_the_input_token_count(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    chat = {"model": "a", "messages": [{"role": "system", "content": "Book"},
                                       {"role": "user", "content": "What is the best book"}]}
    st, doc = s.json("POST", "/apply-template", chat)  # what the count is of: the template's
    assert st == 200, doc
    st, toks = s.json("POST", "/tokenize", {"model": "a", "content": doc["prompt"],
                                            "add_special": True})
    assert st == 200 and toks["tokens"], toks
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        st, doc = s.json("POST", path, chat)
        assert st == 200 and doc == {"input_tokens": len(toks["tokens"])}, (path, doc)
    st, _, out = s.request("POST", "/completions", {"model": "a", "prompt": "hi",
                                                    "n_predict": 4})
    assert st == 200 and "content" in json.loads(out), out  # llama-server's native /completion
    st, doc = s.json("POST", "/responses", {"model": "a", "input": "hi"})
    assert st == 200 and doc["object"] == "response", doc


@pytest.mark.slow
def test_a_client_that_leaves_the_queue_costs_the_busy_model_nothing(serve, fakes):
    """llama.cpp's test_router_queue_client_disconnect_keeps_model, with a
    model that is really busy (llama-server's test makes it so with
    LLAMA_SERVER_DEBUG_FAKE_TIMING): B's only client leaves while B waits
    for A's slot, so once A is idle nothing evicts it for B."""
    import threading

    fakes.add("a", ttft_s=3.0)
    fakes.add("b")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--models-max", "1")
    assert s.request("POST", "/models/load", {"model": "a"})[0] == 200
    wait_for(lambda: s.models()["a"]["status"]["value"] == "loaded", 20, what="a loaded")
    busy: list = []
    t = threading.Thread(target=lambda: busy.append(s.request("POST", CHAT, chat_body("a"))))
    t.start()
    wait_for(lambda: s.seg.counters[:, :, L.C_IN_FLIGHT].sum() > 0 or busy, 10, what="a busy")
    try:
        s.request("POST", CHAT, chat_body("b"), timeout=1.0)
        raise AssertionError("b was served while a was busy")
    except TimeoutError:
        pass  # the client left while queued
    t.join(30)
    assert busy and busy[0][0] == 200, busy
    # nobody waits for b any more: a keeps its slot (watched for 2 s)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        ms = s.models()
        assert ms["a"]["status"]["value"] == "loaded" and ms["b"]["status"]["value"] == "unloaded"
        time.sleep(0.1)


def test_cors_origins_localhost_reflects_pages_of_this_machine_only():
    from ggmux.proxy.cors import PREFLIGHT_METHODS, Cors, is_localhost

    for o in (b"http://localhost", b"http://localhost:8080", b"http://127.0.0.1",
              b"http://127.0.0.1:3000", b"http://[::1]", b"https://[::1]:3000"):
        assert is_localhost(o), o
        h = Cors("localhost").headers(o)
        assert b"Access-Control-Allow-Origin: " + o + b"\r\n" in h, o  # llama-server's case
    for o in (b"http://web.mydomain.fr", b"http://evil.com", b"http://notlocalhost",
              b"http://localhost.evil.com", b"http://localhost:x", b"file://localhost"):
        assert not is_localhost(o), o
        assert b"access-control-allow-origin" not in Cors("localhost").headers(o).lower(), o
    both = Cors("localhost, http://a.example")
    assert both.allows(b"http://a.example") and both.allows(b"http://127.0.0.1:1")
    assert not both.allows(b"http://b.example")
    # the default echoes the origin as llama-server does, never with credentials
    star = Cors("*").headers(b"http://localhost:3000")
    assert star.startswith(b"Access-Control-Allow-Origin: http://localhost:3000\r\nVary: Origin")
    assert b"Credentials" not in star
    assert Cors("*").headers(b"bad\x01origin").startswith(b"Access-Control-Allow-Origin: *\r\n")
    assert PREFLIGHT_METHODS == b"GET, POST, DELETE, OPTIONS"  # llama-server's (DELETE /models)


def test_dedup_hidden_cache_entries_leave_the_list_and_do_not_count_as_models():
    """llama.cpp's test_router_dedup_cache_models: the registry marked the
    entries (tests/test_registry.py), the list left them in."""
    import numpy as np
    from ggmux.proxy.listing import models_list
    from ggmux.proxy.router_mode import RouterMode

    reg = [{"name": "model-dedup"}, {"name": "org/repo:F32", "hidden": True},
           {"name": "org/gone", "removed": True}]
    rows = np.zeros((3, L.M_WORDS), dtype=np.int64)
    assert [m["id"] for m in models_list(reg, rows, {})["data"]] == ["model-dedup"]

    class One(RouterMode):
        def __init__(self, router: dict) -> None:
            self.names = {"model-dedup": 0, "org/repo:F32": 1}  # hidden: served by name
            self.reg_models = reg
            self.router = router

    one = One({})
    assert one.only_model() == 0 and one.name_for_unnamed() == "model-dedup"
    assert one.pick_model("org/repo:F32") == 1 and one.pick_model("gpt-4") is None
    assert One({"model_fallback": "model-dedup"}).pick_model("gpt-4") == 0
