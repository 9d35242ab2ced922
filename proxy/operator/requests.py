"""``GET /requests`` and ``GET /requests/stream``: the request ring, as JSON and live.

Every proxy records the requests it served in its own region of the
request ring (:mod:`ggmux.shm.requestring`, written by
:mod:`ggmux.proxy.activity`); any proxy answers these routes by reading
every region and merging the records by time. One record::

    {"time": 1733040000.123, "request_id": "6f1c...", "proxy": 0,
     "model": "smollm2-135m", "replica": 0, "where": "local",
     "api": "openai", "path": "/v1/chat/completions", "status": 200,
     "stream": true, "prompt_tokens": 31, "cached_tokens": 0,
     "generated_tokens": 64, "tokens_from": "replica",
     "wait_ms": 0.2, "ttft_ms": 41.5, "duration_ms": 812.0,
     "tokens_per_s": 82.0, "bytes": 14512}

``time``: arrival (Unix seconds); ``replica``: the slot that served it
(null: the proxy answered itself, e.g. a load that failed); ``where``:
``local``, another cluster node's name, or an upstream's ``host:port``;
``tokens_from``: ``replica`` (its usage), ``proxy`` (the stream's events
counted: generated tokens only) or null (unknown); ``wait_ms``: arrival to
forwarding (a load, a free replica); ``ttft_ms``: forwarding to the first
byte (the replica's, as ``/ps`` counts it); ``tokens_per_s``: generated
tokens over the generation's time (a stream: after its first token). With
``--log-requests-bodies``: ``prompt`` and ``answer`` excerpts too.

``GET /requests``: newest first, ``?model=NAME`` (or an alias) that
model's only, ``?limit=N`` the newest N (default: all the ring holds).
``GET /requests/stream``: server-sent events, one ``data: {record}`` per
request, the newest ``?limit=`` (default :data:`STREAM_BACKLOG`) first,
oldest of them first, then each new one as it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from urllib.parse import parse_qs

import numpy as np
import orjson

from ...http1 import HttpConnection, Request
from ...shm import requestring as Q
from ...shm.requestring import RequestRing
from ..activity import ROUTES
from .logs import follow

POLL_S = 0.2  # how often a proxy with /requests/stream subscribers looks for new records
KEEPALIVE_S = 15.0
STREAM_BACKLOG = 50  # records a new /requests/stream subscriber gets first

# what a record needs to be shown: (reg_models, remotes by slot)
View = Callable[[], tuple[list[dict], dict[int, dict]]]


def _ms(us: int) -> float | None:
    return None if us < 0 else round(us / 1000, 1)


def record_json(proxy: int, row: np.ndarray, prompt: bytes, answer: bytes,
                reg_models: list[dict], remotes: dict[int, dict]) -> dict:
    """One ring record as the JSON object of the module docstring."""
    m = int(row[Q.Q_MODEL])
    slot = int(row[Q.Q_SLOT])
    flags = int(row[Q.Q_FLAGS])
    api, path = ROUTES[int(row[Q.Q_API])] if 0 <= int(row[Q.Q_API]) < len(ROUTES) else ROUTES[0]
    gen = int(row[Q.Q_GENERATED])
    wait, ttft, total = int(row[Q.Q_WAIT_US]), int(row[Q.Q_TTFT_US]), int(row[Q.Q_DURATION_US])
    stream = bool(flags & Q.F_STREAM)
    rate = None
    if gen > 0 and ttft >= 0:
        # a stream's rate after its first token (as the page's playground
        # counts it); a whole answer's over the replica's whole time
        span, n = (total - wait - ttft, gen - 1) if stream else (total - wait, gen)
        if span > 0 and n > 0:
            rate = round(n * 1e6 / span, 1)
    remote = remotes.get(slot) if slot >= 0 else None
    where = None if slot < 0 else "local" if remote is None else (
        remote.get("node") or f"{remote.get('host')}:{remote.get('port')}")
    rid = row[Q.Q_RID : Q.Q_RID + 2].tobytes().rstrip(b"\0").decode("latin-1")
    doc = {
        "time": round(int(row[Q.Q_WALL_NS]) / 1e9, 3),
        "request_id": rid,
        "proxy": proxy,
        "model": reg_models[m]["name"] if 0 <= m < len(reg_models) else None,
        "replica": slot if slot >= 0 else None,
        "where": where,
        "api": api,
        "path": path.decode(),
        "status": int(row[Q.Q_STATUS]),
        "stream": stream,
        "prompt_tokens": _count(row[Q.Q_PROMPT]),
        "cached_tokens": _count(row[Q.Q_CACHED]),
        "generated_tokens": _count(gen),
        "tokens_from": ("replica" if flags & Q.F_USAGE_REPLICA else
                        "proxy" if flags & Q.F_USAGE_COUNTED else None),
        "wait_ms": _ms(wait),
        "ttft_ms": _ms(ttft),
        "duration_ms": _ms(total),
        "tokens_per_s": rate,
        "bytes": int(row[Q.Q_BYTES]),
    }
    if prompt or answer or int(row[Q.Q_PROMPT_LEN]) or int(row[Q.Q_ANSWER_LEN]):
        doc["prompt"] = prompt.decode("utf-8", "replace")
        doc["answer"] = answer.decode("utf-8", "replace")
    return doc


def _count(v) -> int | None:
    v = int(v)
    return None if v < 0 else v


class RequestLog:
    """One proxy's reader of the request ring and its ``/requests/stream``
    subscribers. While there are subscribers, the ring is looked at every
    :data:`POLL_S` seconds and new records go to each subscriber whose
    model filter keeps them; a comment every :data:`KEEPALIVE_S` seconds
    keeps idle streams open. ``ring``: None when it could not be attached
    (every route then answers 503)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, ring: RequestRing | None) -> None:
        self.loop = loop
        self.ring = ring
        self.subs: dict[tuple[HttpConnection, Request], int | None] = {}
        self.cursor: np.ndarray | None = None
        self.view: View | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.quiet_s = 0.0

    def _records(self, since: np.ndarray | None, view: View, model: int | None,
                 until: np.ndarray | None = None) -> tuple[list[dict], np.ndarray]:
        """Records after ``since`` (up to ``until``), oldest first, as JSON objects."""
        found, cursor = self.ring.read(since, until)
        reg_models, remotes = view()
        found.sort(key=lambda r: int(r[1][Q.Q_WALL_NS]))
        out = [record_json(p, row, prompt, answer, reg_models, remotes)
               for p, row, prompt, answer in found
               if model is None or int(row[Q.Q_MODEL]) == model]
        return out, cursor

    def _limit(self, conn: HttpConnection, req: Request, default: int | None) -> int | None | bool:
        vals = parse_qs(req.query.decode("latin-1")).get("limit")
        if not vals:
            return default
        try:
            n = int(vals[0])
            if n < 0:
                raise ValueError
        except ValueError:
            conn.send_error(req, 400, "'limit' must be a whole number >= 0")
            return False
        return n

    def _ready(self, conn: HttpConnection, req: Request) -> bool:
        if self.ring is None:
            conn.send_error(req, 503, "the request ring is not available")
            return False
        return True

    def list(self, conn: HttpConnection, req: Request, view: View, model: int | None) -> None:
        """``GET /requests``: ``{"object": "list", "data": [records, newest first]}``."""
        if not self._ready(conn, req):
            return
        n = self._limit(conn, req, None)
        if n is False:
            return
        recs, _ = self._records(None, view, model)
        recs.reverse()
        if n is not None:
            recs = recs[:n]
        conn.send_json(req, 200, {"object": "list", "data": recs})

    async def stream(self, conn: HttpConnection, req: Request, view: View,
                     model: int | None) -> None:
        """``GET /requests/stream``: SSE (module docstring), for as long as
        the client stays."""
        if not self._ready(conn, req):
            return
        n = self._limit(conn, req, STREAM_BACKLOG)
        if n is False:
            return
        self.view = view
        if self.subs:
            self._flush()  # the others get what came since the last poll ...
        else:
            self.cursor = self.ring.written()  # (nobody was reading: from now on)
        # ... so the backlog ends where the next poll starts
        backlog, _ = self._records(None, view, model, until=self.cursor)
        backlog = backlog[-n:] if n else []
        conn.start_stream(req)
        await follow(self, conn, req, backlog, b": no requests yet\n\n", model, POLL_S)

    def _flush(self) -> None:
        if self.ring is None or self.view is None or self.cursor is None:
            return
        if np.array_equal(self.ring.written(), self.cursor):
            return
        found, self.cursor = self.ring.read(self.cursor)
        found.sort(key=lambda r: int(r[1][Q.Q_WALL_NS]))
        reg_models, remotes = self.view()
        recs = [(int(row[Q.Q_MODEL]), orjson.dumps(record_json(p, row, prompt, answer,
                                                               reg_models, remotes)))
                for p, row, prompt, answer in found]
        for (conn, _), model in list(self.subs.items()):
            chunk = b"".join(b"data: " + data + b"\n\n" for m, data in recs
                             if model is None or m == model)
            if chunk:
                conn.send_chunk(chunk)

    def _poll(self) -> None:
        self.timer = None
        if not self.subs:
            return
        before = self.cursor
        self._flush()
        self.quiet_s = 0.0 if self.cursor is not before else self.quiet_s + POLL_S
        if self.quiet_s >= KEEPALIVE_S:
            self.quiet_s = 0.0
            for conn, _ in list(self.subs):
                conn.send_chunk(b": keep-alive\n\n")
        self.timer = self.loop.call_later(POLL_S, self._poll)
