"""Tool calls, reasoning and images as the API adapters share them: OpenAI's
chat-completion shapes read back (a whole answer, a streamed delta) and the
pieces every adapter writes into a chat request (DESIGN.md "Tools and
reasoning"; issue 19).

What a replica answers (OpenAI's chat completions, as llama-server's Jinja
mode writes them): ``message.tool_calls`` ``[{"id", "type": "function",
"function": {"name", "arguments": JSON text}}]``, streamed as
``delta.tool_calls`` ``[{"index", "id", "function": {"name", "arguments"}}]``
(id and name in the first delta of an index, then argument pieces),
``finish_reason: "tool_calls"``, and ``reasoning_content`` (llama-server's
``--reasoning-format deepseek``; ``reasoning``, vLLM's newer name, is read
too) beside ``content``. Nothing here does I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import orjson

from .common import BadReply, BadRequest, new_id

log = logging.getLogger(__name__)

# what an adapter puts in a chat request's messages for an image
IMAGE_PART = "image_url"


@dataclass(slots=True)
class ToolCall:
    """One whole tool call: ``id`` (the replica's, or a fresh ``call_...``),
    ``name``, ``arguments`` the JSON text as the replica sent it."""

    id: str
    name: str
    arguments: str = ""

    def openai(self) -> dict:
        """OpenAI's ``tool_calls`` entry."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Reply:
    """The first choice of a whole chat completion (or completion)."""

    text: str = ""
    reasoning: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    finish: str | None = None


@dataclass(slots=True)
class CallDelta:
    """One ``delta.tool_calls`` entry: ``id``/``name`` None when this piece
    does not carry them, ``arguments`` the JSON text piece (may be empty)."""

    index: int
    id: str | None
    name: str | None
    arguments: str


@dataclass(slots=True)
class Delta:
    """What one streamed chunk adds (``("", "", [], None)`` for the usage
    chunk)."""

    text: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)
    finish: str | None = None


def _reasoning(d: dict) -> str:
    r = d.get("reasoning_content")
    if not isinstance(r, str):
        r = d.get("reasoning")
    return r if isinstance(r, str) else ""


def _first_choice(obj: dict, whole: bool) -> dict | None:
    """The first of ``obj``'s ``choices``; None for a chunk with none (the
    usage chunk's ``[]``, or no ``choices`` at all). Raises :class:`BadReply`
    for ``choices`` that is not a list of objects, and for a whole answer
    (``whole``) without a choice (issue 31 item 4: ``{"choices": 5}`` was an
    empty 200 ``end_turn``)."""
    choices = obj.get("choices")
    if choices is None and not whole:
        return None
    if not isinstance(choices, list):
        raise BadReply(f"the replica's 'choices' is {type(choices).__name__}, not a list")
    if not choices:
        if whole:
            raise BadReply("the replica's answer has no choice")
        return None
    if not isinstance(choices[0], dict):
        raise BadReply(f"the replica's choice is {type(choices[0]).__name__}, not an object")
    return choices[0]


def reply(obj: dict) -> Reply:
    """:class:`Reply` of a chat completion (``message``) or a completion
    (``text``); tool calls without a name are dropped (nothing could run
    them), ids a replica left out are made up (``call_`` + 24 hex digits).
    Raises :class:`BadReply` for an answer without a choice, or whose
    choice has neither a ``message`` object nor a ``text`` string."""
    ch = _first_choice(obj, True)
    msg = ch.get("message")
    if not isinstance(msg, dict):
        text = ch.get("text")
        if not isinstance(text, str):
            raise BadReply("the replica's choice has neither a 'message' object nor a 'text'")
        return Reply(text, finish=ch.get("finish_reason"))
    text = msg.get("content")
    calls = []
    tool_calls = msg.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise BadReply(f"the replica's 'tool_calls' is {type(tool_calls).__name__}, not a list")
    for c in tool_calls or ():
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        args = fn.get("arguments")
        if not isinstance(args, str):  # some servers send an object
            args = orjson.dumps(args).decode() if args is not None else ""
        cid = c.get("id")
        calls.append(ToolCall(cid if isinstance(cid, str) and cid else new_id("call_"),
                              fn["name"], args))
    return Reply(text if isinstance(text, str) else "", _reasoning(msg), calls,
                 ch.get("finish_reason"))


def delta(chunk: dict) -> Delta:
    """:class:`Delta` of a chat-completion chunk (``delta``) or a
    completion chunk (``text``); raises :class:`BadReply` for ``choices``,
    ``delta`` or ``delta.tool_calls`` of the wrong type."""
    ch = _first_choice(chunk, False)
    if ch is None:
        return Delta()
    d = ch.get("delta")
    if not isinstance(d, dict):
        if d is not None:
            raise BadReply(f"the replica's 'delta' is {type(d).__name__}, not an object")
        text = ch.get("text")
        return Delta(text if isinstance(text, str) else "", finish=ch.get("finish_reason"))
    text = d.get("content")
    calls = []
    tool_calls = d.get("tool_calls")
    if tool_calls is not None and not isinstance(tool_calls, list):
        raise BadReply(f"the replica's 'tool_calls' is {type(tool_calls).__name__}, not a list")
    for i, c in enumerate(tool_calls or ()):
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        index = c.get("index")
        args = fn.get("arguments")
        calls.append(CallDelta(index if isinstance(index, int) else i,
                               c.get("id") if isinstance(c.get("id"), str) else None,
                               fn.get("name") if isinstance(fn.get("name"), str) else None,
                               args if isinstance(args, str) else ""))
    return Delta(text if isinstance(text, str) else "", _reasoning(d), calls,
                 ch.get("finish_reason"))


class Calls:
    """The tool calls of one stream, put together from their deltas in the
    order their indexes first came. :meth:`add` returns the call a delta
    belongs to and whether it is new (its id and name are then known: a
    delta that opens a call without a name waits for the name)."""

    __slots__ = ("by_index", "calls")

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self.by_index: dict[int, ToolCall] = {}

    def add(self, d: CallDelta) -> tuple[ToolCall, bool]:
        call = self.by_index.get(d.index)
        new = call is None
        if new:
            call = ToolCall(d.id or new_id("call_"), d.name or "")
            self.by_index[d.index] = call
            self.calls.append(call)
        elif d.name and not call.name:
            call.name = d.name
        call.arguments += d.arguments
        return call, new


def check_arguments(calls: list[ToolCall]) -> None:
    """Raise :class:`BadReply` unless every call's arguments are a JSON
    object (or empty): a streamed answer ends with the API's error event,
    a whole one gets 502 (issue 31 item 4)."""
    for c in calls:
        arguments_object(c.arguments, c.name)


def cut_by_limit(call: ToolCall, finish: str | None) -> bool:
    """Whether ``call`` was cut by the client's token limit: the answer
    ended at it (``finish`` ``length``) and the call's arguments are not a
    whole JSON object (empty: cut before they began, right after the
    name). Such a call is left out of a whole Anthropic or Ollama answer and
    is an ``incomplete`` Responses item: with empty or made-up arguments a
    client could run it, and the cut is the client's limit, never the
    replica's fault (no 502)."""
    if finish != "length":
        return False
    text = call.arguments.strip()
    if not text:
        return True
    try:
        return not isinstance(orjson.loads(text), dict)
    except orjson.JSONDecodeError:
        return True


def arguments_object(text: str, name: str) -> dict:
    """A tool call's arguments (JSON text) as the object Anthropic's
    ``input`` and Ollama's ``arguments`` are; empty text is ``{}``. Raises
    :class:`BadReply` for text that is not a JSON object (the replica's
    fault: a grammar-constrained one never sends that)."""
    if not text.strip():
        return {}
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError:
        raise BadReply(f"the replica's arguments for tool {name!r} are not JSON: "
                       f"{text[:200]!r}") from None
    if not isinstance(obj, dict):
        raise BadReply(f"the replica's arguments for tool {name!r} are not a JSON object")
    return obj


def arguments_text(args, where: str) -> str:
    """A client's tool-call arguments (an object, or JSON text as OpenAI
    clients send it) as JSON text; raises :class:`BadRequest`."""
    if isinstance(args, str):
        return args
    if args is None:
        return "{}"
    if not isinstance(args, dict):
        raise BadRequest(f"{where}: the arguments must be an object")
    return orjson.dumps(args).decode()


def function_tool(name, description, parameters, where: str) -> dict:
    """OpenAI's ``{"type": "function", "function": {...}}`` tool; raises
    :class:`BadRequest` for a nameless tool, or a schema that is not a JSON
    object or describes anything but an object."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}: a tool needs a non-empty string 'name'")
    fn: dict = {"name": name}
    if description is not None:
        if not isinstance(description, str):
            raise BadRequest(f"{where}.description must be a string")
        fn["description"] = description
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise BadRequest(f"{where}: the tool's schema must be a JSON object")
    if parameters.get("type", "object") != "object":
        # its arguments are one object in every API (Anthropic's input, Ollama's
        # arguments): a schema of another type could never be answered (issue 18,
        # finding 8: a 502 before); OpenAI and Anthropic refuse it so too
        raise BadRequest(f"{where}: the tool's schema must describe an object "
                         "(\"type\": \"object\")")
    fn["parameters"] = parameters
    return {"type": "function", "function": fn}


def named_choice(name, where: str) -> dict:
    """OpenAI's ``tool_choice`` forcing the function ``name``."""
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where}: needs the tool's 'name'")
    return {"type": "function", "function": {"name": name}}


def image_part(url: str) -> dict:
    """An OpenAI ``image_url`` content part (``url`` an http(s) or
    ``data:`` URL)."""
    return {"type": IMAGE_PART, "image_url": {"url": url}}


def content(parts: list[dict]) -> str | list[dict]:
    """Chat message content from OpenAI parts: one string when every part is
    text (what every template renders), else the parts."""
    if all(p.get("type") == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def no_projector(model: str) -> str:
    """The 400's message for images sent to a model without a multimodal
    projector (``mmproj``)."""
    return (f"image input is not supported: model '{model}' has no multimodal projector (put "
            "its mmproj file beside it, give its preset an 'mmproj' file, or use a model that "
            "has one)")
