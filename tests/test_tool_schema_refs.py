"""Tool schemas with ``$defs`` / ``$ref`` in every tool-call format, on
bytes (issue 31, item 2): what pydantic v2 writes for a nested model
(``"$ref": "#/$defs/City"``), a list of models, an optional model, a
recursive model, and draft 7's ``definitions``, as a tool's
``parameters``. Each format wraps the parameters in its call's grammar;
the references resolve against the tool's own schema (they resolved
against the wrapper and were a 400 "cannot resolve $ref" in the generic
and Hermes formats). llama.cpp's own grammar engine (tests/grammar_probe.py)
runs each format's grammar over a call with valid arguments and refuses
wrong ones; the format's parser reads the call back and pydantic validates
its arguments. A cycle of bare references is a 400 naming the cycle, not
a hang. The real-model end to end (OpenAI Agents SDK) is in
tests/test_tools_real.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pydantic
import pytest
from ggmux.instance.grammar.json_grammar import GrammarBuilder, SchemaError
from ggmux.instance.template import JinjaTemplate
from ggmux.instance.tools import format_for
from ggmux.instance.tools.base import ToolRequest
from ggmux.instance.tools.request import tool_request
from ggmux.instance.validate import BadRequest, RequestLimits
from grammar_probe import GrammarProbe

TEMPLATES = Path(__file__).parent / "templates"


class City(pydantic.BaseModel):
    name: str
    country: str


class Trip(pydantic.BaseModel):
    start: City  # nested
    stops: list[City]  # a list of models
    end: Optional[City] = None  # an optional model (anyOf [$ref, null])  # noqa: UP045


class Node(pydantic.BaseModel):  # recursive: the schema's root is a $ref
    label: str
    children: list[Node] = []


class Zip(pydantic.BaseModel):  # another tool's ``City``: same $defs name, other fields
    code: int


class Parcel(pydantic.BaseModel):
    to: Zip


def parcel_schema() -> dict:
    s = json.loads(json.dumps(Parcel.model_json_schema()).replace("Zip", "City"))
    assert s["$defs"]["City"]["properties"] == {"code": {"title": "Code", "type": "integer"}}
    return s


def draft7(schema: dict) -> dict:
    """``schema`` with draft 7's spelling: ``definitions``."""
    return json.loads(json.dumps(schema).replace("$defs", "definitions"))


TRIP = {"start": {"name": "Oslo", "country": "NO"},
        "stops": [{"name": "Lund", "country": "SE"}], "end": None}
TREE = {"label": "a", "children": [{"label": "b", "children": [{"label": "c"}]}]}
BAD_TRIP = {"start": {"name": "Oslo"}, "stops": []}  # the nested model misses a field
BAD_TREE = {"label": "a", "children": [{"name": "b"}]}

# (template, format, the call of special_function with @ARGS@, as the format writes it)
FORMATS = [
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "generic",
     '{"tool_calls": [{"name": "special_function", "arguments": @ARGS@}]}'),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes-2-pro",
     '<tool_call>\n{"name": "special_function", "arguments": @ARGS@}\n</tool_call>'),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-3.x",
     '{"name": "special_function", "parameters": @ARGS@}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo",
     '[TOOL_CALLS][{"name": "special_function", "arguments": @ARGS@, "id": "123456789"}]'),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral-small",
     "[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]@ARGS@"),
    ("meetkai-functionary-medium-v3.2.jinja", "functionary-v3.2", "special_function\n@ARGS@"),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b",
     ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "special_function", '
      '"parameters": @ARGS@}]<|END_ACTION|>')),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
      "```json\n@ARGS@```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>@ARGS@"
      "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     "<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>@ARGS@"),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite",
     '<|tool_call|>[{"name": "special_function", "arguments": @ARGS@}]'),
]


@pytest.fixture(scope="module")
def probe():
    p = GrammarProbe()
    yield p
    p.close()


def tool(name: str, schema: dict) -> dict:
    return {"type": "function", "function": {"name": name, "description": "d",
                                             "parameters": schema}}


def plan(template: str, tools: list[dict], choice: str = "required", **req):
    tmpl = JinjaTemplate((TEMPLATES / template).read_text(), "<s>", "</s>")
    # the DeepSeek prompts open a reasoning block: thinking off, the call comes first
    r = ToolRequest(tools=tools, choice=choice, enable_thinking=False, **req)
    fmt = format_for(tmpl.source, r.calls_tools)
    return fmt, fmt.plan(tmpl, [{"role": "user", "content": "Hey"}], r)


def args(value: dict) -> str:
    return json.dumps(value, separators=(", ", ": "))


@pytest.mark.parametrize("template,family,shape", FORMATS, ids=[f[1] for f in FORMATS])
def test_pydantic_nested_list_optional_and_recursive_models_are_grammars_in_every_format(
        probe, template, family, shape):
    for model, schema, good, bad in [
            (Trip, Trip.model_json_schema(), TRIP, BAD_TRIP),
            (Node, Node.model_json_schema(), TREE, BAD_TREE),
            (Trip, draft7(Trip.model_json_schema()), TRIP, BAD_TRIP)]:
        for choice in ("required", "auto"):
            fmt, p = plan(template, [tool("special_function", schema)], choice)
            assert fmt.name == family and p.grammar, (family, choice)
            call = shape.replace("@ARGS@", args(good))
            assert probe.accepts(p.grammar, call), (family, model.__name__, choice)
            assert not probe.accepts(p.grammar, shape.replace("@ARGS@", args(bad))), family
            msg = fmt.parse(call, False, p)
            assert [c.name for c in msg.tool_calls] == ["special_function"], msg
            model.model_validate_json(msg.tool_calls[0].arguments)


@pytest.mark.parametrize("template,family,shape", FORMATS, ids=[f[1] for f in FORMATS])
def test_two_tools_with_the_same_defs_name_each_keep_their_own_definition(
        probe, template, family, shape):
    _fmt, p = plan(template, [tool("plan_trip", Trip.model_json_schema()),
                             tool("special_function", parcel_schema())])
    # special_function's City is {"code": int}, plan_trip's {"name", "country"}
    assert probe.accepts(p.grammar, shape.replace("@ARGS@", '{"to": {"code": 5}}')), family
    assert not probe.accepts(
        p.grammar, shape.replace("@ARGS@", '{"to": {"name": "Oslo", "country": "NO"}}')), family


CYCLES = [
    {"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"},
    {"type": "object", "properties": {"x": {"$ref": "#/properties/x"}}},
    {"$ref": "#"},
]


@pytest.mark.parametrize("schema", CYCLES, ids=["a-b-a", "self", "root"])
def test_a_cycle_of_bare_references_is_a_400_naming_it_not_a_hang(schema):
    with pytest.raises(BadRequest, match=r"\$ref cycle"):
        tool_request({"tools": [tool("loop", schema)], "tool_choice": "required"},
                     RequestLimits())
    for template, family, _ in FORMATS:
        with pytest.raises(SchemaError, match=r"\$ref cycle"):
            plan(template, [tool("special_function", schema)])


def test_a_reference_resolves_against_the_document_it_is_written_in():
    b = GrammarBuilder()
    trip = Trip.model_json_schema()
    b.add_schema("trip", trip)
    b.add_schema("parcel", parcel_schema())
    rules = b.format()
    # two City rules: one with name and country, one with an integer code
    assert '"\\"country\\""' in rules and '"\\"code\\""' in rules
    with pytest.raises(SchemaError, match="cannot resolve"):
        GrammarBuilder().add_schema("x", {"type": "object", "properties": {
            "a": {"$ref": "#/$defs/Missing"}}})


def test_a_response_format_schema_with_defs_beside_tools_resolves_its_own_references(probe):
    # tools and a response_format schema: the generic format puts the schema
    # inside its answer's schema ({"response": ...}); its $refs are its own
    fmt, p = plan("HuggingFaceTB-SmolLM2-135M-Instruct.jinja",
                  [tool("special_function", Node.model_json_schema())], "auto",
                  json_schema=Trip.model_json_schema())
    assert fmt.name == "generic"
    assert probe.accepts(p.grammar, json.dumps({"response": TRIP}))
    assert not probe.accepts(p.grammar, json.dumps({"response": BAD_TRIP}))
    assert probe.accepts(p.grammar, json.dumps(
        {"tool_calls": [{"name": "special_function", "arguments": TREE}]}))
