"""The connections a proxy keeps to its replicas, and the exchanges on them.

:class:`UpstreamPool` holds idle keep-alive :class:`~ggmux.http1.upstream.Upstream`
connections per replica, opens new ones, forwards one request with the
keep-alive race's single retry (:meth:`UpstreamPool.forward`), and watches
the exchanges in flight: their first-byte and stream-idle deadlines (issue
11, a hung replica) and, when the proxy stops, their end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from .connection import HttpConnection
from .exchange import Exchange, UpstreamError
from .request import Request
from .upstream import Upstream

log = logging.getLogger(__name__)

LOCAL_HOST = "127.0.0.1"


def _settle(fut: asyncio.Future,
            on_end: Callable[[Exchange], None] | None = None) -> Callable[[object], None]:
    """An ``on_done`` that resolves ``fut`` (unless it was cancelled),
    calling ``on_end`` first, at once, with an :class:`Exchange` (not an
    :class:`UpstreamError`)."""

    def done(result: object) -> None:
        if on_end is not None and type(result) is Exchange:
            on_end(result)
        if not fut.done():
            fut.set_result(result)

    return done


class UpstreamPool:
    """Idle keep-alive connections per replica (``max_idle`` each), and the
    exchanges in flight.

    ``idle`` holds local replicas' connections by port (what the proxy
    prunes when a replica leaves the ready set); ``idle_remote`` holds
    remote upstreams' by ``(host, port)``, so two remotes on one port never
    share a connection. ``active`` holds the connections with an exchange
    in flight: :meth:`sweep` times them out (``stream_idle_ns``: nothing
    received for this long once the replica answered, 0: no limit; the
    first-byte limit comes per exchange) and :meth:`abort_all` ends them
    when the proxy stops; meanwhile ``closing`` says why (a replica that
    stops with the server and cuts a stream is not a replica failure).
    ``keep_bodies``: each exchange keeps its answer's first bytes
    (:data:`~.upstream.KEEP_BYTES`, for the request ring's excerpts)."""

    SWEEP_S = 0.25  # how often deadlines are checked: timeouts are that coarse

    def __init__(self, loop: asyncio.AbstractEventLoop, max_idle: int = 64,
                 stream_idle_s: float = 0.0, keep_bodies: bool = False) -> None:
        self.loop = loop
        self.keep_bodies = keep_bodies
        self.idle: dict[int, deque[Upstream]] = {}
        self.idle_remote: dict[tuple[str, int], deque[Upstream]] = {}
        self.max_idle = max_idle
        self.active: set[Upstream] = set()
        self.closing = ""  # set while the proxy stops: why a cut stream ends
        self.stream_idle_ns = int(stream_idle_s * 1e9)
        self._sweeper: asyncio.TimerHandle | None = None
        # replicas seen closing a connection right after a chunked answer
        # (llama-server): their connections are not pooled after one
        self.closes_after_chunked: set[int | tuple[str, int]] = set()

    def start_sweeping(self) -> None:
        """Check the deadlines of the exchanges in flight every
        :attr:`SWEEP_S` seconds from now on."""
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(self.SWEEP_S, self._sweep_tick)

    def _sweep_tick(self) -> None:
        self._sweeper = self.loop.call_later(self.SWEEP_S, self._sweep_tick)
        self.sweep(time.monotonic_ns())

    def sweep(self, now_ns: int) -> int:
        """Time out every exchange whose deadline is before ``now_ns``
        (:meth:`Upstream.time_out`); returns how many."""
        late = [up for up in self.active if up.deadline_ns and up.deadline_ns < now_ns]
        for up in late:
            log.warning("replica on %s timed out (%s)", up.key,
                        "stream idle" if up.got_bytes else "no first byte")
            up.time_out()
        return len(late)

    def abort_all(self, why: str) -> int:
        """End every exchange in flight with ``why`` (:meth:`Upstream.abort`);
        returns how many."""
        ups = list(self.active)
        for up in ups:
            up.abort(why)
        return len(ups)

    def _bucket(self, key: int | tuple[str, int]) -> dict:
        return self.idle if type(key) is int else self.idle_remote

    def take_idle(self, key: int | tuple[str, int]) -> Upstream | None:
        """An idle pooled connection (``reused`` set) to the local replica
        on port ``key`` or the remote ``(host, port)``, or None."""
        q = self._bucket(key).get(key)
        while q:
            up = q.pop()
            if not up.closed and not up.transport.is_closing():
                up.reused = True
                return up
        return None

    async def acquire(self, port: int, host: str = LOCAL_HOST, fresh: bool = False) -> Upstream:
        """An idle connection to ``host:port`` (``reused`` set) or, when
        there is none or ``fresh`` is set, a new one.

        Raises :class:`UpstreamError` when the replica refuses."""
        key = port if host == LOCAL_HOST else (host, port)
        up = None if fresh else self.take_idle(key)
        if up is not None:
            return up
        try:
            _, up = await self.loop.create_connection(lambda: Upstream(self, key), host, port)
        except OSError as e:
            raise UpstreamError(f"cannot connect to replica at {host}:{port}: {e}") from e
        return up

    async def forward(
        self, port: int, client: HttpConnection, req: Request, data: bytes,
        host: str = LOCAL_HOST, *, first_byte_ns: int = 0,
        on_head: Callable[[Exchange], None] | None = None, capture: bool = False,
        on_end: Callable[[Exchange], None] | None = None,
    ) -> Exchange:
        """Send ``data`` (a whole request: :func:`request_head` + body) to
        the replica at ``host:port`` and relay its response to ``client``
        (``first_byte_ns``, ``on_head``, ``capture``: see :meth:`Upstream.send`).
        ``on_end`` is called with the Exchange as soon as it is over, before
        the end of the response leaves for the client (and before this
        coroutine resumes): bookkeeping that a client who saw the end must
        find done, such as the in-flight count.

        A pooled connection the replica closed before it got the request is
        replaced by a fresh one once (nothing reached the client yet).
        Returns the :class:`Exchange` (status 499: the client left first,
        nothing to answer); raises :class:`UpstreamError` when the replica
        could not answer at all."""
        retried = False
        while True:
            up = await self.acquire(port, host, fresh=retried)
            if req.disconnected:
                self.release(up)
                return Exchange(status=499, retried=retried)
            fut = self.loop.create_future()
            up.send(client, req, data, _settle(fut, on_end), first_byte_ns, on_head, capture)
            ex = await fut
            if isinstance(ex, UpstreamError):
                if ex.stale and not retried and not req.disconnected:
                    log.debug("stale pooled connection to %s:%d (%s): retrying", host, port, ex)
                    retried = True
                    continue
                raise ex
            ex.retried = retried
            return ex

    def release(self, up: Upstream) -> None:
        if up.closed:
            return
        key = up.key
        bucket = self.idle if type(key) is int else self.idle_remote
        q = bucket.get(key)
        if q is None:
            q = bucket[key] = deque()
        if len(q) >= self.max_idle:
            up.closed = True
            up.transport.close()
            return
        up.idle_ns = time.monotonic_ns()
        q.append(up)

    def forget(self, up: Upstream) -> None:
        q = self._bucket(up.key).get(up.key)
        if q:
            try:
                q.remove(up)
            except ValueError:
                pass

    def drop_port(self, port: int, host: str = LOCAL_HOST) -> None:
        """Close idle connections to a replica that went away."""
        key = port if host == LOCAL_HOST else (host, port)
        q = self._bucket(key).pop(key, None)
        while q:
            up = q.pop()
            up.closed = True
            if up.transport is not None:
                up.transport.close()

    def close(self) -> None:
        """Close every idle connection (shutdown)."""
        for port in list(self.idle):
            self.drop_port(port)
        for host, port in list(self.idle_remote):
            self.drop_port(port, host)


__all__ = ["LOCAL_HOST", "UpstreamPool"]
