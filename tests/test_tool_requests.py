"""Checks of a chat request's messages and tool fields for the Jinja path
(instance/messages.py, instance/tools/request.py), on plain dicts: what
every OpenAI client sends after a tool call is accepted, each mistake is a
400 naming its field (issue 19)."""

from __future__ import annotations

import pytest
from ggmux.instance.messages import chat_messages
from ggmux.instance.tools.request import tool_request
from ggmux.instance.validate import BadRequest, RequestLimits

LIMITS = RequestLimits()
F = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g", "description": "gee"}}


def param(fn, *args) -> str | None:
    with pytest.raises(BadRequest) as e:
        fn(*args)
    return e.value.param


def test_tool_call_turns_content_parts_and_results_are_accepted():
    msgs = chat_messages([
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                     "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f",
                                                              "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
        {"role": "assistant", "content": "It is 42.", "reasoning_content": "easy"},
    ], "m")
    assert msgs[0]["content"] == "a\nb"  # joined as llama.cpp joins text parts
    assert msgs[1]["content"] is None
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'
    assert msgs[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    assert msgs[3]["reasoning_content"] == "easy"


def test_bad_messages_are_400s_naming_the_field_and_images_name_the_model():
    for messages, where in [
        ([], "messages"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "robot", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        ([{"role": "tool", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {}}]}],
         "messages[0].tool_calls[0].function"),
        ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": 5}}]}], "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "user", "content": [{"type": "video", "text": "x"}]}],
         "messages[0].content[0]"),
        ([{"role": "user", "content": "x", "tool_call_id": 3}], "messages[0].tool_call_id"),
    ]:
        assert param(chat_messages, messages, "m") == where, messages
    with pytest.raises(BadRequest) as e:
        chat_messages([{"role": "user", "content": [
            {"type": "text", "text": "what is it?"},
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}],
            "smollm2-135m")
    assert "smollm2-135m" in str(e.value) and "projector" in str(e.value)
    assert e.value.param == "messages[0].content[1]"


def test_tool_choice_forms_and_template_fields():
    r = tool_request({"tools": [F, G]}, LIMITS)
    assert r.choice == "auto" and r.parallel and [t["function"]["name"] for t in r.tools] == \
        ["f", "g"]
    assert r.tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    r = tool_request({"tools": [F, G], "tool_choice": {"type": "function",
                                                      "function": {"name": "g"}}}, LIMITS)
    assert (r.choice, r.parallel, [t["function"]["name"] for t in r.tools]) == \
        ("required", False, ["g"])
    r = tool_request({"functions": [F["function"]], "function_call": {"name": "f"}}, LIMITS)
    assert r.choice == "required" and r.tools[0]["function"]["name"] == "f"
    r = tool_request({"tools": [F], "tool_choice": "none", "parallel_tool_calls": False},
                     LIMITS)
    assert not r.calls_tools and not r.parallel
    r = tool_request({"chat_template_kwargs": {"enable_thinking": False, "x": 1},
                      "reasoning_effort": "high", "reasoning_format": "auto"}, LIMITS, "none")
    assert not r.enable_thinking and r.extra == {"enable_thinking": False, "x": 1,
                                                 "reasoning_effort": "high"}
    assert r.reasoning_format == "deepseek"
    assert tool_request({}, LIMITS, "none").reasoning_format == "none"


def test_bad_tool_fields_are_400s_naming_the_field():
    for body, where in [
        ({"tools": "x"}, "tools"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [F, F]}, "tools[1].function.name"),
        ({"tools": [F], "functions": [F["function"]]}, "functions"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "h"}}},
         "tool_choice"),
        ({"tools": [F], "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": "no"}},
         "chat_template_kwargs.enable_thinking"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
        ({"reasoning_format": "xml"}, "reasoning_format"),
        ({"add_generation_prompt": 1}, "add_generation_prompt"),
        # (a maximum over llama.cpp's 2000 is no maximum: a minimum is refused)
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"s": {"type": "string", "minLength": 10**6}}}}}]},
         "tools[0].function.parameters.properties.s.minLength"),
        # a function's arguments are one object: a schema of another type is refused
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "string"}}}]}, "tools[0].function.parameters"),
    ]:
        assert param(tool_request, body, LIMITS) == where, body


def test_a_function_schema_without_a_type_describes_an_object():
    """A function's arguments are one object (what Anthropic's ``input`` and
    Ollama's ``arguments`` must be): a schema without ``type`` (llama-server
    takes it) gets ``"object"``, so no grammar lets a model write a string or
    ``null`` there, an answer no API could translate (a 502 for the client's
    schema, which the served fuzz test found)."""
    loose = {"type": "function", "function": {"name": "f", "parameters": {"": None}}}
    either = {"type": "function", "function": {"name": "e", "parameters": {
        "type": ["object", "null"], "properties": {"a": {"type": "integer"}}}}}
    r = tool_request({"tools": [loose, either, G]}, LIMITS)
    assert [t["function"]["parameters"] for t in r.tools] == [
        {"": None, "type": "object"},
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {}}]
