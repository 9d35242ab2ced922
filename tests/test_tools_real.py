"""Tool calls end to end on smollm2 (the generic format: its template knows
no tools) with the real ``openai`` SDK through a real ``ggmux serve``
(issue 19, "done when" 2, the chat-completions part): ``tool_choice``
auto, required and named, streamed and not, the round trip with a
``role: "tool"`` result; the arguments of every call parse and match the
tool's schema (``jsonschema``). The OpenAI Agents SDK's ``function_tool``
taking a nested pydantic model (``$defs``/``$ref`` in its parameters: issue
31, item 2) is answered 200 with ``tool_choice: required``."""

from __future__ import annotations

import json

import pydantic
import pytest
from conftest import Server, free_port

pytestmark = pytest.mark.slow  # the demo model; tool calls on the fake: test_tools_apis.py

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

SMOL = "smollm2-135m"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7}},
           "required": ["city"]}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
        "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather forecast of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description":
                                           "The time now in a time zone",
                                           "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    s = Server(["--proxies", "1", "--threads", "1", "--ctx-size", "1024"], free_port(),
               d / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=smol.base + "/v1", api_key="unused", max_retries=0,
                         timeout=300)


def checked(calls) -> list[tuple[str, dict]]:
    """Each call's arguments parse and match its tool's schema."""
    out = []
    for c in calls:
        assert c.type == "function" and c.id
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, SCHEMAS[c.function.name])
        out.append((c.function.name, args))
    return out


def streamed(stream) -> tuple[str, list[dict], str]:
    """(content, calls as {id, name, arguments}, finish_reason) from chunks,
    checking OpenAI's delta rules: id, type and name once per call, then
    argument pieces."""
    content, calls, reason = [], {}, None
    for chunk in stream:
        if not chunk.choices:
            continue
        ch = chunk.choices[0]
        if ch.delta.content:
            content.append(ch.delta.content)
        for tc in ch.delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls[tc.index] = {"id": tc.id, "name": tc.function.name,
                                   "arguments": tc.function.arguments or ""}
            else:
                assert tc.id is None and not tc.function.name, tc
                calls[tc.index]["arguments"] += tc.function.arguments or ""
        reason = ch.finish_reason or reason
    return "".join(content), [calls[i] for i in sorted(calls)], reason


def test_required_and_named_tool_choice_call_a_tool_with_valid_arguments(client):
    r = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS,
                                       tool_choice="required", max_tokens=80, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert c.message.content is None and checked(c.message.tool_calls)
    r = client.chat.completions.create(
        model=SMOL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert [name for name, _ in checked(c.message.tool_calls)] == ["get_time"]


def test_auto_tool_choice_answers_with_a_valid_call_or_with_text(client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        r = client.chat.completions.create(model=SMOL, messages=messages, tools=TOOLS,
                                           max_tokens=80, temperature=0)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls" and checked(c.message.tool_calls)
        else:
            assert c.finish_reason in ("stop", "length") and c.message.content, c


def test_streamed_tool_calls_come_as_openai_deltas(client):
    content, calls, reason = streamed(client.chat.completions.create(
        model=SMOL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80,
        temperature=0, stream=True))
    assert reason == "tool_calls" and not content and calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # auto, streamed: a call or text, never both broken
    content, calls, reason = streamed(client.chat.completions.create(
        model=SMOL, messages=ASK, tools=TOOLS, max_tokens=80, temperature=0, stream=True))
    assert (reason == "tool_calls" and calls) or (content and not calls), (content, calls)
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_the_tool_result_round_trip_renders_and_is_answered(client):
    first = client.chat.completions.create(model=SMOL, messages=ASK, tools=TOOLS,
                                           tool_choice="required", max_tokens=80,
                                           temperature=0).choices[0].message
    assert first.content is None and first.tool_calls
    call = first.tool_calls[0]
    history = [*ASK, first.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"}]
    r = client.chat.completions.create(model=SMOL, messages=history, tools=TOOLS,
                                       max_tokens=60, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "length":
        # cut inside a call: its arguments are what came, as OpenAI's are (the
        # prompt cache's state decides how long a 135M model's answer runs)
        assert c.message.content or c.message.tool_calls, c
    else:
        assert c.message.content or checked(c.message.tool_calls or [])
    # the same history with content parts and tool_choice none: plain text, no tools
    history[0] = {"role": "user", "content": [{"type": "text", "text": ASK[0]["content"]}]}
    r = client.chat.completions.create(model=SMOL, messages=history, tools=TOOLS,
                                       tool_choice="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_bad_tool_requests_and_images_are_400s_naming_the_field(smol):
    def err(body):
        status, doc = smol.json("POST", "/v1/chat/completions",
                                {"model": SMOL, "messages": ASK, "max_tokens": 4, **body})
        assert status == 400, (body, doc)
        return doc["error"]

    assert err({"tools": TOOLS, "tool_choice": {"type": "function", "function": {
        "name": "nope"}}})["param"] == "tool_choice"
    # a minimum over --max-grammar-repetitions (a maximum over llama.cpp's 2000 is
    # no maximum: tests/test_agent_schemas.py)
    assert err({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "minLength": 10**6}}}}}]})[
        "param"] == "tools[0].function.parameters.properties.s.minLength"
    # a function's arguments are one object
    assert err({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]})["param"] == "tools[0].function.parameters"
    assert err({"tools": TOOLS, "parallel_tool_calls": "yes"})["param"] == "parallel_tool_calls"
    e = err({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]})
    assert SMOL in e["message"] and "projector" in e["message"], e
    assert e["param"] == "messages[0].content[1]"


def test_apply_template_renders_the_tools_as_the_answer_will_see_them(smol):
    # what the adapters count an Anthropic request's tokens with (llama-server's route)
    status, doc = smol.json("POST", "/apply-template", {"model": SMOL, "messages": ASK,
                                                         "tools": TOOLS})
    assert status == 200, doc
    prompt = doc["prompt"]
    assert "get_weather" in prompt and "Respond in JSON format" in prompt
    assert prompt.endswith("<|im_start|>assistant\n") and ASK[0]["content"] in prompt
    status, plain = smol.json("POST", "/apply-template", {"model": SMOL, "messages": ASK})
    assert status == 200 and "get_weather" not in plain["prompt"]
    assert len(plain["prompt"]) < len(prompt)
    status, doc = smol.json("POST", "/apply-template", {"model": SMOL, "messages": []})
    assert status == 400 and doc["error"]["param"] == "messages"


class City(pydantic.BaseModel):
    """A nested model of a tool's parameters (module level: the SDK reads
    the annotations by name)."""

    name: str = pydantic.Field(max_length=12)


def test_agents_sdk_function_tool_of_a_nested_pydantic_model_is_answered_with_a_valid_call(smol):
    # its parameters hold "$defs" and "$ref": "#/$defs/City" (a 400 "cannot
    # resolve $ref" before issue 31, item 2); the grammar forces valid arguments
    sdk = pytest.importorskip("agents")
    import asyncio

    from openai import AsyncOpenAI

    called: list[City] = []

    @sdk.function_tool
    def forecast(city: City) -> str:
        """The weather forecast of a city."""
        called.append(city)
        return f"{city.name}: sunny"

    assert "$defs" in json.dumps(forecast.params_json_schema)
    sdk.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=smol.base + "/v1", api_key="unused", max_retries=0,
                         timeout=300)
    model = sdk.OpenAIChatCompletionsModel(model=SMOL, openai_client=client)
    agent = sdk.Agent(name="forecaster", instructions="Answer with the forecast tool.",
                      tools=[forecast], model=model, tool_use_behavior="stop_on_first_tool",
                      model_settings=sdk.ModelSettings(tool_choice="required", max_tokens=60,
                                                       temperature=0))
    result = asyncio.run(sdk.Runner.run(agent, "Weather in Oslo?", max_turns=2))
    assert len(called) >= 1 and all(isinstance(c, City) for c in called), called
    assert result.final_output == f"{called[0].name}: sunny"
