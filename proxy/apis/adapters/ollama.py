"""Ollama's API (``/api/*``) on chat-completion replicas.

Routes (Ollama's docs/api.md): ``POST /api/chat`` and ``/api/generate``
(NDJSON streaming by default, one object with ``"stream": false``),
``POST /api/embed`` and the older ``/api/embeddings``, and the router-level
``GET /api/tags``, ``GET /api/ps``, ``POST /api/show``, ``GET /api/version``.

Option names map to OpenAI's: ``num_predict`` -> ``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``min_p``, ``stop``, ``seed``,
``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``; ``num_ctx``
and other load-time options are ignored (logged: a replica's context is
set by its preset). ``format`` (``"json"`` or a JSON schema) becomes
``response_format``. ``/api/generate`` is a chat with the prompt as the user
message and ``system`` as the system message (Ollama applies the model's
template), or with ``"raw": true`` a plain completion of the prompt.
``keep_alive`` is read by :func:`keep_alive_seconds`; the proxy maps it to
the model's idle timer. Errors are Ollama's ``{"error": "message"}``, in a
stream as one such line.

Tools and reasoning (issue 19): ``tools`` (OpenAI's function tools) pass
on; assistant ``tool_calls`` (arguments as objects) and ``role: "tool"``
messages (``tool_name``) map to OpenAI's (:func:`chat_messages`); ``think``
(true, false, ``"low"``/``"medium"``/``"high"``) switches the template's
reasoning; the answer's ``reasoning_content`` is ``message.thinking``
(``thinking`` for ``/api/generate``) and its tool calls
``message.tool_calls`` with ``arguments`` as an object. ``images``
(base64) become ``image_url`` parts.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
import time
from datetime import UTC, datetime

import orjson

from .common import (
    Adapter,
    BadReply,
    BadRequest,
    StreamState,
    Translated,
    Usage,
    stream_flag,
    string_list,
)
from .tools import (
    Calls,
    ToolCall,
    arguments_object,
    arguments_text,
    cut_by_limit,
    delta,
    function_tool,
    image_part,
    reply,
)

log = logging.getLogger(__name__)

VERSION = "0.6.0"  # the Ollama API version this adapter follows (GET /api/version)
NDJSON = b"application/x-ndjson"

# Ollama option -> OpenAI chat field (the rest of Ollama's options are load-time ones)
OPTIONS = {"num_predict": "max_tokens", "temperature": "temperature", "top_k": "top_k",
           "top_p": "top_p", "min_p": "min_p", "stop": "stop", "seed": "seed",
           "repeat_penalty": "repeat_penalty", "presence_penalty": "presence_penalty",
           "frequency_penalty": "frequency_penalty"}

ROLES = ("system", "user", "assistant", "tool")  # a tuple: a role that is a list compares, not hashes
THINK_LEVELS = ("low", "medium", "high")  # Ollama's think levels (GPT-OSS)
# the first base64 characters of an image file -> its media type
_IMAGE_SIGNATURES = (("/9j/", "image/jpeg"), ("iVBOR", "image/png"), ("R0lGOD", "image/gif"),
                     ("UklGR", "image/webp"))

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0,
          "h": 3600.0}
# Go's time.ParseDuration, which Ollama's keep_alive strings go through: one
# or more <number><unit>, a number having a digit before or after its point
_DURATION = re.compile(r"(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|μs|ms|s|m|h))+", re.ASCII)
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|μs|ms|s|m|h)", re.ASCII)
_BARE_NUMBER = re.compile(r"\d+\.?\d*|\.\d+", re.ASCII)
MAX_DURATION_CHARS = 64  # a longer keep_alive string is no duration anyone means
KEEP_ALIVE_SHAPE = "'keep_alive' must be a number of seconds or a duration such as '5m'"
# Ollama's integer options are Go ints (64-bit): a number outside is refused there too
_INT_OPTIONS = frozenset(("num_predict", "top_k", "seed"))
_INT_RANGE = 2 ** 63


def keep_alive_seconds(v) -> float | None:
    """Ollama's ``keep_alive`` in seconds: a number (seconds) or a Go
    duration string (``"5m"``, ``"1h30m"``, ``"300ms"``, ``"0"``, Go's
    ``time.ParseDuration`` grammar; a bare number string is taken as
    seconds); negative means forever (returned as ``float("inf")``); None
    when absent. Raises :class:`BadRequest` for anything else: another
    type, a string that is no duration (``".s"``, ``"1..2s"``), ``"nan"``,
    ``"inf"`` (issue 18, finding 8: those gave 500 or were dropped)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise BadRequest(KEEP_ALIVE_SHAPE)
    if not isinstance(v, str):
        if not math.isfinite(v):
            raise BadRequest(KEEP_ALIVE_SHAPE)
        return float("inf") if v < 0 else float(v)
    s = v.strip()
    if len(s) > MAX_DURATION_CHARS:
        raise BadRequest(f"'keep_alive': a duration of at most {MAX_DURATION_CHARS} characters")
    sign = s[:1]
    body = s[1:] if sign in ("+", "-") else s
    if _BARE_NUMBER.fullmatch(body):
        total = float(body)
    elif _DURATION.fullmatch(body):
        total = sum(float(n) * _UNITS[u] for n, u in _DURATION_PART.findall(body))
    else:
        raise BadRequest(f"'keep_alive': cannot read duration {v[:40]!r} (a number of seconds, "
                         "or a duration such as '5m' or '1h30m')")
    if not math.isfinite(total):
        raise BadRequest(f"'keep_alive': duration {v[:40]!r} is too long")
    return float("inf") if sign == "-" and total > 0 else total


def _options(body: dict, chat: dict) -> None:
    opts = body.get("options")
    if opts is None:
        return
    if not isinstance(opts, dict):
        raise BadRequest("'options' must be an object")
    for k, v in opts.items():
        field = OPTIONS.get(k)
        if field is None:
            log.info("ollama option %r ignored (a replica's load-time settings come from its "
                     "preset)", k[:64])
            continue
        if v is None:
            continue
        if field == "stop":
            chat["stop"] = string_list(v, "options.stop")
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise BadRequest(f"'options.{k}' must be a number")
        if k in _INT_OPTIONS and not -_INT_RANGE <= v < _INT_RANGE:
            raise BadRequest(f"'options.{k}' must be an integer in 64 bits, not {v:g}")
        if field == "max_tokens":
            if v > 0:  # Ollama: -1 = until the context is full, -2 = fill it
                chat["max_tokens"] = int(v)
        elif k in _INT_OPTIONS and isinstance(v, float) and v.is_integer():
            chat[field] = int(v)  # 1e3 as 1000: the replica reads an integer
        else:
            chat[field] = v


def _format(body: dict, chat: dict) -> None:
    fmt = body.get("format")
    if fmt in (None, ""):
        return
    if fmt == "json":
        chat["response_format"] = {"type": "json_object"}
    elif isinstance(fmt, dict):
        chat["response_format"] = {"type": "json_schema",
                                   "json_schema": {"name": "format", "schema": fmt}}
    else:
        raise BadRequest("'format' must be \"json\" or a JSON schema object")


def _think(body: dict, chat: dict) -> None:
    """Ollama's ``think``: true/false switch the template's thinking
    (``chat_template_kwargs.enable_thinking``), a level (GPT-OSS's) also
    sets ``reasoning_effort``."""
    think = body.get("think")
    if think is None:
        return
    if think in THINK_LEVELS:
        chat["reasoning_effort"] = think
    elif not isinstance(think, bool):
        raise BadRequest("'think' must be true, false, \"low\", \"medium\" or \"high\"")
    chat["chat_template_kwargs"] = {"enable_thinking": think is not False}


def _common(body: dict, chat: dict, stream: bool) -> None:
    if stream:
        chat["stream_options"] = {"include_usage": True}
    _options(body, chat)
    _format(body, chat)
    _think(body, chat)


def _image_url(data, where: str) -> dict:
    """An Ollama image (base64 without a media type) as an ``image_url``
    part with a ``data:`` URL, its type told by the first bytes."""
    if not isinstance(data, str) or not data:
        raise BadRequest(f"{where}: an image must be a base64 string")
    media = next((t for sig, t in _IMAGE_SIGNATURES if data.startswith(sig)), "image/png")
    return image_part(f"data:{media};base64,{data}")


def _with_images(text: str, images, where: str) -> str | list[dict]:
    if not images:
        return text
    if not isinstance(images, list):
        raise BadRequest(f"{where}.images must be a list of base64 strings")
    return [{"type": "text", "text": text}] + [_image_url(d, f"{where}.images[{j}]")
                                              for j, d in enumerate(images)]


def _calls(m: dict, i: int) -> list[dict]:
    """An assistant message's ``tool_calls`` (arguments objects) in
    OpenAI's shape; ids the client left out (Ollama's have none) are
    ``call_<message>_<call>``, the same on every turn."""
    calls = m.get("tool_calls")
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}: needs a 'function' with a 'name'")
        cid = c.get("id") if isinstance(c.get("id"), str) and c.get("id") else f"call_{i}_{j}"
        out.append({"id": cid, "type": "function", "function": {
            "name": fn["name"], "arguments": arguments_text(fn.get("arguments"), where)}})
    return out


def chat_messages(msgs) -> list[dict]:
    """``/api/chat`` messages as chat-completion messages: ``images`` as
    ``image_url`` parts, assistant ``tool_calls`` with ids (:func:`_calls`),
    a ``role: "tool"`` message answering the call its ``tool_call_id``
    names, else the first unanswered one of its ``tool_name``, else the
    first unanswered one; ``thinking`` kept as ``reasoning_content``."""
    if not isinstance(msgs, list):
        raise BadRequest("'messages' must be a list")
    out: list[dict] = []
    pending: list[dict] = []  # the last assistant message's calls not yet answered
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}]: needs a role of system, user, assistant or tool")
        role = m["role"]
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string")
        msg: dict = {"role": role, "content": _with_images(content, m.get("images"),
                                                          f"messages[{i}]")}
        if role == "assistant":
            if m.get("tool_calls"):
                calls = _calls(m, i)
                msg["tool_calls"] = calls
                pending = list(calls)
            if isinstance(m.get("thinking"), str) and m["thinking"]:
                msg["reasoning_content"] = m["thinking"]
        elif role == "tool":
            cid = m.get("tool_call_id")
            name = m.get("tool_name") or m.get("name")
            call = next((c for c in pending if c["id"] == cid), None) or next(
                (c for c in pending if c["function"]["name"] == name), None) or (
                pending[0] if pending else None)
            if call is not None:
                pending.remove(call)
                cid = call["id"]
            msg["tool_call_id"] = cid if isinstance(cid, str) and cid else f"call_{i}"
        out.append(msg)
    return out


def _tools(body: dict, chat: dict) -> None:
    tools = body.get("tools")
    if not tools:
        return
    if not isinstance(tools, list):
        raise BadRequest("'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise BadRequest(f"tools[{i}]: must be {{\"type\": \"function\", \"function\": "
                             "{\"name\", \"description\", \"parameters\"}}")
        out.append(function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                                 f"tools[{i}]"))
    chat["tools"] = out


def chat_request(body: dict) -> Translated:
    """``/api/chat`` -> chat completion (``stream`` defaults to true)."""
    out = chat_messages(body.get("messages"))
    stream = stream_flag(body, True)
    chat = {"model": body.get("model"), "messages": out, "stream": stream}
    _common(body, chat, stream)
    _tools(body, chat)
    return Translated(b"/v1/chat/completions", chat, stream,
                      images=any(isinstance(m["content"], list) for m in out))


def generate_request(body: dict) -> Translated:
    """``/api/generate`` -> chat completion (or, ``raw``, completion)."""
    prompt = body.get("prompt", "")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' must be a string")
    system = body.get("system")
    if system is not None and not isinstance(system, str):
        raise BadRequest("'system' must be a string")
    stream = stream_flag(body, True)
    if body.get("raw"):
        if body.get("images"):
            raise BadRequest("images need the model's template: leave out 'raw'")
        chat = {"model": body.get("model"), "prompt": prompt, "stream": stream}
        target = b"/v1/completions"
    else:
        msgs = [{"role": "system", "content": system}] if system else []
        msgs.append({"role": "user", "content": _with_images(prompt, body.get("images"),
                                                             "body")})
        chat = {"model": body.get("model"), "messages": msgs, "stream": stream}
        target = b"/v1/chat/completions"
    _common(body, chat, stream)
    return Translated(target, chat, stream, images=bool(body.get("images")))


def embed_request(body: dict, old: bool = False) -> Translated:
    """``/api/embed`` (``input``: string or list) or, ``old``,
    ``/api/embeddings`` (``prompt``) -> ``/v1/embeddings``."""
    inp = body.get("prompt") if old else body.get("input")
    if old:
        if not isinstance(inp, str):
            raise BadRequest("'prompt' must be a string")
    else:
        inp = string_list(inp, "input")
    return Translated(b"/v1/embeddings", {"model": body.get("model"), "input": inp})


def created_at(ns: int | None = None) -> str:
    """An RFC 3339 UTC time with nanoseconds, as Ollama writes ``created_at``."""
    ns = time.time_ns() if ns is None else ns
    dt = datetime.fromtimestamp(ns // 1_000_000_000, tz=UTC)
    return dt.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ns % 1_000_000_000:09d}Z"


def _done_fields(usage: Usage, t0: int, t1: int, t2: int, timings=None) -> dict:
    """Ollama's closing statistics (nanoseconds); ``t0`` request start,
    ``t1`` first token, ``t2`` end (``time.monotonic_ns()``). The prompt's
    and the generation's durations are the replica's own ``timings``
    (llama.cpp's ``prompt_ms``, ``predicted_ms``) when it sent them: a whole
    answer has no first-token time here, and clients divide ``eval_count``
    by ``eval_duration`` for tokens per second; else the proxy's times."""
    prompt_ns, eval_ns = max(0, t1 - t0), max(0, t2 - t1)
    if isinstance(timings, dict):
        p, g = timings.get("prompt_ms"), timings.get("predicted_ms")
        if isinstance(p, int | float) and p >= 0:
            prompt_ns = int(p * 1e6)
        if isinstance(g, int | float) and g >= 0:
            eval_ns = int(g * 1e6)
    return {"total_duration": t2 - t0, "load_duration": 0, "prompt_eval_count": usage.prompt,
            "prompt_eval_duration": prompt_ns, "eval_count": usage.completion,
            "eval_duration": eval_ns}


def ollama_calls(calls: list[ToolCall], finish: str | None = None) -> list[dict]:
    """Tool calls in Ollama's shape: ``{"id", "function": {"index", "name",
    "arguments": {...}}}`` (arguments an object); raises
    :class:`~.common.BadReply` for arguments that are not one, but for an
    answer cut by the client's limit (``finish`` ``length``): there a call
    whose arguments were cut (:func:`~.tools.cut_by_limit`) is left out (``done_reason`` is ``length``),
    since a call with made-up or missing arguments could be run, and the
    cut is the client's limit, not the replica's fault (as the Anthropic
    adapter leaves an incomplete ``tool_use`` out)."""
    out = []
    for c in calls:
        if cut_by_limit(c, finish):
            continue
        out.append({"id": c.id, "function": {"index": len(out), "name": c.name,
                                             "arguments": arguments_object(c.arguments, c.name)}})
    return out


def done_reason(finish: str | None) -> str:
    """Ollama's ``done_reason`` (``stop`` after tool calls too, as Ollama says)."""
    return "length" if finish == "length" else "stop"


class NdjsonStream(StreamState):
    """Chat-completion chunks -> Ollama's NDJSON lines: one
    ``{"model", "created_at", "message": {...}, "done": false}`` per text
    or thinking piece (``message.thinking``; ``"response"`` and
    ``"thinking"`` for ``/api/generate``), the tool calls whole in one line
    once the replica finished them (Ollama streams no partial arguments),
    then the ``done: true`` line with ``done_reason`` and the statistics."""

    content_type = NDJSON

    def __init__(self, model: str, generate: bool, t0: int | None = None) -> None:
        self.model = model
        self.generate = generate
        self.usage = Usage()
        self.finish: str | None = None
        self.calls = Calls()
        self.t0 = time.monotonic_ns() if t0 is None else t0  # the request's arrival
        self.t1 = 0
        self.timings: dict | None = None  # the replica's (llama.cpp), from its last chunk

    def _line(self, text: str, thinking: str = "", calls: list[dict] | None = None,
              **extra) -> bytes:
        obj: dict = {"model": self.model, "created_at": created_at()}
        if self.generate:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        else:
            msg: dict = {"role": "assistant", "content": text}
            if thinking:
                msg["thinking"] = thinking
            if calls:
                msg["tool_calls"] = calls
            obj["message"] = msg
        obj.update(extra)
        return orjson.dumps(obj) + b"\n"

    def chunk(self, chunk: dict) -> bytes:
        if "usage" in chunk:
            self.usage.take(chunk["usage"])
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        d = delta(chunk)
        if d.finish:
            self.finish = d.finish
        for cd in d.calls:
            self.calls.add(cd)
        if not (d.text or d.reasoning or d.calls):
            return b""
        if not self.t1:
            self.t1 = time.monotonic_ns()
        self.usage.counted()
        if not (d.text or d.reasoning):
            return b""
        return self._line(d.text, d.reasoning, done=False)

    def end(self) -> bytes:
        out = b""
        if self.calls.calls:
            try:
                calls = ollama_calls(self.calls.calls, self.finish)
                if calls:
                    out = self._line("", calls=calls, done=False)
            except BadReply as e:
                return self.untranslatable(e)
        t2 = time.monotonic_ns()
        return out + self._line("", done=True, done_reason=done_reason(self.finish),
                                **_done_fields(self.usage, self.t0, self.t1 or t2, t2,
                                               self.timings))

    def error(self, status: int, message: str) -> bytes:
        return orjson.dumps({"error": message}) + b"\n"


_PART = re.compile(r"messages\[(\d+)\]\.content\[(\d+)\]")


def ollama_where(message: str, generate: bool) -> str:
    """``message`` (an error from the chat completion an Ollama request
    became) with the places it names in the chat request's content parts
    named as the Ollama request's: part 0 is the message's text, part ``j``
    its ``images[j - 1]`` (:func:`_with_images`); ``/api/generate`` has one
    ``images`` list at the top."""
    def sub(m: re.Match) -> str:
        j = int(m.group(2))
        if j == 0:
            return "prompt" if generate else f"messages[{m.group(1)}].content"
        return f"images[{j - 1}]" if generate else f"messages[{m.group(1)}].images[{j - 1}]"

    return _PART.sub(sub, message)


def error_body(message: str) -> bytes:
    """Ollama's error envelope."""
    return orjson.dumps({"error": message})


class _Ollama(Adapter):
    name = "ollama"

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        return b"application/json", error_body(message)


class Chat(_Ollama):
    """``POST /api/chat`` (and, ``generate``, ``POST /api/generate``)."""

    generate = False

    def error(self, status: int, message: str) -> tuple[bytes, bytes]:
        return b"application/json", error_body(ollama_where(message, self.generate))

    def request(self, body: dict) -> Translated:
        t = generate_request(body) if self.generate else chat_request(body)
        t.echo["model"] = body.get("model")
        t.echo["t0"] = time.monotonic_ns()
        return t

    def response(self, obj: dict, req: Translated) -> dict:
        r = reply(obj)
        usage = Usage()
        usage.take(obj.get("usage"))
        out: dict = {"model": req.echo["model"], "created_at": created_at()}
        if self.generate:
            out["response"] = r.text
            if r.reasoning:
                out["thinking"] = r.reasoning
        else:
            msg: dict = {"role": "assistant", "content": r.text}
            if r.reasoning:
                msg["thinking"] = r.reasoning
            calls = ollama_calls(r.calls, r.finish) if r.calls else []
            if calls:
                msg["tool_calls"] = calls
            out["message"] = msg
        t2 = time.monotonic_ns()
        out.update(done=True, done_reason=done_reason(r.finish),
                   **_done_fields(usage, req.echo["t0"], t2, t2, obj.get("timings")))
        return out

    def stream(self, req: Translated) -> StreamState:
        return NdjsonStream(req.echo["model"], self.generate, req.echo.get("t0"))


class Generate(Chat):
    """``POST /api/generate``."""

    generate = True


class Embed(_Ollama):
    """``POST /api/embed`` (``old``: ``/api/embeddings``)."""

    old = False

    def request(self, body: dict) -> Translated:
        t = embed_request(body, self.old)
        t.echo["model"] = body.get("model")
        t.echo["t0"] = time.monotonic_ns()
        return t

    def response(self, obj: dict, req: Translated) -> dict:
        data = obj.get("data")
        if not isinstance(data, list):
            raise BadReply("the replica's embeddings answer has no 'data' list")
        vectors = [d.get("embedding") for d in sorted(data, key=lambda d: d.get("index", 0))]
        if self.old:
            return {"embedding": vectors[0] if vectors else []}
        usage = obj.get("usage") or {}
        return {"model": req.echo["model"], "embeddings": vectors,
                "total_duration": time.monotonic_ns() - req.echo["t0"], "load_duration": 0,
                "prompt_eval_count": usage.get("prompt_tokens", 0)}


class Embeddings(Embed):
    """``POST /api/embeddings`` (Ollama's older embedding route)."""

    old = True


# ---- router-level answers ---------------------------------------------------------
def tag_name(name: str) -> str:
    """The name Ollama clients see: ``NAME:latest`` unless it has a tag."""
    return name if ":" in name.rsplit("/", 1)[-1] else name + ":latest"


def digest(mdl: dict) -> str:
    """A stable 64-hex-digit id of a model (of its name, arguments and
    size: not the file's own sha256, which would cost a full read)."""
    key = orjson.dumps([mdl.get("name"), mdl.get("args"), mdl.get("size_bytes")])
    return hashlib.sha256(key).hexdigest()


def details(info: dict) -> dict:
    """Ollama's ``details`` from GGUF facts ``info`` (keys ``family``,
    ``parameter_size``, ``quantization_level``; missing ones are empty)."""
    fam = info.get("family") or ""
    return {"parent_model": "", "format": "gguf", "family": fam,
            "families": [fam] if fam else None,
            "parameter_size": info.get("parameter_size") or "",
            "quantization_level": info.get("quantization_level") or ""}


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, tz=UTC).isoformat().replace("+00:00", "Z")


def tags(models: list[tuple[dict, dict]]) -> dict:
    """``GET /api/tags`` for ``(registry model, GGUF info)`` pairs."""
    return {"models": [{"name": tag_name(m["name"]), "model": tag_name(m["name"]),
                        "modified_at": _iso(m.get("created") or 0), "size": m.get("size_bytes", 0),
                        "digest": digest(m), "details": details(info)} for m, info in models]}


def ps(loaded: list[tuple[dict, dict, int, float | None, int]]) -> dict:
    """``GET /api/ps`` for ``(registry model, GGUF info, memory bytes,
    expiry epoch seconds or None for never, context length)`` tuples."""
    out = []
    for m, info, mem, expires, n_ctx in loaded:
        out.append({"name": tag_name(m["name"]), "model": tag_name(m["name"]),
                    "size": mem, "digest": digest(m), "details": details(info),
                    # Ollama shows a model kept forever with a far-future expiry
                    "expires_at": _iso(expires if expires is not None else 253402300799),
                    "size_vram": 0, "context_length": n_ctx})
    return {"models": out}


def show(m: dict, info: dict) -> dict:
    """``POST /api/show`` for one model; ``capabilities`` adds ``vision``
    and ``audio`` where the model's projector reads them (measured:
    the registry's ``modalities``), as Ollama lists ``vision``."""
    params = "\n".join(f"{k} {v}" for k, v in info.get("parameters", {}).items())
    caps = list(info.get("capabilities", ["completion"]))
    mods = m.get("modalities")
    if isinstance(mods, dict):
        caps += [k for k in ("vision", "audio") if mods.get(k) and k not in caps]
    return {"modelfile": f"# served by ggmux\nFROM {m['name']}\n", "parameters": params,
            "template": info.get("template", ""), "details": details(info),
            "model_info": info.get("model_info", {}), "capabilities": caps,
            "modified_at": _iso(m.get("created") or 0)}
