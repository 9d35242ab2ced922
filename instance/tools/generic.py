"""The generic format: tool calls for any template that knows no tools of
its own (smollm2, gemma), as llama.cpp's ``common_chat_params_init_generic``
(llama.cpp until 2025; since replaced by its auto-parser).

A system message asks for JSON (``Respond in JSON format, either with
`tool_calls` ... or with `response` ...``), the template's missing tool
support is polyfilled (:mod:`ggmux.instance.template`: the tools listed in
the system message, earlier calls and results as JSON text), and a grammar
(not lazy: the whole answer is JSON) forces one of

* ``{"tool_calls": [{"name": "<a tool>", "arguments": {...its schema...}}, ...]}``
  (at least one call; exactly one when ``parallel_tool_calls`` is false;
  the only shape for ``tool_choice: "required"`` or a named function);
* ``{"response": "<text>"}`` (``tool_choice: "auto"``; the ``response``
  follows the request's ``response_format`` schema when it has one).

The parser reads that JSON as it streams: the ``response`` string's decoded
text is the content, the calls are ``tool_calls`` (``tool_call``, the
single-call shape of older llama.cpp, is read too).
"""

from __future__ import annotations

from ..grammar.json_grammar import Document
from ..template import JinjaTemplate, add_system
from .base import ChatMsg, ChatPlan, Tail, ToolFormat, ToolRequest
from .calls import open_tail, read_call, read_call_list
from .jsonscan import Incomplete, object_items, partial_string, value_end, ws


def parameters_document(tool: dict) -> Document:
    """``tool``'s parameters schema (``{"type": "object"}`` when it gives
    none) as a :class:`~ggmux.instance.grammar.json_grammar.Document`: its
    ``#/$defs/...`` references resolve against it when it is wrapped inside
    a call's schema (issue 31, item 2)."""
    return Document(tool["function"].get("parameters") or {"type": "object"})


def call_schema(tool: dict) -> dict:
    """The JSON schema of one call of ``tool`` (name, then arguments; the
    arguments a :func:`parameters_document`)."""
    f = tool["function"]
    schema = {"type": "object",
              "properties": {"name": {"type": "string", "const": f["name"]},
                             "arguments": parameters_document(tool)},
              "required": ["name", "arguments"]}
    if f.get("description"):
        schema["description"] = f["description"]
    return schema


def calls_schema(tools: list[dict], parallel: bool) -> dict:
    """``{"tool_calls": [call, ...]}``: one or more calls of ``tools``."""
    schemas = [call_schema(t) for t in tools]
    items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    array = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        array["maxItems"] = 1
    return {"type": "object", "properties": {"tool_calls": array}, "required": ["tool_calls"]}


class GenericFormat(ToolFormat):
    name = "generic"
    think = None

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        if not req.calls_tools:
            return super().plan(tmpl, messages, req)
        schema = calls_schema(req.tools, req.parallel)
        if req.choice == "required":
            ask = ("Respond in JSON format with `tool_calls`: a request to call one of the "
                   "tools" + (" (or several)" if req.parallel else ""))
        else:
            schema = {"anyOf": [schema, {
                "type": "object",
                # the response_format schema's #/... references are its own
                "properties": {"response": Document(req.json_schema) if req.json_schema
                               else {"type": "string"}},
                "required": ["response"]}]}
            ask = ("Respond in JSON format, either with `tool_calls` (a request to call "
                   "tools) or with `response` reply to the user's request")
        b = self.builder()
        b.add_schema("root", schema)
        prompt = self.render(tmpl, add_system(messages, ask), req, req.tools)
        return ChatPlan(prompt, grammar=b.format(), parse_tools=True, reasoning=False,
                        format=self.name)

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        i = ws(text, 0)
        if i >= len(text):
            return
        items = object_items(text, i)
        try:
            key, start = next(items)
            while True:
                if key == "response":
                    if start < len(text) and text[start] == '"':
                        msg.content, end = partial_string(text, start)
                        if end is None:
                            msg.tail = Tail("content", start, "string")
                            return
                    else:  # a response_format schema: the JSON value is the content
                        try:
                            end = value_end(text, start)
                        except Incomplete:
                            msg.content = text[start:].rstrip()
                            msg.tail = Tail("content", start, "json")
                            return
                        msg.content = text[start:end]
                elif key == "tool_calls":
                    msg.tool_calls, end = read_call_list(text, start, partial)
                    if end is None:
                        msg.tail = open_tail(msg.tool_calls)
                        return
                elif key == "tool_call":
                    call, end = read_call(text, start)
                    if call is not None:
                        msg.tool_calls = [call]
                    if end is None:
                        msg.tail = open_tail(msg.tool_calls)
                        return
                else:
                    end = value_end(text, start)
                key, start = items.send(end)
        except StopIteration:
            return
        except Incomplete:
            if not partial:
                raise ValueError("the answer's JSON is not complete") from None
