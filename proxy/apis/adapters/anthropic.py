"""Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
on a chat-completion replica.

Request (Anthropic's Messages reference): ``model``, ``max_tokens``
(required), ``messages`` (``user``/``assistant``, content a string or
blocks), ``system`` (string or text blocks), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata.user_id`` (the
session key), ``tools``, ``tool_choice``, ``thinking``. Blocks:

* ``text``; ``image`` (base64 or URL source) becomes an ``image_url`` part
  (refused with 400 by the proxy for a model without a projector);
* ``tool_use`` (assistant) becomes the assistant message's ``tool_calls``
  (``input`` as JSON text), ``tool_result`` (user) a ``role: "tool"``
  message with ``tool_call_id`` (string or block content; ``is_error``
  prefixes the text with ``Error:``), placed before the user's other
  content, as the chat API wants the results right after the calls;
* ``thinking`` (assistant) becomes the message's ``reasoning_content``,
  which templates that know reasoning render (llama-server's own
  translation does the same); ``redacted_thinking`` is dropped;
* a ``system`` message inside ``messages`` (Claude Code's
  mid-conversation system prompt) stays a system message in its place;
* ``cache_control`` on any block or tool is ignored (the replica's prompt
  cache is automatic); ``document``, ``search_result`` and the server-tool
  blocks are refused with 400.

``tools`` (``name``, ``description``, ``input_schema``) become function
tools; a tool with a ``type`` other than ``custom`` (Anthropic's server and
built-in tools: ``web_search_*``, ``code_execution_*``, ``bash_*``,
``text_editor_*``, ...) is left out of what the model sees (nothing here
runs them; the answer's ``x-ggmux-dropped-tools`` header and a log line
name it), and a ``tool_choice`` that forces one is refused with 400
(issue 31 item 13).
``tool_choice``: ``auto`` -> ``"auto"``, ``any`` -> ``"required"``,
``tool`` -> that function, ``none`` -> ``"none"``;
``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``.
``thinking`` (``enabled``/``adaptive``/``disabled``) becomes
``chat_template_kwargs.enable_thinking`` (Qwen 3's and others' switch),
``output_config.effort`` (``low``/``medium``/``high``) ``reasoning_effort``;
``chat_template_kwargs`` is passed on, as llama-server takes it. Claude
Code's ``x-anthropic-billing-header`` system text has its per-request
``cch=`` stamp made constant, as llama-server does, so the prompt cache
gets past it. Other fields (``context_management``, ``service_tier``, ...)
are ignored.

Answer: a ``message`` whose content is a ``thinking`` block (from the
replica's ``reasoning_content``), a ``text`` block, then one ``tool_use``
block per tool call (``stop_reason: "tool_use"``); streamed, Anthropic's
event sequence (:mod:`.anthropic_stream`). Errors as ``{"type": "error",
"error": {"type", "message"}}``, in a stream as an ``error`` event. Split
after LiteLLM's Anthropic adapter: these pure functions plus the stream
state object.
"""

from __future__ import annotations

import re

import orjson

from .anthropic_stream import STOP_REASONS, MessagesStream, error_body, stop_reason, usage_object
from .common import (
    Adapter,
    BadReply,
    BadRequest,
    StreamState,
    Translated,
    Usage,
    integer,
    new_id,
    number,
    stream_flag,
    string_list,
)
from .tools import (
    arguments_object,
    content,
    cut_by_limit,
    function_tool,
    image_part,
    named_choice,
    reply,
)

__all__ = ["STOP_REASONS", "CountTokens", "Messages", "MessagesStream", "error_body",
           "from_chat", "to_chat"]

# blocks the Messages API has that no chat template can take
_UNSUPPORTED_BLOCKS = {
    "document": "documents (PDF, text files) are not supported: send their text as a text block",
    "search_result": "search_result blocks are not supported: send their text as a text block",
    "server_tool_use": "server tool blocks are not supported (ggmux runs no server tools)",
    "web_search_tool_result": "server tool blocks are not supported (ggmux runs no server "
                              "tools)",
    "container_upload": "container_upload blocks are not supported (ggmux has no code "
                        "execution container)",
}


def _text_block(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise BadRequest(f"{where}: a text block needs a string 'text'")
    return block["text"]


def _image(block: dict, where: str) -> dict:
    """An ``image`` block as an ``image_url`` part (base64 -> ``data:`` URL)."""
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64" and isinstance(src.get("data"), str):
        media = src.get("media_type") if isinstance(src.get("media_type"), str) else "image/png"
        return image_part(f"data:{media};base64,{src['data']}")
    if kind == "url" and isinstance(src.get("url"), str):
        return image_part(src["url"])
    raise BadRequest(f"{where}: an image block needs a 'source' of type base64 (with "
                     "'data') or url (with 'url'); file sources need Anthropic's Files API")


def _blocks(content, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict):
            raise BadRequest(f"{where}.content.{j}: each content block must be an object")
    return content


def _unsupported(kind, where: str) -> BadRequest:
    why = _UNSUPPORTED_BLOCKS.get(kind) if isinstance(kind, str) else None
    return BadRequest(f"{where}: {why or f'content blocks of type {kind!r} are not supported'}")


_BILLING = "x-anthropic-billing-header:"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.:-]")  # of a name that goes into a header
_CCH = re.compile(r"cch=[0-9a-zA-Z]{5};")


def _system_text(system, where: str) -> str:
    parts = []
    for j, block in enumerate(_blocks(system, where)):
        if block.get("type") != "text":
            raise BadRequest(f"{where}.{j}: only text blocks may form a system prompt")
        text = _text_block(block, f"{where}.{j}")
        if text.startswith(_BILLING):  # a stamp that changes every request
            text = _CCH.sub("cch=fffff;", text, count=1)
        parts.append(text)
    return "".join(parts)


def _tool_result(block: dict, where: str) -> tuple[dict, list[dict]]:
    """A ``tool_result`` block -> ``(role "tool" message, image parts)``."""
    tid = block.get("tool_use_id")
    if not isinstance(tid, str) or not tid:
        raise BadRequest(f"{where}: a tool_result block needs its 'tool_use_id'")
    texts, images = [], []
    c = block.get("content")
    if c is not None:
        for j, b in enumerate(_blocks(c, where)):
            kind = b.get("type")
            if kind == "text":
                texts.append(_text_block(b, f"{where}.content.{j}"))
            elif kind == "image":
                images.append(_image(b, f"{where}.content.{j}"))
            else:
                raise _unsupported(kind, f"{where}.content.{j}")
    text = "\n".join(texts)
    if block.get("is_error") is True:
        text = "Error: " + text if text else "Error"
    return {"role": "tool", "tool_call_id": tid, "content": text}, images


def _user(m: dict, where: str) -> list[dict]:
    """A user message: its tool results first (``role: "tool"``), then
    what it says (text and images, the tool results' images included)."""
    results, parts = [], []
    for j, block in enumerate(_blocks(m.get("content"), where)):
        kind, here = block.get("type"), f"{where}.content.{j}"
        if kind == "text":
            parts.append({"type": "text", "text": _text_block(block, here)})
        elif kind == "image":
            parts.append(_image(block, here))
        elif kind == "tool_result":
            msg, images = _tool_result(block, here)
            results.append(msg)
            parts += images
        else:
            raise _unsupported(kind, here)
    if parts or not results:
        results.append({"role": "user", "content": content(parts)})
    return results


def _assistant(m: dict, where: str) -> dict:
    """An assistant message: its text, its ``tool_use`` blocks as
    ``tool_calls`` and its thinking as ``reasoning_content``."""
    texts, calls, thinking = [], [], []
    for j, block in enumerate(_blocks(m.get("content"), where)):
        kind, here = block.get("type"), f"{where}.content.{j}"
        if kind == "text":
            texts.append(_text_block(block, here))
        elif kind == "tool_use":
            name, tid, inp = block.get("name"), block.get("id"), block.get("input")
            if not isinstance(name, str) or not isinstance(tid, str):
                raise BadRequest(f"{here}: a tool_use block needs a string 'id' and 'name'")
            if inp is not None and not isinstance(inp, dict):
                raise BadRequest(f"{here}: a tool_use block's 'input' must be an object")
            calls.append({"id": tid, "type": "function", "function": {
                "name": name, "arguments": orjson.dumps(inp or {}).decode()}})
        elif kind == "thinking":
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "redacted_thinking":
            continue
        else:
            raise _unsupported(kind, here)
    # "" rather than null beside tool_calls: every template renders it
    msg: dict = {"role": "assistant", "content": "".join(texts)}
    if calls:
        msg["tool_calls"] = calls
    if thinking:
        msg["reasoning_content"] = "".join(thinking)
    return msg


def chat_messages(body: dict) -> list[dict]:
    """``system`` + ``messages`` as chat-completion messages (module
    docstring); raises :class:`BadRequest` for anything the Messages API
    itself refuses or that has no chat form."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _system_text(system, "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages.{i}: must be an object")
        role = m.get("role")
        if role == "user":
            out += _user(m, f"messages.{i}")
        elif role == "assistant":
            out.append(_assistant(m, f"messages.{i}"))
        elif role == "system":
            out.append({"role": "system", "content": _system_text(m.get("content"),
                                                                  f"messages.{i}")})
        else:
            raise BadRequest(f"messages.{i}.role: must be 'user', 'assistant' or 'system'")
    return out


def hosted_tools(body: dict) -> list[str]:
    """The names of the server and built-in tools ``tools`` offers (a
    ``type`` other than ``custom``: ``web_search_20250305``, ...), which
    nothing here runs: left out of what the model sees (issue 31 item 13)."""
    tools = body.get("tools")
    if not isinstance(tools, list):
        return []
    return [_UNSAFE.sub("_", str(t.get("name") or t.get("type")))[:64] for t in tools
            if isinstance(t, dict) and t.get("type") not in (None, "custom")]


def chat_tools(body: dict) -> list[dict]:
    """``tools`` as OpenAI function tools, server and built-in tools left
    out (:func:`hosted_tools`; :func:`_tool_choice` refuses a choice that
    forces one)."""
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise BadRequest(f"tools.{i}: must be an object")
        kind = t.get("type")
        if kind not in (None, "custom"):
            continue
        if "input_schema" not in t:
            raise BadRequest(f"tools.{i}: a tool needs an 'input_schema'")
        out.append(function_tool(t.get("name"), t.get("description"), t["input_schema"],
                                 f"tools.{i}"))
    return out


def _tool_choice(body: dict, chat: dict) -> None:
    tc = body.get("tool_choice")
    if tc is None:
        return
    if not isinstance(tc, dict):
        raise BadRequest("'tool_choice' must be an object such as {\"type\": \"auto\"}")
    kind = tc.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise BadRequest("'tool_choice.type' must be auto, any, tool or none")
    hosted = hosted_tools(body)
    if kind == "tool" and tc.get("name") in hosted:
        raise BadRequest(f"'tool_choice' forces {tc.get('name')!r}, one of Anthropic's server "
                         "or built-in tools, which ggmux cannot run (offered with tool_choice "
                         "auto it is left out)")
    if not chat.get("tools"):
        if kind in ("any", "tool"):
            raise BadRequest(f"'tool_choice' {kind!r} needs 'tools'" + (
                f" that ggmux can run (not only {', '.join(hosted)})" if hosted else ""))
        return  # auto or none of no tools: nothing to say to the replica
    chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or (
        named_choice(tc.get("name"), "tool_choice"))
    dp = tc.get("disable_parallel_tool_use")
    if dp is not None:
        if not isinstance(dp, bool):
            raise BadRequest("'tool_choice.disable_parallel_tool_use' must be a boolean")
        if dp and chat.get("tools"):
            chat["parallel_tool_calls"] = False


def _thinking(body: dict, chat: dict) -> None:
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise BadRequest("'chat_template_kwargs' must be an object")
    kwargs = dict(kwargs or {})
    th = body.get("thinking")
    if th is not None:
        kind = th.get("type") if isinstance(th, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise BadRequest("'thinking.type' must be enabled, adaptive or disabled")
        kwargs.setdefault("enable_thinking", kind != "disabled")
    if kwargs:
        chat["chat_template_kwargs"] = kwargs
    oc = body.get("output_config")
    effort = oc.get("effort") if isinstance(oc, dict) else None
    if effort in ("low", "medium", "high"):
        chat["reasoning_effort"] = effort


def _session(body: dict) -> str | None:
    meta = body.get("metadata")
    if meta is None:
        return None
    if not isinstance(meta, dict):
        raise BadRequest("'metadata' must be an object")
    uid = meta.get("user_id")
    if uid is not None and not isinstance(uid, str):
        raise BadRequest("'metadata.user_id' must be a string")
    return uid


def _has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) for m in messages)


def to_chat(body: dict) -> Translated:
    """A Messages request -> a chat-completion request (see the module
    docstring for what maps); raises :class:`BadRequest`."""
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required")
    if body.get("mcp_servers"):
        raise BadRequest("'mcp_servers' (Anthropic's MCP connector) is not supported: ggmux "
                         "connects to no MCP server; run the tools in the client")
    stream = stream_flag(body)
    messages = chat_messages(body)
    chat: dict = {"model": body.get("model"), "messages": messages,
                  "max_tokens": max_tokens, "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}
    for key, lo, hi in (("temperature", 0, 2), ("top_p", 0, 1)):
        v = number(body, key, lo, hi)
        if v is not None:
            chat[key] = v
    top_k = integer(body, "top_k", 0)
    if top_k is not None:
        chat["top_k"] = top_k
    if body.get("stop_sequences") is not None:
        chat["stop"] = string_list(body["stop_sequences"], "stop_sequences")
    tools = chat_tools(body)
    if tools:
        chat["tools"] = tools
    _tool_choice(body, chat)
    _thinking(body, chat)
    return Translated(b"/v1/chat/completions", chat, stream, _session(body),
                      images=_has_images(messages), dropped=hosted_tools(body))


def from_chat(obj: dict, model: str) -> dict:
    """A chat completion -> a Messages ``message`` answer; raises
    :class:`BadReply` for tool-call arguments that are not a JSON object,
    but for an answer cut by ``max_tokens`` (finish ``length``): there a
    call whose arguments were cut (:func:`~.tools.cut_by_limit`: not a JSON
    object, or none yet) is left out and
    ``stop_reason`` is ``max_tokens`` (issue 37, item 7: it was a 502, a
    replica fault for the client's own limit). Left out, not kept with a
    made-up ``input``: a whole answer's ``tool_use`` promises an input
    object a client may run the tool on, and Anthropic's advice for a
    ``max_tokens`` stop with an incomplete ``tool_use`` is to ask again with
    a higher ``max_tokens``. A stream shows the partial block as Anthropic
    streams one (:meth:`MessagesStream.end`)."""
    r = reply(obj)
    usage = Usage()
    usage.take(obj.get("usage"))
    calls: list[dict] = []
    for c in r.calls:
        if cut_by_limit(c, r.finish):
            continue  # cut by the client's max_tokens: incomplete, left out
        calls.append({"type": "tool_use", "id": c.id, "name": c.name,
                      "input": arguments_object(c.arguments, c.name)})
    blocks: list[dict] = []
    if r.reasoning:
        blocks.append({"type": "thinking", "thinking": r.reasoning, "signature": ""})
    if r.text or not calls:
        blocks.append({"type": "text", "text": r.text})
    blocks += calls
    rid = obj.get("id")
    stop = stop_reason(r.finish, bool(r.calls))
    return {
        "id": "msg_" + rid if isinstance(rid, str) and rid else new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": usage_object(usage),
    }


class Messages(Adapter):
    """``POST /v1/messages``."""

    name = "anthropic"

    def request(self, body: dict) -> Translated:
        return to_chat(body)

    def response(self, obj: dict, req: Translated) -> dict:
        return from_chat(obj, req.body.get("model") or "")

    def stream(self, req: Translated) -> StreamState:
        return MessagesStream(req.body.get("model") or "")

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        return b"application/json", error_body(status, message)


def count_text(body: dict) -> str:
    """The text whose tokens ``count_tokens`` counts when the replica cannot
    render its chat template: the system prompt, every message's text
    (tool calls and results included) and the tools as JSON, one per line
    (the template's own tokens are then left out)."""
    lines = []
    for m in chat_messages(body):
        c = m.get("content")
        if isinstance(c, list):
            c = "".join(p.get("text", "") for p in c)
        lines.append(c)
        for call in m.get("tool_calls") or ():
            lines.append(orjson.dumps(call["function"]).decode())
    lines += [orjson.dumps(t["function"]).decode() for t in chat_tools(body)]
    return "\n".join(lines)


class CountTokens(Messages):
    """``POST /v1/messages/count_tokens``, answered ``{"input_tokens": N}``.

    The proxy first asks the replica to render the request with its chat
    template (:meth:`template_request`: llama-server's ``/apply-template``,
    a chat body in, ``{"prompt"}`` out), then tokenizes that prompt
    (:meth:`tokenize_request`), so the template's tokens and the tools are
    counted as the model will see them; a replica without that route (404,
    501) gets :meth:`request`, the tokens of :func:`count_text`. Both
    tokenize through llama.cpp's ``/tokenize`` (``{"content"}`` ->
    ``{"tokens": [...]}``; with ``"count_only": true`` ggmux's instance
    answers ``{"n_tokens": N}``)."""

    def template_request(self, body: dict) -> Translated:
        chat: dict = {"model": body.get("model"), "messages": chat_messages(body)}
        tools = chat_tools(body)
        if tools:
            chat["tools"] = tools
            _tool_choice(body, chat)
        _thinking(body, chat)
        return Translated(b"/apply-template", chat, images=_has_images(chat["messages"]))

    def tokenize_request(self, body: dict, prompt: str) -> Translated:
        # the rendered prompt holds the template's special tokens (BOS too);
        # count_only: ggmux's instance answers {"n_tokens": N}, not megabytes
        # of ids for this loop to parse (issue 31, item 1); llama-server
        # ignores it and lists them
        return Translated(b"/tokenize", {"model": body.get("model"), "content": prompt,
                                         "add_special": False, "parse_special": True,
                                         "count_only": True})

    def request(self, body: dict) -> Translated:
        return Translated(b"/tokenize", {"model": body.get("model"), "content": count_text(body),
                                         "add_special": True, "count_only": True})

    def media_request(self, chat: dict) -> Translated:
        """A chat body with media, counted by a built-in instance whose
        projector reads them (its ``/chat/completions/input_tokens``:
        ``{"input_tokens": N}``)."""
        return Translated(b"/v1/chat/completions/input_tokens", chat, images=True)

    def response(self, obj: dict, req: Translated) -> dict:
        n = obj.get("n_tokens", obj.get("input_tokens"))
        if type(n) is int and n >= 0:
            return {"input_tokens": n}
        tokens = obj.get("tokens")
        if not isinstance(tokens, list):
            raise BadReply("the replica's /tokenize answer has no 'tokens' list")
        return {"input_tokens": len(tokens)}
