"""Command R7B: reasoning in ``<|START_THINKING|>...<|END_THINKING|>``,
text in ``<|START_RESPONSE|>...<|END_RESPONSE|>``, calls as a JSON list in
``<|START_ACTION|>[{"tool_call_id", "tool_name", "parameters"}]<|END_ACTION|>``,
as llama.cpp's ``common_chat_params_init_command_r7b`` and its parser.

* Detection: ``<|END_THINKING|><|START_ACTION|>`` in the template.
* Prompt: earlier reasoning goes back as the template's ``tool_plan``;
  ``enable_thinking``; a prompt ending in ``<|START_THINKING|>`` is open
  reasoning (closed at once when thinking is off).
* Grammar: ``<|START_ACTION|>[`` calls ``]<|END_ACTION|>``, ids of digits;
  lazy for ``auto``, armed at ``<|START_ACTION|>``.
"""

from __future__ import annotations

from ..template import JinjaTemplate
from .base import (
    ChatMsg,
    ChatPlan,
    Tail,
    ToolFormat,
    ToolRequest,
    content_before,
    split_reasoning,
)
from .calls import open_tail, read_call_list
from .generic import parameters_document

START_THINKING, END_THINKING = "<|START_THINKING|>", "<|END_THINKING|>"
START_ACTION, END_ACTION = "<|START_ACTION|>", "<|END_ACTION|>"
START_RESPONSE, END_RESPONSE = "<|START_RESPONSE|>", "<|END_RESPONSE|>"


class CommandR7BFormat(ToolFormat):
    name = "command-r7b"
    think = (START_THINKING, END_THINKING)
    thinking = True

    @staticmethod
    def detect(source: str) -> bool:
        return END_THINKING + START_ACTION in source

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        msgs = []
        for m in messages:
            if m.get("reasoning_content"):
                m = {**m, "tool_plan": m["reasoning_content"]}
                del m["reasoning_content"]
            msgs.append(m)
        plan = self.thinking_plan(ChatPlan(self.render(
            tmpl, msgs, req, req.tools if req.calls_tools else None), format=self.name), req)
        plan.preserved = [START_ACTION, END_ACTION, START_RESPONSE, END_RESPONSE,
                          START_THINKING, END_THINKING]
        plan.parse_tools = True
        if not req.calls_tools:
            return plan
        b = self.builder()
        schemas = [{"type": "object", "properties": {
            "tool_call_id": {"type": "string", "pattern": "^[0-9]{1,10}$"},
            "tool_name": {"type": "string", "const": t["function"]["name"]},
            "parameters": parameters_document(t)},
            "required": ["tool_call_id", "tool_name", "parameters"]} for t in req.tools]
        array = {"type": "array", "items": schemas[0] if len(schemas) == 1 else
                 {"anyOf": schemas}, "minItems": 1}
        if not req.parallel:
            array["maxItems"] = 1
        calls = b.add_schema("tool-calls", array)
        head = f'( "{END_THINKING}" space )? ' if plan.thinking_open else \
            f'( "{START_THINKING}" [^<]* "{END_THINKING}" space )? '
        b.add_rule("root", f'{head}"{START_ACTION}" {calls} "{END_ACTION}"')
        plan.grammar = b.format()
        plan.lazy = req.choice != "required"
        plan.trigger_words = [START_ACTION]
        return plan

    def take_reasoning(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> str:
        reasoning, rest = split_reasoning(text, partial, START_THINKING, END_THINKING,
                                          plan.thinking_open, msg if plan.reasoning else None)
        if not plan.reasoning:  # reasoning_format none: inline, as the model wrote it
            if reasoning or text.lstrip().startswith(START_THINKING):
                head = "" if plan.thinking_open else START_THINKING
                return head + reasoning + (END_THINKING if END_THINKING in text else "") + rest
            return rest
        msg.reasoning_content = reasoning
        return rest

    def parse(self, text: str, partial: bool, plan: ChatPlan) -> ChatMsg:
        msg = super().parse(text, partial, plan)
        if not plan.reasoning and (plan.thinking_open or
                                   text.lstrip().startswith(START_THINKING)):
            msg.tail = None  # the reasoning is written into the content again: no tail
        return msg

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        before, at, marker = content_before(text, (START_ACTION, START_RESPONSE), partial)
        if at < 0:
            msg.content = before
            if partial:
                msg.tail = Tail("content", 0, "text", (START_ACTION, START_RESPONSE))
            return
        if marker == START_RESPONSE:
            body = text[at + len(START_RESPONSE):]
            end = body.find(END_RESPONSE)
            if end >= 0:
                msg.content = before + body[:end]
            else:
                msg.content, _, _ = content_before(body, (END_RESPONSE,), partial)
                msg.content = before + msg.content
                if partial:
                    msg.tail = Tail("content", at + len(START_RESPONSE), "text", (END_RESPONSE,))
            return
        msg.content = before
        calls, end = read_call_list(text, at + len(START_ACTION), partial,
                                    ("tool_name",), ("parameters",), ("tool_call_id",))
        msg.tool_calls = calls
        if end is None and not partial:
            raise ValueError("an unfinished <|START_ACTION|> list")
        if end is None:
            msg.tail = open_tail(calls)
