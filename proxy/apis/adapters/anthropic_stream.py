"""Anthropic's streaming events out of a replica's chat-completion stream,
and the error envelope and usage object the Messages adapter shares.

The sequence (Anthropic's "Streaming messages" page): ``message_start``;
for each content block ``content_block_start``, its deltas,
``content_block_stop``, with one ``ping`` after the first block's start;
then ``message_delta`` (``stop_reason``, ``usage``) and ``message_stop``.
Blocks open in the order their content arrives and one at a time, as
Anthropic sends them: a ``thinking`` block for ``delta.reasoning_content``
(``thinking_delta`` pieces, closed by an empty ``signature_delta``), a
``text`` block for ``delta.content`` (``text_delta``), and one ``tool_use``
block per tool call (``{"id", "name", "input": {}}``, then
``input_json_delta`` pieces of the arguments, ``partial_json``).
"""

from __future__ import annotations

import orjson

from .common import BadReply, StreamState, Usage, new_id, sse
from .tools import Calls, check_arguments, delta

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


def stop_reason(finish: str | None, calls: bool) -> str:
    """Anthropic's ``stop_reason`` for the replica's ``finish_reason``:
    ``max_tokens`` when cut short (calls or not), ``tool_use`` for calls,
    else :data:`STOP_REASONS`' mapping."""
    if finish == "length":
        return "max_tokens"
    return "tool_use" if calls else STOP_REASONS.get(finish or "stop", "end_turn")


def error_body(status: int, message: str) -> bytes:
    """Anthropic's error envelope for ``status``."""
    etype = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return orjson.dumps({"type": "error", "error": {"type": etype, "message": message}})


def usage_object(u: Usage, output: int | None = None) -> dict:
    """Anthropic's ``usage`` of these counts, as llama-server's
    (``server-task.cpp``) and Anthropic's: ``input_tokens`` the prompt's
    tokens not read from the cache, ``cache_read_input_tokens`` those that
    were, ``output_tokens`` (``output``: instead of the completion's)."""
    return {"cache_read_input_tokens": u.cached, "input_tokens": max(u.prompt - u.cached, 0),
            "output_tokens": u.completion if output is None else output}


class MessagesStream(StreamState):
    """Chat-completion chunks -> Anthropic's stream events (module docstring).

    ``message_start`` goes out with the first chunk, so a replica that fails
    before answering leaves room for a plain HTTP error, and carries the
    prompt's token count when that chunk is llama-server's
    ``prompt_progress`` (the built-in instance's ``return_progress``); a stream with no
    content at all still gets one empty text block. ``block`` is the kind
    of the open block (``"thinking"``, ``"text"``, ``"tool_use"`` or None),
    ``index`` its index; ``tools`` maps a tool call's OpenAI index to its
    block's."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.started = False
        self.finish: str | None = None
        self.usage = Usage()
        self.id = new_id("msg_")
        self.block: str | None = None
        self.index = -1
        self.calls = Calls()
        self.tools: dict[int, int] = {}

    def _start(self) -> bytes:
        self.started = True
        msg = {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": usage_object(self.usage, 0)}
        return sse("message_start", {"type": "message_start", "message": msg})

    def keepalive(self) -> bytes:
        """``message_start`` if it did not go out yet, else a ``ping``
        (Anthropic's keep-alive event); nothing once a block opened."""
        if not self.started:
            return self._start()
        return sse("ping", {"type": "ping"}) if self.index < 0 else b""

    def _close(self) -> bytes:
        if self.block is None:
            return b""
        out = b""
        if self.block == "thinking":
            out = self._delta({"type": "signature_delta", "signature": ""})
        self.block = None
        return out + sse("content_block_stop", {"type": "content_block_stop",
                                                "index": self.index})

    def _open(self, kind: str, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.block = kind
        out += sse("content_block_start", {"type": "content_block_start", "index": self.index,
                                           "content_block": block})
        if self.index == 0:
            out += sse("ping", {"type": "ping"})
        return out

    def _delta(self, d: dict, index: int | None = None) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta",
                                           "index": self.index if index is None else index,
                                           "delta": d})

    def chunk(self, chunk: dict) -> bytes:
        if "usage" in chunk:
            self.usage.take(chunk["usage"])
        progress = chunk.get("prompt_progress")  # asked for: the prompt's size, first
        if isinstance(progress, dict) and not self.usage.reported:
            total, cache = progress.get("total"), progress.get("cache")
            if isinstance(total, int) and isinstance(cache, int):
                self.usage.prompt, self.usage.cached = total, cache
        d = delta(chunk)
        if d.finish:
            self.finish = d.finish
        out = b"" if self.started else self._start()
        if d.reasoning:
            if self.block != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "",
                                               "signature": ""})
            out += self._delta({"type": "thinking_delta", "thinking": d.reasoning})
        if d.text:
            if self.block != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out += self._delta({"type": "text_delta", "text": d.text})
        for cd in d.calls:
            call, new = self.calls.add(cd)
            if new:
                out += self._open("tool_use", {"type": "tool_use", "id": call.id,
                                               "name": call.name, "input": {}})
                self.tools[cd.index] = self.index
            if cd.arguments:
                out += self._delta({"type": "input_json_delta", "partial_json": cd.arguments},
                                   self.tools[cd.index])
        if d.text or d.reasoning or d.calls:
            self.usage.counted()
        return out

    def stop_reason(self) -> str:
        """The ``stop_reason`` of what was streamed: ``max_tokens`` for an
        answer cut short even with calls in it (their arguments may be cut
        too: Claude Code would run a ``tool_use`` whose input is no JSON),
        as llama-server's ``length`` beats ``tool_calls``
        (tools/server/server-task.cpp)."""
        return stop_reason(self.finish, bool(self.calls.calls))

    def end(self) -> bytes:
        """The closing events; the API's error event instead when a tool
        call's arguments are not a JSON object (as a whole answer's 502),
        but for an answer cut at its limit (``max_tokens`` says so)."""
        try:
            if self.finish != "length":
                check_arguments(self.calls.calls)
        except BadReply as e:
            return (b"" if self.started else self._start()) + self.untranslatable(e)
        out = b"" if self.started else self._start()
        if self.index < 0:
            out += self._open("text", {"type": "text", "text": ""})
        delta_ = {"stop_reason": self.stop_reason(), "stop_sequence": None}
        return (out + self._close()
                + sse("message_delta", {"type": "message_delta", "delta": delta_,
                                        "usage": usage_object(self.usage)})
                + sse("message_stop", {"type": "message_stop"}))

    def error(self, status: int, message: str) -> bytes:
        return b"event: error\ndata: " + error_body(status, message) + b"\n\n"
