"""OpenAI Responses API (``POST /v1/responses``) on a chat-completion replica.

Request (OpenAI's Responses reference): ``model``, ``input`` (a string, or
message items ``{"role", "content"}`` with ``type: "message"`` optional and
content a string or ``input_text``/``output_text`` parts),
``instructions`` (the system message), ``max_output_tokens``,
``temperature``, ``top_p``, ``stream``, ``text.format`` (``text``,
``json_object``, ``json_schema``), and ``previous_response_id``,
``prompt_cache_key`` or ``user`` as the session key. ggmux stores no
responses: ``previous_response_id`` only keeps the conversation on one
replica (its history is not restored), and what needs stored state
(``background``, ``conversation``, ``item_reference`` items, retrieving a
response) is refused with a 400 that says so. Tools and non-text items are
refused too.

Answer: a ``response`` object (``status`` ``completed``, or ``incomplete``
with ``incomplete_details.reason: max_output_tokens``); streamed, the
events ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta`` ..., ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``,
``response.completed`` (or ``response.incomplete``), each with its
``sequence_number``; a failure mid-stream is an ``error`` event. Errors
use OpenAI's envelope.
"""

from __future__ import annotations

from .common import (
    Adapter,
    BadRequest,
    StreamState,
    Translated,
    Usage,
    chunk_delta,
    integer,
    message_text,
    new_id,
    now_s,
    number,
    sse,
    stream_flag,
)
from .openai import error_body

NOT_STORED = ("ggmux stores no responses (no server-side state): {what} is not available; "
              "send the whole conversation as 'input' instead")


def _content_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where}: content must be a string or a list of parts")
    parts = []
    for p in content:
        if not isinstance(p, dict) or p.get("type") not in ("input_text", "output_text", "text"):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise BadRequest(f"{where}: content parts of type {kind!r} are not supported "
                             "(ggmux translates text only)")
        if not isinstance(p.get("text"), str):
            raise BadRequest(f"{where}: a text part needs a string 'text'")
        parts.append(p["text"])
    return "".join(parts)


def chat_messages(body: dict) -> list[dict]:
    """``instructions`` + ``input`` as chat-completion messages."""
    out = []
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
    for i, item in enumerate(inp):
        if not isinstance(item, dict):
            raise BadRequest(f"input.{i}: must be an object")
        kind = item.get("type", "message")
        if kind == "item_reference":
            raise BadRequest(NOT_STORED.format(what="an item_reference input item"))
        if kind != "message":
            raise BadRequest(f"input.{i}: items of type {kind!r} are not supported "
                             "(ggmux translates message items only)")
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise BadRequest(f"input.{i}.role: must be user, assistant, system or developer")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _content_text(item.get("content"), f"input.{i}")})
    return out


def _response_format(text) -> dict | None:
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
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
    if body.get("tools"):
        raise BadRequest("'tools' are not supported (ggmux translates text only)")
    stream = stream_flag(body)
    chat: dict = {"model": body.get("model"), "messages": chat_messages(body), "stream": stream}
    if stream:
        chat["stream_options"] = {"include_usage": True}
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
    session = None
    for key in ("previous_response_id", "prompt_cache_key", "user"):
        v = body.get(key)
        if v is not None:
            if not isinstance(v, str):
                raise BadRequest(f"'{key}' must be a string")
            session = session or v
    echo = {k: body.get(k) for k in ("instructions", "max_output_tokens", "previous_response_id",
                                     "temperature", "top_p", "metadata")}
    return Translated(b"/v1/chat/completions", chat, stream, session, echo=echo)


def _usage(u: Usage) -> dict:
    return {"input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion}


def _message(item_id: str, text: str, status: str) -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content if status != "in_progress" else []}


def _response(rid: str, created: int, req: Translated, status: str, output: list, usage,
              finish: str | None = None) -> dict:
    """The ``response`` object (the parts of OpenAI's that apply here)."""
    body = req.echo
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": req.body.get("model"),
        "output": output,
        "parallel_tool_calls": False,
        "previous_response_id": body.get("previous_response_id"),
        "store": False,
        "temperature": body.get("temperature"),
        "text": {"format": {"type": "text"}},
        "tool_choice": "none",
        "tools": [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "metadata": body.get("metadata") or {},
    }


def from_chat(obj: dict, req: Translated) -> dict:
    """A chat completion -> a ``response`` object for the translated request ``req``."""
    text, finish = message_text(obj)
    usage = Usage()
    usage.take(obj.get("usage"))
    status = "incomplete" if finish == "length" else "completed"
    created = obj.get("created") if isinstance(obj.get("created"), int) else now_s()
    # a message cut at max_output_tokens is incomplete too, as OpenAI marks it
    return _response(new_id("resp_"), created, req, status,
                     [_message(new_id("msg_"), text, status)], _usage(usage), finish)


class ResponsesStream(StreamState):
    """Chat-completion chunks -> the Responses stream events (module docstring)."""

    def __init__(self, req: Translated) -> None:
        self.req = req
        self.id = new_id("resp_")
        self.item_id = new_id("msg_")
        self.created = now_s()
        self.seq = 0
        self.started = False
        self.text: list[str] = []
        self.finish: str | None = None
        self.usage = Usage()

    def _ev(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(kind, obj)

    def _start(self) -> bytes:
        self.started = True
        resp = _response(self.id, self.created, self.req, "in_progress", [], None)
        return (self._ev("response.created", response=resp)
                + self._ev("response.in_progress", response=resp)
                + self._ev("response.output_item.added", output_index=0,
                           item=_message(self.item_id, "", "in_progress"))
                + self._ev("response.content_part.added", item_id=self.item_id, output_index=0,
                           content_index=0,
                           part={"type": "output_text", "text": "", "annotations": []}))

    def chunk(self, chunk: dict) -> bytes:
        if "usage" in chunk:
            self.usage.take(chunk["usage"])
        text, finish = chunk_delta(chunk)
        if finish:
            self.finish = finish
        out = b"" if self.started else self._start()
        if text:
            self.usage.counted()
            self.text.append(text)
            out += self._ev("response.output_text.delta", item_id=self.item_id, output_index=0,
                            content_index=0, delta=text, logprobs=[])
        return out

    def end(self) -> bytes:
        out = b"" if self.started else self._start()
        text = "".join(self.text)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        status = "incomplete" if self.finish == "length" else "completed"
        item = _message(self.item_id, text, status)
        resp = _response(self.id, self.created, self.req, status, [item], _usage(self.usage),
                         self.finish)
        return (out
                + self._ev("response.output_text.done", item_id=self.item_id, output_index=0,
                           content_index=0, text=text, logprobs=[])
                + self._ev("response.content_part.done", item_id=self.item_id, output_index=0,
                           content_index=0, part=part)
                + self._ev("response.output_item.done", output_index=0, item=item)
                + self._ev("response." + status, response=resp))

    def error(self, status: int, message: str) -> bytes:
        code = "server_error" if status >= 500 else "invalid_request_error"
        return self._ev("error", code=code, message=message, param=None)


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

