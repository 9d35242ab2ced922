"""Requests that wait for their model to load, in one proxy.

A waiting request is counted in this proxy's row of the ``waiters`` table
(the supervisor reads demand there: the count, and when the oldest came),
announced once on the command queue (``want``; a lost message costs a poll
timeout, never correctness), and parked on a future that the proxy's
table refresh resolves: ``"ready"`` when the model has a ready replica,
``"failed"`` when its load failed and it is in backoff, ``"pinned"`` when
only pinned models hold the capacity it needs (issue 34), ``"shutdown"`` when
the proxy stops (:meth:`ModelWaiters.shutdown`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import numpy as np
import posix_ipc

from ..http1 import HttpConnection, Request
from ..shm import layout as L

log = logging.getLogger(__name__)

MAX_WAITERS = 1 << 24
"""The most waiters one cell may count (the supervisor's
``proxy_rows.MAX_COUNT``): more is a corrupt cell."""


class ModelWaiters:
    """The waiting requests of one proxy.

    ``row``: this proxy's ``waiters`` rows, int64 ``(models, W_WORDS)``,
    written only here; ``mq``: the supervisor's command queue;
    ``load_wait``: seconds a request waits before giving up;
    ``keepalive``: seconds between SSE comments to a waiting stream;
    ``progress(m)``: the model's load progress, per mille."""

    def __init__(self, loop: asyncio.AbstractEventLoop, row: np.ndarray, mq,
                 load_wait: float, keepalive: float, progress: Callable[[int], int]) -> None:
        self.loop = loop
        self.row = row
        self.mq = mq
        self.load_wait = load_wait
        self.keepalive = keepalive
        self.progress = progress
        self.waiting: dict[int, set[asyncio.Future]] = {}
        # model -> when each of our waiters begins to count its wait (monotonic
        # ns: its arrival, later for a key with a drain penalty: .drain_penalty)
        self.starts: dict[int, list[int]] = {}
        self.timers: dict[int, asyncio.TimerHandle] = {}

    def __bool__(self) -> bool:
        """Whether any request waits."""
        return bool(self.waiting)

    def join(self, m: int, delay_ns: int = 0) -> int:
        """Count one more request waiting for model ``m`` and tell the
        supervisor; its wait counts for a drain from ``delay_ns`` after now
        (a key's drain penalty, :mod:`.drain_penalty`; 0: at once). Returns
        that start, for :meth:`leave`."""
        start = time.monotonic_ns() + max(0, delay_ns)
        self.starts.setdefault(m, []).append(start)
        self._write(m)
        try:
            self.mq.send(b'{"op":"want","model":%d}' % m, timeout=0)
        except posix_ipc.BusyError:
            pass  # demand is in the waiters table; the supervisor's tick sees it
        return start

    def leave(self, m: int, start: int | None = None) -> None:
        """One request no longer waits for ``m`` (served, or gave up):
        the one :meth:`join` returned ``start`` for (None: the oldest)."""
        starts = self.starts.get(m)
        if starts:
            if start is not None and start in starts:
                starts.remove(start)
            else:
                starts.remove(min(starts))
        if not starts:
            self.starts.pop(m, None)
        self._write(m)

    def _write(self, m: int) -> None:
        """This proxy's waiters cell of ``m`` from its waiters: their count,
        and the earliest start that has come (0 while none has: a cell that
        counts waiters without a time has demand, and a model with room
        loads for it, but no wait that could drain another); a timer
        writes it again when the next start comes."""
        starts = self.starts.get(m) or ()
        now = time.monotonic_ns()
        came = [t for t in starts if t <= now]
        w = self.row
        w[m, L.W_FIRST_NS] = min(came) if came else 0
        w[m, L.W_COUNT] = min(len(starts), MAX_WAITERS)
        timer = self.timers.pop(m, None)
        if timer is not None:
            timer.cancel()
        later = [t for t in starts if t > now]
        if later:
            self.timers[m] = self.loop.call_later((min(later) - now) / 1e9, self._write, m)

    def wake(self, outcome: Callable[[int], str | None]) -> None:
        """Resolve the waits of every model for which ``outcome(m)`` says
        something (``"ready"``, ``"failed"``); None leaves them waiting."""
        for m, futs in list(self.waiting.items()):
            o = outcome(m)
            if o is None:
                continue
            for f in futs:
                if not f.done():
                    f.set_result(o)

    def shutdown(self) -> None:
        """The proxy stops: every wait ends with ``"shutdown"``; no load will come."""
        for futs in self.waiting.values():
            for f in futs:
                if not f.done():
                    f.set_result("shutdown")

    async def wait(self, m: int, req: Request, conn: HttpConnection | None = None,
                   name: str = "") -> str:
        """Wait for model ``m``: ``"ready"``, ``"failed"``, ``"timeout"``,
        ``"shutdown"`` or ``"gone"`` (client disconnected). The caller
        :meth:`join` ed and must :meth:`leave`.

        With ``conn`` (a streaming request), after ``keepalive`` seconds
        the SSE head goes out and a comment every interval keeps the client
        and any proxy between from timing out during a long load (the
        llama.cpp router sends nothing until the model is ready)."""
        fut = self.loop.create_future()
        self.waiting.setdefault(m, set()).add(fut)
        req.on_disconnect = lambda: fut.done() or fut.set_result("gone")
        deadline = self.loop.time() + self.load_wait
        try:
            while True:
                left = deadline - self.loop.time()
                if left <= 0:
                    return "timeout"
                step = min(left, self.keepalive) if conn is not None else left
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), step)
                except TimeoutError:
                    if conn is None or req.disconnected:
                        continue
                    if not req.preheaded:
                        req.preheaded = True
                        conn.start_stream(req)
                    conn.send_chunk(b": waiting for %s to load (%d%%)\n\n" % (
                        name.encode(), self.progress(m) // 10))
        finally:
            req.on_disconnect = None
            s = self.waiting.get(m)
            if s is not None:
                s.discard(fut)
                if not s:
                    del self.waiting[m]


__all__ = ["ModelWaiters"]
