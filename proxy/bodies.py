"""Request bodies on the proxy: bounded in items before any work on them, and
parsed (and translated) off the event loop past a size (issue 37, item 11).

A proxy's event loop writes every stream it relays, so whatever it does for
one request delays every other tenant's tokens: a 51.5 MB Responses body of
1.59 M items stopped another stream on the same proxy for 15-19 s, 50 MB of
token ids on a plain route 2 s. Two rules:

* **items** (:func:`item_refusal`): a body's lists are bounded by named
  limits (``HttpLimits.max_messages``, ``max_input_items``,
  ``max_token_ids``, ``max_content_parts``), answered 413 before the body
  is translated or forwarded; nothing a model could read needs more (a
  context of 262,144 tokens holds fewer messages, and fewer ids than four
  times that).
* **objects before the parse** (:func:`object_refusal`): orjson holds the
  GIL for the whole parse, on whatever thread (0.58 s for one message of
  1.7 M one-letter content parts, 46 MB: the proxy's loop, and every other
  tenant's stream on it, stood still that long). So a large body's JSON
  objects are counted first, on the worker thread, without holding the GIL
  for long (a numpy count of ``{``, and only past the bound a scan that
  skips the ``{`` inside strings, in Python steps); a body with more
  objects than its messages, input items and content parts may have all
  together (every one is an object) is answered 413 unparsed.
* **the loop** (:func:`off_loop`, :func:`read_object`): a body larger than
  ``HttpLimits.offloop_body_bytes`` is parsed, checked and translated on
  one worker thread per proxy (:data:`WORKER`), one body at a time. orjson
  holds the GIL while it parses (about 10 ms per MB), the rest (checks,
  translation: the 15 s of the 1.59 M items) is Python that hands the GIL
  back every few milliseconds, so the streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import orjson

from ..http1 import HttpConnection, Request
from ..http1.limits import HttpLimits

T = TypeVar("T")

WORKER = ThreadPoolExecutor(1, thread_name_prefix="bodies")
"""The proxy's thread for large bodies (one: they wait for each other, never
for the loop)."""

ID_FIELDS = ("prompt", "input", "tokens", "content")
"""Fields that may hold token ids (a list of ids, or of lists of ids)."""


class BodyError(ValueError):
    """A body refused before any work: ``status`` (400 or 413) and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def token_ids(v) -> int:
    """The token ids in ``v``: a list of ints, or a list holding lists of
    ints (a batch of prompts); 0 for anything else."""
    if type(v) is not list:
        return 0
    n = 0
    for x in v:
        if type(x) is int:
            n += 1
        elif type(x) is list:
            n += len(x)
    return n


def content_parts(body: dict) -> int:
    """Content parts of ``body``: the lengths of the ``content`` lists of its
    ``messages`` and ``input`` items, and of Anthropic's ``system`` list."""
    n = 0
    for key in ("messages", "input"):
        items = body.get(key)
        if type(items) is list:
            for m in items:
                if type(m) is dict:
                    c = m.get("content")
                    if type(c) is list:
                        n += len(c)
    system = body.get("system")
    if type(system) is list:
        n += len(system)
    return n


def item_refusal(limits: HttpLimits, body: dict) -> str | None:
    """Why ``body`` has more items than ``limits`` allow (module docstring),
    as the 413's message; None when it fits."""
    msgs = body.get("messages")
    if type(msgs) is list and len(msgs) > limits.max_messages:
        return (f"'messages' has {len(msgs)} items; the most one request may send is "
                f"{limits.max_messages} (--max-messages)")
    inp = body.get("input")
    if type(inp) is list and len(inp) > limits.max_input_items:
        return (f"'input' has {len(inp)} items; the most one request may send is "
                f"{limits.max_input_items} (--max-input-items)")
    parts = content_parts(body)
    if parts > limits.max_content_parts:
        return (f"the request has {parts} content parts; the most one request may send is "
                f"{limits.max_content_parts} (--max-content-parts)")
    for k in ID_FIELDS:
        n = token_ids(body.get(k))
        if n > limits.max_token_ids:
            return (f"'{k}' holds {n} token ids; the most one request may send is "
                    f"{limits.max_token_ids} (--max-token-ids)")
    return None


_STRING_OR_OBJECT = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|\{')
"""A JSON string (skipped whole, escapes and all) or an object's ``{``."""


def objects_allowed(limits: HttpLimits) -> int:
    """The most JSON objects a body within ``limits`` needs: its messages,
    input items and content parts are each one."""
    return limits.max_messages + limits.max_input_items + limits.max_content_parts


def object_refusal(limits: HttpLimits, data: bytes) -> str | None:
    """The 413's message when ``data`` holds more JSON objects than
    :func:`objects_allowed` (counted without parsing: module docstring);
    None when it holds fewer. For a large body, on the worker thread."""
    cap = objects_allowed(limits)
    raw = int(np.count_nonzero(np.frombuffer(data, np.uint8) == 0x7B))  # numpy lets the GIL go
    if raw <= cap:
        return None
    n = 0  # past the bound: the "{" inside strings do not count
    for m in _STRING_OR_OBJECT.finditer(data):  # a Python step each: the GIL goes round
        if m.end() - m.start() == 1:
            n += 1
            if n > cap:
                return (f"the request body holds more than {cap} JSON objects, more than its "
                        "messages, input items and content parts may be together "
                        "(--max-messages, --max-input-items, --max-content-parts); it was "
                        "not read")
    return None


def parse_object(limits: HttpLimits, data: bytes) -> dict:
    """``data`` as a JSON object whose items fit ``limits``; raises
    :class:`BodyError` (400: not JSON, not an object; 413: too many items,
    or, for a large body, too many objects to parse: :func:`object_refusal`)."""
    if is_large(limits, data) and (why := object_refusal(limits, data)) is not None:
        raise BodyError(413, why)
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise BodyError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BodyError(400, "request body must be a JSON object")
    why = item_refusal(limits, body)
    if why is not None:
        raise BodyError(413, why)
    return body


def is_large(limits: HttpLimits, data: bytes) -> bool:
    """Whether a body of ``data`` is worked on off the loop."""
    return len(data) > limits.offloop_body_bytes


async def off_loop(large: bool, fn: Callable[..., T], *args) -> T:
    """``fn(*args)``: on :data:`WORKER` when ``large``, else here."""
    if not large:
        return fn(*args)
    return await asyncio.get_running_loop().run_in_executor(WORKER, fn, *args)


async def read_object(conn: HttpConnection, req: Request) -> dict | None:
    """The body of ``req`` as a JSON object within the item limits (off the
    loop when large), or None after answering 400 or 413."""
    limits = conn.limits
    try:
        return await off_loop(is_large(limits, req.body), parse_object, limits, req.body)
    except BodyError as e:
        conn.send_error(req, e.status, str(e))
        return None


__all__ = ["WORKER", "BodyError", "content_parts", "is_large", "item_refusal",
           "object_refusal", "off_loop", "parse_object", "read_object", "token_ids"]
