"""Tool calls, tool results and reasoning through every client API, end to
end with the real SDKs, on every replica kind (issue 19): the fake
instance (translated: it answers OpenAI tool calls and reasoning, see
ggmux.instance.fake), a ``cmd`` replica and an ``upstream`` that speak
Anthropic's and the Responses API themselves (tests/recording_server.py:
passed through), and both with ``translate = true``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import Server, connectable, free_port, wait_for, write_fake

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")
jsonschema = pytest.importorskip("jsonschema")

HERE = Path(__file__).parent
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 2},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1}}, "required": ["city", "unit", "days"]}
NOTE = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """``agent`` (a fake that reasons first), ``plain`` (a fake), ``native`` /
    ``native-translated`` (cmd replicas speaking Anthropic and Responses),
    ``remote`` / ``remote-translated`` (upstreams to one more of them)."""
    d = tmp_path_factory.mktemp("tools")
    fakes = d / "fakes"
    write_fake(fakes, "agent", reasoning="Oslo needs a forecast", tokens=4)
    write_fake(fakes, "plain", tokens=3)
    rec = HERE / "recording_server.py"
    up_port = free_port()
    up = subprocess.Popen([sys.executable, str(rec), "--port", str(up_port),
                           "--log", str(d / "remote.jsonl")])
    preset = d / "tools.ini"
    cmd = f"{sys.executable} {rec} --port ${{PORT}} --log"
    preset.write_text(
        f"[native]\ncmd = {cmd} {d / 'native.jsonl'}\nstop-timeout = 2\n\n"
        f"[native-translated]\ncmd = {cmd} {d / 'translated.jsonl'}\nstop-timeout = 2\n"
        "translate = true\n\n"
        f"[remote]\nupstream = http://127.0.0.1:{up_port}\n\n"
        f"[remote-translated]\nupstream = http://127.0.0.1:{up_port}\ntranslate = true\n")
    s = Server(["--fake-models-dir", str(fakes), "--models-preset", str(preset), "--no-hf-cache",
                "--proxies", "1"], free_port(), d / "server.log")
    s.dir = d
    try:
        wait_for(lambda: connectable(up_port), 10, what="the upstream")
        s.wait_ready()
        yield s
    finally:
        s.stop()
        up.terminate()
        up.wait(10)


def recorded(srv, name: str) -> list[dict]:
    p = srv.dir / f"{name}.jsonl"
    return [json.loads(x) for x in p.read_text().splitlines()] if p.exists() else []


def anth_client(srv):
    return anthropic.Anthropic(base_url=srv.base, api_key="unused", max_retries=0)


def oai_client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="unused", max_retries=0)


A_TOOLS = [{"name": "weather", "description": "The forecast", "input_schema": WEATHER,
            "cache_control": {"type": "ephemeral"}},
           {"name": "note", "description": "Take a note", "input_schema": NOTE}]
F_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
           {"type": "function", "function": {"name": "note", "parameters": NOTE}}]


# ---- Anthropic -----------------------------------------------------------------------
def test_anthropic_tool_use_round_trip_streamed_and_not(srv):
    c = anth_client(srv)
    msg = c.messages.create(model="agent", max_tokens=64, messages=ASK, tools=A_TOOLS,
                            thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "Oslo needs a forecast"
    use = msg.content[1]
    assert use.name == "weather"
    jsonschema.validate(use.input, WEATHER)
    follow = ASK + [{"role": "assistant", "content": [b.model_dump() for b in msg.content]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": [{"type": "text",
                                                               "text": "-3 C, snow"}]}]}]
    done = c.messages.create(model="agent", max_tokens=64, messages=follow, tools=A_TOOLS)
    assert done.stop_reason == "end_turn" and done.content[-1].text.startswith("[agent:")
    with c.messages.stream(model="plain", max_tokens=64, messages=ASK, tools=A_TOOLS,
                           tool_choice={"type": "tool", "name": "note"}) as s:
        final = s.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].name == "note" and final.content[0].input == {"text": "text"}
    none = c.messages.create(model="plain", max_tokens=8, messages=ASK, tools=A_TOOLS,
                             tool_choice={"type": "none"})
    assert none.stop_reason == "end_turn" and none.content[0].type == "text"


def test_anthropic_forced_server_tools_and_images_are_400s_in_anthropics_envelope(srv):
    c = anth_client(srv)
    with pytest.raises(anthropic.BadRequestError) as e:  # forced (issue 31 item 13)
        c.messages.create(model="plain", max_tokens=8, messages=ASK,
                          tools=[{"type": "web_search_20250305", "name": "web_search"}],
                          tool_choice={"type": "tool", "name": "web_search"})
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "web_search" in e.value.body["error"]["message"]
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="plain", max_tokens=8, messages=[
            {"role": "user", "content": [img, {"type": "text", "text": "what?"}]}])
    assert "'plain'" in e.value.body["error"]["message"] and "projector" in \
        e.value.body["error"]["message"]


def test_count_tokens_renders_the_template_or_falls_back_to_the_text(srv):
    c = anth_client(srv)
    # the fake has no /apply-template (501): the text and the tools are counted
    bare = c.messages.count_tokens(model="plain", messages=ASK).input_tokens
    with_tools = c.messages.count_tokens(model="plain", messages=ASK, tools=A_TOOLS)
    assert 0 < bare < with_tools.input_tokens
    # a replica with /apply-template renders it, and the rendering is tokenized
    n = c.messages.count_tokens(model="native-translated", messages=ASK, tools=A_TOOLS,
                                system="Be brief.").input_tokens
    got = [x for x in recorded(srv, "translated") if x["method"] == "POST"]
    tpl = next(x for x in got if x["path"] == "/apply-template")
    assert tpl["body"]["tools"][0]["function"]["name"] == "weather"
    assert tpl["body"]["messages"][0] == {"role": "system", "content": "Be brief."}
    tok = [x for x in got if x["path"] == "/tokenize"][-1]
    assert tok["body"]["content"].startswith("<tpl>") and tok["body"]["add_special"] is False
    assert n == len(tok["body"]["content"].split())
    # passed through to a replica that counts itself
    assert c.messages.count_tokens(model="native", messages=ASK).input_tokens == 42


@pytest.mark.parametrize("model, log", [("native", "native"), ("remote", "remote")])
def test_anthropic_tools_pass_through_unchanged_to_replicas_that_speak_it(srv, model, log):
    c = anth_client(srv)
    before = len(recorded(srv, log))
    msg = c.messages.create(model=model, max_tokens=16, messages=ASK, tools=A_TOOLS,
                            tool_choice={"type": "auto"}, extra_query={"beta": "true"})
    assert msg.stop_reason == "tool_use" and msg.content[0].id == "toolu_native"
    got = recorded(srv, log)[before:]
    posted = [x for x in got if x["method"] == "POST"][-1]
    assert posted["path"] == "/v1/messages?beta=true"
    assert posted["body"]["tools"] == A_TOOLS and posted["body"]["tool_choice"] == {
        "type": "auto"}
    oai_client(srv).responses.create(model=model, input="Weather?", tools=R_TOOLS)
    posted = [x for x in recorded(srv, log) if x["method"] == "POST"][-1]
    assert posted["path"] == "/v1/responses" and posted["body"]["tools"] == R_TOOLS
    # Ollama's API is always translated: the replica gets OpenAI's tools
    r = ollama.Client(host=srv.base).chat(model=model, messages=ASK, tools=F_TOOLS)
    assert r.message.tool_calls[0].function.name == "weather"
    assert r.message.tool_calls[0].function.arguments == {}
    posted = [x for x in recorded(srv, log) if x["method"] == "POST"][-1]
    assert posted["path"] == "/v1/chat/completions"  # (the ollama client keeps less schema)
    assert [t["function"]["name"] for t in posted["body"]["tools"]] == ["weather", "note"]


@pytest.mark.parametrize("model, log", [("native-translated", "translated"),
                                        ("remote-translated", "remote")])
def test_translate_true_sends_openai_tools_and_maps_the_calls_back(srv, model, log):
    c = anth_client(srv)
    before = len(recorded(srv, log))
    msg = c.messages.create(model=model, max_tokens=16, messages=ASK, tools=A_TOOLS,
                            tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert msg.stop_reason == "tool_use"
    assert (msg.content[0].id, msg.content[0].name, msg.content[0].input) == (
        "call_native", "weather", {})
    posted = [x for x in recorded(srv, log)[before:] if x["method"] == "POST"][-1]
    assert posted["path"] == "/v1/chat/completions"
    assert posted["body"]["tools"][0] == {"type": "function", "function": {
        "name": "weather", "description": "The forecast", "parameters": WEATHER}}
    assert posted["body"]["tool_choice"] == "required"
    assert posted["body"]["parallel_tool_calls"] is False
    r = oai_client(srv).responses.create(model=model, input="Weather?", tools=[
        {"type": "function", "name": "note", "parameters": NOTE}])
    assert [o.type for o in r.output] == ["function_call"] and r.output[0].name == "note"


# ---- Responses -----------------------------------------------------------------------
R_TOOLS = [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": False},
           {"type": "namespace", "name": "notes", "description": "Notes",
            "tools": [{"type": "function", "name": "note", "parameters": NOTE}]}]


def test_responses_function_call_round_trip_streamed_and_not(srv):
    c = oai_client(srv)
    r = c.responses.create(model="agent", input="Weather in Oslo?", tools=R_TOOLS,
                           tool_choice="auto", parallel_tool_calls=True)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[0].content[0].text == "Oslo needs a forecast"
    call = r.output[1]
    assert call.name == "weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    follow = [{"role": "user", "content": "Weather in Oslo?"},
              *[o.model_dump(exclude_none=True) for o in r.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "-3 C"}]
    done = c.responses.create(model="agent", input=follow, tools=R_TOOLS)
    assert done.output_text.startswith("[agent:") and done.output[-1].type == "message"
    kinds, args = [], ""
    with c.responses.stream(model="plain", input="note this", tools=R_TOOLS,
                            tool_choice={"type": "function", "name": "note"}) as s:
        for ev in s:
            kinds.append(ev.type)
            if ev.type == "response.function_call_arguments.delta":
                args += ev.delta
        final = s.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    assert json.loads(args) == {"text": "text"}
    out = final.output[0]
    assert (out.type, out.name, out.namespace) == ("function_call", "note", "notes")


def test_responses_forced_hosted_tools_and_images_are_400s_in_openais_envelope(srv):
    c = oai_client(srv)
    with pytest.raises(openai.BadRequestError) as e:  # forced: nothing here runs it
        c.responses.create(model="plain", input="x", tools=[{"type": "web_search"}],
                           tool_choice={"type": "web_search"})
    assert e.value.body["type"] == "invalid_request_error" and "hosted" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        c.responses.create(model="plain", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}]}])
    assert "'plain'" in str(e.value) and "projector" in str(e.value)


# ---- OpenAI chat completions (the fake itself, relayed) ---------------------------------
def test_chat_completions_tool_calls_streamed_with_usage_and_not(srv):
    c = oai_client(srv)
    r = c.chat.completions.create(model="agent", messages=ASK, tools=F_TOOLS,
                                  tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), WEATHER)
    chunks = list(c.chat.completions.create(model="agent", messages=ASK, tools=F_TOOLS,
                                            stream=True, stream_options={"include_usage": True}))
    calls = [tc for k in chunks if k.choices for tc in k.choices[0].delta.tool_calls or ()]
    assert calls[0].id and calls[0].function.name == "weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == json.loads(
        ch.message.tool_calls[0].function.arguments)
    reasoning = "".join(getattr(k.choices[0].delta, "reasoning_content", None) or ""
                        for k in chunks if k.choices)
    assert reasoning == "Oslo needs a forecast"
    assert chunks[-1].usage is not None and chunks[-2].choices[0].finish_reason == "tool_calls"


# ---- Ollama --------------------------------------------------------------------------
def test_ollama_tools_think_and_tool_messages_streamed_and_not(srv):
    c = ollama.Client(host=srv.base)
    r = c.chat(model="agent", messages=ASK, tools=F_TOOLS, think=True, stream=False)
    assert r.message.thinking == "Oslo needs a forecast" and r.done_reason == "stop"
    call = r.message.tool_calls[0]
    assert call.function.name == "weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), WEATHER)
    follow = ASK + [r.message, {"role": "tool", "tool_name": "weather", "content": "-3 C"}]
    done = c.chat(model="agent", messages=follow, tools=F_TOOLS, stream=False)
    assert done.message.content.startswith("[agent:") and not done.message.tool_calls
    parts = list(c.chat(model="agent", messages=ASK, tools=F_TOOLS, think="high", stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == "Oslo needs a forecast"
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1 and with_calls[0].message.tool_calls[0].function.arguments == \
        dict(call.function.arguments)
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="plain", messages=[{"role": "user", "content": "what?",
                                         "images": [b"\x89PNG\r\n"]}])
    assert e.value.status_code == 400 and "'plain'" in e.value.error


# ---- issue 31 items 6 and 13 -------------------------------------------------------------
TWO_NS = [{"type": "namespace", "name": "fs", "tools": [
              {"type": "function", "name": "read", "parameters": NOTE}]},
          {"type": "namespace", "name": "db", "tools": [
              {"type": "function", "name": "read", "parameters": NOTE}]}]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_namespaces_sharing_a_function_name_answer_under_their_own(srv, stream):
    # issue 31 item 6: both calls came back labelled with the last namespace
    for ns in ("fs", "db"):
        st, _, data = srv.request("POST", "/v1/responses", {
            "model": "plain", "input": "x", "tools": TWO_NS, "stream": stream,
            "tool_choice": {"type": "function", "name": "read", "namespace": ns}})
        assert st == 200, data
        if stream:
            done = [json.loads(b[6:]) for b in data.split(b"\n") if b.startswith(b"data: ")]
            doc = next(d for d in done if d["type"] == "response.completed")["response"]
        else:
            doc = json.loads(data)
        calls = [o for o in doc["output"] if o["type"] == "function_call"]
        assert [(o["name"], o["namespace"]) for o in calls] == [("read", ns)], doc


def test_codexs_default_web_search_is_left_out_and_named_in_a_header(srv):
    # issue 31 item 13: Codex's default config offers its hosted web_search tool
    body = json.loads((HERE / "agent_requests" / "codex_first.json").read_text())
    body = {**body, "model": "plain", "tools": [*body["tools"], {"type": "web_search"}]}
    st, headers, data = srv.request("POST", "/v1/responses", body)
    assert st == 200, data
    assert headers["x-ggmux-dropped-tools"] == "web_search"
    assert b"response.completed" in data
    wait_for(lambda: "left out the hosted tools web_search" in srv.logs(), 10,
             what="the log line")
    st, headers, _ = srv.request("POST", "/v1/responses", {**body, "stream": False})
    assert st == 200 and headers["x-ggmux-dropped-tools"] == "web_search"
