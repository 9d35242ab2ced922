"""IBM Granite 3.x: reasoning in ``<think>...</think>`` and the answer in
``<response>...</response>`` (when the template's ``thinking`` is on),
tool calls as ``<|tool_call|>`` and a JSON list of ``{"name",
"arguments"}``, as llama.cpp's ``common_chat_params_init_granite`` and its
parser. (Granite 4 templates write ``<tool_call>``: the Hermes format.)

* Detection: ``elif thinking`` and ``<|tool_call|>`` in the template.
* Prompt: the template's own, its ``thinking`` variable from
  ``enable_thinking``.
* Grammar: ``<|tool_call|>`` and the list (one call when
  ``parallel_tool_calls`` is false); lazy for ``auto``, armed at
  ``<|tool_call|>``.
"""

from __future__ import annotations

from ..template import JinjaTemplate
from .base import ChatMsg, ChatPlan, Tail, ToolFormat, ToolRequest, content_before
from .calls import open_tail, read_call_list
from .generic import call_schema

TOOL_CALL = "<|tool_call|>"


class GraniteFormat(ToolFormat):
    name = "granite"
    thinking = True

    @staticmethod
    def detect(source: str) -> bool:
        return "elif thinking" in source and TOOL_CALL in source

    def extra(self, req: ToolRequest) -> dict:
        return {"thinking": req.enable_thinking, **super().extra(req)}

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        plan = self.thinking_plan(ChatPlan(self.render(
            tmpl, messages, req, req.tools if req.calls_tools else None), format=self.name), req)
        plan.preserved = ["<think>", "</think>", "<response>", "</response>", TOOL_CALL]
        plan.parse_tools = True
        if not req.calls_tools:
            return plan
        b = self.builder()
        schemas = [call_schema(t) for t in req.tools]
        array = {"type": "array", "items": schemas[0] if len(schemas) == 1 else
                 {"anyOf": schemas}, "minItems": 1}
        if not req.parallel:
            array["maxItems"] = 1
        calls = b.add_schema("tool-calls", array)
        head = '( "<think>" [^<]* "</think>" space )? ' if req.enable_thinking else ""
        b.add_rule("root", f'{head}"{TOOL_CALL}" space {calls}')
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_words = [TOOL_CALL]
        return plan

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        before, at, marker = content_before(text, (TOOL_CALL, "<response>"), partial)
        msg.content = before
        if at < 0 and partial:
            msg.tail = Tail("content", 0, "text", (TOOL_CALL, "<response>"))
        if marker == "<response>":
            body_at = at + len("<response>")
            inner, end, _ = content_before(text[body_at:], ("</response>",), partial)
            msg.content += inner
            if end < 0:
                if partial:
                    msg.tail = Tail("content", body_at, "text", ("</response>",))
                return
            rest = body_at + end + len("</response>")
            at = text.find(TOOL_CALL, rest)
        if at < 0:
            return
        calls, end = read_call_list(text, at + len(TOOL_CALL), partial)
        msg.tool_calls = calls
        if end is None and not partial:
            raise ValueError("an unfinished <|tool_call|> list")
        if end is None:
            msg.tail = open_tail(calls)
