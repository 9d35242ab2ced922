"""``GET /logs`` and ``GET /logs/stream``: the log ring, as text and live.

The supervisor writes every log line of its own and of its children into the
log ring (:mod:`ggmux.shm.logring`), one JSON record per line::

    {"ts": 1733040000.123, "level": "INFO", "src": "smollm2-135m#0",
     "model": "smollm2-135m", "replica": 0, "msg": "..."}

``src`` is ``supervisor``, ``proxy-N``, ``NAME#SLOT`` (an instance),
``measure:NAME`` or ``spare``. ``?model=NAME`` (or an alias) keeps the lines
of that model's children and the supervisor's lines that name it;
``?lines=N`` keeps the last N (``/logs``: all the ring holds;
``/logs/stream``: the last 100 first, then every new line).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from urllib.parse import parse_qs

import orjson
import posix_ipc

from ...http1 import HttpConnection, Request
from ...shm.logring import LogRing, format_line

log = logging.getLogger(__name__)

POLL_S = 0.2  # how often a proxy with /logs/stream subscribers looks for new lines
KEEPALIVE_S = 15.0
STREAM_BACKLOG = 100  # lines a new /logs/stream subscriber gets first


def model_filter(name: str | None) -> Callable[[dict], bool]:
    """Predicate for ``?model=name``: the model's own children's lines, and
    the supervisor's that name it (``loading NAME in slot 0``); every line
    when ``name`` is None. A name matches whole (``a`` is not in ``a-b``)."""
    if name is None:
        return lambda rec: True
    # names hold '/', ':', '.' and '-' (org/repo:Q4_K_M): around a match
    # none of those may continue it, but "a: text" ends the name "a"
    word = re.compile(r"(?<![\w.\-/:])" + re.escape(name) + r"(?![\w.\-/]|:\S)")

    def keep(rec: dict) -> bool:
        model = rec.get("model")
        if model is not None:
            return model == name
        return bool(word.search(rec.get("msg", "")))

    return keep


def _decode(payloads: list[bytes]) -> list[dict]:
    out = []
    for p in payloads:
        try:
            rec = orjson.loads(p)
        except orjson.JSONDecodeError:
            continue
        if type(rec) is dict:
            out.append(rec)
    return out


async def follow(tail, conn: HttpConnection, req: Request, backlog: list, empty: bytes,
                 key, poll_s: float) -> None:
    """Serve one SSE subscriber of a ring ``tail`` (:class:`LogTail`,
    :class:`~.requests.RequestLog`: ``subs``, ``loop``, ``timer``,
    ``_poll``) on a stream already started: ``backlog`` records as
    ``data:`` events (else the ``empty`` comment), then ``(conn, req)`` is
    in ``tail.subs`` with ``key`` (its filter) until the client leaves;
    the tail's poll runs every ``poll_s`` seconds while anyone follows."""
    for rec in backlog:
        conn.send_chunk(b"data: " + orjson.dumps(rec) + b"\n\n")
    if not backlog:
        conn.send_chunk(empty)
    sub = (conn, req)
    tail.subs[sub] = key
    gone = tail.loop.create_future()
    req.on_disconnect = lambda: gone.done() or gone.set_result(None)
    if tail.timer is None:
        tail.timer = tail.loop.call_later(poll_s, tail._poll)
    try:
        await gone
    finally:
        tail.subs.pop(sub, None)
        conn.finish(req)


class LogTail:
    """One proxy's reader of the log ring and its ``/logs/stream`` subscribers.

    ``ring_name`` is the ring's shm name (attached on first use: the
    supervisor creates it before the proxies start). While there are
    subscribers, the ring's head is checked every :data:`POLL_S` seconds and
    new records go to each subscriber whose filter keeps them; a comment
    every :data:`KEEPALIVE_S` seconds keeps idle streams open."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring_name: str) -> None:
        self.loop = loop
        self.ring_name = ring_name
        self.ring: LogRing | None = None
        self.subs: dict[tuple[HttpConnection, Request], Callable[[dict], bool]] = {}
        self.cursor = 0
        self.timer: asyncio.TimerHandle | None = None
        self.quiet_s = 0.0

    def _ring(self) -> LogRing | None:
        if self.ring is None:
            try:
                self.ring = LogRing.attach(self.ring_name)
            except (OSError, ValueError, posix_ipc.Error) as e:  # missing or foreign: say so, serve nothing
                log.warning("log ring %s unavailable: %s", self.ring_name, e)
                return None
        return self.ring

    @staticmethod
    def _lines_param(query: dict, default: int | None) -> int | None:
        vals = query.get("lines")
        if not vals:
            return default
        n = int(vals[0])  # ValueError: the caller answers 400
        if n < 0:
            raise ValueError("negative")
        return n

    def _open(self, conn: HttpConnection, req: Request, default: int | None):
        """``(ring, lines)`` for a ``/logs`` request (``lines``: its
        ``?lines=``, else ``default``), or None once it got its error: 400
        for a bad ``lines``, 503 when the ring is not there."""
        try:
            n = self._lines_param(parse_qs(req.query.decode("latin-1")), default)
        except ValueError:
            conn.send_error(req, 400, "'lines' must be a whole number >= 0")
            return None
        ring = self._ring()
        if ring is None:
            conn.send_error(req, 503, "the log ring is not available")
            return None
        return ring, n

    def text(self, conn: HttpConnection, req: Request, model: str | None) -> None:
        """``GET /logs``: the lines the ring holds, oldest first, as text."""
        opened = self._open(conn, req, None)
        if opened is None:
            return
        ring, n = opened
        keep = model_filter(model)
        recs = [r for r in _decode(ring.read(None)[0]) if keep(r)]
        if n is not None:
            recs = recs[-n:] if n else []
        body = "".join(format_line(r) + "\n" for r in recs).encode()
        conn.send_response(req, 200, body, b"text/plain; charset=utf-8")

    async def stream(self, conn: HttpConnection, req: Request, model: str | None) -> None:
        """``GET /logs/stream``: SSE, one ``data: {record}`` per line, the
        last ``?lines=`` (default :data:`STREAM_BACKLOG`) first, then new
        lines as they come, for as long as the client stays."""
        opened = self._open(conn, req, STREAM_BACKLOG)
        if opened is None:
            return
        ring, n = opened
        keep = model_filter(model)
        if self.subs:
            self._flush()  # the others get what came since the last poll ...
        else:
            self.cursor = ring.head  # (nobody was reading: start from now)
        # ... so the backlog ends where the next poll starts
        payloads, _, _ = ring.read(None, until=self.cursor)
        backlog = [r for r in _decode(payloads) if keep(r)]
        backlog = backlog[-n:] if n else []
        conn.start_stream(req, headers=[(b"x-accel-buffering", b"no")])
        await follow(self, conn, req, backlog, b": no log lines yet\n\n", keep, POLL_S)

    def _flush(self) -> None:
        ring = self.ring
        if ring is None or ring.head == self.cursor:
            return
        payloads, self.cursor, lost = ring.read(self.cursor)
        if lost:
            note = {"ts": time.time(), "level": "WARNING", "src": "proxy", "model": None,
                    "replica": None, "msg": "log lines were dropped (the ring overflowed)"}
            payloads = [orjson.dumps(note), *payloads]
        recs = _decode(payloads)
        for (conn, _), keep in list(self.subs.items()):
            chunk = b"".join(b"data: " + orjson.dumps(r) + b"\n\n" for r in recs if keep(r))
            if chunk:
                conn.send_chunk(chunk)

    def _poll(self) -> None:
        self.timer = None
        if not self.subs:
            return
        before = self.cursor
        self._flush()
        self.quiet_s = 0.0 if self.cursor != before else self.quiet_s + POLL_S
        if self.quiet_s >= KEEPALIVE_S:
            self.quiet_s = 0.0
            for conn, _ in list(self.subs):
                conn.send_chunk(b": keep-alive\n\n")
        self.timer = self.loop.call_later(POLL_S, self._poll)
