"""Mistral Nemo and Mistral Small 3.x / Devstral: tool calls after the
``[TOOL_CALLS]`` token, as llama.cpp's ``common_chat_params_init_mistral_nemo``
and its Mistral Small 3.2 parser.

* Detection: ``[TOOL_CALLS]`` in the template, and only for requests that
  call tools (llama.cpp: other requests render and parse as plain
  content). The template has ``[ARGS]`` (Small 3.2, Devstral): each call is
  ``[TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}`` (``[CALL_ID]`` only when the
  template has it); else (Nemo) one ``[TOOL_CALLS]`` and a JSON list of
  ``{"name", "arguments", "id"}``.
* Prompt: the template's own. Mistral's templates refuse tool call ids that
  are not 9 letters or digits; other ids (OpenAI's ``call_...``) are mapped
  to 9 characters derived from them, the same in the assistant's calls and
  in the results that answer them.
* Grammar: the calls, ids 9 alphanumerics; lazy for ``auto``, armed at the
  ``[TOOL_CALLS]`` token (preserved, so the parser sees it).
"""

from __future__ import annotations

import hashlib
import re

from ..grammar.json_grammar import format_literal
from ..template import JinjaTemplate
from .base import ChatMsg, ChatPlan, Tail, ToolCall, ToolFormat, ToolRequest, content_before
from .calls import open_tail, read_call_list
from .generic import call_schema
from .jsonscan import Incomplete, value_end, ws

TOOL_CALLS, CALL_ID, ARGS = "[TOOL_CALLS]", "[CALL_ID]", "[ARGS]"
_ID = re.compile(r"[a-zA-Z0-9]{9}")


def mistral_id(cid: str) -> str:
    """``cid`` as a Mistral tool call id (9 letters or digits)."""
    if _ID.fullmatch(cid):
        return cid
    return hashlib.sha1(cid.encode()).hexdigest()[:9]


class MistralFormat(ToolFormat):
    name = "mistral-nemo"
    think = None

    def __init__(self, source: str = "") -> None:
        super().__init__(source)
        self.args_tag = ARGS in source
        self.call_id_tag = CALL_ID in source
        if self.args_tag:
            self.name = "mistral-small"

    @staticmethod
    def detect(source: str) -> bool:
        return TOOL_CALLS in source

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        fixed = []
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):
                m["tool_calls"] = [{**c, "id": mistral_id(c.get("id") or f"{len(fixed)}")}
                                   for c in m["tool_calls"]]
            if m.get("tool_call_id"):
                m["tool_call_id"] = mistral_id(m["tool_call_id"])
            fixed.append(m)
        plan = ChatPlan(self.render(tmpl, fixed, req, req.tools if req.calls_tools else None),
                        format=self.name, reasoning=False, preserved=[TOOL_CALLS, CALL_ID, ARGS])
        if not req.calls_tools:
            return plan
        b = self.builder()
        if self.args_tag:
            alts = []
            for t in req.tools:
                name = t["function"]["name"]
                args = b.add_schema(name + "-args", t["function"].get("parameters") or {})
                cid = ' "[CALL_ID]" [a-zA-Z0-9]{9}' if self.call_id_tag else ""
                alts.append(b.add_rule(name + "-call",
                                       f'"{TOOL_CALLS}" {format_literal(name)}{cid} "{ARGS}" {args}'))
            one = b.add_rule("tool-call", " | ".join(alts))
            b.add_rule("root", f"({one})+" if req.parallel else one)
        else:
            schemas = []
            for t in req.tools:
                s = call_schema(t)
                s["properties"]["id"] = {"type": "string", "pattern": "^[a-zA-Z0-9]{9}$"}
                s["required"].append("id")
                schemas.append(s)
            array = {"type": "array", "items": schemas[0] if len(schemas) == 1 else
                     {"anyOf": schemas}, "minItems": 1}
            if not req.parallel:
                array["maxItems"] = 1
            body = b.add_schema("tool-calls", array)
            b.add_rule("root", f'"{TOOL_CALLS}" {body}')
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_words = [TOOL_CALLS]
        plan.parse_tools = True
        return plan

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        msg.content, at, _ = content_before(text, (TOOL_CALLS,), partial)
        if at < 0:
            if partial:
                msg.tail = Tail("content", 0, "text", (TOOL_CALLS,))
            return
        if not self.args_tag:
            calls, end = read_call_list(text, at + len(TOOL_CALLS), partial)
            msg.tool_calls = calls
            if end is None and not partial:
                raise ValueError("an unfinished [TOOL_CALLS] list")
            if end is None:
                msg.tail = open_tail(calls)
            return
        i = at
        while text.startswith(TOOL_CALLS, i):
            i += len(TOOL_CALLS)
            j = text.find(ARGS, i)
            if j < 0:
                if not partial:
                    raise ValueError("[TOOL_CALLS] without [ARGS]")
                return
            head = text[i:j]
            name, _, cid = head.partition(CALL_ID)
            start = ws(text, j + len(ARGS))
            try:
                end = value_end(text, start)
            except Incomplete:
                if not partial:
                    raise ValueError("unfinished arguments") from None
                msg.tool_calls.append(ToolCall(name.strip(), text[start:].rstrip(), cid.strip()))
                msg.tail = Tail("arguments", start, "json")
                return
            msg.tool_calls.append(ToolCall(name.strip(), text[start:end], cid.strip()))
            i = ws(text, end)
