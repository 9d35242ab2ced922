"""Every client speaks to it (issue 14): the real SDKs (anthropic, openai,
ollama) against the demo model smollm2-135m through one server, and the
error shapes, CORS and native pass-through on fake replicas."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import Server, free_port, wait_for, write_fake

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

SMOL = "smollm2-135m"
HI = [{"role": "user", "content": "Say hi"}]
HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """One server with the demo models for every SDK check of this module."""
    d = tmp_path_factory.mktemp("real")
    s = Server(["--proxies", "1", "--ctx-size", "512", "--spares", "0"], free_port(),
               d / "server.log")
    try:
        s.wait_ready(60)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    """Fake replicas: ``a`` answers, ``broken-*`` fail their load after 0.6 s,
    ``native`` is a cmd replica speaking Anthropic and Responses itself
    (tests/recording_server.py, recording what it got), ``native-translated``
    the same with ``translate = true``; CORS only for http://a.example."""
    d = tmp_path_factory.mktemp("fake")
    fakes = d / "fakes"
    write_fake(fakes, "a", load_s=0.05)
    for name in ("ka-timed", "ka-forever", "ka-probe", "ld"):
        write_fake(fakes, name, load_s=0.05)
    for api in ("anthropic", "responses", "ollama"):  # one each: a failed load backs off
        write_fake(fakes, f"broken-{api}", load_s=0.6, fail_load="no weights today")
    preset = d / "native.ini"
    rec = HERE / "recording_server.py"
    preset.write_text(
        f"[native]\ncmd = {sys.executable} {rec} --port ${{PORT}} --log {d / 'native.jsonl'}\n"
        "check-endpoint = /health\nstop-timeout = 2\n\n"
        f"[native-translated]\ncmd = {sys.executable} {rec} --port ${{PORT}} "
        f"--log {d / 'translated.jsonl'}\ncheck-endpoint = /health\nstop-timeout = 2\n"
        "translate = true\n\n[native-broken]\ncmd = /bin/false ${PORT}\n\n[ka-forever]\nttl = 0.5\n\n[ka-probe]\nttl = 0.5\n")
    s = Server(["--fake-models-dir", str(fakes), "--models-preset", str(preset), "--no-hf-cache",
                "--proxies", "1", "--stream-keepalive", "0.2",
                "--cors-origins", "http://a.example"], free_port(), d / "server.log")
    s.dir = d
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def recorded(server, name: str) -> list[dict]:
    p = server.dir / f"{name}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


# ---- 1. the anthropic SDK ------------------------------------------------------------
@pytest.mark.slow
def test_anthropic_sdk_create_stream_count_tokens_and_not_found(real):
    c = anthropic.Anthropic(base_url=real.base, api_key="unused", max_retries=0)
    msg = c.messages.create(model=SMOL, max_tokens=16, messages=HI, system="You are brief.")
    assert msg.role == "assistant" and msg.content[0].type == "text"
    assert msg.content[0].text.strip() and msg.usage.output_tokens > 0
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with c.messages.stream(model=SMOL, max_tokens=16, messages=HI) as stream:
        starts = []
        for ev in stream:
            if ev.type == "message_start":  # the prompt's size, known before the answer
                starts.append(ev.message.usage)
        pieces = [b.text for b in stream.get_final_message().content if b.type == "text"]
        final = stream.get_final_message()
    assert starts and starts[0].input_tokens > 0, starts  # as llama-server's (issue 23)
    assert starts[0].cache_read_input_tokens is not None and msg.usage.cache_read_input_tokens == 0
    assert "".join(pieces).strip() and final.content[0].text == "".join(pieces)
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.output_tokens > 0
    n = c.messages.count_tokens(model=SMOL, messages=HI, system="You are brief.")
    assert n.input_tokens > 0
    with pytest.raises(anthropic.NotFoundError) as e:
        c.messages.create(model="no-such-model", max_tokens=4, messages=HI)
    assert e.value.body["error"]["type"] == "not_found_error"


# ---- 2. the openai SDK ---------------------------------------------------------------
@pytest.mark.slow
def test_openai_sdk_responses_models_retrieve_and_stream_usage(real):
    c = openai.OpenAI(base_url=real.base + "/v1", api_key="unused", max_retries=0)
    r = c.responses.create(model=SMOL, input="Say hi", instructions="Be brief.",
                           max_output_tokens=16)
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.output_tokens > 0
    kinds, text = [], []
    for ev in c.responses.create(model=SMOL, input=[{"role": "user", "content": "Say hi"}],
                                 max_output_tokens=16, stream=True):
        kinds.append(ev.type)
        if ev.type == "response.output_text.delta":
            text.append(ev.delta)
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed",
                                                            "response.incomplete")
    assert "response.output_text.done" in kinds and "".join(text).strip()
    m = c.models.retrieve(SMOL)
    assert m.id == SMOL and m.created > 1_600_000_000  # the file's time, not 0
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("no-such-model")
    chunks = list(c.chat.completions.create(model=SMOL, messages=HI, max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert chunks[-1].choices == []
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks[:-1]).strip()
    # what worked before still does
    out = c.chat.completions.create(model=SMOL, messages=HI, max_tokens=8)
    assert out.choices[0].message.content.strip()
    assert SMOL in {x.id for x in c.models.list().data}


# ---- 3. the ollama client ------------------------------------------------------------
@pytest.mark.slow
def test_ollama_client_list_ps_show_chat_generate_embed(real):
    c = ollama.Client(host=real.base)
    names = {m.model for m in c.list().models}
    assert f"{SMOL}:latest" in names
    tag = next(m for m in c.list().models if m.model == f"{SMOL}:latest")
    assert tag.details.family == "llama" and tag.details.quantization_level == "Q4_1"
    assert tag.size > 0 and tag.modified_at is not None
    shown = c.show(f"{SMOL}:latest")
    assert shown.details.parameter_size == "135M" and shown.modelinfo
    r = c.chat(model=f"{SMOL}:latest", messages=HI, options={"num_predict": 8})
    assert r.done and r.message.role == "assistant" and r.message.content.strip()
    parts = list(c.chat(model=SMOL, messages=HI, stream=True, options={"num_predict": 8}))
    assert parts[-1].done and parts[-1].done_reason in ("stop", "length")
    assert not any(p.done for p in parts[:-1]) and parts[-1].eval_count > 0
    assert "".join(p.message.content for p in parts).strip()
    g = c.generate(model=SMOL, prompt="Say hi", options={"num_predict": 8})
    assert g.done and g.response.strip()
    e = c.embed(model=SMOL, input=["hello", "world"])
    assert len(e.embeddings) == 2 and len(e.embeddings[0]) > 10
    running = next(m for m in c.ps().models if m.model == f"{SMOL}:latest")
    assert running.context_length == 512  # the server's --ctx-size, not the trained 8192


@pytest.mark.slow
def test_ollama_generate_on_a_base_model_sends_the_prompt_alone(real):
    # gemma3-270m's GGUF has no chat template: Ollama's template is then the
    # prompt itself, so no chat format may wrap it (/api/show says "")
    c = ollama.Client(host=real.base)
    assert c.show("gemma3-270m").template == ""
    prompt = "The capital of France is"
    g = c.generate(model="gemma3-270m", prompt=prompt, options={"num_predict": 4})
    status, doc = real.json("POST", "/v1/completions",
                            {"model": "gemma3-270m", "prompt": prompt, "max_tokens": 1})
    assert status == 200, doc
    assert g.done and g.prompt_eval_count == doc["usage"]["prompt_tokens"]


@pytest.mark.slow
def test_ollama_keep_alive_zero_unloads_after_the_request(real):
    c = ollama.Client(host=real.base)
    r = c.chat(model=SMOL, messages=HI, options={"num_predict": 4}, keep_alive=0)
    assert r.done and r.message.content is not None
    wait_for(lambda: real.models()[SMOL]["status"]["value"] == "unloaded", 30,
             what="smollm2 unloaded after keep_alive=0")
    assert f"{SMOL}:latest" not in {m.model for m in c.ps().models}


@pytest.mark.slow
def test_ollama_keep_alive_is_the_idle_timer_until_the_model_unloads(fake):
    c = ollama.Client(host=fake.base)
    status = lambda name: fake.models()[name]["status"]["value"]
    assert c.chat(model="ka-timed", messages=HI, keep_alive="1s").done  # no ttl of its own
    wait_for(lambda: status("ka-timed") == "unloaded", 20, what="ka-timed unloaded after 1 s")
    # keep_alive -1 (forever) outlives the preset's ttl = 0.5 that unloads its twin
    assert c.chat(model="ka-forever", messages=HI, keep_alive=-1).done
    assert c.chat(model="ka-probe", messages=HI).done
    wait_for(lambda: status("ka-probe") == "unloaded", 20, what="ka-probe unloaded by its ttl")
    assert status("ka-forever") == "loaded"
    assert "keep_alive forever" in fake.logs()


def test_ollama_empty_generate_loads_and_with_keep_alive_zero_unloads(fake):
    c = ollama.Client(host=fake.base)
    status = lambda: fake.models()["ld"]["status"]["value"]
    assert status() == "unloaded"
    r = c.generate(model="ld:latest")  # Ollama's idiom: no prompt loads the model
    assert r.done and r.done_reason == "load" and status() == "loaded"
    r = c.generate(model="ld", keep_alive=0)
    assert r.done and r.done_reason == "unload"
    wait_for(lambda: status() == "unloaded", 20, what="ld unloaded")


def test_ollama_pull_and_the_other_model_management_say_ggmux_does_not_download(fake):
    """Open WebUI and the ollama client call /api/pull: a model ggmux serves
    is "success" (nothing to download), any other, and push, create, copy,
    delete, a clear 501 in Ollama's envelope instead of a 404 "no route"."""
    c = ollama.Client(host=fake.base)
    assert c.pull("a").status == "success"
    assert [p.status for p in c.pull("a:latest", stream=True)] == ["success"]
    calls = [lambda: c.pull("llama3.2"), lambda: list(c.pull("llama3.2", stream=True)),
             lambda: c.push("a"), lambda: c.create("b", from_="a"), lambda: c.copy("a", "b"),
             lambda: c.delete("a")]
    for call in calls:
        with pytest.raises(ollama.ResponseError) as e:
            call()
        assert e.value.status_code == 501, e.value
        assert e.value.error.startswith("ggmux does not ") and "--models-dir" in e.value.error
    with pytest.raises(ollama.ResponseError, match="'llama3.2' is not here"):
        c.pull("llama3.2")
    assert fake.request("HEAD", "/api/blobs/sha256:00")[0] == 501  # create's first step
    assert "a" in fake.models()  # nothing deleted


# ---- 4. CORS -------------------------------------------------------------------------
@pytest.mark.slow
def test_cors_preflight_and_actual_request_with_the_default_origins(real):
    origin = {"Origin": "http://localhost:3000"}
    st, h, _ = real.request("OPTIONS", "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization"})
    # echoed, as llama-server; without credentials
    assert st == 200 and h["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in h["access-control-allow-methods"]
    assert "authorization" in h["access-control-allow-headers"]
    assert "access-control-allow-credentials" not in h  # never for any origin
    st, h, _ = real.request("GET", "/v1/models", headers=origin)
    assert st == 200 and h["access-control-allow-origin"] == "http://localhost:3000"
    assert "access-control-allow-credentials" not in h and h["vary"] == "Origin"
    st, h, _ = real.request("OPTIONS", "/v1/models")
    assert st == 200 and "GET" in h["allow"]


def test_cors_listed_origin_gets_credentials_and_others_nothing(fake):
    st, h, _ = fake.request("OPTIONS", "/v1/messages", headers={
        "Origin": "http://a.example", "Access-Control-Request-Method": "POST"})
    assert st == 200 and h["access-control-allow-origin"] == "http://a.example"
    assert h["access-control-allow-credentials"] == "true"
    st, h, _ = fake.request("POST", "/v1/chat/completions",
                            {"model": "a", "messages": HI}, headers={"Origin": "http://b.example"})
    assert st == 200 and "access-control-allow-origin" not in h
    st, h, _ = fake.request("OPTIONS", "/v1/messages", headers={
        "Origin": "http://b.example", "Access-Control-Request-Method": "POST"})
    assert st == 200 and "access-control-allow-origin" not in h


# ---- 5. native pass-through ------------------------------------------------------------
def test_cmd_replica_speaking_the_apis_gets_them_unchanged(fake):
    a = anthropic.Anthropic(base_url=fake.base, api_key="k", max_retries=0)
    msg = a.messages.create(model="native", max_tokens=7, messages=HI, stop_sequences=["END"])
    assert msg.content[0].text == "native:/v1/messages"
    with a.messages.stream(model="native", max_tokens=7, messages=HI) as s:
        assert "".join(s.text_stream) == "native:/v1/messages"
    o = openai.OpenAI(base_url=fake.base + "/v1", api_key="k", max_retries=0)
    r = o.responses.create(model="native", input="Say hi", max_output_tokens=9)
    assert r.output_text == "native:/v1/responses"
    got = [x for x in recorded(fake, "native") if x["method"] == "POST"]
    assert [x["path"] for x in got] == ["/v1/messages", "/v1/messages", "/v1/responses"]
    assert got[0]["body"] == {"model": "native", "max_tokens": 7, "messages": HI, "stop_sequences": ["END"]}
    assert got[0]["headers"]["anthropic-version"]  # the client's headers go along
    assert got[2]["body"] == {"model": "native", "input": "Say hi", "max_output_tokens": 9}
    # translate = true: the same request becomes a chat completion for the replica
    msg = a.messages.create(model="native-translated", max_tokens=7, messages=HI)
    assert msg.content[0].text == "native:/v1/chat/completions"
    got = [x for x in recorded(fake, "translated") if x["method"] == "POST"]
    assert got[-1]["path"] == "/v1/chat/completions"
    assert got[-1]["body"]["messages"] == HI and got[-1]["body"]["max_tokens"] == 7
    # the proxy's own refusal of a passed-through request is in the API's envelope too
    with pytest.raises(anthropic.APIStatusError) as e:
        a.messages.create(model="native-broken", max_tokens=7, messages=HI)
    assert e.value.status_code == 503 and e.value.body["type"] == "error"


# ---- 6. errors in each API's shape -----------------------------------------------------
@pytest.mark.parametrize("path, body, status, check", [
    ("/v1/messages", {"model": "a", "messages": HI}, 400,
     lambda e: e["type"] == "error" and e["error"]["type"] == "invalid_request_error"
     and "max_tokens" in e["error"]["message"]),
    ("/v1/messages", {"model": "zz", "max_tokens": 3, "messages": HI}, 404,
     lambda e: e["error"]["type"] == "not_found_error"),
    ("/v1/messages", b"{not json", 400, lambda e: e["type"] == "error"),
    ("/v1/messages/count_tokens", {"model": "a", "messages": "x"}, 400,
     lambda e: e["error"]["type"] == "invalid_request_error"),
    ("/v1/responses", {"model": "a", "input": "x", "background": True}, 400,
     lambda e: e["error"]["code"] == "invalid_request_error"
     and "stores no responses" in e["error"]["message"]),
    ("/v1/responses", {"model": "zz", "input": "x"}, 404,
     lambda e: e["error"]["type"] == "not_found_error"),
    ("/api/chat", {"model": "a", "messages": [{"role": "user", "content": 3}]}, 400,
     lambda e: set(e) == {"error"} and isinstance(e["error"], str)),
    ("/api/chat", {"model": "zz", "messages": HI}, 404,
     lambda e: set(e) == {"error"} and e["error"].startswith("model 'zz' not found; models "
                                                             "here: ")),
    ("/api/generate", {"model": "a", "prompt": "x", "keep_alive": "soon"}, 400,
     lambda e: "keep_alive" in e["error"]),
    ("/api/show", {"model": "zz"}, 404, lambda e: isinstance(e["error"], str)),
])
def test_bad_input_gets_the_apis_own_error_shape(fake, path, body, status, check):
    st, _, data = fake.request("POST", path, body, headers={"content-type": "application/json"})
    assert st == status, data
    assert check(json.loads(data)), data


def test_a_wrong_type_gets_a_400_naming_the_field_not_orjsons_encoding_message(fake):
    # issue 31 item 5: the proxy caught every TypeError as orjson's JSONEncodeError
    st, doc = fake.json("POST", "/v1/responses", {
        "model": "a", "input": [{"type": "reasoning", "content": 5}, {"role": "user",
                                                                       "content": "x"}]})
    assert st == 400 and "input.0.content must be a list" in doc["error"]["message"], doc
    assert "64 bits" not in doc["error"]["message"]


def test_a_response_id_cannot_be_retrieved_and_the_400_says_why(fake):
    st, doc = fake.json("GET", "/v1/responses/resp_123")
    assert st == 400 and "stores no responses" in doc["error"]["message"]


def raw_stream(server, path: str, body: dict) -> bytes:
    """POST ``body`` and read the whole response, as bytes, until the
    server closes or ends it."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as s:
        s.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (path.encode(), len(data),
                                                                           data))
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


@pytest.mark.parametrize("path, body, event", [
    ("/v1/messages", {"model": "broken-anthropic", "max_tokens": 4, "messages": HI},
     b"event: error\ndata: "),
    ("/v1/responses", {"model": "broken-responses", "input": "x"}, b"event: error\ndata: "),
    ("/api/chat", {"model": "broken-ollama", "messages": HI}, b'{"error":'),
])
def test_a_stream_that_fails_gets_the_apis_error_event(fake, path, body, event):
    # the stream head goes out while the model loads (--stream-keepalive), then its
    # load fails: the failure arrives as the API's own error event
    raw = raw_stream(fake, path, {"stream": True, **body})
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    assert event in raw and b"no weights today" in raw, raw
    assert not raw.endswith(b"0\r\n\r\n")  # never a clean end
    if path == "/v1/messages":
        err = json.loads(raw.split(b"event: error\ndata: ")[1].split(b"\n")[0])
        assert err["type"] == "error" and err["error"]["type"] == "overloaded_error"


def test_error_codes_are_openai_strings_but_numbers_on_llama_cpp_routes(fake):
    st, doc = fake.json("POST", "/v1/chat/completions", {"model": "a", "messages": "x"})
    assert st == 400 and doc["error"]["code"] == "invalid_request_error"  # the replica's
    st, doc = fake.json("POST", "/v1/chat/completions", {"messages": []})  # the proxy's
    assert st == 400 and doc["error"]["code"] == "invalid_request_error"
    st, doc = fake.json("POST", "/tokenize", {"model": "a", "content": 3})
    assert st == 400 and doc["error"]["code"] == 400  # llama.cpp's numeric code
