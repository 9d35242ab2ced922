"""Tools, tool results, reasoning and images through the Anthropic,
Responses and Ollama adapters, on bytes, without any process (issue 19).

The answers are checked against the real SDKs' own types (``anthropic``,
``openai``, ``ollama``): what an adapter writes must parse as what the
API's client expects."""

from __future__ import annotations

import json

import pytest
from adapter_streams import delta_sse, events, run_stream, tool_deltas
from ggmux.proxy.apis.adapters import anthropic as A
from ggmux.proxy.apis.adapters import ollama as O
from ggmux.proxy.apis.adapters import responses as R
from ggmux.proxy.apis.adapters.common import BadReply, BadRequest, Translated

pydantic = pytest.importorskip("pydantic")
anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
ollama = pytest.importorskip("ollama")

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALLS = (("call_1", "weather", '{"city": "Paris"}'), ("call_2", "time", '{"zone": "CET"}'))


def chat_answer(text=None, calls=(), reasoning=None, finish=None) -> dict:
    msg: dict = {"role": "assistant", "content": text}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [{"id": i, "type": "function", "function": {"name": n, "arguments": a}}
                             for i, n, a in calls]
    return {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": msg,
                         "finish_reason": finish or ("tool_calls" if calls else "stop")}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}


# ---- Anthropic: requests --------------------------------------------------------------
def anth(**kw):
    return {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_anthropic_tools_and_every_tool_choice_map_to_openai():
    tools = [{"name": "weather", "description": "Weather now", "input_schema": WEATHER,
              "cache_control": {"type": "ephemeral"}},
             {"type": "custom", "name": "time", "input_schema": {"type": "object"}}]
    t = A.to_chat(anth(tools=tools))
    assert t.body["tools"] == [
        {"type": "function", "function": {"name": "weather", "description": "Weather now",
                                          "parameters": WEATHER}},
        {"type": "function", "function": {"name": "time", "parameters": {"type": "object"}}}]
    assert "tool_choice" not in t.body
    for choice, want in (({"type": "auto"}, "auto"), ({"type": "any"}, "required"),
                         ({"type": "none"}, "none"),
                         ({"type": "tool", "name": "time"},
                          {"type": "function", "function": {"name": "time"}})):
        body = A.to_chat(anth(tools=tools, tool_choice=choice)).body
        assert body["tool_choice"] == want and "parallel_tool_calls" not in body
    body = A.to_chat(anth(tools=tools, tool_choice={"type": "auto",
                                                     "disable_parallel_tool_use": True})).body
    assert body["parallel_tool_calls"] is False


@pytest.mark.parametrize("tool, words", [
    ({"type": "web_search_20250305", "name": "web_search"}, "server or built-in tools"),
    ({"type": "code_execution_20250522", "name": "code_execution"}, "server or built-in"),
    ({"type": "bash_20250124", "name": "bash"}, "server or built-in"),
    ({"name": "f"}, "input_schema"),
    ({"input_schema": {}}, "name"),
])
def test_anthropic_server_tools_forced_and_malformed_tools_are_a_clear_400(tool, words):
    # a server tool is refused only when tool_choice forces it (issue 31 item 13)
    choice = {"type": "tool", "name": tool["name"]} if "type" in tool else None
    with pytest.raises(BadRequest, match=words) as e:
        A.to_chat(anth(tools=[tool], tool_choice=choice))
    assert e.value.status == 400
    _ctype, body = A.Messages().error(400, str(e.value))
    assert json.loads(body)["error"]["type"] == "invalid_request_error"


def test_anthropic_tool_use_and_tool_results_become_tool_calls_and_tool_messages():
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "weather and time?",
                                      "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two tools", "signature": "sig"},
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Paris"}},
            {"type": "tool_use", "id": "toolu_2", "name": "time", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no clock"}]},
            {"type": "text", "text": "thanks"}]},
        {"role": "system", "content": "Mid-conversation rule."},
    ]
    out = A.to_chat(anth(messages=msgs, system="Be brief.")).body["messages"]
    assert out == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather and time?"},
        {"role": "assistant", "content": "Looking.", "reasoning_content": "two tools",
         "tool_calls": [
             {"id": "toolu_1", "type": "function",
              "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "time",
                                                                 "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no clock"},
        {"role": "user", "content": "thanks"},
        {"role": "system", "content": "Mid-conversation rule."},
    ]


def test_anthropic_thinking_effort_and_billing_stamp():
    b = A.to_chat(anth(thinking={"type": "enabled", "budget_tokens": 1024},
                       output_config={"effort": "low"})).body
    assert b["chat_template_kwargs"] == {"enable_thinking": True}
    assert b["reasoning_effort"] == "low"
    assert A.to_chat(anth(thinking={"type": "disabled"})).body["chat_template_kwargs"] == {
        "enable_thinking": False}
    with pytest.raises(BadRequest, match="thinking"):
        A.to_chat(anth(thinking={"type": "maybe"}))
    sys1 = "x-anthropic-billing-header: cc_version=2.1; cch=a5145;You are Claude Code."
    sys2 = sys1.replace("a5145", "0b9f2")
    one = A.to_chat(anth(system=[{"type": "text", "text": sys1}])).body["messages"][0]
    two = A.to_chat(anth(system=sys2)).body["messages"][0]
    assert one == two and "cch=fffff;" in one["content"]  # the same prefix every request


def test_anthropic_images_become_image_parts_and_documents_are_refused():
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/jpeg",
                                       "data": "AAAA"}}
    t = A.to_chat(anth(messages=[{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, img]}]))
    assert t.images
    assert t.body["messages"][0]["content"][1] == {
        "type": "image_url", "image_url": {"url": "data:image/jpeg;base64,AAAA"}}
    assert not A.to_chat(anth()).images
    with pytest.raises(BadRequest, match="documents"):
        A.to_chat(anth(messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "data": "x"}}]}]))


# ---- Anthropic: answers ---------------------------------------------------------------
def test_anthropic_answer_has_thinking_text_and_tool_use_blocks():
    msg = A.from_chat(chat_answer("Let me look.", CALLS, reasoning="hmm"), "smol")
    anthropic.types.Message.model_validate(msg)
    assert [b["type"] for b in msg["content"]] == ["thinking", "text", "tool_use", "tool_use"]
    assert msg["content"][0]["thinking"] == "hmm"
    assert msg["content"][2] == {"type": "tool_use", "id": "call_1", "name": "weather",
                                 "input": {"city": "Paris"}}
    assert msg["stop_reason"] == "tool_use"
    only_calls = A.from_chat(chat_answer(None, CALLS[:1]), "smol")
    assert [b["type"] for b in only_calls["content"]] == ["tool_use"]
    with pytest.raises(BadReply, match="not JSON"):
        A.from_chat(chat_answer(None, (("c", "weather", "{city"),)), "smol")


def test_anthropic_stream_events_in_anthropics_order_and_the_sdk_rebuilds_the_message():
    from anthropic.lib.streaming._messages import accumulate_event

    body = delta_sse(tool_deltas("think about it", "On it.", CALLS), "tool_calls",
                     usage={"prompt_tokens": 9, "completion_tokens": 11, "total_tokens": 20})
    for pieces in (1, 4, 60):
        evs = events(run_stream(A.MessagesStream("smol"), body, pieces))
        names = [(n, d.get("content_block", d.get("delta", {})).get("type")) for n, d in evs]
        assert names[:3] == [("message_start", None), ("content_block_start", "thinking"),
                             ("ping", None)]
        blocks = [(d["index"], d["content_block"]["type"]) for n, d in evs
                  if n == "content_block_start"]
        assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use"), (3, "tool_use")]
        # one block at a time: each stops before the next starts
        opened = []
        for n, d in evs:
            if n == "content_block_start":
                assert not opened
                opened.append(d["index"])
            elif n == "content_block_delta":
                assert opened == [d["index"]]
            elif n == "content_block_stop":
                assert opened == [d["index"]]
                opened.pop()
        assert [n for n, _ in evs][-2:] == ["message_delta", "message_stop"]
        snap, bufs = None, {}
        for _, d in evs:
            snap = accumulate_event(event=d, current_snapshot=snap, json_bufs=bufs)
        final = anthropic.types.Message.model_validate(snap.to_dict())
        assert final.stop_reason == "tool_use"
        assert final.content[0].thinking == "think about it"
        assert final.content[1].text == "On it."
        assert (final.content[2].name, final.content[2].input) == ("weather", {"city": "Paris"})
        assert (final.content[3].id, final.content[3].input) == ("call_2", {"zone": "CET"})
        assert final.usage.input_tokens == 9 and final.usage.output_tokens == 11


def test_anthropic_answer_cut_short_in_a_call_stops_at_max_tokens_not_tool_use():
    # smollm2 under Claude Code: a Write call whose content ran past max_tokens came
    # back as stop_reason tool_use, and Claude Code ran a tool_use whose input was
    # no JSON, turn after turn; llama-server's "length" beats "tool_calls" too
    cut = (("call_1", "weather", '{"city": "Par'),)
    body = delta_sse(tool_deltas("", "", cut), "length")
    for pieces in (1, 60):
        evs = events(run_stream(A.MessagesStream("smol"), body, pieces))
        assert [d["delta"]["stop_reason"] for n, d in evs if n == "message_delta"] == [
            "max_tokens"]
    whole = A.from_chat(chat_answer("Let me", finish="length"), "smol")
    assert whole["stop_reason"] == "max_tokens"
    assert A.from_chat(chat_answer(None, CALLS[:1]), "smol")["stop_reason"] == "tool_use"


def test_anthropic_stream_of_nothing_still_has_one_text_block():
    evs = events(run_stream(A.MessagesStream("m"), delta_sse([{"role": "assistant"}])))
    assert [n for n, _ in evs] == ["message_start", "content_block_start", "ping",
                                   "content_block_stop", "message_delta", "message_stop"]


def test_count_tokens_text_holds_the_tools_and_the_calls():
    body = anth(tools=[{"name": "weather", "input_schema": WEATHER}], messages=[
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "weather",
                                           "input": {"city": "Oslo"}}]}])
    text = A.count_text(body)
    assert "Oslo" in text and '"parameters"' in text and "weather" in text
    tpl = A.CountTokens().template_request(body)
    assert tpl.target == b"/apply-template" and tpl.body["tools"][0]["function"]["name"] == \
        "weather"
    tok = A.CountTokens().tokenize_request(body, "<|im_start|>x")
    assert tok.body["content"] == "<|im_start|>x" and tok.body["add_special"] is False


# ---- Responses ------------------------------------------------------------------------
def resp(**kw):
    return {"model": "m", "input": "hi", **kw}


def test_responses_function_calls_outputs_and_reasoning_items_become_chat_messages():
    inp = [
        {"type": "message", "role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "call it"}]},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": '{"city":"Oslo"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "rain"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "noon"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "patch", "input": "*** diff"},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "ok"},
        # Codex 0.171's context output: named, of no call (tests/agent_requests/)
        {"type": "function_call_output", "id": "fco_1", "name": "goal_objective",
         "namespace": "agent", "output": "say hi"},
    ]
    msgs = R.to_chat(resp(input=inp)).body["messages"]
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "call it", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
            {"id": "c2", "type": "function", "function": {"name": "time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function",
             "function": {"name": "patch", "arguments": '{"input":"*** diff"}'}}]},
        {"role": "tool", "tool_call_id": "c3", "content": "ok"},
        {"role": "user", "content": "[agent.goal_objective] say hi"},
    ]
    with pytest.raises(BadRequest, match="needs a string 'call_id'"):  # no call, no name
        R.to_chat(resp(input=[{"type": "function_call_output", "output": "x"}]))


def test_responses_tools_namespaces_custom_tools_and_choices():
    tools = [{"type": "function", "name": "weather", "parameters": WEATHER, "strict": False},
             {"type": "custom", "name": "patch", "description": "apply a patch"},
             {"type": "namespace", "name": "agents", "description": "sub-agents",
              "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}]
    t = R.to_chat(resp(tools=tools, tool_choice="required", parallel_tool_calls=False))
    names = [x["function"]["name"] for x in t.body["tools"]]
    assert names == ["weather", "patch", "spawn"]
    assert t.body["tools"][1]["function"]["parameters"] == R.CUSTOM_INPUT
    assert t.body["tool_choice"] == "required" and t.body["parallel_tool_calls"] is False
    assert t.echo["kinds"] == {"patch": {"custom": True}, "spawn": {"namespace": "agents"}}
    named = R.to_chat(resp(tools=tools, tool_choice={"type": "function", "name": "weather"}))
    assert named.body["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    for builtin in ({"type": "web_search"}, {"type": "file_search", "vector_store_ids": []},
                    {"type": "code_interpreter"}, {"type": "mcp", "server_label": "x"}):
        with pytest.raises(BadRequest, match="hosted tools"):  # forced: 400 (issue 31 item 13)
            R.to_chat(resp(tools=[builtin], tool_choice={"type": builtin["type"]}))
        with pytest.raises(BadRequest, match="hosted tools"):  # required of only those
            R.to_chat(resp(tools=[builtin], tool_choice="required"))


def test_responses_answer_has_reasoning_message_and_call_items():
    from openai.types.responses import Response

    t = R.to_chat(resp(tools=[{"type": "function", "name": "weather", "parameters": WEATHER},
                              {"type": "custom", "name": "time"}], tool_choice="auto"))
    out = R.from_chat(chat_answer("Checking.", CALLS, reasoning="hmm"), t)
    r = Response.model_validate(out)
    assert [o.type for o in r.output] == ["reasoning", "message", "function_call",
                                          "custom_tool_call"]
    assert r.output[0].content[0].text == "hmm"
    assert (r.output[2].call_id, r.output[2].name, r.output[2].arguments) == CALLS[0]
    assert r.output[3].input == "" and r.output[3].call_id == "call_2"  # no "input" key
    assert r.tool_choice == "auto" and len(r.tools) == 2 and r.output_text == "Checking."


def test_a_call_cut_by_the_clients_limit_is_left_out_or_incomplete_in_every_api():
    """A call the client's token limit cut (its arguments partial, or none
    yet: cut right after the name) is no call a client may run: left out of
    a whole Anthropic answer (``stop_reason`` ``max_tokens``), an
    ``incomplete`` Responses item, whole and streamed; a complete call
    before it stays as it was."""
    from openai.types.responses import Response

    for partial in ("", '{"city": "Pa'):
        calls = (CALLS[0], ("call_2", "weather", partial))
        a = A.from_chat(chat_answer("", calls, finish="length"), "smol")
        assert a["stop_reason"] == "max_tokens"
        assert [(b["id"], b["input"]) for b in a["content"] if b["type"] == "tool_use"] == [
            ("call_1", {"city": "Paris"})]
        t = R.to_chat(resp(tools=[{"type": "function", "name": "weather",
                                   "parameters": WEATHER}]))
        r = Response.model_validate(R.from_chat(chat_answer("", calls, finish="length"), t))
        assert r.status == "incomplete"
        assert [(o.call_id, o.status) for o in r.output if o.type == "function_call"] == [
            ("call_1", "completed"), ("call_2", "incomplete")]
        st = R.to_chat(resp(tools=[{"type": "function", "name": "weather",
                                    "parameters": WEATHER}], stream=True))
        for pieces in (1, 40):
            evs = events(run_stream(R.ResponsesStream(st),
                                    delta_sse(tool_deltas("", "", calls), "length"), pieces))
            done = [d["item"] for n, d in evs if n == "response.output_item.done"
                    and d["item"]["type"] == "function_call"]
            assert [(i["call_id"], i["status"]) for i in done] == [
                ("call_1", "completed"), ("call_2", "incomplete")]
    whole = R.from_chat(chat_answer("", CALLS), R.to_chat(resp()))
    assert {o["status"] for o in whole["output"] if o["type"] == "function_call"} == {
        "completed"}


def test_responses_stream_events_parse_as_the_sdks_and_rebuild_the_calls():
    from openai.types.responses import ResponseStreamEvent

    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    t = R.to_chat(resp(tools=[{"type": "function", "name": "weather", "parameters": WEATHER},
                              {"type": "function", "name": "time"}], stream=True))
    body = delta_sse(tool_deltas("so then", "Sure.", CALLS), "tool_calls")
    for pieces in (1, 5, 80):
        evs = [adapter.validate_python(d) for _, d in events(run_stream(R.ResponsesStream(t),
                                                                        body, pieces))]
        kinds = [e.type for e in evs]
        assert kinds[:3] == ["response.created", "response.in_progress",
                             "response.output_item.added"]
        assert [e.sequence_number for e in evs] == list(range(len(evs)))
        added = [(e.output_index, e.item.type) for e in evs
                 if e.type == "response.output_item.added"]
        assert added == [(0, "reasoning"), (1, "message"), (2, "function_call"),
                         (3, "function_call")]
        args = {}
        for e in evs:
            if e.type == "response.function_call_arguments.delta":
                args[e.output_index] = args.get(e.output_index, "") + e.delta
        assert args == {2: CALLS[0][2], 3: CALLS[1][2]}
        done = [e for e in evs if e.type == "response.function_call_arguments.done"]
        assert [(d.output_index, d.arguments) for d in done] == [(2, CALLS[0][2]),
                                                                  (3, CALLS[1][2])]
        final = evs[-1]
        assert final.type == "response.completed"
        assert [o.type for o in final.response.output] == ["reasoning", "message",
                                                           "function_call", "function_call"]
        assert final.response.output[3].call_id == "call_2"


# ---- Ollama ---------------------------------------------------------------------------
def test_ollama_tool_calls_tool_messages_think_and_images_map_to_openai():
    body = {"model": "m", "think": "high", "tools": [
        {"type": "function", "function": {"name": "weather", "parameters": WEATHER}}],
        "messages": [
            {"role": "user", "content": "look", "images": ["/9j/4AAQ"]},
            {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": [
                {"function": {"name": "weather", "arguments": {"city": "Rome"}}},
                {"function": {"name": "time", "arguments": {}}}]},
            {"role": "tool", "tool_name": "time", "content": "noon"},
            {"role": "tool", "content": "hot"}]}
    t = O.chat_request(body)
    assert t.images and t.body["reasoning_effort"] == "high"
    assert t.body["chat_template_kwargs"] == {"enable_thinking": True}
    assert t.body["tools"][0]["function"]["name"] == "weather"
    m = t.body["messages"]
    assert m[0]["content"][1] == {"type": "image_url",
                                  "image_url": {"url": "data:image/jpeg;base64,/9j/4AAQ"}}
    assert m[1]["reasoning_content"] == "hm"
    assert m[1]["tool_calls"][0] == {"id": "call_1_0", "type": "function", "function": {
        "name": "weather", "arguments": '{"city":"Rome"}'}}
    # by name first, then the call left unanswered
    assert (m[2]["tool_call_id"], m[3]["tool_call_id"]) == ("call_1_1", "call_1_0")
    assert O.chat_request({**body, "think": False}).body["chat_template_kwargs"] == {
        "enable_thinking": False}
    with pytest.raises(BadRequest, match="think"):
        O.chat_request({**body, "think": "max"})


def test_ollama_answer_has_arguments_as_objects_and_thinking():
    t = O.Chat().request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "stream": False})
    out = O.Chat().response(chat_answer("", CALLS, reasoning="hm"), t)
    r = ollama.ChatResponse.model_validate(out)
    assert r.message.thinking == "hm" and r.done_reason == "stop"
    assert r.message.tool_calls[0].function.arguments == {"city": "Paris"}
    assert out["message"]["tool_calls"][1]["function"]["index"] == 1


def test_ollama_stream_sends_thinking_then_the_whole_calls_before_done():
    t = O.Chat().request({"model": "m", "messages": [{"role": "user", "content": "x"}]})
    body = delta_sse(tool_deltas("a b", "", CALLS), "tool_calls")
    raw = run_stream(O.Chat().stream(t), body, 6)
    lines = [ollama.ChatResponse.model_validate(json.loads(x)) for x in raw.splitlines()]
    assert "".join(x.message.thinking or "" for x in lines) == "a b"
    with_calls = [x for x in lines if x.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done
    assert [c.function.arguments for c in with_calls[0].message.tool_calls] == [
        {"city": "Paris"}, {"zone": "CET"}]
    assert lines[-1].done and lines[-1].done_reason == "stop"


def test_ollama_answer_cut_in_a_call_by_max_tokens_leaves_the_call_out_not_a_502():
    """A call whose arguments the client's limit cut is left out, whole or
    streamed, with ``done_reason`` ``length`` (it was a 502, the replica
    counted at fault for the client's limit); a complete call before it
    stays; bad arguments without the cut are still the replica's 502."""
    t = O.Chat().request({"model": "m", "messages": [{"role": "user", "content": "x"}],
                          "stream": False})
    cut = (CALLS[0], ("call_2", "time", '{"zone": "C'))
    out = O.Chat().response(chat_answer("On it.", cut, finish="length"), t)
    r = ollama.ChatResponse.model_validate(out)
    assert r.done_reason == "length" and r.message.content == "On it."
    assert [c.function.name for c in r.message.tool_calls] == ["weather"]
    alone = O.Chat().response(chat_answer("", cut[1:], finish="length"), t)
    assert "tool_calls" not in alone["message"] and alone["done_reason"] == "length"
    with pytest.raises(BadReply):
        O.Chat().response(chat_answer("", cut[1:], finish="tool_calls"), t)
    # cut right after the name: no arguments yet, not a call with {} (required ones missing)
    named = O.Chat().response(chat_answer("", (("call_3", "weather", ""),), finish="length"), t)
    assert "tool_calls" not in named["message"]
    done = O.Chat().response(chat_answer("", (("call_3", "weather", ""),)), t)  # finished: {}
    assert done["message"]["tool_calls"][0]["function"]["arguments"] == {}
    for pieces in (1, 40):
        raw = run_stream(O.Chat().stream(t), delta_sse(tool_deltas("", "", cut), "length"),
                         pieces)
        lines = [ollama.ChatResponse.model_validate(json.loads(x)) for x in raw.splitlines()]
        calls = [c.function.name for x in lines for c in x.message.tool_calls or ()]
        assert calls == ["weather"] and lines[-1].done_reason == "length"


def test_translated_requests_flag_images_only_when_there_are_some():
    assert not Translated(b"/x", {}).images
    assert not O.generate_request({"model": "m", "prompt": "hi"}).images
    assert O.generate_request({"model": "m", "prompt": "hi", "images": ["iVBORw"]}).images
    with pytest.raises(BadRequest, match="raw"):
        O.generate_request({"model": "m", "prompt": "hi", "images": ["x"], "raw": True})


def test_images_go_to_models_with_a_projector_or_remote_ones_only():
    from ggmux.proxy.apis.client_apis import has_projector

    assert not has_projector({"kind": "llama", "args": ["--model", "m.gguf"]})
    assert has_projector({"kind": "llama", "args": ["--model", "m.gguf", "--mmproj", "p.gguf"]})
    assert has_projector({"kind": "cmd", "args": ["llama-server", "-m", "x", "--mmproj=p"]})
    assert has_projector({"kind": "upstream", "args": []})


def test_ollama_capabilities_offer_tools_and_thinking_by_the_template():
    from ggmux.proxy.modelinfo import capabilities

    assert capabilities("") == ["completion"]
    assert capabilities("{{ messages }}") == ["completion", "tools"]
    assert capabilities("{% if enable_thinking %}<think>") == ["completion", "tools", "thinking"]


def test_ollama_generate_thinks_and_answers_thinking_apart():
    g = O.Generate()
    t = g.request({"model": "m", "prompt": "why?", "think": True, "stream": False})
    assert t.body["chat_template_kwargs"] == {"enable_thinking": True}
    out = g.response(chat_answer("because", reasoning="let me see"), t)
    r = ollama.GenerateResponse.model_validate(out)
    assert (r.response, r.thinking) == ("because", "let me see")
    raw = run_stream(g.stream(t), delta_sse(tool_deltas("let me see", "because")))
    lines = [json.loads(x) for x in raw.splitlines()]
    assert "".join(x.get("thinking", "") for x in lines) == "let me see"
    assert "".join(x["response"] for x in lines) == "because" and lines[-1]["done"]


def test_anthropic_tool_choice_without_tools():
    assert "tool_choice" not in A.to_chat(anth(tool_choice={"type": "auto"})).body
    with pytest.raises(BadRequest, match="needs 'tools'"):
        A.to_chat(anth(tool_choice={"type": "any"}))


# ---- Responses: namespaces and hosted tools (issue 31 items 6 and 13) ------------------
TWO_NS = [{"type": "namespace", "name": "fs", "tools": [{"type": "function", "name": "read"}]},
          {"type": "namespace", "name": "db", "tools": [
              {"type": "function", "name": "read"}, {"type": "function", "name": "write"}]}]


def test_two_namespaces_with_one_function_name_stay_apart_end_to_end():
    hist = [{"role": "user", "content": "go"},
            {"type": "function_call", "call_id": "c0", "name": "read", "namespace": "db",
             "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c0", "output": "rows"}]
    t = R.to_chat(resp(input=hist, tools=TWO_NS))
    # the model sees one name per (namespace, name); a name only one namespace has stays
    assert [x["function"]["name"] for x in t.body["tools"]] == ["fs__read", "db__read", "write"]
    assert t.body["messages"][1]["tool_calls"][0]["function"]["name"] == "db__read"
    calls = (("c1", "fs__read", "{}"), ("c2", "db__read", "{}"), ("c3", "write", "{}"))
    whole = R.from_chat(chat_answer(calls=calls), t)["output"]
    named = [(o["name"], o.get("namespace")) for o in whole]
    assert named == [("read", "fs"), ("read", "db"), ("write", "db")]
    st = R.Responses().stream(R.to_chat(resp(input="go", tools=TWO_NS, stream=True)))
    evs = events(run_stream(st, delta_sse(tool_deltas(calls=calls), finish="tool_calls")))
    done = [d["item"] for n, d in evs if n == "response.output_item.done"]
    assert [(o["name"], o.get("namespace")) for o in done] == named
    assert [d["name"] for n, d in evs if n == "response.function_call_arguments.done"] == [
        "read", "read", "write"]
    final = next(d for n, d in evs if n == "response.completed")["response"]["output"]
    assert [(o["name"], o.get("namespace")) for o in final] == named
    # a choice names its namespace; without one it must not be ambiguous
    chosen = R.to_chat(resp(tools=TWO_NS, tool_choice={"type": "function", "name": "read",
                                                       "namespace": "db"}))
    assert chosen.body["tool_choice"] == {"type": "function", "function": {"name": "db__read"}}
    with pytest.raises(BadRequest, match="namespaces 'fs' and 'db'"):
        R.to_chat(resp(tools=TWO_NS, tool_choice={"type": "function", "name": "read"}))
    # a qualified name that is taken is refused naming both namespaces
    with pytest.raises(BadRequest, match="namespaces 'fs' and 'db' each have a function 'read'"):
        R.to_chat(resp(tools=[{"type": "function", "name": "fs__read"}, *TWO_NS]))


def test_a_hosted_tool_offered_with_tool_choice_auto_is_left_out_and_named():
    for choice in (None, "auto", "none", {"type": "allowed_tools", "mode": "auto"}):
        t = R.to_chat(resp(tools=[{"type": "web_search"}, {"type": "function", "name": "f"}],
                           tool_choice=choice))
        assert [x["function"]["name"] for x in t.body["tools"]] == ["f"]
        assert t.dropped == ["web_search"]
    only = R.to_chat(resp(tools=[{"type": "web_search"}]))
    assert "tools" not in only.body and only.dropped == ["web_search"]
    # a header value: nothing of a client's label that could break the head
    odd = R.to_chat(resp(tools=[{"type": "mcp", "server_label": "a\r\nx-evil: 1"}]))
    assert odd.dropped == ["mcp:a__x-evil:_1"]
    t = A.to_chat(anth(tools=[{"type": "web_search_20250305", "name": "web_search"},
                              {"name": "f", "input_schema": {"type": "object"}}]))
    assert [x["function"]["name"] for x in t.body["tools"]] == ["f"]
    assert t.dropped == ["web_search"]


def test_anthropic_call_cut_by_max_tokens_is_max_tokens_never_a_502():
    """Issue 37, item 7: ``max_tokens: 24`` cut a ``tool_use`` at ``{`` and the
    whole answer was a 502 (arguments not JSON), a replica fault for the
    client's own limit. Whole: the cut call is left out (complete ones
    stay), ``stop_reason`` ``max_tokens``; streamed (and a whole answer
    played as a stream): the partial block as Anthropic streams it."""
    from ggmux.proxy.apis.translate import _as_chunk

    cut = ("call_2", "get_weather", "{")
    whole = A.from_chat(chat_answer("Sure.", (CALLS[0], cut), finish="length"), "smol")
    assert whole["stop_reason"] == "max_tokens"
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][1]["input"] == {"city": "Paris"}
    alone = A.from_chat(chat_answer(None, (cut,), finish="length"), "smol")
    assert alone["stop_reason"] == "max_tokens" and alone["content"] == [
        {"type": "text", "text": ""}]
    anthropic = pytest.importorskip("anthropic")
    anthropic.types.Message.model_validate(alone)
    with pytest.raises(BadReply):  # not cut: no JSON is still the replica's fault
        A.from_chat(chat_answer(None, (cut,)), "smol")
    state = A.MessagesStream("smol")
    evs = events(state.chunk(_as_chunk(chat_answer(None, (cut,), finish="length"))) + state.end())
    assert not state.failed
    assert [d["delta"]["stop_reason"] for n, d in evs if n == "message_delta"] == ["max_tokens"]
    assert [d["delta"]["partial_json"] for n, d in evs if n == "content_block_delta"] == ["{"]
