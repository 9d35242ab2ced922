"""Functionary v3.2: the answer is a series of ``RECIPIENT\\n...`` parts
after ``>>>`` (the prompt ends with the first ``>>>``): ``all`` is text for
the user, any other recipient is a tool called with the JSON that follows
(``python`` may be followed by raw code), as llama.cpp's
``common_chat_params_init_functionary_v3_2`` and its parser.

* Detection: ``>>>all`` in the template (its handler serves every request:
  plain content is prefixed ``all\\n`` there too).
* Grammar: the first call ``NAME\\n{args}``, then (``parallel_tool_calls``)
  more ``>>>NAME\\n{args}``; lazy for ``auto``, armed when the answer starts
  with a tool's name and a newline, or at ``>>>NAME\\n`` later on.
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
    function_names,
    held_prefix,
)
from .base import regex_escape as rx
from .calls import code_arguments
from .jsonscan import Incomplete, value_end, ws

SEP = ">>>"


class FunctionaryFormat(ToolFormat):
    name = "functionary-v3.2"
    think = None

    @staticmethod
    def detect(source: str) -> bool:
        return ">>>all" in source

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        plan = ChatPlan(self.render(tmpl, messages, req, req.tools if req.calls_tools else None),
                        format=self.name, reasoning=False, parse_tools=True)
        if not req.calls_tools:
            return plan
        b = self.builder()
        first, later = [], []
        for t in req.tools:
            name = t["function"]["name"]
            args = b.add_schema(name + "-args", t["function"].get("parameters") or {})
            first.append(b.add_rule(name + "-call", f"{format_literal(name + chr(10))} {args}"))
            later.append(b.add_rule(name + "-call2",
                                    f"{format_literal(SEP + name + chr(10))} {args}"))
        one = " | ".join(first)
        b.add_rule("root", f"( {one} ) ( {' | '.join(later)} )*" if req.parallel else one)
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        names = function_names(req.tools)
        plan.trigger_patterns = [f"^((?:[\\s\\S]+?>>>)?{rx(n)}\\n)[\\s\\S]*$" for n in names]
        plan.trigger_words = [f"{SEP}{n}\n" for n in names]
        return plan

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        content: list[str] = []
        i = 0
        first = True
        while i < len(text) or first:
            nl = text.find("\n", i)
            if nl < 0:
                head = text[i:]
                if not partial:
                    if first:  # no recipient at all: plain text
                        content.append(text[i:])
                    elif head.strip():
                        content.append(head)
                break
            name = text[i:nl].strip()
            body = nl + 1
            first = False
            if name == "all":
                nxt = text.find(SEP, body)
                end = len(text) if nxt < 0 else nxt
                piece = text[body:end]
                if partial and nxt < 0:  # the end may still become ">>>"
                    piece = piece[:len(piece) - held_prefix(piece, (SEP,))]
                content.append(piece)
                if nxt < 0:
                    if partial:
                        msg.tail = Tail("content", body, "text", (SEP,))
                    break
                i = nxt + len(SEP)
                continue
            j = ws(text, body)
            if name == "python" and not text.startswith("{", j) and (j < len(text) or not partial):
                nxt = text.find(SEP, body)
                code = text[body:] if nxt < 0 else text[body:nxt]
                msg.tool_calls.append(ToolCall("python", code_arguments(code, partial and nxt < 0)))
                if nxt < 0:
                    break
                i = nxt + len(SEP)
                continue
            try:
                end = value_end(text, j)
            except Incomplete:
                if not partial:
                    raise ValueError(f"unfinished arguments of {name}") from None
                if j < len(text):
                    msg.tool_calls.append(ToolCall(name, text[j:].rstrip()))
                    msg.tail = Tail("arguments", j, "json")
                break
            msg.tool_calls.append(ToolCall(name, text[j:end]))
            k = ws(text, end)
            if text.startswith(SEP, k):
                i = k + len(SEP)
            elif partial and SEP.startswith(text[k:]):
                break
            else:
                if text[k:].strip():
                    content.append(text[k:])
                break
        msg.content = "".join(content)
