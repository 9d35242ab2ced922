"""The token routes of an instance, off its event loop: ``/tokenize``,
``/detokenize``, ``/apply-template`` and ``/chat/completions/input_tokens``
(what Anthropic's ``count_tokens`` becomes at the proxy).

Issue 31, item 1: these ran on the instance's event loop, which also writes
every stream's chunks, so one tenant's ``/tokenize`` of 19 MB stalled every
other tenant's stream 9.9 s. llama-server runs them on its HTTP threads
(cpp-httplib's pool), apart from the slots' loop; here :class:`TokenWork`
runs the whole of one, JSON decode, the backend's work and JSON encode, on a
thread of its own (llama.cpp's tokenizer releases the GIL through ctypes),
one at a time. What stays on a thread for long holds the GIL only in short
pieces, so the loop's thread gets it back every few milliseconds:

* the body's JSON decode (orjson holds the GIL throughout) is bounded by
  ``HttpLimits.max_tokenize_bytes`` (``--max-tokenize-bytes``): a larger
  body is answered 413 before it is parsed, by the proxy and here.
  llama-server has no limit of its own for these routes but its HTTP
  payload limit (cpp-httplib's, 100 MiB);
* lists of ids are built, checked and encoded in slices of :data:`SLICE`
  (:func:`encode_answer`, ``ModelContext.tokenize``, ``check_tokens``).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import orjson

from ..http1 import HttpConnection, Request, json_object
from ..http1.limits import HttpLimits, detokenize_refusal, tokenize_body_refusal

log = logging.getLogger(__name__)

TOKEN_KINDS = frozenset(("tokenize", "detokenize", "apply_template", "input_tokens"))
"""The route kinds (``instance.server.ROUTES``) served by :class:`TokenWork`."""

SLICE = 1 << 16
"""Ids encoded per GIL-holding ``orjson.dumps`` (well under a millisecond)."""
TEXT_SLICE = 1 << 20
"""Characters of a text encoded per ``orjson.dumps`` (a few ms at most)."""


def _big(v) -> bool:
    return (type(v) is list and len(v) > SLICE) or (type(v) is str and len(v) > TEXT_SLICE)


def encode_answer(out: dict) -> bytes:
    """``out`` as JSON (orjson's bytes), a list longer than :data:`SLICE`
    or a text longer than :data:`TEXT_SLICE` encoded a slice at a time, so
    that no single call holds the GIL for all of it (3 M ids: 26 ms in one
    ``orjson.dumps``; 10 MB of detokenized text, 70-90 ms)."""
    if not any(_big(v) for v in out.values()):
        return orjson.dumps(out)
    parts = [b"{"]
    for i, (k, v) in enumerate(out.items()):
        if i:
            parts.append(b",")
        parts.append(orjson.dumps(k) + b":")
        if type(v) is list and len(v) > SLICE:
            parts.append(b"[")
            parts.append(b",".join([orjson.dumps(v[j:j + SLICE])[1:-1]
                                    for j in range(0, len(v), SLICE)]))
            parts.append(b"]")
        elif type(v) is str and len(v) > TEXT_SLICE:  # slices of code points: each is JSON
            parts.append(b'"')
            parts.append(b"".join([orjson.dumps(v[j:j + TEXT_SLICE])[1:-1]
                                   for j in range(0, len(v), TEXT_SLICE)]))
            parts.append(b'"')
        else:
            parts.append(orjson.dumps(v))
    parts.append(b"}")
    return b"".join(parts)


class _Refusal:
    """Collects what :func:`json_object` would answer, off the loop."""

    __slots__ = ("message", "status")

    def __init__(self) -> None:
        self.status = 0
        self.message = ""

    def send_error(self, req: Request, status: int, message: str) -> None:
        self.status, self.message = status, message


class TokenWork:
    """Runs the token routes of one instance on one thread of its own.

    ``backend``: the instance's :class:`~ggmux.instance.backend.Backend`
    (its ``tokenize``, ``detokenize``, ``apply_template``, ``input_tokens``
    may be called from that thread); ``error_fields``: the error envelope's
    fields of a ``ValueError`` (``instance.server.error_fields``). One thread:
    token requests wait for each other, never for a generation, and never
    take the threads that set generations up."""

    def __init__(self, backend, error_fields) -> None:
        self.backend = backend
        self.error_fields = error_fields
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="tokens")

    def too_large(self, conn: HttpConnection, req: Request) -> bool:
        """Answer 413 (and True) when the body is over
        ``conn.limits.max_tokenize_bytes``; checked before it is parsed."""
        refusal = tokenize_body_refusal(conn.limits, req.body, req.path == b"/detokenize")
        if refusal is None:
            return False
        conn.send_error(req, 413, refusal)
        return True

    async def serve(self, conn: HttpConnection, req: Request, kind: str) -> None:
        """Answer ``req`` (a ``kind`` of :data:`TOKEN_KINDS`): 413 past the
        size limit, 400 for a body that is not a JSON object or that the
        backend refuses (``ValueError``), else 200 and the backend's answer.
        Other errors propagate (the HTTP core answers 500)."""
        if self.too_large(conn, req):
            return
        loop = asyncio.get_running_loop()
        status, data, fields = await loop.run_in_executor(self.executor, self.answer, kind, req,
                                                          conn.limits)
        if status == 200:
            conn.send_response(req, 200, data)
        else:
            conn.send_error(req, status, data, **fields)

    def answer(self, kind: str, req: Request,
               limits: HttpLimits) -> tuple[int, bytes | str, dict]:
        """On the worker thread: ``(200, JSON bytes, {})`` or ``(status,
        message, error fields)`` (413 for a ``/detokenize`` of more ids than
        ``limits.max_detokenize_tokens``)."""
        refusal = _Refusal()
        body = json_object(refusal, req)
        if body is None:
            return refusal.status, refusal.message, {}
        ids = body.get("tokens") if kind == "detokenize" else None
        if type(ids) is list:
            too_many = detokenize_refusal(limits, len(ids))
            if too_many is not None:
                return 413, too_many, {}
        try:
            out = getattr(self.backend, kind)(body)
        except ValueError as e:
            return 400, str(e), self.error_fields(e)
        return 200, encode_answer(out), {}
