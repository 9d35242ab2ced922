"""The tools Claude Code and Codex really send, on bytes, no process
(issue 19, "done when" 3): their request bodies, captured once from the
CLIs (Claude Code 2.1.197 to ``/v1/messages``, Codex 0.171.0 to
``/v1/responses``; ids and paths scrubbed) in ``tests/agent_requests/``,
go through the API adapter, the instance's tool checks and the generic
format's grammar, which llama.cpp's own grammar engine then runs
(tests/grammar_probe.py). Their schemas use ``anyOf``/``const``,
``propertyNames``, ``{}`` any-values, ``pattern``, ``format``, integer
ranges and a ``maxLength`` of 524288 (Claude Code's ``Workflow`` tool),
which was a 400 before: llama.cpp's grammar parser reads a maximum over
2000 as no maximum, and so does the converter now."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ggmux.instance.grammar.gbnf import check_gbnf
from ggmux.instance.grammar.json_grammar import GrammarBuilder, schema_to_gbnf
from ggmux.instance.grammar.structured import schema_grammar
from ggmux.instance.tools.generic import calls_schema
from ggmux.instance.tools.request import tool_request
from ggmux.instance.validate import BadRequest, RequestLimits
from ggmux.proxy.apis.adapters import anthropic, responses
from grammar_probe import GrammarProbe

REQUESTS = Path(__file__).parent / "agent_requests"
LIMITS = RequestLimits()
CLIENTS = {"claude_code": anthropic, "codex": responses}


@pytest.fixture(scope="module")
def probe():
    p = GrammarProbe()
    yield p
    p.close()


def chat_body(name: str) -> dict:
    """A captured CLI request as the chat-completions body the proxy sends on."""
    client = name.rsplit("_", 1)[0].removesuffix("_after")
    return CLIENTS[client].to_chat(json.loads((REQUESTS / f"{name}.json").read_text())).body


def grammar_of(schema) -> str:
    b = GrammarBuilder()
    b.add_schema("root", schema)
    return b.format()


@pytest.mark.parametrize("name", ["claude_code_first", "claude_code_after_tool", "codex_first",
                                  "codex_after_tool"])
def test_every_tool_of_claude_code_and_codex_becomes_a_grammar_llama_cpp_runs(probe, name):
    chat = chat_body(name)
    req = tool_request(chat, LIMITS)  # a BadRequest here was the 400 Claude Code got
    assert req.calls_tools and len(req.tools) == len(chat["tools"]) >= 8
    for t in req.tools:
        g = schema_grammar(t["function"]["parameters"], LIMITS, t["function"]["name"])
        assert probe.parses(g), t["function"]["name"]
    # the generic format's whole answer: any of the tools, or a response
    whole = grammar_of({"anyOf": [calls_schema(req.tools, req.parallel), {
        "type": "object", "properties": {"response": {"type": "string"}},
        "required": ["response"]}]})
    check_gbnf(whole, LIMITS.max_grammar_depth, LIMITS.max_grammar_repetitions)
    assert probe.accepts(whole, '{"response": "done"}')


def test_claude_code_and_codex_calls_are_accepted_and_wrong_ones_refused(probe):
    tools = {t["function"]["name"]: t for t in tool_request(chat_body("claude_code_first"),
                                                              LIMITS).tools}
    tools |= {t["function"]["name"]: t for t in tool_request(chat_body("codex_first"),
                                                               LIMITS).tools}

    def grammar(name: str) -> str:
        return schema_grammar(tools[name]["function"]["parameters"], LIMITS, name)

    write = grammar("Write")
    assert probe.accepts(write, '{"file_path": "/tmp/work/hello.txt", "content": "hi"}')
    assert not probe.accepts(write, '{"file_path": "/tmp/work/hello.txt"}')  # content required
    assert not probe.accepts(write, '{"file_path": 3, "content": "hi"}')
    assert not probe.accepts(write, '{"file_path": "x", "content": "hi", "mode": "w"}')
    read = grammar("Read")  # integers from 0 (or above 0) to 2**53 - 1
    assert probe.accepts(read, '{"file_path": "/a", "offset": 9007199254740991, "limit": 1}')
    assert not probe.accepts(read, '{"file_path": "/a", "offset": -1}')
    assert not probe.accepts(read, '{"file_path": "/a", "limit": 0}')
    assert not probe.accepts(read, '{"file_path": "/a", "offset": 9007199254740992}')
    task = grammar("TaskUpdate")  # anyOf of an enum and a const; propertyNames with {}
    assert probe.accepts(task, '{"taskId": "1", "status": "deleted", "metadata": {"k": [1]}}')
    assert not probe.accepts(task, '{"taskId": "1", "status": "gone"}')
    # Workflow's script has maxLength 524288: llama.cpp enforces no maximum above 2000
    assert probe.accepts(grammar("Workflow"), json.dumps({"script": "x" * 2500}))
    ex = grammar("exec_command")
    assert probe.accepts(ex, '{"cmd": "printf hi > hello.txt"}')
    assert probe.accepts(ex, '{"cmd": "ls", "sandbox_permissions": "use_default"}')
    assert not probe.accepts(ex, '{"cmd": "ls", "sandbox_permissions": "sudo"}')  # an enum
    # Codex's namespace tools (multi_agent_v1) arrive as plain functions
    assert any("close_agent" in n for n in tools)


def test_a_maximum_over_llama_cpps_threshold_is_no_maximum_and_a_minimum_over_it_a_400(probe):
    for schema, long in [({"type": "string", "maxLength": 524288}, json.dumps("y" * 2100)),
                         ({"type": "array", "items": {"type": "integer"}, "maxItems": 5000},
                          json.dumps([1] * 2100)),
                         ({"type": "string", "pattern": "^a{0,5000}$"}, '"' + "a" * 2100 + '"')]:
        g = schema_grammar(schema, LIMITS, "s")
        assert probe.accepts(g, long), schema
        assert "5000" not in g and "524288" not in g  # written as no maximum
    # up to the threshold the maximum holds
    g = schema_to_gbnf({"type": "string", "maxLength": 2000})
    assert probe.accepts(g, json.dumps("z" * 2000)) and not probe.accepts(g, json.dumps("z" * 2001))
    for schema in ({"type": "string", "minLength": 2001},
                   {"type": "array", "minItems": 3000},
                   {"type": "string", "pattern": "^a{2500,}$"}):
        with pytest.raises(BadRequest, match="max-grammar-repetitions"):
            schema_grammar(schema, LIMITS, "s")
    # a lower limit still refuses maxima between it and the threshold
    with pytest.raises(BadRequest, match="max-grammar-repetitions"):
        schema_grammar({"type": "string", "maxLength": 300},
                       RequestLimits(max_grammar_repetitions=100), "s")
