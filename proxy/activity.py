"""A proxy's record of every request it served: the writer of its region of
the request ring (:mod:`ggmux.shm.requestring`; issue 22, llama-swap's
"Activity").

:meth:`Activity.record` runs once per request that named a model, as its
answer ends (the forwarding's last step; ``GET /props|/slots|/metrics
?model=`` and the proxy's own sub-requests are not recorded): time,
model, replica slot, the client's route (:data:`ROUTES`), status, token
counts, waiting time, TTFT (the replica's, as ``/ps`` counts it),
duration and bytes. Token counts come from the replica's usage line
(:mod:`ggmux.http1.usage`: a header or trailer, read without touching
the body), else from the end of its body (a ``usage`` object, llama-server's
``timings``), else the generated tokens are the stream's events as the
proxy counted them. With ``--log-requests-bodies`` (the ring was made with
excerpts) the last message of the prompt and the answer's text are kept
too, cut to the ring's excerpt size.
"""

from __future__ import annotations

import logging
import time

import orjson
import posix_ipc

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from ..http1.exchange import Exchange
from ..http1.request import Request
from ..http1.usage import parse_usage, usage_from_tail
from ..shm.requestring import (
    F_FORWARDED,
    F_KEY_REFUSED,
    F_STREAM,
    F_USAGE_COUNTED,
    F_USAGE_REPLICA,
    RequestRing,
)

log = logging.getLogger(__name__)

# the client routes a record names (Q_API is the index): (API, path)
ROUTES: tuple[tuple[str, bytes], ...] = (
    ("other", b""),
    ("openai", b"/v1/chat/completions"),
    ("openai", b"/chat/completions"),
    ("openai", b"/v1/completions"),
    ("openai", b"/completions"),
    ("openai", b"/v1/embeddings"),
    ("openai", b"/embeddings"),
    ("llama.cpp", b"/embedding"),
    ("llama.cpp", b"/completion"),
    ("llama.cpp", b"/tokenize"),
    ("llama.cpp", b"/detokenize"),
    ("llama.cpp", b"/infill"),
    ("llama.cpp", b"/rerank"),
    ("llama.cpp", b"/v1/rerank"),
    ("llama.cpp", b"/reranking"),
    ("llama.cpp", b"/apply-template"),
    ("anthropic", b"/v1/messages"),
    ("anthropic", b"/v1/messages/count_tokens"),
    ("responses", b"/v1/responses"),
    ("ollama", b"/api/chat"),
    ("ollama", b"/api/generate"),
    ("ollama", b"/api/embed"),
    ("ollama", b"/api/embeddings"),
    ("passthrough", b"/upstream/"),
    ("responses", b"/responses"),
    ("openai", b"/v1/chat/completions/input_tokens"),
    ("openai", b"/chat/completions/input_tokens"),
)
_INDEX = {path: i for i, (_, path) in enumerate(ROUTES)}
_PASSTHROUGH = _INDEX[b"/upstream/"]


def route_index(path: bytes) -> int:
    """:data:`ROUTES` index of a request's path (0: none of them)."""
    i = _INDEX.get(path)
    if i is not None:
        return i
    return _PASSTHROUGH if path[:10] == b"/upstream/" else 0


def _text(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text
        return " ".join(p.get("text", "") for p in content
                        if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def prompt_excerpt(body: bytes | bytearray) -> str:
    """What a request asked, for the ring's excerpt: the last message of
    ``messages`` (a chat), else ``prompt``, else ``input`` (as text); ""
    when the body is not JSON or has none of them."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError:
        return ""
    if not isinstance(doc, dict):
        return ""
    msgs = doc.get("messages")
    if isinstance(msgs, list) and msgs and isinstance(msgs[-1], dict):
        return _text(msgs[-1].get("content"))
    for key in ("prompt", "input", "content"):
        v = doc.get(key)
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and isinstance(v[0], str):
            return v[0]
    return ""


def _answer_piece(doc: dict) -> str:
    out = []
    choices = doc.get("choices")
    for ch in choices if isinstance(choices, list) else ():  # any JSON from a replica
        if not isinstance(ch, dict):
            continue
        for key in ("delta", "message"):
            part = ch.get(key)
            if isinstance(part, dict) and isinstance(part.get("content"), str):
                out.append(part["content"])
        if isinstance(ch.get("text"), str):
            out.append(ch["text"])
    if isinstance(doc.get("content"), str):  # llama.cpp's /completion
        out.append(doc["content"])
    return "".join(out)


def answer_excerpt(body: bytes | bytearray, sse: bool) -> str:
    """The text of an answer's body (the start of it): the content of each
    event of a stream, else of the JSON answer (chat, completion, or
    llama.cpp's ``content``); "" for anything else."""
    if not sse:
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError:
            return ""
        return _answer_piece(doc) if isinstance(doc, dict) else ""
    out = []
    for line in bytes(body).split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        try:
            doc = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            continue  # the event cut at the end of what was kept
        if isinstance(doc, dict):
            out.append(_answer_piece(doc))
    return "".join(out)


def _cut(text: str, n: int) -> bytes:
    """``text`` as UTF-8, at most ``n`` bytes, cut at a character boundary."""
    data = text.encode()
    if len(data) <= n:
        return data
    return data[:n].decode("utf-8", "ignore").encode()


class Activity:
    """The request ring as one proxy writes it (``index``: its region).
    Attached at start (the supervisor makes the ring first); when it is
    missing or foreign, nothing is recorded (logged once)."""

    def __init__(self, ring_name: str, index: int) -> None:
        self.index = index
        self.ring: RequestRing | None = None
        try:
            self.ring = RequestRing.attach(ring_name)
        except (OSError, ValueError, posix_ipc.Error) as e:
            log.warning("request ring %s unavailable (no request is recorded): %s", ring_name, e)
        self.excerpt = self.ring.shape.excerpt if self.ring is not None else 0
        # called with (req, m, slot, prompt, cached, generated) as each request
        # ends (the keys' settlement and the spend of priced replicas: proxy.keyed)
        self.on_end = None

    @cython.locals(req=Request, ex=Exchange, now=cython.longlong, started=cython.longlong,
                   prompt=cython.longlong, cached=cython.longlong, gen=cython.longlong,
                   ttft=cython.longlong, wait=cython.longlong, size=cython.longlong,
                   flags=cython.longlong, sent=cython.longlong)
    def record(self, req: Request, m: int, slot: int, ex: Exchange | None, status: int) -> None:
        """One request to model ``m`` ended: forwarded to replica ``slot``
        with :class:`Exchange` ``ex`` (its ``status``, unless the client got
        an error for a success the replica sent: ``req.status``, a
        translation's 502; issue 31 item 4), or answered by the proxy itself
        with ``status`` (``slot`` -1, ``ex`` None: a load that failed, every
        replica busy, the client gone while waiting)."""
        ring = self.ring
        if ring is None and self.on_end is None:
            return
        now = time.monotonic_ns()
        started = req.started_ns or now
        prompt = cached = gen = ttft = -1
        wait = now - started
        size = flags = 0
        if ex is not None:
            status = ex.status
            if status < 400 and req.status >= 400:  # the client got an error: that counts
                status = req.status
            sent = ex.sent_ns or now
            wait = sent - started
            if ex.first_byte_ns:
                ttft = (ex.first_byte_ns - sent) // 1000
            size = ex.bytes_out
            if ex.sse:
                flags = F_STREAM
            counts = parse_usage(ex.usage) if ex.usage is not None else None
            if counts is None and ex.tail:
                counts = usage_from_tail(ex.tail)
            if counts is not None:
                prompt, cached, gen = counts
                flags |= F_USAGE_REPLICA
            elif ex.sse and ex.events:
                gen = max(0, ex.events - 1)  # one event a token, but [DONE]
                flags |= F_USAGE_COUNTED
        if req.key_row >= 0 and req.key_hold is None:
            # its key refused it (it never counted in the key's windows): the ledger
            # says so, so that other nodes do not count it either (ledger/sync.py)
            flags |= F_KEY_REFUSED
        if self.on_end is not None:
            self.on_end(req, m, slot, prompt, cached, gen)
        if ring is None:
            return
        if req.hop:
            flags |= F_FORWARDED  # the node the client asked records it for the ledger
        ptext = atext = b""
        if self.excerpt:
            ptext = _cut(prompt_excerpt(req.body), self.excerpt)
            if ex is not None and ex.kept:
                atext = _cut(answer_excerpt(ex.kept, ex.sse), self.excerpt)
        ring.write(self.index, (
            time.time_ns() - (now - started), m, slot, route_index(req.path), status,
            prompt, cached, gen, wait // 1000, ttft, (now - started) // 1000, flags, size,
            len(ptext), len(atext), req.request_id[:16],
            req.key_row), ptext, atext)  # Q_KEY: the key table's row (-1: no keys-file key)
