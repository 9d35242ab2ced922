"""What a new user's first mistakes get back (issue 31, item 14): a model
name that does not exist is answered with the names that do (a few, and
only to a caller whose key may list them), and a body that is not JSON gets
415 with the client API's own error type."""

from __future__ import annotations

import json

import pytest
from conftest import chat_body

CHAT = "/v1/chat/completions"
NAMES = [f"model-{c}" for c in "abcdefg"]


@pytest.fixture
def seven(serve, fakes):
    for name in NAMES:
        fakes.add(name, tokens=2)
    return serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
                 "--api-key", "key-a")


def test_an_unknown_model_404_names_at_most_five_models_that_exist(seven):
    key = {"authorization": "Bearer key-a"}
    status, _, out = seven.request("POST", CHAT, chat_body("modle-a"), headers=key)
    assert status == 404, out
    err = json.loads(out)["error"]
    assert err["code"] == "model_not_found" and err["type"] == "not_found_error"
    listed = [n for n in NAMES if n in err["message"]]
    assert len(listed) == 5 and "and 2 more (GET /v1/models)" in err["message"], err
    # the other client APIs, in their envelopes
    status, _, out = seven.request("POST", "/v1/messages", {
        "model": "modle-a", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]},
        headers=key)
    assert status == 404 and "model-a" in json.loads(out)["error"]["message"], out
    status, _, out = seven.request("POST", "/api/chat", {
        "model": "modle-a", "messages": [{"role": "user", "content": "Hi"}]}, headers=key)
    assert status == 404 and "model-a" in json.loads(out)["error"], out
    status, _, out = seven.request("GET", "/v1/models/modle-a", headers=key)
    assert status == 404 and "model-a" in json.loads(out)["error"]["message"], out


def test_a_caller_without_a_key_that_may_list_models_sees_no_model_names(seven):
    for headers in ({}, {"authorization": "Bearer wrong"}):
        status, _, out = seven.request("POST", CHAT, chat_body("modle-a"), headers=headers)
        assert status == 401 and b"model-" not in out, out


def test_a_body_that_is_not_json_gets_415_with_the_apis_own_error_type(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
    body = json.dumps(chat_body("m")).encode()
    plain = {"content-type": "text/plain"}
    status, _, out = s.request("POST", CHAT, body, headers=plain)
    err = json.loads(out)["error"]
    assert status == 415 and err["type"] == "invalid_request_error", out
    assert err["code"] == "unsupported_media_type"
    status, _, out = s.request("POST", "/v1/responses", body, headers=plain)
    assert status == 415 and json.loads(out)["error"]["type"] == "invalid_request_error", out
    status, _, out = s.request("POST", "/v1/messages", body, headers=plain)
    doc = json.loads(out)
    assert status == 415 and doc["type"] == "error", out
    assert doc["error"]["type"] == "invalid_request_error", out
    status, _, out = s.request("POST", "/api/chat", body, headers=plain)
    assert status == 415 and list(json.loads(out)) == ["error"], out
    status, _, out = s.request("POST", "/models/load", b'{"model": "m"}', headers=plain)
    assert status == 415 and json.loads(out)["error"]["type"] == "invalid_request_error", out
