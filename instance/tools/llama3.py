"""Llama 3.1 / 3.2 / 3.3: a call is a JSON object ``{"name": ...,
"parameters": {...}}`` (optionally ``"type": "function"`` first), and the
built-in tools of 3.1 are ``<|python_tag|>NAME.call(ARG=VALUE, ...)``, as
llama.cpp's ``common_chat_params_init_llama_3_x`` and its parser.

* Detection: ``<|start_header_id|>ipython<|end_header_id|>`` in the
  template; ``<|python_tag|>`` there too means built-in tools.
* Prompt: the template's own, with ``date_string``, ``tools_in_user_message``
  false and ``builtin_tools`` (the request's tools named ``wolfram_alpha``,
  ``web_search``/``brave_search``, ``python``/``code_interpreter``).
* Grammar: one call (the template renders one per turn); lazy for
  ``auto``, armed when the answer starts as such an object, or at
  ``<|python_tag|>`` (a preserved token); ``<|eom_id|>`` also stops.
* Parser: content before the object is content; ``<|python_tag|>`` then
  ``NAME.call(...)`` (or bare code: the ``python`` tool's ``code``).
"""

from __future__ import annotations

import json
import re

from ..grammar.json_grammar import format_literal
from ..template import JinjaTemplate
from .base import ChatMsg, ChatPlan, ToolCall, ToolFormat, ToolRequest
from .calls import code_arguments, open_tail, read_call
from .jsonscan import Incomplete, partial_string, value_end, ws

PYTHON_TAG = "<|python_tag|>"
BUILTIN = ("wolfram_alpha", "web_search", "brave_search", "python", "code_interpreter")
_START = re.compile(r'\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:')
_CALL = re.compile(r"\s*(\w+)\s*\.\s*call\(")
_ARG = re.compile(r"\s*(\w+)\s*=\s*")


class Llama3Format(ToolFormat):
    name = "llama-3.x"
    think = None

    def __init__(self, source: str = "") -> None:
        super().__init__(source)
        self.builtin = PYTHON_TAG in source

    @staticmethod
    def detect(source: str) -> bool:
        return "<|start_header_id|>ipython<|end_header_id|>" in source

    def extra(self, req: ToolRequest) -> dict:
        from datetime import datetime

        names = [t["function"]["name"] for t in req.tools] if req.calls_tools else []
        builtin = [n for n in names if n in BUILTIN] if self.builtin else []
        extra = {"date_string": datetime.now().strftime("%d %b %Y"),
                 "tools_in_user_message": False, **super().extra(req)}
        if builtin:
            extra["builtin_tools"] = builtin
        return extra

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        plan = ChatPlan(self.render(tmpl, messages, req, req.tools if req.calls_tools else None),
                        format=self.name, reasoning=False, stops=["<|eom_id|>"],
                        preserved=[PYTHON_TAG])
        if not req.calls_tools:
            return plan
        b = self.builder()
        rules = []
        for t in req.tools:
            name = t["function"]["name"]
            params = t["function"].get("parameters") or {}
            args = b.add_schema(name + "-args", params)
            rules.append(b.add_rule(
                name + "-call",
                '"{" space ( "\\"type\\"" space ":" space "\\"function\\"" space "," space )? '
                f'"\\"name\\"" space ":" space {format_literal(json.dumps(name))} space "," '
                f'space "\\"parameters\\"" space ":" space {args} space "}}" space'))
            if self.builtin and name in BUILTIN:
                kv = []
                for k, v in (params.get("properties") or {}).items():
                    kv.append(f'{format_literal(k + "=")} {b.add_schema(name + "-" + k, v, params)}')
                rules.append(b.add_rule(
                    name + "-builtin",
                    f'"{PYTHON_TAG}" {format_literal(name + ".call(")} ' +
                    ' ", " '.join(kv or ['""']) + ' ")"'))
                plan.trigger_words = [PYTHON_TAG]
        b.add_rule("root", " | ".join(rules))
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_patterns = [('^\\s*(\\{\\s*(?:"type"\\s*:\\s*"function"\\s*,\\s*)?'
                                 '"name"\\s*:\\s*")[\\s\\S]*$')]
        plan.parse_tools = True
        return plan

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        if self.builtin:
            at = text.find(PYTHON_TAG)
            if at >= 0:
                msg.content = text[:at]
                self._builtin(text, at + len(PYTHON_TAG), partial, msg)
                return
        m = _START.search(text)
        if m is None:
            msg.content = text
            if partial:  # an object just begun may still become a call
                brace = text.rfind("{")
                if brace >= 0 and "}" not in text[brace:] and len(text) - brace < 64:
                    msg.content = text[:brace]
            return
        msg.content = text[:m.start()]
        i = m.start()
        while True:
            call, end = read_call(text, i, ("name",), ("parameters", "arguments"))
            if call is not None:
                msg.tool_calls.append(call)
            if end is None:
                if not partial:
                    raise ValueError("an unfinished tool call")
                msg.tail = open_tail(msg.tool_calls)
                if msg.tail is not None and self.builtin:  # a python tag later changes all
                    msg.tail.guards = (PYTHON_TAG,)
                return
            j = ws(text, end)
            if j < len(text) and text[j] in ",;":
                j = ws(text, j + 1)
            nxt = _START.match(text, j)
            if nxt is None:
                return
            i = j

    def _builtin(self, text: str, i: int, partial: bool, msg: ChatMsg) -> None:
        m = _CALL.match(text, i)
        if m is None:
            code = text[i:]
            if partial and (not code.strip() or re.fullmatch(r"\s*\w*\s*\.?\s*\w*", code)):
                return  # may still become NAME.call(
            msg.tool_calls.append(ToolCall("python", code_arguments(code, partial)))
            return
        name, j = m.group(1), m.end()
        args: dict = {}
        while True:
            a = _ARG.match(text, j)
            if a is None:
                break
            j = a.end()
            try:
                if j < len(text) and text[j] == '"':
                    s, end = partial_string(text, j)
                    if end is None:
                        raise Incomplete
                    args[a.group(1)] = s
                else:
                    end = value_end(text, j)
                    args[a.group(1)] = json.loads(text[j:end])
            except Incomplete:
                if not partial:
                    raise ValueError("an unfinished built-in call") from None
                msg.tool_calls.append(ToolCall(name, ""))
                return
            j = ws(text, end)
            if not text.startswith(",", j):
                break
            j += 1
        if not text.startswith(")", ws(text, j)) and not partial:
            raise ValueError("a built-in call without ')'")
        msg.tool_calls.append(ToolCall(name, json.dumps(args) if text.startswith(
            ")", ws(text, j)) else ""))
