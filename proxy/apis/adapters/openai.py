"""OpenAI's own surface where the proxy must rewrite it: the error
envelope with string codes, and ``stream_options.include_usage`` for
replicas that do not send the usage chunk themselves.

Error codes (OpenAI's style, one string per status) are
:data:`ggmux.http1.ERROR_CODES`; llama.cpp's numeric ``code`` stays on
llama.cpp's own routes (:data:`ggmux.http1.LLAMA_CPP_ROUTES`).
"""

from __future__ import annotations

import orjson

from ....http1 import ERROR_TYPES, error_code
from .common import Adapter, StreamState, Translated, Usage, sse
from .tools import delta


def error_body(status: int, message: str, code: str | int | None = None, **extra) -> bytes:
    """OpenAI's envelope ``{"error": {"message", "type", "code"}}``; ``code``
    defaults to :func:`error_code` of ``status``."""
    err = {"message": message,
           "type": ERROR_TYPES.get(status, "server_error" if status >= 500 else "error"),
           "code": code if code is not None else error_code(status)}
    err.update(extra)
    return orjson.dumps({"error": err})


class UsageStream(StreamState):
    """A chat-completion stream relayed as it is, with the usage chunk
    (``choices: []``, ``usage``) added before ``[DONE]`` when the replica
    sent none (``stream_options.include_usage``; see
    :class:`~.common.Usage` for what is counted then)."""

    def __init__(self) -> None:
        self.usage = Usage()
        self.last: dict = {}

    def event(self, data: bytes) -> bytes:
        out = b"data: " + data + b"\n\n"
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            return out
        if isinstance(obj, dict):
            if "error" in obj:
                self.failed = True
                return out
            self.chunk(obj)
        return out

    def chunk(self, chunk: dict) -> bytes:
        if chunk.get("usage"):
            self.usage.take(chunk["usage"])
        d = delta(chunk)
        if d.text or d.reasoning or d.calls:  # one token per piece, tool calls' too
            self.usage.counted()
        self.last = chunk
        return b""

    def end(self) -> bytes:
        out = b""
        if not self.usage.reported:
            last = self.last
            out = sse(None, {"id": last.get("id", ""), "object": "chat.completion.chunk",
                             "created": last.get("created", 0), "model": last.get("model", ""),
                             "choices": [], "usage": self.usage.openai()})
        return out + b"data: [DONE]\n\n"

    def error(self, status: int, message: str) -> bytes:
        return b"data: " + error_body(status, message) + b"\n\n"


class ChatWithUsage(Adapter):
    """``POST /v1/chat/completions`` with ``stream_options.include_usage``:
    the body goes to the replica unchanged; the stream is
    :class:`UsageStream`, a whole answer is relayed as it is."""

    def request(self, body: dict) -> Translated:
        return Translated(b"/v1/chat/completions", body, body.get("stream") is True)

    def response(self, obj: dict, req: Translated) -> dict:
        return obj

    def stream(self, req: Translated) -> StreamState:
        return UsageStream()

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        return b"application/json", error_body(status, message)

    def replica_error(self, status: int, body: bytes) -> tuple[bytes, bytes]:
        return b"application/json", body  # already OpenAI's envelope: relayed as it is

