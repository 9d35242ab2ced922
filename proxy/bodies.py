"""Request bodies on the proxy: bounded in items before any work on them, and
parsed (and translated) off the event loop past a size (issue 37, item 11).

A proxy's event loop writes every stream it relays, so whatever it does for
one request delays every other tenant's tokens: a 51.5 MB Responses body of
1.59 M items stopped another stream on the same proxy for 15-19 s, 50 MB of
token ids on a plain route 2 s. Two rules:

* **items** (:func:`item_refusal`): a body's lists are bounded by named
  limits (``HttpLimits.max_messages``, ``max_input_items``,
  ``max_token_ids``), answered 413 before the body is translated or
  forwarded; nothing a model could read needs more (a context of 262,144
  tokens holds fewer messages, and fewer ids than four times that).
* **the loop** (:func:`off_loop`, :func:`read_object`): a body larger than
  ``HttpLimits.offloop_body_bytes`` is parsed, checked and translated on
  one worker thread per proxy (:data:`WORKER`), one body at a time. orjson
  holds the GIL while it parses (about 10 ms per MB), the rest (checks,
  translation: the 15 s of the 1.59 M items) is Python that hands the GIL
  back every few milliseconds, so the streams go on meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

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
    for k in ID_FIELDS:
        n = token_ids(body.get(k))
        if n > limits.max_token_ids:
            return (f"'{k}' holds {n} token ids; the most one request may send is "
                    f"{limits.max_token_ids} (--max-token-ids)")
    return None


def parse_object(limits: HttpLimits, data: bytes) -> dict:
    """``data`` as a JSON object whose items fit ``limits``; raises
    :class:`BodyError` (400: not JSON, not an object; 413: too many items)."""
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


__all__ = ["WORKER", "BodyError", "is_large", "item_refusal", "off_loop", "parse_object",
           "read_object", "token_ids"]
