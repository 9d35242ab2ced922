"""What the client-API adapters share: the adapter interface, request
checks, SSE parsing of a replica's chat-completion stream, and token usage.

An adapter (one module per API: :mod:`.anthropic`, :mod:`.responses`,
:mod:`.ollama`, :mod:`.openai`) is an :class:`Adapter`: pure functions from
the API's request to a chat-completion body (raising :class:`BadRequest`)
and from a chat-completion answer back, plus a :class:`StreamState` per
streamed answer that turns chat-completion chunks into the API's events.
What an answer holds (text, reasoning, tool calls) is read by :mod:`.tools`.
Nothing here does I/O; :mod:`ggmux.proxy.apis.translate` feeds them bytes.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import orjson

log = logging.getLogger(__name__)


class BadRequest(ValueError):
    """A request the API itself would refuse: answered with ``status`` in
    the API's own error envelope, and never a replica fault."""

    def __init__(self, message: str, status: int = 400, code: str = "invalid_request_error"):
        super().__init__(message)
        self.status = status
        self.code = code


class BadReply(Exception):
    """A replica's 200 answer lacks what the API's answer needs (answered
    with 502: the replica's fault, not the client's)."""


UNTRANSLATABLE = (BadReply, TypeError, ValueError, AttributeError, KeyError, IndexError)
"""What translating a replica's answer may raise for an answer of the
wrong shape: :class:`BadReply` where an adapter checks, a Python error
where a shape nobody foresaw got past (every one is a 502 in the client's
envelope, or the API's error event in a stream; issue 31 item 4)."""


def reason(e: Exception) -> str:
    """An untranslatable answer's reason for the client: a :class:`BadReply`'s
    text, else the error's type and text."""
    return str(e) if isinstance(e, BadReply) else f"{type(e).__name__}: {e}"


@dataclass(slots=True)
class Translated:
    """A client request turned into a replica request: ``target`` path on
    the replica (``b"/v1/chat/completions"`` ...), ``body`` the JSON object
    sent there, ``stream`` whether the client asked for a stream,
    ``session`` the session key the API names (``metadata.user_id``,
    ``previous_response_id``) or None, ``method`` the replica request's,
    ``echo`` client fields the answer repeats (not sent to the replica),
    ``images`` whether the messages carry images (refused with 400 for a
    model without a multimodal projector, :func:`ggmux.proxy.apis.has_projector`),
    ``dropped`` the hosted tools left out of what the model sees (offered
    with ``tool_choice`` auto; nothing here runs them: issue 31 item 13),
    named in the answer's :data:`DROPPED_TOOLS_HEADER`."""

    target: bytes
    body: dict
    stream: bool = False
    session: str | None = None
    method: bytes = b"POST"
    echo: dict = field(default_factory=dict)
    images: bool = False
    dropped: list[str] = field(default_factory=list)


DROPPED_TOOLS_HEADER = b"x-ggmux-dropped-tools"
"""The answer header naming, comma-separated, the hosted tools a translated
request offered that the model did not see (:attr:`Translated.dropped`)."""


class StreamState:
    """One streamed answer: chat-completion chunks in, the API's bytes out.

    :meth:`event` takes one SSE ``data`` payload of the replica's stream
    (not ``[DONE]``) and returns the bytes to send (possibly empty): a
    chunk goes to :meth:`chunk` (a parsed ``chat.completion.chunk`` or
    ``text_completion`` chunk), an OpenAI error envelope to :meth:`error`
    and sets ``failed``; :meth:`end` returns the closing bytes after the
    replica's ``[DONE]`` or the end of its body; :meth:`error` the API's
    error event for a failure mid-stream (the caller then closes the
    connection: never a clean end). ``content_type`` is the stream's
    media type."""

    content_type: bytes = b"text/event-stream"
    failed: bool = False
    why: str = ""  # what made it fail, when it could not translate

    def event(self, data: bytes) -> bytes:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.failed = True
            return self.error(502, "the replica sent a stream event that is not JSON")
        if not isinstance(obj, dict):
            return b""
        if "error" in obj:
            self.failed = True
            message, status = error_message(obj)
            return self.error(status or 500, message)
        try:
            return self.chunk(obj)
        except UNTRANSLATABLE as e:
            return self.untranslatable(e)

    def untranslatable(self, e: Exception) -> bytes:
        """The API's error event for a replica chunk (or end) that could not
        be translated; sets ``failed`` (issue 31 item 4: the client gets
        what a whole answer's 502 says, never a clean end)."""
        self.failed = True
        self.why = reason(e)
        log.warning("untranslatable stream from the replica: %s", self.why)
        return self.error(502, f"the replica's answer could not be translated: {self.why}")

    def chunk(self, chunk: dict) -> bytes:
        raise NotImplementedError

    def keepalive(self) -> bytes:
        """The API's own keep-alive while the replica reads a long prompt
        (issue 31 item 12: Codex counts its idle timeout in events, not SSE
        comments): the opening events first if they did not go out yet, then
        the API's keep-alive event (Anthropic ``ping``, Responses
        ``response.in_progress``); ``b""`` once content flows, or for an API
        that has none (Ollama's NDJSON, OpenAI's chat completions)."""
        return b""

    def end(self) -> bytes:
        raise NotImplementedError

    def error(self, status: int, message: str) -> bytes:
        raise NotImplementedError


class Adapter:
    """One client API route's translation (see the module docstring).

    ``request(body)`` -> :class:`Translated` (raises :class:`BadRequest`);
    ``response(obj, req)`` -> the API's JSON answer for the replica's
    200 JSON ``obj``; ``stream(req)`` -> a fresh :class:`StreamState`;
    ``error(status, message)`` -> ``(content_type, body bytes)`` in the
    API's error envelope; ``replica_error(status, body)`` the same for a
    replica's own error answer (an OpenAI envelope, or anything).
    ``req`` is the :class:`Translated` request."""

    name = "openai"

    def request(self, body: dict) -> Translated:
        raise NotImplementedError

    def response(self, obj: dict, req: Translated) -> dict:
        raise NotImplementedError

    def stream(self, req: Translated) -> StreamState:
        raise NotImplementedError

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        raise NotImplementedError

    def replica_error(self, status: int, body: bytes) -> tuple[bytes, bytes]:
        return self.error(status, error_message(body)[0])


# ---- request checks ---------------------------------------------------------------
def number(body: dict, key: str, lo: float | None = None, hi: float | None = None):
    """``body[key]`` when it is a number within ``[lo, hi]``, None when absent;
    raises :class:`BadRequest` otherwise."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise BadRequest(f"'{key}' must be a number")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise BadRequest(f"'{key}' must be between {lo} and {hi}")
    return v


def integer(body: dict, key: str, lo: int = 0) -> int | None:
    """``body[key]`` when it is an integer >= ``lo``, None when absent;
    raises :class:`BadRequest` otherwise."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise BadRequest(f"'{key}' must be an integer >= {lo}")
    return v


MAX_DEPTH = 250
"""Deepest nesting of a translated request's body, levels, that may be
allowed (``--max-json-depth``, default 128: JSON schemas,
tool arguments, ``metadata``: a few tens in practice). orjson reads 1024
levels but writes only 254, and a body goes on to the replica and parts
of it back into the answer (the Responses API echoes ``metadata``, ``text``
and ``tools``), so a deeper one is refused with 400 before anything is
sent (issue 18, finding 8: the answer's encoding failed inside the relay,
the client waited for nothing)."""


def check_depth(body: dict, limit: int = MAX_DEPTH) -> None:
    """Raise :class:`BadRequest` when ``body`` nests more than ``limit``
    containers deep (iteratively: any depth is safe to measure)."""
    todo: list[tuple[object, int]] = [(body, 1)]
    while todo:
        v, depth = todo.pop()
        if depth > limit:
            raise BadRequest(f"the request nests deeper than {limit} levels")
        if isinstance(v, dict):
            todo.extend((x, depth + 1) for x in v.values() if isinstance(x, (dict, list)))
        elif isinstance(v, list):
            todo.extend((x, depth + 1) for x in v if isinstance(x, (dict, list)))


def encode_body(obj: dict) -> bytes:
    """A translated request's body as the JSON bytes sent to the replica.
    Raises :class:`BadRequest` for one orjson cannot write: an integer
    beyond 64 bits, or nesting deeper than its 254 levels (orjson reads
    1024), which the client sent (issue 18, finding 8: a 500 before)."""
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError as e:
        raise BadRequest(f"the request cannot be passed on ({e}): it nests too deep or holds "
                         "an integer beyond 64 bits") from None


def string_list(v, key: str) -> list[str]:
    """A string or a list of strings as a list; :class:`BadRequest` else."""
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return v
    raise BadRequest(f"'{key}' must be a string or a list of strings")


def stream_flag(body: dict, default: bool = False) -> bool:
    """``body["stream"]`` (``default`` when absent or null); raises
    :class:`BadRequest` when it is not a boolean."""
    v = body.get("stream", default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest("'stream' must be a boolean")
    return v


# ---- replica stream ---------------------------------------------------------------
class SseEvents:
    """Incremental parser of a replica's SSE body: :meth:`feed` takes bytes
    as they arrive, cut anywhere, and returns the ``data`` payloads of the
    events they complete (``[DONE]`` included, ``event:`` names dropped),
    joining multi-line data with ``\\n`` as the SSE spec says; a comment
    block (a keep-alive) comes back whole, starting with ``b":"`` (no JSON
    payload does). A body cut mid-event keeps the partial event in ``buf``."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self.buf + data if self.buf else data
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        out = []
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            block = buf[start:end]
            start = end + 2
            if block[:6] == b"data: " and b"\n" not in block:  # the common case
                out.append(block[6:])
                continue
            lines = [ln[5:].lstrip(b" ") if ln[:5] == b"data:" else None
                     for ln in block.split(b"\n")]
            data_lines = [ln for ln in lines if ln is not None]
            if data_lines:
                out.append(b"\n".join(data_lines))
            elif block[:1] == b":":
                out.append(block)
        self.buf = buf[start:]
        return out


# OpenAI error type -> HTTP status, for envelopes whose code is not numeric
_TYPE_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                "permission_error": 403, "not_found_error": 404, "rate_limit_error": 429,
                "server_error": 500, "unavailable_error": 503, "timeout_error": 504}


def error_message(payload: bytes | dict) -> tuple[str, int | None]:
    """``(message, status)`` of an OpenAI error envelope (bytes or parsed),
    as a replica or the proxy writes it; the status is the envelope's
    numeric ``code`` when it has one, else its ``type``'s."""
    obj = payload
    if isinstance(payload, (bytes, bytearray)):
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            text = bytes(payload).decode("utf-8", "replace").strip()
            return text or "replica error", None
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) and 400 <= code <= 599 else _TYPE_STATUS.get(
            err.get("type"))
        return str(err.get("message") or err.get("type") or "error"), status
    if isinstance(err, str):
        return err, None
    return "replica error", None


@dataclass(slots=True)
class Usage:
    """Token counts of one answer. ``prompt``/``completion`` come from the
    replica's ``usage`` when it sent one (``reported``); otherwise
    ``completion`` counts the chunks that carried text (one token per chunk,
    as llama.cpp's and llama-cpp-python's servers stream) and ``prompt``
    stays 0 (the proxy has no tokenizer). ``cached`` is
    ``prompt_tokens_details.cached_tokens`` when reported."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0
    reported: bool = False

    def take(self, usage) -> None:
        """Adopt a replica's OpenAI ``usage`` object (ignored if malformed)."""
        if not isinstance(usage, dict):
            return
        p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(p, int) and isinstance(c, int):
            self.prompt, self.completion, self.reported = p, c, True
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                self.cached = details["cached_tokens"]

    def counted(self) -> None:
        """One chunk with text arrived (counts only while nothing was reported)."""
        if not self.reported:
            self.completion += 1

    def openai(self) -> dict:
        """OpenAI's ``usage`` object of these counts."""
        u = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
             "total_tokens": self.prompt + self.completion}
        if self.cached:
            u["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return u


def new_id(prefix: str) -> str:
    """A fresh id such as ``msg_0123456789abcdef01234567`` (24 hex digits)."""
    return prefix + os.urandom(12).hex()


def sse(event: str | None, obj) -> bytes:
    """One SSE event (``event:`` line when named) with ``obj`` as JSON data."""
    data = orjson.dumps(obj)
    if event is None:
        return b"data: " + data + b"\n\n"
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


def now_s() -> int:
    """The wall clock, whole seconds since the epoch (``created`` fields)."""
    return int(time.time())
