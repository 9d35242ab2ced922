"""A model's own Jinja chat template, rendered as llama-server renders it.

:class:`JinjaTemplate` renders OpenAI chat messages (with ``tools``,
assistant ``tool_calls``, ``role: "tool"`` results, content parts) through
the template text of a GGUF (``tokenizer.chat_template``) in a ``jinja2``
sandbox (``ImmutableSandboxedEnvironment``, ``trim_blocks`` and
``lstrip_blocks``, the ``loopcontrols`` extension: what Hugging Face's
``apply_chat_template`` and llama-cpp-python use), with the globals and
filters llama.cpp's own Jinja engine gives templates: ``raise_exception``,
``strftime_now``, ``tojson`` (Python's ``json.dumps`` with HF's keyword
arguments ``indent``, ``separators``, ``sort_keys``, ``ensure_ascii``
defaulting to false), ``bos_token``/``eos_token``, ``add_generation_prompt``,
and the request's ``chat_template_kwargs`` (``enable_thinking``...) and
``reasoning_effort``.

What a template can do is found by rendering probe conversations once
(:class:`Caps`, after minja's and llama.cpp's ``caps`` checks): a system
role, tool definitions, assistant tool calls (with arguments as an object
or as a string), tool results, string or typed content. What it cannot do
is polyfilled as minja (the Jinja engine llama.cpp used until 2025) does:
the system message is merged into the next user message, tools are
described in a system message, tool calls and tool results become JSON
text of assistant and user messages.

Errors the template raises (``raise_exception``, a Jinja error) are
:class:`TemplateRefused`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from datetime import datetime

log = logging.getLogger(__name__)


class TemplateRefused(ValueError):
    """The chat template refused the messages (its ``raise_exception``, or
    a Jinja error while rendering); ``str()`` is the template's reason."""


def tojson(x, ensure_ascii: bool = False, indent=None, separators=None,
           sort_keys: bool = False) -> str:
    """The ``tojson`` filter as Hugging Face's chat templates get it
    (``transformers.utils.chat_template_utils``) and llama.cpp mirrors."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str):
    raise TemplateRefused(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(slots=True)
class Caps:
    """What a template renders (llama.cpp ``jinja::caps``), found by probing."""

    system_role: bool = True
    tools: bool = False
    tool_calls: bool = False
    tool_responses: bool = False
    object_arguments: bool = False
    string_content: bool = True
    typed_content: bool = False
    parallel_tool_calls: bool = False


_USER = {"role": "user", "content": "User message"}
_PROBE_TOOL = {"type": "function", "function": {
    "name": "probe_tool_fn", "description": "Tool description", "parameters": {
        "type": "object", "properties": {"arg": {"type": "string", "description": "d"}},
        "required": ["arg"]}}}


def _call(name: str, args) -> dict:
    return {"id": "call00001", "type": "function", "function": {"name": name, "arguments": args}}


class JinjaTemplate:
    """One Jinja chat template. ``source``: its text; ``bos``/``eos``: the
    model's BOS and EOS token texts (what ``bos_token``/``eos_token`` are in
    the template). Raises :class:`TemplateRefused` when the text does not
    compile."""

    def __init__(self, source: str, bos: str = "", eos: str = "") -> None:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(jinja2.ext.Extension):
            """HF's ``{% generation %}`` tag (marks assistant text): passed through."""

            tags = frozenset({"generation"})

            def parse(self, parser):
                parser.stream.skip(1)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        self.source = source
        self.bos = bos
        self.eos = eos
        try:
            self._tmpl = env.from_string(source)
        except jinja2.TemplateError as e:
            raise TemplateRefused(f"the chat template does not compile: {e}") from None
        self.caps = self._probe()

    # ---- rendering ----------------------------------------------------------
    def render_raw(self, messages: list[dict], tools: list[dict] | None = None,
                   add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """The template's text for exactly these inputs (no polyfills)."""
        import jinja2

        ctx = {"bos_token": self.bos, "eos_token": self.eos,
               "add_generation_prompt": add_generation_prompt, **(extra or {})}
        ctx["messages"] = messages
        if tools:
            ctx["tools"] = tools
        try:
            return self._tmpl.render(**ctx)
        except TemplateRefused:
            raise
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError,
                IndexError) as e:
            raise TemplateRefused(f"{type(e).__name__}: {e}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None,
               add_generation_prompt: bool = True, extra: dict | None = None) -> str:
        """The prompt text for OpenAI ``messages`` and ``tools``, with what the
        template lacks polyfilled (see the module docstring). ``extra``: more
        template variables (``enable_thinking``, ``reasoning_effort``...).
        Raises :class:`TemplateRefused`."""
        return self.render_raw(self.adapt(messages, tools), tools if self.caps.tools else None,
                               add_generation_prompt, extra)

    def adapt(self, messages: list[dict], tools: list[dict] | None) -> list[dict]:
        """``messages`` as this template can render them (minja's polyfills
        and llama.cpp's workarounds, in their order)."""
        caps = self.caps
        msgs = [dict(m) for m in messages]
        if "<|channel|>" not in self.source:  # harmony (GPT-OSS) has a developer role
            for m in msgs:
                if m.get("role") == "developer":
                    m["role"] = "system"
        if tools and not caps.tools:
            msgs = add_system(msgs, "You can call any of the following tools to satisfy the "
                                    "user's requests: " + json.dumps(tools, indent=2))
        out: list[dict] = []
        pending_system = ""
        for m in msgs:
            role = m.get("role")
            if m.get("tool_calls"):
                calls = m["tool_calls"]
                if not caps.tool_calls:
                    obj: dict = {"tool_calls": [
                        {"name": c["function"]["name"],
                         "arguments": _arguments_object(c["function"].get("arguments")),
                         **({"id": c["id"]} if c.get("id") else {})}
                        for c in calls if c.get("type", "function") == "function"]}
                    if m.get("content"):
                        obj["content"] = m["content"]
                    m = {"role": "assistant", "content": json.dumps(obj, indent=2)}
                else:
                    if caps.object_arguments:
                        m["tool_calls"] = [{**c, "function": {
                            **c["function"],
                            "arguments": _arguments_object(c["function"].get("arguments"))}}
                            for c in calls]
                    if m.get("content") is None:
                        m["content"] = ""  # templates that concatenate content need a string
            if role == "tool" and not caps.tool_responses:
                resp: dict = {}
                if m.get("name"):
                    resp["tool"] = m["name"]
                resp["content"] = m.get("content")
                if m.get("tool_call_id"):
                    resp["tool_call_id"] = m["tool_call_id"]
                m = {"role": "user", "content": json.dumps({"tool_response": resp}, indent=2)}
            if m.get("content") is None:
                m["content"] = ""
            if caps.typed_content and not caps.string_content and isinstance(m["content"], str):
                m["content"] = [{"type": "text", "text": m["content"]}]
            if not caps.system_role:
                if m["role"] == "system":
                    pending_system += ("\n" if pending_system else "") + _text(m["content"])
                    continue
                if m["role"] == "user" and pending_system:
                    m["content"] = pending_system + "\n" + _text(m["content"])
                    pending_system = ""
            out.append(m)
        if pending_system:
            out.append({"role": "user", "content": pending_system})
        return out

    # ---- capabilities -------------------------------------------------------
    def _try(self, messages: list[dict], tools: list[dict] | None = None) -> str | None:
        try:
            return self.render_raw(messages, tools, True)
        except TemplateRefused:
            return None
        except Exception:  # noqa: BLE001 - a probe only asks whether it renders
            return None

    def _probe(self) -> Caps:
        c = Caps()
        out = self._try([{"role": "user", "content": "STRING_MARKER"}])
        if out is None or "STRING_MARKER" not in out:
            typed = self._try([{"role": "user",
                                "content": [{"type": "text", "text": "STRING_MARKER"}]}])
            if typed is not None and "STRING_MARKER" in typed:
                c.string_content, c.typed_content = False, True
        out = self._try(self.adapt_probe([{"role": "system", "content": "SYSTEM_MARKER"},
                                          _USER], c))
        c.system_role = out is not None and "SYSTEM_MARKER" in out
        out = self._try(self.adapt_probe([_USER], c), [_PROBE_TOOL])
        c.tools = out is not None and "probe_tool_fn" in out
        for args, obj in (({"arg": "ARG_MARKER"}, True), ('{"arg": "ARG_MARKER"}', False)):
            conv = [_USER, {"role": "assistant", "content": "",
                            "tool_calls": [_call("probe_call_fn", args)]},
                    {"role": "tool", "content": "TOOL_RESULT_MARKER", "tool_call_id": "call00001"},
                    {"role": "assistant", "content": "The tool response was 'tool response'"},
                    _USER]
            out = self._try(self.adapt_probe(conv, c), [_PROBE_TOOL])
            if out is not None and "probe_call_fn" in out:
                c.tool_calls = True
                # objects rendered as objects, not as a JSON text in a string
                c.object_arguments = obj and "ARG_MARKER" in out and '\\"arg\\"' not in out
                c.tool_responses = "TOOL_RESULT_MARKER" in out
                break
        if c.tool_calls:
            two = [_USER, {"role": "assistant", "content": "", "tool_calls": [
                _call("probe_call_fn", {"arg": "a"} if c.object_arguments else '{"arg": "a"}'),
                {**_call("probe_second_fn", {"arg": "b"} if c.object_arguments else
                         '{"arg": "b"}'), "id": "call00002"}]}]
            out = self._try(self.adapt_probe(two, c), [_PROBE_TOOL])
            c.parallel_tool_calls = out is not None and "probe_second_fn" in out
        log.debug("chat template caps: %s", c)
        return c

    @staticmethod
    def adapt_probe(messages: list[dict], c: Caps) -> list[dict]:
        if c.typed_content and not c.string_content:
            return [{**m, "content": [{"type": "text", "text": m["content"]}]}
                    if isinstance(m.get("content"), str) else m for m in messages]
        return messages


def _text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content or ""


def _arguments_object(args):
    """A tool call's ``arguments`` as an object (OpenAI sends a JSON text;
    templates that iterate over them want the object). A text that is not
    JSON stays as it is."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return args if args is not None else {}


def add_system(messages: list[dict], text: str) -> list[dict]:
    """``messages`` with ``text`` appended to the first system message (after
    a blank line), or a system message holding it put first (minja's
    ``add_system``)."""
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0])
        first["content"] = _text(first.get("content")) + "\n\n" + text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
