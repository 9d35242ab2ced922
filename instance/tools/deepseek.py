"""DeepSeek R1 (and its Llama / Qwen distills) and DeepSeek V3.1: calls
between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``, reasoning in
``<think>``, as llama.cpp's ``common_chat_params_init_deepseek_r1`` /
``_deepseek_v3_1`` and their parsers.

* R1: each call ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{args}```<｜tool▁call▁end｜>``.
  Detection: ``<｜tool▁calls▁begin｜>`` in the template. The official
  template leaves a conversation dangling after tool results; as llama.cpp,
  the prompt is closed with ``<｜end▁of▁sentence｜>`` (and the assistant's
  turn opened again).
* V3.1: each call ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}<｜tool▁call▁end｜>``;
  thinking through the template's ``thinking`` variable. Detection: the
  template's ``message['prefix'] is defined and message['prefix'] and
  thinking``.
* Both: a prompt ending in ``<think>`` opens the reasoning (R1 always);
  grammars lazy for ``auto``, armed at the calls' opening token (and its
  spelling variants the models write).
"""

from __future__ import annotations

import re

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
)
from .jsonscan import Incomplete, value_end, ws

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
BEGIN_SPELLINGS = (CALLS_BEGIN, "<｜tool_calls_begin｜>", "<｜tool calls begin｜>",
                   "<｜tool\\_calls\\_begin｜>", "<｜tool▁calls｜>")
EOS = "<｜end▁of▁sentence｜>"


class DeepSeekR1Format(ToolFormat):
    name = "deepseek-r1"
    thinking = True

    @staticmethod
    def detect(source: str) -> bool:
        return CALLS_BEGIN in source

    def render(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest,
               tools: list[dict] | None) -> str:
        prompt = super().render(tmpl, messages, req, tools)
        if "{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}" in tmpl.source:
            if prompt.endswith("<｜tool▁outputs▁end｜>"):  # don't leave the chat dangling
                prompt += EOS + ("<｜Assistant｜>" if req.add_generation_prompt else "")
            prompt = re.sub(r"(<｜tool▁call▁end｜>)[\s\r\n]*(<｜tool▁outputs▁begin｜>|<｜User｜>)",
                            r"\1<｜tool▁calls▁end｜><｜end▁of▁sentence｜>\2", prompt)
        return prompt

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        plan = self.thinking_plan(ChatPlan(self.render(
            tmpl, messages, req, req.tools if req.calls_tools else None), format=self.name), req)
        plan.preserved = ["<think>", "</think>", CALLS_BEGIN, CALL_BEGIN, SEP, CALL_END,
                          CALLS_END]
        plan.parse_tools = True
        if not req.calls_tools:
            return plan
        b = self.builder()
        alts = [b.add_rule(t["function"]["name"] + "-call", self.call_rule(b, t))
                for t in req.tools]
        one = " | ".join(alts)
        begin = "( " + " | ".join(f'"{s}"' for s in BEGIN_SPELLINGS).replace("\\_", "\\\\_") + " )"
        calls = f"({one})+" if req.parallel else f"({one})"
        head = '( "</think>" space )? ' if plan.thinking_open else ""
        b.add_rule("root", f'{head}{begin} {calls} "{CALLS_END}" space')
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_words = [CALLS_BEGIN]
        plan.trigger_patterns = [("(<｜tool_calls_begin｜>|<｜tool calls begin｜>|"
                                 "<｜tool\\\\_calls\\\\_begin｜>|<｜tool▁calls｜>)")]
        return plan

    def call_rule(self, b, tool: dict) -> str:
        name = tool["function"]["name"]
        args = b.add_schema(name + "-args", tool["function"].get("parameters") or {})
        head = format_literal(f"function{SEP}{name}\n```json\n")
        return f'( "{CALL_BEGIN}" )? {head} {args} "```{CALL_END}"'

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        msg.content, at, marker = content_before(text, BEGIN_SPELLINGS, partial)
        if at < 0:
            if partial:
                msg.tail = Tail("content", 0, "text", BEGIN_SPELLINGS)
            return
        i = at + len(marker)
        while True:
            i = ws(text, i)
            if text.startswith(CALLS_END, i) or (partial and i >= len(text)):
                return
            call, end = self.read_one(text, i, partial)
            if call is not None:
                msg.tool_calls.append(call)
            if end is None:
                if not partial:
                    raise ValueError("an unfinished tool call")
                msg.tail = call.tail if call is not None else None
                return
            i = end

    def read_one(self, text: str, i: int, partial: bool) -> tuple[ToolCall | None, int | None]:
        """One call at ``i``: ``(call, end)``, end None while it is unfinished."""
        if text.startswith(CALL_BEGIN, i):
            i += len(CALL_BEGIN)
        head = "function" + SEP
        if not text.startswith(head, i):
            if partial and head.startswith(text[i:]):
                return None, None
            raise ValueError(f"expected {head!r} at {i}")
        nl = text.find("\n", i)
        if nl < 0:
            return None, None
        name = text[i + len(head):nl].strip()
        j = nl + 1
        fence = "```json\n"
        if text.startswith(fence, j):
            j += len(fence)
        elif partial and fence.startswith(text[j:]):
            return None, None
        return self.arguments(text, name, j, "```", partial)

    @staticmethod
    def arguments(text: str, name: str, j: int, close: str, partial: bool
                  ) -> tuple[ToolCall | None, int | None]:
        try:
            end = value_end(text, j)
        except Incomplete:
            if not partial:
                raise ValueError(f"unfinished arguments of {name}") from None
            return ToolCall(name, text[j:].rstrip(), tail=Tail("arguments", j, "json")), None
        call = ToolCall(name, text[j:end])
        k = ws(text, end)
        for tail in (close, CALL_END):
            if tail and text.startswith(tail, k):
                k = ws(text, k + len(tail))
            elif partial and tail.startswith(text[k:]):
                return call, None
        return call, k


class DeepSeekV31Format(DeepSeekR1Format):
    name = "deepseek-v3.1"

    @staticmethod
    def detect(source: str) -> bool:
        return "message['prefix'] is defined and message['prefix'] and thinking" in source

    def extra(self, req: ToolRequest) -> dict:
        return {"thinking": req.enable_thinking, **super().extra(req)}

    def call_rule(self, b, tool: dict) -> str:
        name = tool["function"]["name"]
        args = b.add_schema(name + "-args", tool["function"].get("parameters") or {})
        return f'( "{CALL_BEGIN}" )? {format_literal(name + SEP)} {args} "{CALL_END}"'

    def read_one(self, text: str, i: int, partial: bool) -> tuple[ToolCall | None, int | None]:
        if text.startswith(CALL_BEGIN, i):
            i += len(CALL_BEGIN)
        sep = text.find(SEP, i)
        if sep < 0:
            return None, None
        name = text[i:sep].strip()
        if name.startswith("function"):
            name = name[len("function"):].strip() or name
        return self.arguments(text, name, ws(text, sep + len(SEP)), "", partial)
