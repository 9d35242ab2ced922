"""What every tool-call format shares: the request's tool fields, the plan a
format makes for one request, the parsed message, and the helpers formats
parse with.

A format (one module per template family, :mod:`ggmux.instance.tools`) is
a :class:`ToolFormat`: ``plan()`` renders the prompt and decides the
grammar, its lazy triggers, preserved tokens and stop strings (llama.cpp's
``common_chat_params``); ``parse(text, partial, plan)`` turns the model's
text so far into a :class:`ChatMsg` (content, reasoning, tool calls).
Parsing a prefix (``partial``) never shows what could still turn out to be
a marker: a stream built on it (:mod:`.stream`) only ever appends. A
partial parse that stops inside one growing field (a call's arguments, the
content, the reasoning) says where, as the message's :class:`Tail`, so the
stream can read what comes next without parsing the whole answer again
(issue 31, item 8).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..grammar.json_grammar import GrammarBuilder
from ..template import JinjaTemplate


@dataclass(slots=True)
class Tail:
    """Where a partial parse stopped: the one field still growing at the end
    of the text, so that more text only adds to it until the stream sees
    otherwise (:class:`~.stream.ChatStream`).

    ``field``: ``content``, ``reasoning_content`` or ``arguments`` (of the
    message's last call); ``start``: index in the parsed text where the
    growing part begins; ``kind``: ``json`` (the raw text of an unfinished
    JSON value, right-stripped: all of the field), ``string`` (an unfinished
    JSON string decoded: all of the field) or ``text`` (plain text, the end
    of the field, less an end that may begin one of ``markers``; ``strip``:
    the field is the text stripped, all of it); ``guards``: texts whose
    appearance anywhere after ``start`` changes the parse (``markers`` do
    too)."""

    field: str
    start: int
    kind: str
    markers: tuple[str, ...] = ()
    strip: bool = False
    guards: tuple[str, ...] = ()


@dataclass(slots=True)
class ToolCall:
    """One call: ``arguments`` is JSON text (a prefix of it while streaming);
    ``id`` as the model wrote it, '' when it wrote none; ``tail``: its
    arguments are still growing (a :class:`Tail` for the parser)."""

    name: str
    arguments: str
    id: str = ""
    tail: Tail | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class ChatMsg:
    """A parsed assistant message; ``tail``: where a partial parse stopped
    (:class:`Tail`), or None."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    tail: Tail | None = field(default=None, compare=False, repr=False)


@dataclass(slots=True)
class ToolRequest:
    """A chat request's tool and template fields, checked.

    ``tools``: OpenAI function tools (``{"type": "function", "function":
    {"name", "description", "parameters"}}``, parameters always an object
    schema); ``choice``: ``auto``, ``required`` or ``none`` (a named
    function is ``required`` with only that tool); ``parallel``: more than
    one call allowed; ``json_schema``: the ``response_format`` schema (the
    generic format's ``response``), or None; ``reasoning_format``:
    ``deepseek`` (reasoning to ``reasoning_content``) or ``none`` (inline);
    ``enable_thinking``; ``extra``: template variables
    (``chat_template_kwargs``, ``reasoning_effort``);
    ``add_generation_prompt``."""

    tools: list[dict] = field(default_factory=list)
    choice: str = "auto"
    parallel: bool = True
    json_schema: dict | None = None
    reasoning_format: str = "deepseek"
    enable_thinking: bool = True
    extra: dict = field(default_factory=dict)
    add_generation_prompt: bool = True

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.choice != "none"


@dataclass(slots=True)
class ChatPlan:
    """What a format decided for one request (llama.cpp ``common_chat_params``).

    ``prompt``: the rendered text; ``grammar``: GBNF or None; ``lazy``: the
    grammar waits for a trigger: ``trigger_patterns`` (regexes over the text
    generated so far; the grammar starts at the first capture group) or
    ``trigger_words`` (texts: a word that is one token of the model becomes
    a trigger token, another an escaped pattern); ``preserved``: special
    tokens the answer must show as text (so the parser sees them);
    ``stops``: extra stop strings; ``thinking_open``: the prompt ends inside
    a reasoning block; ``parse_tools``: tool calls are parsed out;
    ``reasoning``: reasoning is split out (``reasoning_format`` deepseek)."""

    prompt: str
    grammar: str | None = None
    lazy: bool = False
    trigger_patterns: list[str] = field(default_factory=list)
    trigger_words: list[str] = field(default_factory=list)
    preserved: list[str] = field(default_factory=list)
    stops: list[str] = field(default_factory=list)
    thinking_open: bool = False
    parse_tools: bool = False
    reasoning: bool = True
    format: str = "content"


class ToolFormat:
    """A template family's format; subclasses override what differs.

    ``detect(source)``: whether a template's text is of this family (as
    llama.cpp's ``common_chat_templates_apply_jinja`` tells them apart)."""

    name = "content"
    think = ("<think>", "</think>")  # reasoning tags, or None
    thinking = False  # this family reasons in ``think`` tags

    def __init__(self, source: str = "") -> None:
        self.source = source

    @staticmethod
    def detect(source: str) -> bool:
        return False

    def extra(self, req: ToolRequest) -> dict:
        """Template variables for ``req``."""
        return {"enable_thinking": req.enable_thinking, **req.extra}

    def render(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest,
               tools: list[dict] | None) -> str:
        return tmpl.render(messages, tools, req.add_generation_prompt, self.extra(req))

    def plan(self, tmpl: JinjaTemplate, messages: list[dict], req: ToolRequest) -> ChatPlan:
        """The prompt and constraints for ``messages`` and ``req``; the base
        renders the tools (if any) and parses content and reasoning only."""
        prompt = self.render(tmpl, messages, req, req.tools if req.calls_tools else None)
        return self.thinking_plan(ChatPlan(prompt, format=self.name), req)

    def thinking_plan(self, plan: ChatPlan, req: ToolRequest) -> ChatPlan:
        """Note a prompt that opens the reasoning block itself (DeepSeek R1,
        Qwen 3: ``<think>\\n`` at the end); with thinking off such a prompt
        gets the closing tag too (llama.cpp)."""
        plan.reasoning = req.reasoning_format != "none"
        if self.think and plan.prompt.rstrip().endswith(self.think[0]):
            if req.enable_thinking:
                plan.thinking_open = True
            else:
                plan.prompt += self.think[1]
        return plan

    def parse(self, text: str, partial: bool, plan: ChatPlan) -> ChatMsg:
        """``text`` (the whole answer so far) as a message."""
        msg = ChatMsg()
        rest = self.take_reasoning(text, partial, plan, msg)
        thinking, msg.tail = msg.tail, None
        if plan.parse_tools:
            self.parse_body(rest, partial, plan, msg)
        else:
            msg.content = rest
            if partial:
                msg.tail = Tail("content", 0, "text")
        if thinking is not None:  # an open reasoning block: all of the text so far
            msg.tail = thinking
        elif msg.tail is not None and rest is not text:
            # the body's tail in the whole text's places; a body still empty
            # starts where the whitespace after the reasoning ends: not yet known
            if rest and text.endswith(rest):
                msg.tail.start += len(text) - len(rest)
            else:
                msg.tail = None
        return msg

    def parse_body(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> None:
        msg.content = text

    def take_reasoning(self, text: str, partial: bool, plan: ChatPlan, msg: ChatMsg) -> str:
        """Move a leading reasoning block into ``msg.reasoning_content``;
        the text after it."""
        if not plan.reasoning or not self.think or not (self.thinking or plan.thinking_open):
            return text
        reasoning, rest = split_reasoning(text, partial, self.think[0], self.think[1],
                                          plan.thinking_open, msg)
        msg.reasoning_content = reasoning
        return rest

    def builder(self) -> GrammarBuilder:
        return GrammarBuilder()


def held_prefix(text: str, markers: tuple[str, ...] | list[str]) -> int:
    """Length of the longest end of ``text`` that begins one of ``markers``
    (and is not all of it): what a partial parse holds back."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def find_first(text: str, markers: tuple[str, ...] | list[str], start: int = 0
               ) -> tuple[int, str]:
    """``(index, marker)`` of the earliest of ``markers`` in ``text`` from
    ``start``; ``(-1, "")`` when none."""
    best, which = -1, ""
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best, which = i, m
    return best, which


def content_before(text: str, markers, partial: bool) -> tuple[str, int, str]:
    """Content up to the first marker: ``(content, marker index or -1,
    marker)``; a partial parse holds back an end that may become a marker
    (the content is then a ``text`` :class:`Tail` with these ``markers``)."""
    i, m = find_first(text, markers)
    if i >= 0:
        return text[:i], i, m
    if partial:
        return text[:len(text) - held_prefix(text, markers)], -1, ""
    return text, -1, ""


def split_reasoning(text: str, partial: bool, start: str, end: str,
                    forced_open: bool, msg: ChatMsg | None = None) -> tuple[str, str]:
    """``(reasoning, rest)``: a ``start``...``end`` block at the beginning of
    ``text`` (after whitespace), or from the beginning when the prompt
    opened it (``forced_open``). Unclosed: all of it is reasoning (with
    ``msg``, a partial parse then sets ``msg.tail``). The reasoning is
    stripped of surrounding whitespace, the rest of leading whitespace
    (llama.cpp ``try_parse_reasoning``)."""
    body = text
    if not forced_open:
        s = text.lstrip()
        if s.startswith(start):
            body = s[len(start):]
        elif partial and start.startswith(s):
            return "", ""  # may still become the opening tag
        else:
            return "", text
    i = body.find(end)
    if i >= 0:
        return body[:i].strip(), body[i + len(end):].lstrip()
    if partial:  # trailing whitespace waits: the final reasoning is stripped
        if msg is not None:
            msg.tail = Tail("reasoning_content", len(text) - len(body), "text", (end,), True)
        return body[:len(body) - held_prefix(body, (end,))].strip(), ""
    return body.strip(), ""


def regex_escape(text: str) -> str:
    """``text`` as a literal in llama.cpp's ``std::regex`` (ECMAScript)."""
    return re.sub(r"[.^$|()\[\]{}*+?\\/-]", lambda m: "\\" + m.group(), text)


def function_names(tools: list[dict]) -> list[str]:
    return [t["function"]["name"] for t in tools]
