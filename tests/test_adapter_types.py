"""Every field of every translated API's request, given a value of each wrong
JSON type, is refused with :class:`BadRequest` (a 400 in the API's envelope
naming what is wrong) or translated: never another exception, which the
proxy once answered with orjson's message about deep nesting (issue 31
item 5: a Responses ``reasoning`` item's ``content: 5``). On bytes, no
process."""

from __future__ import annotations

import copy

import pytest
from ggmux.proxy.apis.adapters import anthropic, ollama, responses
from ggmux.proxy.apis.adapters.common import BadRequest, encode_body

TOOL = {"type": "function", "name": "f", "description": "d",
        "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}
BODIES = {
    "responses": (responses.Responses(), {
        "model": "m", "instructions": "i", "input": [
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "x"},
                {"type": "input_image", "image_url": "http://x"}]},
            {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}],
             "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "o"},
            {"type": "custom_tool_call", "call_id": "d", "name": "g", "input": "x"},
            {"type": "custom_tool_call_output", "call_id": "d",
             "output": [{"type": "input_text", "text": "o"}]},
            {"type": "function_call_output", "name": "goal", "namespace": "ns", "output": "o"}],
        "tools": [TOOL, {"type": "custom", "name": "g"}, {"type": "web_search"},
                  {"type": "namespace", "name": "ns", "tools": [dict(TOOL, name="h")]}],
        "tool_choice": {"type": "function", "name": "f"}, "parallel_tool_calls": True,
        "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}},
        "reasoning": {"effort": "low"}, "max_output_tokens": 5, "temperature": 1, "top_p": 1,
        "stream": True, "metadata": {"a": "b"}, "user": "u"}),
    "anthropic": (anthropic.Messages(), {
        "model": "m", "max_tokens": 5, "system": [{"type": "text", "text": "s"}],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "x"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": "AA"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "t"}, {"type": "text", "text": "y"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": "b"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1",
                 "content": [{"type": "text", "text": "r"}], "is_error": False}]}],
        "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 10}, "output_config": {"effort": "low"},
        "chat_template_kwargs": {"a": 1}, "metadata": {"user_id": "u"}, "stop_sequences": ["x"],
        "temperature": 1, "top_p": 1, "top_k": 3, "stream": True}),
    "ollama-chat": (ollama.Chat(), {
        "model": "m", "messages": [
            {"role": "system", "content": "s"}, {"role": "user", "content": "x", "images": ["AA"]},
            {"role": "assistant", "content": "", "thinking": "t",
             "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
            {"role": "tool", "content": "r", "tool_name": "f"}],
        "tools": [{"type": "function", "function": {"name": "f", "description": "d",
                                                    "parameters": {"type": "object"}}}],
        "format": {"type": "object"}, "think": True, "stream": False, "keep_alive": "5m",
        "options": {"temperature": 1, "stop": ["x"], "num_predict": 3, "seed": 1}}),
    "ollama-generate": (ollama.Generate(), {
        "model": "m", "prompt": "p", "system": "s", "suffix": "x", "images": ["AA"],
        "format": "json", "options": {"num_ctx": 5}, "raw": False, "template": "t",
        "context": [1], "think": False}),
}
WRONG = [5, 1.5, True, None, "s", [5], {"a": 5}]


def paths(v, at=()):
    yield at
    if isinstance(v, dict):
        for k, x in v.items():
            yield from paths(x, (*at, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from paths(x, (*at, i))


def replaced(body: dict, at: tuple, value) -> dict:
    out = copy.deepcopy(body)
    node = out
    for k in at[:-1]:
        node = node[k]
    node[at[-1]] = value
    return out


@pytest.mark.parametrize("api", sorted(BODIES))
def test_every_field_of_a_wrong_type_is_a_bad_request_or_translated(api):
    adapter, body = BODIES[api]
    encode_body(adapter.request(body).body)  # the body itself is fine
    surprises = []
    for at in paths(body):
        if not at:
            continue
        for value in WRONG:
            try:
                encode_body(adapter.request(replaced(body, at, value)).body)
            except BadRequest as e:
                assert "64 bits" not in str(e), (at, value, str(e))
            except Exception as e:  # noqa: BLE001 - what the test looks for
                surprises.append((".".join(map(str, at)), value, repr(e)))
    assert not surprises, surprises
