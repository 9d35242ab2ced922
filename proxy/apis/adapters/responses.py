"""OpenAI Responses API (``POST /v1/responses``) on a chat-completion replica.

Request (OpenAI's Responses reference): ``model``, ``input`` (a string, or
items), ``instructions`` (the system message), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_object``, ``json_schema``), ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``reasoning.effort``, and ``previous_response_id``,
``prompt_cache_key`` or ``user`` as the session key. Input items:

* ``message`` (``type`` optional; ``developer`` is a system message;
  content a string or ``input_text``/``output_text``/``refusal`` parts,
  ``input_image`` becomes an ``image_url`` part);
* ``function_call`` (``call_id``, ``name``, ``arguments``) joins the
  assistant message before it as one of its ``tool_calls``;
  ``function_call_output`` (``call_id``, ``output``) is a ``role: "tool"``
  message (one with no ``call_id`` but a ``name``, Codex's context output
  ``agent.goal_objective``, a user message ``[agent.goal_objective] TEXT``);
  ``custom_tool_call`` / ``custom_tool_call_output`` the same, the
  free-form ``input`` carried as ``{"input": ...}``;
* ``reasoning`` items become the next assistant message's
  ``reasoning_content`` (their ``content`` text, else their summary).

Tools: ``function`` tools as they are; ``custom`` (free-form) tools as a
function of one string ``input``, their calls answered as
``custom_tool_call`` items; a ``namespace`` (Codex's grouping) adds its
functions, their calls answered with that ``namespace`` (when two
namespaces, or a namespace and a plain tool, have a function of one name,
the model sees ``NAMESPACE__NAME`` for each namespaced one and its calls
come back under the client's namespace and name: issue 31 item 6).
Hosted (built-in) tools (``web_search``, ``file_search``,
``computer_use_preview``, ``code_interpreter``, ``image_generation``,
``mcp``, ``local_shell``, ...), which nothing here runs, are left out of
what the model sees (the answer's ``x-ggmux-dropped-tools`` header and a
log line name them: Codex's default config offers ``web_search``); a
``tool_choice`` that forces one, or ``required`` with only those, is
refused with 400 (issue 31 item 13). ``tool_choice``: ``auto``,
``none``, ``required``, ``{"type": "function", "name"}`` (and
``namespace``), ``{"type": "allowed_tools", "mode"}`` (its mode).

ggmux stores no responses: ``previous_response_id`` only keeps the
conversation on one replica (its history is not restored), and what needs
stored state (``background``, ``conversation``, ``item_reference`` items,
retrieving a response) is refused with a 400 that says so.

Answer: a ``response`` object (``status`` ``completed``, or ``incomplete``
with ``incomplete_details.reason: max_output_tokens``) whose ``output`` is a
``reasoning`` item (from ``reasoning_content``), a ``message`` and one
``function_call`` item per tool call; streamed, :mod:`.responses_stream`.
Errors use OpenAI's envelope.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import orjson

from .common import (
    Adapter,
    BadRequest,
    StreamState,
    Translated,
    Usage,
    integer,
    new_id,
    now_s,
    number,
    stream_flag,
)
from .openai import error_body
from .responses_stream import ResponsesStream, output_items, response_object, usage_object
from .tools import content, function_tool, image_part, named_choice, reply

NOT_STORED = ("ggmux stores no responses (no server-side state): {what} is not available; "
              "send the whole conversation as 'input' instead")

# the one parameter of a custom (free-form) tool's function
CUSTOM_INPUT = {"type": "object", "properties": {"input": {"type": "string"}},
                "required": ["input"]}


def _parts(c, where: str) -> list[dict]:
    """Message content as OpenAI chat parts (text and ``image_url``)."""
    if isinstance(c, str):
        return [{"type": "text", "text": c}]
    if not isinstance(c, list):
        raise BadRequest(f"{where}: content must be a string or a list of parts")
    out = []
    for j, p in enumerate(c):
        kind = p.get("type") if isinstance(p, dict) else type(p).__name__
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = p.get("refusal") if kind == "refusal" else p.get("text")
            if not isinstance(text, str):
                raise BadRequest(f"{where}.{j}: a text part needs a string 'text'")
            out.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = p.get("image_url")
            if not isinstance(url, str):
                raise BadRequest(f"{where}.{j}: an input_image needs an 'image_url' (a URL or "
                                 "a data: URL); file_id needs OpenAI's Files API")
            out.append(image_part(url))
        else:
            raise BadRequest(f"{where}.{j}: content parts of type {kind!r} are not supported")
    return out


def _output_text(output, where: str) -> str:
    """A tool output (a string or text parts) as the tool message's text."""
    if isinstance(output, str):
        return output
    parts = _parts(output, where)
    if any(p["type"] != "text" for p in parts):
        raise BadRequest(f"{where}: a tool output may hold text only")
    return "".join(p["text"] for p in parts)


def _call_id(item: dict, where: str) -> str:
    cid = item.get("call_id")
    if not isinstance(cid, str) or not cid:
        raise BadRequest(f"{where}: needs a string 'call_id'")
    return cid


def _reasoning_text(item: dict, where: str) -> str:
    """A ``reasoning`` input item's text: its ``content`` parts' text, else
    its ``summary``'s (each a list of ``{"type", "text"}`` parts, or null);
    raises :class:`BadRequest` naming the field for any other type (issue 31
    item 5: a ``content`` of 5 got orjson's message about deep nesting)."""
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is not None and not isinstance(parts, list):
            raise BadRequest(f"{where}.{key} must be a list of parts, not "
                             f"{type(parts).__name__}")
    texts = [p.get("text") for p in item.get("content") or item.get("summary") or ()
             if isinstance(p, dict) and isinstance(p.get("text"), str)]
    return "".join(texts)


def _model_name(names: dict, item: dict, name: str) -> str:
    """The name the model knows a call's function by (:class:`ChatTools`'
    ``names``; ``item``'s ``namespace`` picks among namespaces)."""
    ns = item.get("namespace")
    seen = names.get((ns if isinstance(ns, str) and ns else None, name))
    if seen is None:
        found = [v for k, v in names.items() if k[1] == name]
        seen = found[0] if len(found) == 1 else name
    return seen


def chat_messages(body: dict, names: dict | None = None) -> list[dict]:
    """``instructions`` + ``input`` as chat-completion messages (module
    docstring); ``names`` maps a call's (namespace, name) to the name the
    model sees (:class:`ChatTools`). Raises :class:`BadRequest`."""
    names = names or {}
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise BadRequest("'instructions' must be a string")
        out.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        out.append({"role": "user", "content": inp})
        return out
    if not isinstance(inp, list) or not inp:
        raise BadRequest("'input' must be a string or a non-empty list of items")
    reasoning: list[str] = []

    def assistant() -> dict:
        """The assistant message the next call joins (a new one after
        anything else)."""
        last = out[-1] if out else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            out.append(last)
        if reasoning:
            last["reasoning_content"] = "".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(inp):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise BadRequest(f"{where}: must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise BadRequest(f"{where}.role: must be user, assistant, system or developer")
            c = content(_parts(item.get("content"), where))
            if role == "assistant":
                msg = {"role": "assistant", "content": c}
                out.append(msg)
                if reasoning:
                    msg["reasoning_content"] = "".join(reasoning)
                    reasoning.clear()
            else:
                out.append({"role": "system" if role == "developer" else role, "content": c})
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            if not isinstance(name, str) or not name:
                raise BadRequest(f"{where}: needs a string 'name'")
            if kind == "function_call":
                args = item.get("arguments")
                if not isinstance(args, str):
                    raise BadRequest(f"{where}.arguments must be a string of JSON")
            else:
                if not isinstance(item.get("input"), str):
                    raise BadRequest(f"{where}.input must be a string")
                args = orjson.dumps({"input": item["input"]}).decode()
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": _call_id(item, where), "type": "function",
                 "function": {"name": _model_name(names, item, name), "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            text = _output_text(item.get("output", ""), f"{where}.output")
            if item.get("call_id") is None and isinstance(item.get("name"), str):
                # Codex's context outputs (``agent.goal_objective``): named, of no
                # call; text for the model, as a user turn (a tool turn needs its call)
                ns = item.get("namespace")
                label = f"{ns}.{item['name']}" if isinstance(ns, str) and ns else item["name"]
                out.append({"role": "user", "content": f"[{label}] {text}"})
            else:
                out.append({"role": "tool", "tool_call_id": _call_id(item, where),
                            "content": text})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind == "item_reference":
            raise BadRequest(NOT_STORED.format(what="an item_reference input item"))
        else:
            raise BadRequest(f"{where}: items of type {kind!r} are not supported (ggmux "
                             "translates messages, function and custom tool calls and their "
                             "outputs, and reasoning)")
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")

NAMESPACE_SEP = "__"
"""Between a namespace and its function's name in the name the model sees
when two namespaces (or a namespace and a plain tool) hold functions of
one name (issue 31 item 6): ``fs`` + ``read`` -> ``fs__read``."""


def hosted_tool_name(t: dict) -> str:
    """What a hosted (built-in) tool is called in logs and the
    ``x-ggmux-dropped-tools`` header: its ``type`` (``web_search``), or
    ``mcp:LABEL`` for an MCP server."""
    kind = str(t.get("type"))
    label = t.get("server_label")
    name = f"{kind}:{label}" if kind == "mcp" and isinstance(label, str) else kind
    return _UNSAFE.sub("_", name)[:64]  # it goes into a header and a log line


@dataclass(slots=True)
class ChatTools:
    """A Responses request's ``tools`` as the model sees them: ``tools``
    (OpenAI function tools), ``kinds`` (model-facing function name -> how
    its calls are answered: ``{"custom": True}`` for a free-form tool,
    ``{"namespace": N}`` for a function of a namespace, plus ``"name"``, the
    client's name, when the model sees another: :data:`NAMESPACE_SEP`),
    ``names`` ((namespace or None, client's name) -> model-facing name),
    ``hosted`` the hosted tools offered (``web_search``, ...: nothing here
    runs them), ``hosted_names`` theirs (:func:`hosted_tool_name`)."""

    tools: list[dict] = field(default_factory=list)
    kinds: dict[str, dict] = field(default_factory=dict)
    names: dict[tuple[str | None, str], str] = field(default_factory=dict)
    hosted: list[dict] = field(default_factory=list)
    hosted_names: list[str] = field(default_factory=list)


def chat_tools(tools) -> ChatTools:
    """``tools`` -> :class:`ChatTools`. A function of a namespace keeps its
    name unless another namespace, or a plain tool, has a function of that
    name: then each namespaced one is ``NAMESPACE__NAME`` toward the model
    and its calls come back under its namespace and name (issue 31 item 6:
    both came back labelled with the last namespace). Hosted tools are set
    apart (``hosted``; :func:`to_chat` leaves them out or refuses). Raises
    :class:`BadRequest` for a malformed tool, a name given twice in one
    namespace, or a qualified name that is taken."""
    ct = ChatTools()
    if tools is None:
        return ct
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    funcs: list[tuple[dict, str | None, str]] = []  # (tool, namespace, where)

    def add(t, where: str, namespace: str | None = None) -> None:
        if not isinstance(t, dict):
            raise BadRequest(f"{where}: must be an object")
        kind = t.get("type")
        if kind == "function" or (kind == "custom" and namespace is None):
            funcs.append((t, namespace, where))
        elif kind == "namespace" and namespace is None:
            name = t.get("name")
            if not isinstance(name, str) or not name or not isinstance(t.get("tools"), list):
                raise BadRequest(f"{where}: a namespace needs a 'name' and a list of 'tools'")
            for j, inner in enumerate(t["tools"]):
                add(inner, f"{where}.tools.{j}", name)
        elif namespace is None and isinstance(kind, str) and kind:
            ct.hosted.append(t)
            ct.hosted_names.append(hosted_tool_name(t))
        else:
            raise BadRequest(f"{where}: a tool of type {kind!r} is not supported here (a "
                             "namespace holds function tools)")

    for i, t in enumerate(tools):
        add(t, f"tools.{i}")
    owners: dict[str, list[str | None]] = {}  # client's name -> the namespaces holding it
    for t, ns, where in funcs:
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise BadRequest(f"{where}: a tool needs a non-empty string 'name'")
        if ns in owners.get(name, ()):
            raise BadRequest(f"{where}: {name!r} is given twice" + (
                f" in namespace {ns!r}" if ns else ""))
        owners.setdefault(name, []).append(ns)
    taken = {t["name"] for t, ns, _ in funcs if ns is None}
    for t, ns, where in funcs:
        name = t["name"]
        seen = name
        if ns is not None and len(owners[name]) > 1:
            seen = ns.rstrip("_") + NAMESPACE_SEP + name
            if seen in taken or seen in owners:
                both = " and ".join(repr(x) for x in owners[name] if x)
                raise BadRequest(f"{where}: namespaces {both} each have a function {name!r}, "
                                 f"and {seen!r}, the name ggmux would give this one, is "
                                 "taken: rename one")
            taken.add(seen)
        ct.names[(ns, name)] = seen
        if t.get("type") == "custom":
            ct.tools.append(function_tool(seen, t.get("description"), CUSTOM_INPUT, where))
            ct.kinds[seen] = {"custom": True}
            continue
        ct.tools.append(function_tool(seen, t.get("description"), t.get("parameters"), where))
        if ns is not None:
            ct.kinds[seen] = {"namespace": ns} if seen == name else {"namespace": ns,
                                                                     "name": name}
    return ct


def _tool_choice(tc, ct: ChatTools):
    """``tool_choice`` in chat form; raises :class:`BadRequest`, also for a
    choice that forces a hosted tool (nothing here runs one)."""
    if tc is None:
        return None
    if tc in ("auto", "none", "required"):
        return tc
    kind = tc.get("type") if isinstance(tc, dict) else None
    if kind in ("function", "custom"):
        name, ns = tc.get("name"), tc.get("namespace")
        if isinstance(name, str):
            key = (ns if isinstance(ns, str) else None, name)
            if key not in ct.names:  # a namespaced function named without its namespace
                found = [(k[0], v) for k, v in ct.names.items() if k[1] == name]
                if len(found) > 1:
                    raise BadRequest(f"'tool_choice' names {name!r}, which namespaces "
                                     + " and ".join(repr(n) for n, _ in found if n)
                                     + " each have: give its 'namespace' too")
                name = found[0][1] if found else name
            else:
                name = ct.names[key]
        return named_choice(name, "tool_choice")
    if kind == "allowed_tools" and tc.get("mode") in ("auto", "required"):
        return tc["mode"]
    if isinstance(kind, str) and kind:
        raise BadRequest(f"'tool_choice' forces {kind!r}, one of OpenAI's hosted tools, which "
                         "ggmux cannot run (offered with tool_choice auto it is left out)")
    raise BadRequest("'tool_choice' must be auto, none, required or {\"type\": \"function\", "
                     "\"name\": ...}")


def _response_format(text) -> dict | None:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest(f"'text' must be an object, not {type(text).__name__}")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise BadRequest("'text.format.schema' must be a JSON schema object")
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise BadRequest("'text.format.type' must be text, json_object or json_schema")


def to_chat(body: dict) -> Translated:
    """A Responses request -> a chat-completion request; raises
    :class:`BadRequest` (module docstring)."""
    if body.get("background"):
        raise BadRequest(NOT_STORED.format(what="'background' (it needs the stored response)"))
    if body.get("conversation") is not None:
        raise BadRequest(NOT_STORED.format(what="'conversation'"))
    stream = stream_flag(body)
    ct = chat_tools(body.get("tools"))
    messages = chat_messages(body, ct.names)
    chat: dict = {"model": body.get("model"), "messages": messages, "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}
        for key in ("return_progress", "timings_per_token"):  # llama-server's telemetry
            if body.get(key) is True:
                chat[key] = True
    mt = integer(body, "max_output_tokens", 1)
    if mt is not None:
        chat["max_tokens"] = mt
    for key, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1)):
        v = number(body, key, lo, hi)
        if v is not None:
            chat[key] = v
    rf = _response_format(body.get("text"))
    if rf is not None:
        chat["response_format"] = rf
    tc = _tool_choice(body.get("tool_choice"), ct)
    if ct.hosted and not ct.tools and tc == "required":
        raise BadRequest(f"'tool_choice' requires a tool, and the only ones offered "
                         f"({', '.join(ct.hosted_names)}) are OpenAI's hosted tools, which "
                         "ggmux cannot run")
    if ct.tools:
        chat["tools"] = ct.tools
        if tc is not None:
            chat["tool_choice"] = tc
        ptc = body.get("parallel_tool_calls")
        if ptc is not None:
            if not isinstance(ptc, bool):
                raise BadRequest("'parallel_tool_calls' must be a boolean")
            chat["parallel_tool_calls"] = ptc
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise BadRequest(f"'reasoning' must be an object, not {type(reasoning).__name__}")
    if isinstance(reasoning, dict) and reasoning.get("effort") in ("low", "medium", "high"):
        chat["reasoning_effort"] = reasoning["effort"]
    session = None
    for key in ("previous_response_id", "prompt_cache_key", "user"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise BadRequest(f"'{key}' must be a string")
            session = session or v
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "previous_response_id",
                                     "temperature", "top_p", "metadata", "tools", "tool_choice",
                                     "parallel_tool_calls", "text")}
    echo["kinds"] = ct.kinds
    # prompt_progress on response.in_progress only when the client asked (the
    # proxy asks the built-in instance itself: its acceptance opens the stream)
    echo["progress"] = body.get("return_progress") is True
    return Translated(b"/v1/chat/completions", chat, stream, session, echo=echo,
                      images=any(isinstance(m.get("content"), list) for m in messages),
                      dropped=ct.hosted_names)


def from_chat(obj: dict, req: Translated) -> dict:
    """A chat completion -> a ``response`` object for the translated request ``req``."""
    r = reply(obj)
    usage = Usage()
    usage.take(obj.get("usage"))
    # a message cut at max_output_tokens is incomplete too, as OpenAI marks it
    status = "incomplete" if r.finish == "length" else "completed"
    created = obj.get("created") if isinstance(obj.get("created"), int) else now_s()
    output = output_items(r.reasoning, r.text, r.calls, req.echo.get("kinds") or {}, status)
    return response_object(new_id("resp_"), created, req, status, output,
                           usage_object(usage), r.finish)


class Responses(Adapter):
    """``POST /v1/responses``."""

    name = "responses"

    def request(self, body: dict) -> Translated:
        return to_chat(body)

    def response(self, obj: dict, req: Translated) -> dict:
        return from_chat(obj, req)

    def stream(self, req: Translated) -> StreamState:
        return ResponsesStream(req)

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        return b"application/json", error_body(status, message)
