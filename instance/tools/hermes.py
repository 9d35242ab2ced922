"""Hermes 2 Pro / Hermes 3, Qwen 2.5 and Qwen 3 (and QwQ, MiMo): tool calls
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, reasoning
in ``<think>...</think>`` (Qwen 3, QwQ), as llama.cpp's
``common_chat_params_init_hermes_2_pro`` and its parser.

* Detection: the template's text has ``<tool_call>``.
* Prompt: the template's own (it lists the tools), with
  ``enable_thinking``; a prompt ending in ``<think>\\n`` (thinking forced
  open) gets ``</think>`` when thinking is off.
* Grammar: one call is ``"<tool_call>" space {name, arguments} space
  "</tool_call>"`` (or ``<function=NAME>{args}</function>``, a shape some
  of these models write), one or more of them in a row
  (``parallel_tool_calls``); lazy for ``auto``, armed by the words
  ``<tool_call>`` / ``<function=NAME>`` or by an answer that starts as a
  bare ``{"name": "NAME"`` object.
* Parser: content until a call; each call's JSON; content between calls
  is kept; an unclosed ``<think>`` is all reasoning.
"""

from __future__ import annotations

from ..grammar.json_grammar import format_literal
from ..template import JinjaTemplate
from .base import (
    ChatMsg,
    ChatPlan,
    Tail,
    ToolCall,
    ToolFormat,
    ToolRequest,
    content_before,
    function_names,
    regex_escape,
)
from .calls import open_tail, read_call
from .generic import call_schema
from .jsonscan import Incomplete, value_end, ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION = "<function="


class HermesFormat(ToolFormat):
    name = "hermes-2-pro"

    def __init__(self, source: str = "") -> None:
        super().__init__(source)
        self.thinking = "<think>" in source

    @staticmethod
    def detect(source: str) -> bool:
        return OPEN in source

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        plan = self.thinking_plan(ChatPlan(self.render(
            tmpl, messages, req, req.tools if req.calls_tools else None), format=self.name), req)
        plan.preserved = ["<think>", "</think>", OPEN, CLOSE]
        if not req.calls_tools:
            return plan
        b = self.builder()
        calls, tags = [], []
        for t in req.tools:
            name = t["function"]["name"]
            calls.append(b.add_schema(name + "-call", call_schema(t)))
            args = b.add_schema(name + "-args", t["function"].get("parameters") or {})
            tags.append(b.add_rule(name + "-function-tag",
                                   f'{format_literal(f"<function={name}>")} space {args} space "</function>"'))
        any_call = b.add_rule("any-tool-call", "( " + " | ".join(calls) + " ) space")
        one = b.add_rule("tool-call", " | ".join(
            [f'"{OPEN}" space {any_call} space "{CLOSE}" space', any_call, *tags]))
        head = '( "</think>" space )? ' if plan.thinking_open else ""
        b.add_rule("root", head + (f"({one})+" if req.parallel else one))
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        names = "|".join(regex_escape(n) for n in function_names(req.tools))
        plan.trigger_words = [OPEN, *(f"<function={n}>" for n in function_names(req.tools))]
        think = "[\\s\\S]*?</think>\\s*" if plan.thinking_open else \
            "(?:<think>[\\s\\S]*?</think>\\s*)?"
        plan.trigger_patterns = [f'^{think}\\s*(\\{{\\s*"name"\\s*:\\s*"(?:{names})")[\\s\\S]*$']
        plan.parse_tools = True
        return plan

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        content: list[str] = []
        i = 0
        bare = ws(text, 0)
        if text.startswith("{", bare):  # a bare call object at the start
            call, end = read_call(text, bare)
            if end is None and not partial:
                raise ValueError("an unfinished tool call")
            if call is not None:
                msg.tool_calls.append(call)
            if end is None:
                msg.tail = open_tail(msg.tool_calls)
                return
            i = end
        while True:
            before, at, marker = content_before(text[i:], (OPEN, FUNCTION), partial)
            content.append(before)
            if at < 0:
                # more content, unless the answer is still only whitespace (a bare
                # call may follow) or the content's start is not yet known
                # (a "</function>" still being written would move its start)
                if partial and bare < len(text) and i < len(text):
                    msg.tail = Tail("content", i, "text", (OPEN, FUNCTION),
                                    guards=("</function>",))
                break
            start = i + at + len(marker)
            if marker == OPEN:
                call, end = read_call(text, start)
                if call is not None:
                    msg.tool_calls.append(call)
                if end is None:
                    if not partial:
                        raise ValueError("an unfinished <tool_call>")
                    msg.tail = open_tail(msg.tool_calls)
                    break
                j = ws(text, end)
                if text.startswith(CLOSE, j):
                    j += len(CLOSE)
                elif partial and CLOSE.startswith(text[j:]):
                    break
            else:
                close = text.find(">", start)
                if close < 0:
                    if not partial:
                        raise ValueError("an unfinished <function=")
                    break
                name = text[start:close]
                args_at = ws(text, close + 1)
                try:
                    end = value_end(text, args_at)
                except Incomplete:
                    if not partial:
                        raise ValueError("an unfinished <function=...>") from None
                    msg.tool_calls.append(ToolCall(name, text[args_at:].rstrip()))
                    msg.tail = Tail("arguments", args_at, "json")
                    break
                msg.tool_calls.append(ToolCall(name, text[args_at:end]))
                j = ws(text, end)
                if text.startswith("</function>", j):
                    j += len("</function>")
            i = ws(text, j)
        msg.content = "".join(content)
