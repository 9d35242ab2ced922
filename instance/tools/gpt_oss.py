"""GPT-OSS (OpenAI's harmony format): the answer is a series of messages
``[HEADER]<|message|>BODY`` separated by ``<|end|><|start|>assistant``; the
header names a channel (``analysis``: reasoning; ``final`` or
``commentary``: text for the user) and maybe a recipient (``to=functions.NAME``:
a tool call whose body is the JSON arguments, ``<|constrain|>json``
optional), as llama.cpp's ``common_chat_params_init_gpt_oss`` and its
parser.

* Detection: ``<|channel|>`` in the template.
* Prompt: the template's own; ``reasoning_effort`` (default ``medium``)
  reaches it; earlier turns' ``reasoning_content`` is its ``thinking``; the
  ``developer`` role stays (harmony has one).
* Grammar: a call in either header form (``<|channel|>commentary
  to=functions.NAME ...<|message|>{args}`` or `` to=functions.NAME<|channel|>
  commentary...``); lazy for ``auto``, armed at ``to=functions.``;
  ``required`` allows one analysis message first.
* Messages to other recipients (built-in ``python``, ``container.exec``)
  are not tool calls of the request: they are dropped, as llama.cpp does.
"""

from __future__ import annotations

import re

from ..grammar.json_grammar import format_literal
from ..template import JinjaTemplate
from .base import ChatMsg, ChatPlan, Tail, ToolCall, ToolFormat, ToolRequest, held_prefix
from .jsonscan import Incomplete, value_end, ws

MESSAGE, END, START, CHANNEL = "<|message|>", "<|end|>", "<|start|>", "<|channel|>"
STOPS = (END, START, "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>(\w+)")


class GptOssFormat(ToolFormat):
    name = "gpt-oss"
    think = None

    @staticmethod
    def detect(source: str) -> bool:
        return CHANNEL in source

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        msgs = []
        for m in messages:
            if m.get("reasoning_content") and m["role"] == "assistant":
                m = {**m, "thinking": m["reasoning_content"]}
                del m["reasoning_content"]
            msgs.append(m)
        plan = ChatPlan(self.render(tmpl, msgs, req, req.tools if req.calls_tools else None),
                        format=self.name, reasoning=req.reasoning_format != "none",
                        parse_tools=True,
                        preserved=[CHANNEL, MESSAGE, START, END, "<|constrain|>"])
        if not req.calls_tools:
            return plan
        b = self.builder()
        alts = []
        for t in req.tools:
            name = t["function"]["name"]
            args = b.add_schema(name + "-args", t["function"].get("parameters") or {})
            fn = format_literal(f" to=functions.{name}")
            chan = '"<|channel|>" ( "commentary" | "analysis" )'
            constrain = '( " <|constrain|>json" )?'
            alts.append(b.add_rule(name + "-call",
                                   f'( {chan} {fn} | {fn} {chan} ) {constrain} "{MESSAGE}" {args}'))
        call = b.add_rule("tool-call", " | ".join(alts))
        if req.choice == "required":
            b.add_rule("root", f'( "<|channel|>analysis<|message|>" [^<]* "{END}{START}assistant"'
                               f' )? {call}')
        else:
            b.add_rule("root", call)
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_patterns = [  # full-match; the grammar starts at group 1
            "^[\\s\\S]*?(<\\|channel\\|>(?:commentary|analysis) to=functions\\.)[\\s\\S]*$",
            "^[\\s\\S]*?(?:^|<\\|start\\|>assistant)( to=functions\\.)[\\s\\S]*$"]
        return plan

    def parse(self, text: str, partial: bool, plan: ChatPlan) -> ChatMsg:
        msg = ChatMsg()
        content: list[str] = []
        reasoning: list[str] = []
        i = 0
        tail = None
        while i < len(text):
            m = text.find(MESSAGE, i)
            if m < 0:  # a header still being written (or stray text at the end)
                if not partial and not text[i:].startswith((CHANNEL, " to=")):
                    content.append(text[i:])
                break
            header = text[i:m]
            body_at = m + len(MESSAGE)
            ends = [k for k in (text.find(s, body_at) for s in STOPS) if k >= 0]
            stop = min(ends) if ends else -1
            recipients = _RECIPIENT.findall(header)
            recipient = recipients[-1] if recipients else ""
            channels = _CHANNEL.findall(header)
            channel = channels[-1] if channels else "final"
            body = text[body_at:] if stop < 0 else text[body_at:stop]
            if stop < 0 and partial:
                body = body[:len(body) - held_prefix(body, STOPS)]
            if recipient.startswith("functions."):
                name = recipient[len("functions."):]
                j = ws(text, body_at)
                try:
                    end = value_end(text, j)
                    msg.tool_calls.append(ToolCall(name, text[j:end]))
                except Incomplete:
                    if not partial:
                        raise ValueError(f"unfinished arguments of {name}") from None
                    if text[j:].strip():
                        msg.tool_calls.append(ToolCall(name, text[j:].rstrip()))
                    else:
                        msg.tool_calls.append(ToolCall(name, ""))
                    if stop < 0:  # a stop inside the arguments would change the parse
                        tail = Tail("arguments", j, "json", guards=STOPS)
            elif recipient and recipient != "assistant":
                pass  # a built-in tool the request did not offer
            elif channel == "analysis":
                if plan.reasoning:
                    reasoning.append(body)
                    field = "reasoning_content"
                else:
                    content.append(f"{CHANNEL}analysis{MESSAGE}{body}" + (END if stop >= 0 else ""))
                    field = "content"
                if stop < 0 and partial:
                    tail = Tail(field, body_at, "text", STOPS)
            else:
                content.append(body)
                if stop < 0 and partial:
                    tail = Tail("content", body_at, "text", STOPS)
            if stop < 0:
                break
            i = stop
            for s in (END, START):
                if text.startswith(s, i):
                    i += len(s)
            if text.startswith("assistant", i):
                i += len("assistant")
        msg.reasoning_content = "".join(reasoning)
        msg.content = "".join(content)
        msg.tail = tail if partial else None
        return msg
