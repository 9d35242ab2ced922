"""Anthropic Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``)
on a chat-completion replica.

Request (Anthropic's Messages reference): ``model``, ``max_tokens``
(required), ``messages`` (``user``/``assistant``, content a string or text
blocks), ``system`` (string or text blocks), ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``stream``, ``metadata.user_id`` (the
session key). Blocks other than text (images, tools) and ``tools`` are
refused with 400: the replicas' chat API here carries text only.

Answer: a ``message`` object; streamed, Anthropic's event sequence
``message_start``, ``content_block_start``, ``ping``,
``content_block_delta`` (``text_delta``) ..., ``content_block_stop``,
``message_delta`` (``stop_reason``, ``usage``), ``message_stop``; errors as
``{"type": "error", "error": {"type", "message"}}``, in a stream as an
``error`` event. Split after LiteLLM's Anthropic adapter: these pure
functions plus :class:`MessagesStream` holding the streaming state.
"""

from __future__ import annotations

import orjson

from .common import (
    Adapter,
    BadReply,
    BadRequest,
    StreamState,
    Translated,
    Usage,
    chunk_delta,
    integer,
    message_text,
    new_id,
    number,
    sse,
    stream_flag,
    string_list,
)

# HTTP status -> Anthropic error type (Anthropic's "Errors" page)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    501: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

# chat finish_reason -> Anthropic stop_reason
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use",
                "content_filter": "refusal"}


def error_body(status: int, message: str) -> bytes:
    """Anthropic's error envelope for ``status``."""
    etype = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})


def _text(content, where: str) -> str:
    """The text of a content (string or list of text blocks)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of content blocks")
    parts = []
    for block in content:
        if not isinstance(block, dict):
            raise BadRequest(f"{where}: each content block must be an object")
        kind = block.get("type")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise BadRequest(f"{where}: a text block needs a string 'text'")
            parts.append(block["text"])
        else:
            raise BadRequest(f"{where}: content blocks of type {kind!r} are not supported "
                             "(ggmux translates text blocks only)")
    return "".join(parts)


def chat_messages(body: dict) -> list[dict]:
    """``system`` + ``messages`` as chat-completion messages; raises
    :class:`BadRequest` for anything the Messages API itself refuses or
    that has no text form."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    system = body.get("system")
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise BadRequest(f"messages.{i}: must be an object")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise BadRequest(f"messages.{i}.role: must be 'user' or 'assistant'")
        out.append({"role": role, "content": _text(m.get("content"), f"messages.{i}")})
    return out


def to_chat(body: dict) -> Translated:
    """A Messages request -> a chat-completion request (see the module
    docstring for what maps); raises :class:`BadRequest`."""
    if body.get("tools"):
        raise BadRequest("'tools' are not supported (ggmux translates text only)")
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required")
    stream = stream_flag(body)
    chat: dict = {"model": body.get("model"), "messages": chat_messages(body),
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
    session = None
    meta = body.get("metadata")
    if meta is not None:
        if not isinstance(meta, dict):
            raise BadRequest("'metadata' must be an object")
        uid = meta.get("user_id")
        if uid is not None:
            if not isinstance(uid, str):
                raise BadRequest("'metadata.user_id' must be a string")
            session = uid
    return Translated(b"/v1/chat/completions", chat, stream, session)


def _usage(u: Usage) -> dict:
    out = {"input_tokens": u.prompt, "output_tokens": u.completion}
    if u.cached:
        out["cache_read_input_tokens"] = u.cached
    return out


def from_chat(obj: dict, model: str) -> dict:
    """A chat completion -> a Messages ``message`` answer."""
    text, finish = message_text(obj)
    usage = Usage()
    usage.take(obj.get("usage"))
    rid = obj.get("id")
    return {
        "id": "msg_" + rid if isinstance(rid, str) and rid else new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": STOP_REASONS.get(finish or "stop", "end_turn"),
        "stop_sequence": None,
        "usage": _usage(usage),
    }


class MessagesStream(StreamState):
    """Chat-completion chunks -> Anthropic's stream events (module docstring).

    ``message_start`` (with ``content_block_start`` and ``ping``) goes out
    with the first chunk, so a replica that fails before answering leaves
    room for a plain HTTP error; the text block closes at the end, followed
    by ``message_delta`` with the stop reason and the usage (the input
    tokens the replica reported, else 0)."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.finish: str | None = None
        self.usage = Usage()
        self.id = new_id("msg_")

    def _start(self) -> bytes:
        self.started = True
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.usage.prompt, "output_tokens": 0}}
        return (sse("message_start", {"type": "message_start", "message": msg})
                + sse("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}})
                + sse("ping", {"type": "ping"}))

    def chunk(self, chunk: dict) -> bytes:
        if "usage" in chunk:
            self.usage.take(chunk["usage"])
        text, finish = chunk_delta(chunk)
        if finish:
            self.finish = finish
        out = b"" if self.started else self._start()
        if text:
            self.usage.counted()
            out += sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": text}})
        return out

    def end(self) -> bytes:
        out = b"" if self.started else self._start()
        delta = {"stop_reason": STOP_REASONS.get(self.finish or "stop", "end_turn"),
                 "stop_sequence": None}
        return (out + sse("content_block_stop", {"type": "content_block_stop", "index": 0})
                + sse("message_delta", {"type": "message_delta", "delta": delta,
                                        "usage": _usage(self.usage)})
                + sse("message_stop", {"type": "message_stop"}))

    def error(self, status: int, message: str) -> bytes:
        return b"event: error\ndata: " + error_body(status, message) + b"\n\n"


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
    """The text whose tokens ``count_tokens`` counts: the system prompt and
    every message's text, one per line (the chat template's own tokens are
    not counted: the replica's tokenizer sees the text alone)."""
    return "\n".join(m["content"] for m in chat_messages(body))


class CountTokens(Messages):
    """``POST /v1/messages/count_tokens`` through the replica's ``/tokenize``
    (llama.cpp's: ``{"content"}`` -> ``{"tokens": [...]}``), answered
    ``{"input_tokens": N}``."""

    def request(self, body: dict) -> Translated:
        if body.get("tools"):
            raise BadRequest("'tools' are not supported (ggmux translates text only)")
        return Translated(b"/tokenize", {"model": body.get("model"), "content": count_text(body),
                                         "add_special": True})

    def response(self, obj: dict, req: Translated) -> dict:
        tokens = obj.get("tokens")
        if not isinstance(tokens, list):
            raise BadReply("the replica's /tokenize answer has no 'tokens' list")
        return {"input_tokens": len(tokens)}
