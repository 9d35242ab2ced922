"""Chat turns to a prompt.

The engine takes tokens; this module turns OpenAI chat messages into them.
A GGUF with a Jinja ``tokenizer.chat_template`` (and no ``--chat-template``
naming another format) is rendered as llama-server renders it
(:mod:`ggmux.instance.template`), with the request's tools through the
template family's format (:mod:`ggmux.instance.tools`): :meth:`ChatTemplate.chat`.
Otherwise llama-cpp-python's own chat handlers do it, chosen as
``llama_cpp.Llama`` chooses them: the format named by ``--chat-template``
(``chatml``, ``llama-2``, ...) (:meth:`ChatTemplate.prompt`). A GGUF with
no template at all (a base model) gets llama-server's default, its ChatML
template (``CHATML_TEMPLATE_SRC`` in llama.cpp's ``common/chat.cpp``; the
GGUF's ``tool_use`` template first when it has only that), rendered on the
Jinja path exactly as llama-server renders it: no stop strings are added
(a base model often writes ``<|im_end|>`` as its very first text, which as a
stop string would make its answer empty again), so a chat request gets the
model's continuation, never the empty answer of a format it never saw.

A handler renders the prompt and then calls ``llama.create_completion``; it
is handed a stand-in (:class:`_Capture`) that tokenizes with the engine and
keeps the prompt tokens and stop strings the handler would have generated
with, instead of generating.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from .builtin_templates import builtin_names, render_builtin
from .checkpoint_hints import specialized, user_start_marker
from .template import JinjaTemplate, TemplateRefused
from .tools import ChatPlan, ToolFormat, ToolRequest, format_for
from .tools.base import regex_escape
from .validate import BadRequest

log = logging.getLogger(__name__)

# llama.cpp's CHATML_TEMPLATE_SRC (common/chat.cpp): llama-server's template
# for a GGUF that has none
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}")


class _Capture:
    """What a llama-cpp-python chat handler uses of ``Llama``: ``tokenize``,
    ``verbose`` and ``create_completion``, which records its prompt (token
    ids) and stop strings and returns an empty completion."""

    verbose = False

    def __init__(self, tokenize: Callable[[bytes, bool, bool], list[int]]) -> None:
        self._tokenize = tokenize
        self.prompt: list[int] = []
        self.stop: list[str] = []

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self._tokenize(text, add_bos, special)

    def create_completion(self, prompt, stop=None, **_kw) -> dict:
        self.prompt = list(prompt)
        self.stop = [stop] if isinstance(stop, str) else list(stop or [])
        return {"id": "capture", "object": "text_completion", "created": 0, "model": "",
                "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}}


@dataclass(slots=True)
class ChatPrompt:
    """A chat request ready for the engine: ``tokens``; ``fmt`` and
    ``plan`` (the format's prompt, grammar and parser settings);
    ``preserved`` token ids shown as text; the lazy grammar's
    ``trigger_tokens`` and ``trigger_patterns`` (full-match regexes whose
    first group is where the grammar starts, as llama.cpp's samplers take
    them)."""

    tokens: list[int]
    fmt: ToolFormat
    plan: ChatPlan
    preserved: frozenset[int] = frozenset()
    trigger_tokens: list[int] = field(default_factory=list)
    trigger_patterns: list[str] = field(default_factory=list)


def _handler_exists(cf, name: str) -> bool:
    """Whether llama-cpp-python has a chat format called ``name``."""
    try:
        cf.get_chat_completion_handler(name)
        return True
    except Exception:  # noqa: BLE001 - llama-cpp-python raises its own exception type
        return False


class ChatTemplate:
    """The chat format of one model (see the module docstring).

    ``metadata``: GGUF key -> value; ``bos``/``eos``: those tokens' texts,
    ``eos_id`` its id (-1: none); ``chat_format``: a llama-cpp-python format
    name, one of llama.cpp's built-in names (:mod:`.builtin_templates`) or
    a Jinja template's text (llama-server's ``--chat-template``), or None;
    ``tokenize(raw, add_bos, special)``: the engine's; ``source``: a Jinja
    template over the GGUF's (``--chat-template-file``); ``jinja`` False
    (``--no-jinja``): the GGUF's template as llama.cpp's built-in one it
    resembles, as llama-server renders it then. Raises ValueError for an
    unknown ``chat_format``."""

    def __init__(self, metadata: dict[str, str], bos: str, eos: str, eos_id: int,
                 chat_format: str | None,
                 tokenize: Callable[[bytes, bool, bool], list[int]],
                 source: str | None = None, jinja: bool = True) -> None:
        from llama_cpp import llama_chat_format as cf

        self._tokenize = tokenize
        # llama-server's --chat-template: a built-in name of llama.cpp's, else
        # a template's text (as --chat-template-file's, ``source``)
        self.builtin: str | None = None
        if source is None and chat_format is not None:
            if chat_format in builtin_names():
                self.builtin, chat_format = chat_format, None
            elif not _handler_exists(cf, chat_format):
                source, chat_format = chat_format, None
        if source is not None:
            metadata = {k: v for k, v in metadata.items()
                        if not k.startswith("tokenizer.chat_template")}
            metadata["tokenizer.chat_template"] = source
        if not jinja and self.builtin is None and chat_format is None:
            # --no-jinja: llama.cpp recognises the template among its own
            src = metadata.get("tokenizer.chat_template", "")
            try:
                render_builtin(src, [{"role": "user", "content": "test"}])
                self.builtin = src
            except ValueError:
                log.warning("--no-jinja: llama.cpp has no built-in template like this one; "
                            "rendering it with Jinja")
        own = {name[len("tokenizer."):]: t for name, t in metadata.items()
               if name.startswith("tokenizer.chat_template.")}
        if "tokenizer.chat_template" in metadata:
            own["chat_template.default"] = metadata["tokenizer.chat_template"]
        handlers = {name: cf.Jinja2ChatFormatter(template=t, eos_token=eos, bos_token=bos,
                                                 stop_token_ids=[eos_id] if eos_id >= 0 else None
                                                 ).to_chat_handler()
                    for name, t in own.items()}
        name = chat_format
        if self.builtin is not None:
            name = "builtin"
        elif name is None and "chat_template.default" in own:
            name = cf.guess_chat_format_from_gguf_metadata(metadata) or "chat_template.default"
        name = name or "chatml"
        self.name = name
        self.template = metadata.get("tokenizer.chat_template", "")
        self.bos = bos
        self.jinja: JinjaTemplate | None = None
        self.jinja_tools: JinjaTemplate | None = None  # tokenizer.chat_template.tool_use
        self._markers: dict[int, str] = {}  # id(template) -> its user-turn start marker
        # no template of its own: llama-server's default (see the module docstring)
        self.default = chat_format is None and not self.template and self.builtin is None
        text = self.template or (metadata.get("tokenizer.chat_template.tool_use")
                                 or CHATML_TEMPLATE if self.default else "")
        if chat_format is None and text and self.builtin is None:
            try:
                self.jinja = JinjaTemplate(text, bos, eos)
                self.name = "jinja" if self.template else "chatml (llama-server's default: " \
                                                          "the GGUF has no chat template)"
                tool_use = metadata.get("tokenizer.chat_template.tool_use")
                if tool_use:
                    self.jinja_tools = JinjaTemplate(tool_use, bos, eos)
            except TemplateRefused as e:
                log.warning("the GGUF's chat template does not compile (%s): using %s", e, name)
                self.jinja = self.jinja_tools = None
        self._handler = None
        if self.builtin is None:
            try:
                self._handler = handlers.get(name) or cf.get_chat_completion_handler(name)
            except Exception as e:  # noqa: BLE001 - llama-cpp-python raises its own type
                raise ValueError(f"unknown chat template {name!r}: {e}") from None
        log.info("chat format: %s", self.name if self.builtin is None
                 else f"llama.cpp's built-in {self.builtin[:40]!r}")

    def prompt(self, messages: list[dict], tool: dict | None = None,
               prefill: str | None = None,
               tokenize: Callable[[str, bool], list[int]] | None = None
               ) -> tuple[list[int], list[str]]:
        """``(prompt tokens, stop strings)`` for checked ``messages``
        (:func:`~ggmux.instance.validate.chat_messages`); ``tool``
        (``{"name", "parameters"}``) is offered to the template as the one
        forced tool; ``prefill``: text after the generation prompt (a
        built-in template's; :mod:`.prefill`). Raises BadRequest when the
        template refuses the messages (a Jinja ``raise_exception``, a role
        it does not know). ``tokenize(text, add_bos)``: the prompt's own
        tokenizer (a prompt with media markers: the projector's), for a
        built-in template; a chat handler takes text only."""
        from jinja2 import TemplateError

        if self.builtin is not None:
            text = render_builtin(self.builtin, messages) + (prefill or "")
            if tokenize is not None:
                return tokenize(text, True), []
            return self._tokenize(text.encode("utf-8"), True, True), []
        if tokenize is not None:
            raise BadRequest(f"images and audio need a Jinja chat template; the chat format "
                             f"{self.name!r} takes text only", "messages")

        cap = _Capture(self._tokenize)
        kw = {}
        if tool is not None:
            kw["tools"] = [{"type": "function", "function": tool}]
        try:
            self._handler(llama=cap, messages=messages, **kw)
        except (TemplateError, ValueError, TypeError, KeyError) as e:
            raise BadRequest(f"messages: the model's chat template refused them: {e}",
                             "messages") from None
        return cap.prompt, cap.stop

    # ---- the Jinja path -----------------------------------------------------
    def render(self, messages: list[dict], req: ToolRequest,
               prefill: str | None = None) -> tuple[ToolFormat, ChatPlan]:
        """The format and plan (its rendered prompt text) for checked
        ``messages`` (:func:`~ggmux.instance.messages.chat_messages`) and
        ``req``, through the GGUF's ``tool_use`` template when it has one and
        the request gives tools; needs :attr:`jinja`. Raises BadRequest when the template
        refuses the messages."""
        assert self.jinja is not None
        # a GGUF's tool_use template serves requests with tools (llama.cpp)
        tmpl = self.jinja_tools if req.tools and self.jinja_tools else self.jinja
        fmt = format_for(tmpl.source, req.calls_tools, req.json_schema is not None)
        if prefill is not None:  # the messages before it, then the assistant's turn
            req.add_generation_prompt = True
        try:
            plan = fmt.plan(tmpl, messages, req)
        except TemplateRefused as e:
            raise BadRequest(f"messages: the model's chat template refused them: {e}",
                             "messages") from None
        if prefill is not None:
            plan.prompt += prefill
        return fmt, plan

    def user_marker(self, tools: bool) -> str:
        """The user turn's start marker that llama-server's template analyser
        finds in the template that renders a request (with ``tools``, the
        GGUF's ``tool_use`` template when it has one;
        :func:`~.checkpoint_hints.user_start_marker`), "" for a template
        llama-server parses with its own code (it finds no message spans
        then) or one the probe cannot render. Cached per template."""
        tmpl = self.jinja_tools if tools and self.jinja_tools else self.jinja
        if tmpl is None:
            return ""
        key = id(tmpl)
        if key not in self._markers:
            self._markers[key] = "" if specialized(tmpl.source) else user_start_marker(
                lambda ms: tmpl.render(ms, None, False, {"enable_thinking": True}))
        return self._markers[key]

    def chat(self, messages: list[dict], req: ToolRequest,
             prefill: str | None = None,
             tokenize: Callable[[str, bool], list[int]] | None = None) -> ChatPrompt:
        """:meth:`render`, tokenized: the prompt (no second BOS when the
        template wrote one), preserved tokens and lazy-grammar triggers
        (a trigger word that is one token is a trigger token, as
        llama-server does). ``tokenize(text, add_bos)``: the prompt's own
        tokenizer (a prompt with media markers: the projector's)."""
        fmt, plan = self.render(messages, req, prefill)
        text = plan.prompt
        add_bos = not (self.bos and text.startswith(self.bos))
        if tokenize is not None:
            tokens = tokenize(text, add_bos)
        else:
            tokens = self._tokenize(text.encode("utf-8"), add_bos, True)
        preserved = set()
        for t in plan.preserved:
            ids = self._tokenize(t.encode("utf-8"), False, True)
            if len(ids) == 1:
                preserved.add(ids[0])
        cp = ChatPrompt(tokens, fmt, plan, frozenset(preserved))
        for word in plan.trigger_words:
            ids = self._tokenize(word.encode("utf-8"), False, True)
            if len(ids) == 1 and ids[0] in preserved:
                cp.trigger_tokens.append(ids[0])
            else:
                cp.trigger_patterns.append(f"^[\\s\\S]*?({regex_escape(word)})[\\s\\S]*$")
        for p in plan.trigger_patterns:
            cp.trigger_patterns.append(p if p.startswith("^") and p.endswith("$") else
                                       f"^[\\s\\S]*?({p})[\\s\\S]*$")
        return cp
