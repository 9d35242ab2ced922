"""HTTP/1.1 server core on a plain ``asyncio.Protocol`` with httptools.

Shared by the proxy and the built-in instance. Modelled on uvicorn's
httptools protocol: parser callbacks fill one :class:`Request` per message,
requests on one connection are handled one at a time and answered in order
(pipelining), flow control is explicit (``pause_writing`` /
``resume_writing`` from the transport, ``pause_reading`` when too many
pipelined requests queue up), and every limit is a field of
:class:`~.limits.HttpLimits` with a default (:mod:`.limits` holds them and
their options; the names are importable from here too). The open
connections of one server are counted, per client address too, in its
:class:`~.connections.ConnectionRegistry`, which closes idle ones under
pressure.

A handler is ``async def handler(conn: HttpConnection, req: Request)``; it
must answer through ``conn`` (``send_response``, ``start_stream`` /
``send_chunk`` / ``end_stream``, or ``head`` + ``write`` + ``finish``)
exactly once. An optional ``fast(conn, req) -> bool`` runs first, inside
the parser's callback: when it returns True it took the request (and
answers it from callbacks, with no task: a task and its coroutine frames
cost a proxied request about as much as its parsing), else the handler's
task runs as usual.

What the core guarantees, so handlers need not:

* every response carries exactly one framing header (``content-length``
  or ``transfer-encoding: chunked``; none for 204/304; an HTTP/1.0 client
  gets a close-delimited body instead of chunks) and ``x-request-id``: the
  client's own when it sent a sane one, else a fresh 16-hex-digit id
  (``req.request_id``);
* HEAD gets the headers GET would get and no body;
* ``Expect: 100-continue`` is answered with ``100 Continue`` only once the
  head was accepted and it is the request's turn; an unknown expectation
  gets 417, a body over the limit 413, both without reading the body;
* RFC 9112's edges (issue 11, findings 8 and 11): fields of a chunked
  trailer are not headers (they are dropped, never seen by a handler nor
  forwarded); a chunk whose size overflows or exceeds what is left of the
  body limit gets 413 as soon as its size line is in; a version other than
  HTTP/1.0 and 1.1 gets 505; a missing ``Host`` on HTTP/1.1, or more than
  one, gets 400; an absolute-form target (``GET http://h/p``) is served as
  its path (``req.url`` is the origin form);
* a request the server cannot frame (bad syntax, conflicting lengths, bad
  chunk size, limits, timeouts, invalid UTF-8 in a header) is answered with
  an OpenAI error envelope after the responses it was pipelined behind, and
  the connection is closed: nothing after it on the connection is executed;
* closing after an error is graceful (``write_eof``, then unread input is
  discarded for ``linger_timeout`` seconds), so the client reads the error
  instead of a reset, as nginx's lingering close does.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable

import httptools

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from .connections import ADMITTED
from .limits import (  # the limits' names, importable from here as before the split
    HttpLimits,
    add_http_limit_options,
    fit_fd_limit,
    http_limit_argv,
    limits_from_args,
)
from .reading import _HEAD, _IDLE, _LINGER, MAX_CHUNK_LINE, RequestReader
from .request import Header, Request, json_object, new_request_id
from .response import (
    CHUNKED,
    ERROR_CODES,
    ERROR_TYPES,
    LLAMA_CPP_ROUTES,
    error_body,
    error_code,
    status_line,
)

log = logging.getLogger(__name__)


class HttpConnection(RequestReader):
    """Server side of one client connection (see the module docstring): an
    asyncio protocol, whose fields are :class:`~.state.ConnectionState`'s."""

    __slots__ = ()

    def __init__(
        self,
        handler: Callable[[HttpConnection, Request], Awaitable[None]],
        limits: HttpLimits,
        on_close: Callable[[HttpConnection], None] | None = None,
        fast: Callable[[HttpConnection, Request], bool] | None = None,
    ) -> None:
        self.handler = handler
        self.fast = fast
        self.limits = limits
        self.loop = asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._cur: Request | None = None  # being parsed
        self._active: Request | None = None  # being answered
        self._queue: deque[Request] = deque()  # parsed, waiting for their turn
        self._queued_bytes = 0
        self._closed = False  # no more responses: closing or closed
        self._lost = False  # connection_lost ran
        self._discard = False  # input is no longer parsed
        self._discarded = False  # input arrived after that
        self._reading_paused = False
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._on_close = on_close
        self._responding = False  # a response head was sent for _active
        self._chunked = False  # the current response body is chunked
        self._body_ok = True  # the current response may carry a body
        self._task: asyncio.Task | None = None
        self.write_paused_cb: Callable[[bool], None] | None = None
        self._error: tuple[int, str] | None = None  # set by a callback that raised _Reject
        self._pending_error: tuple[int, str] | None = None  # to answer after _active
        self._in_head = True  # the next input bytes belong to a request head
        self._head_seen = 0  # raw bytes of the head being received
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._deadline = 0.0
        self._tkind = 0
        self._send_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._cork: list[bytes] | None = None  # writes collected by cork()
        self._max_head = limits.max_header_bytes
        self._max_body = limits.max_body_bytes
        self._reg = limits.connections
        # the registry's sheddable set, which this connection is in while
        # closing it loses nothing (idle, no whole head yet, lingering)
        self._idle = self._reg.sheddable
        self.sheddable = False  # closing it now loses nothing (the registry's flag)
        self.receiving = False  # receiving a body, not answered (the registry's flag)
        self._body_until = 0.0  # loop time by which the body being received must be in
        self._ip: str | None = None  # client address, when counted per address
        self._ip_idle: OrderedDict | None = None  # the registry's sheddable set of that address
        self._chunk_at = -1  # body bytes before the open chunk whose size is unchecked
        self._tail = b""  # last bytes of the previous read, while a chunked body arrives

    # ---- asyncio.Protocol ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        lim = self.limits
        if lim.max_connections_per_ip:
            peer = transport.get_extra_info("peername")
            if type(peer) is tuple:
                self._ip = peer[0]
        self._counted = True
        refused = self._reg.admit(self._ip, lim.max_connections, lim.max_connections_per_ip,
                                  lim.max_connections * lim.shed_idle_at)
        if refused != ADMITTED:
            # answered before reading anything: the request never runs
            self._discard = True
            if refused == 429:
                msg = (f"too many connections from {self._ip} "
                       f"({lim.max_connections_per_ip}, --max-connections-per-ip)")
            else:
                msg = f"server is at its connection limit ({lim.max_connections})"
            self._write_error(None, refused, msg, extra=b"retry-after: 1\r\n")
            self._close_gracefully()
            return
        self.sheddable = True  # nothing sent yet
        self._idle[self] = None
        if self._ip is not None:
            self._ip_idle = ip_idle = self._reg.sheddable_of[self._ip]
            ip_idle[self] = None
        self._set_timeout(_IDLE, lim.keepalive_timeout)

    def shed(self) -> None:
        """Close under pressure (:class:`~.connections.ConnectionRegistry`
        chose this connection, idle, lingering or with a stalled body, and
        forgot it already). A stalled body's request is answered 408."""
        if self._counted:
            self._counted = False
            self._reg.leave(self, self._ip)
        if self._closed:  # lingering after an error: it was answered
            self._tkind = 0
            self.transport.abort()
        elif self.receiving:  # issue 31, item 7
            self.receiving = False
            self._write_error(self._cur, 408, "request body stalled: the connection was closed "
                                              "for a new one (at the connection limit)")
            self.close()
        else:
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = self._lost = self._discard = True
        self._cork = None
        if self._counted:
            self._counted = False
            self._reg.leave(self, self._ip)
        self._tkind = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        for req in (self._active, *self._queue):
            if req is not None and not req.disconnected:
                req.disconnected = True
                cb = req.on_disconnect
                if cb is not None:
                    try:
                        cb()
                    except Exception:  # pragma: no cover - defensive
                        log.exception("disconnect callback failed")
        self._queue.clear()
        self._wake_drain()
        if self._on_close is not None:
            self._on_close(self)

    def eof_received(self) -> None:  # (asyncio.Protocol's: the transport closes)
        return None

    def pause_writing(self) -> None:
        self.write_paused = True
        if self._send_timer is None and not self._lost:
            self._send_timer = self.loop.call_later(self.limits.send_timeout, self._send_timeout)
        if self.write_paused_cb is not None:
            self.write_paused_cb(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self.write_paused_cb is not None:
            self.write_paused_cb(False)
        self._wake_drain()

    def _wake_drain(self) -> None:
        if self._drain_waiters:
            for w in self._drain_waiters:
                if not w.done():
                    w.set_result(None)
            self._drain_waiters.clear()

    # ---- request cycle ----------------------------------------------------
    @cython.locals(req=Request)
    def _start(self, req: Request) -> None:
        self._active = req
        self._responding = False
        self._tkind = 0
        self._task = None
        fast = self.fast
        if fast is not None:
            try:
                if fast(self, req):
                    return
            except Exception:  # the handler's task answers instead
                log.exception("fast path failed for %s %s", req.method, req.url)
                if (self._active is not req or self._responding or self._closed
                        or req.on_disconnect is not None or self._task is not None):
                    # it may have gone upstream already: never send it twice
                    self.close()
                    return
        self._task = self.loop.create_task(self._run(req))

    @cython.locals(req=Request)
    def run_handler(self, req: Request) -> None:
        """Answer ``req``, the request being answered, with the handler's
        task: how a ``fast`` path that took a request hands it back."""
        if self._active is req and not self._closed:
            self._task = self.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            await self.handler(self, req)
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.url)
            if self._active is req:
                if not self._responding and not self._closed:
                    self.send_error(req, 500, "internal error")
                else:
                    self.close()
        else:
            if self._active is req and not self._closed:
                # a handler that forgot to answer must not wedge the connection
                log.error("handler returned without answering %s %s", req.method, req.url)
                if not self._responding:
                    self.send_error(req, 500, "no response")
                else:
                    self.close()

    @cython.locals(nxt=Request, cur=Request)
    def finish(self, req: Request) -> None:
        """The response to ``req`` is complete: close or move to the next."""
        if self._active is not req:
            return
        self._active = None
        self._responding = False
        if self._closed:
            return
        if not req.keep_alive:
            # nginx's heuristic: linger only when the client sent more than
            # the request it asked to be the last; else a plain close is safe
            if self._discarded:
                self._close_gracefully()
            else:
                self.close()
            return
        if self._queue:
            nxt = self._queue.popleft()
            self._queued_bytes -= len(nxt.body)
            if self._reading_paused and len(self._queue) < self.limits.max_pipelined // 2 + 1:
                self._reading_paused = False
                self.transport.resume_reading()
            self._start(nxt)
            return
        if self._pending_error is not None:
            self._reject(*self._pending_error)
            return
        cur = self._cur
        if cur is None or self._in_head:
            # idle keep-alive, or no whole head yet: sheddable, the newest
            self.sheddable = True
            try:
                self._idle.move_to_end(self)
            except KeyError:  # its entry was dropped while it was busy
                self._idle[self] = None
            ip_idle = self._ip_idle
            if ip_idle is not None:
                try:
                    ip_idle.move_to_end(self)
                except KeyError:
                    ip_idle[self] = None
        if cur is None:
            self._set_timeout(_IDLE, self.limits.keepalive_timeout)
        elif self._in_head:
            # a request is arriving behind the one just answered: its clock
            # starts now, so a slow earlier response does not time it out
            self._set_timeout(_HEAD, self.limits.header_timeout)
        else:
            if cur.expect_continue:
                self._continue(cur)
            self._body_progress()

    # ---- errors, closing, timeouts -----------------------------------------
    def _reject(self, status: int, message: str) -> None:
        """Answer a request whose framing is unsure, after the responses it
        was pipelined behind, then close; nothing after it is parsed."""
        self._error = None
        if self._closed:
            return
        self._discard = True
        if self._active is not None:
            if self._pending_error is None:
                self._pending_error = (status, message)
            return
        self._pending_error = None
        self._write_error(self._cur, status, message)
        self._close_gracefully()

    def _close_gracefully(self) -> None:
        """Half-close after the last response, drain what the client still
        sends, and drop the socket at its EOF or after ``linger_timeout``:
        closing with unread input would reset the connection and could
        destroy the response in flight."""
        if self._closed:
            return
        self.uncork()
        self._closed = self._discard = True
        self.receiving = False
        if self._counted:  # answered: the first to go under pressure
            self.sheddable = True
            for idle in (self._idle, self._ip_idle):
                if idle is not None:
                    idle[self] = None
                    idle.move_to_end(self, last=False)
        t = self.transport
        self._set_timeout(_LINGER, self.limits.linger_timeout)
        if self._reading_paused:
            self._reading_paused = False
            t.resume_reading()
        if t.can_write_eof():
            try:
                t.write_eof()
            except (OSError, RuntimeError):
                t.close()
        else:
            t.close()

    def close(self) -> None:
        """Close now (after flushing what was written); a client that does
        not read is dropped after ``linger_timeout``."""
        t = self.transport
        if not self._closed and t is not None:
            self.uncork()
            self._closed = self._discard = True
            self.sheddable = self.receiving = False
            self._idle.pop(self, None)
            if self._ip_idle is not None:
                self._ip_idle.pop(self, None)
            if t.get_write_buffer_size():  # else the close is immediate
                self._set_timeout(_LINGER, self.limits.linger_timeout)
            t.close()

    def _set_timeout(self, kind: int, seconds: float) -> None:
        # one lazily moved timer per connection: a later deadline only
        # updates _deadline and the timer re-arms itself when it fires, so
        # a keep-alive request cycle costs no timer operations
        at = self.loop.time() + seconds
        self._deadline = at
        self._tkind = kind
        t = self._timer
        if t is None or self._timer_at > at:
            if t is not None:
                t.cancel()
            self._timer_at = at
            self._timer = self.loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        kind = self._tkind
        if not kind or self._lost:
            return
        if self.loop.time() + 0.001 < self._deadline:
            self._timer_at = self._deadline
            self._timer = self.loop.call_at(self._deadline, self._on_timer)
            return
        self._tkind = 0
        if kind == _LINGER:
            self.transport.abort()
        elif self._active is not None:
            return
        elif kind == _IDLE:
            if self._cur is None:
                self.close()
        elif kind == _HEAD:
            if self._cur is not None:
                self._reject(408, f"request head not received within "
                                  f"{self.limits.header_timeout:g} s")
        elif self._cur is not None:
            lim = self.limits
            if self.loop.time() + 0.001 < self._body_until:
                self._reject(408, f"no request body bytes for {lim.body_read_timeout:g} s "
                                  f"(--body-read-timeout)")
            else:
                self._reject(408, f"request body not received within {lim.body_timeout:g} s")

    def _send_timeout(self) -> None:
        self._send_timer = None
        if not self._lost and self.write_paused:
            log.info("client did not read for %g s: closing", self.limits.send_timeout)
            self._closed = True
            self.transport.abort()


__all__ = [
    "CHUNKED",
    "ERROR_CODES",
    "ERROR_TYPES",
    "LLAMA_CPP_ROUTES",
    "MAX_CHUNK_LINE",
    "Header",
    "HttpConnection",
    "HttpLimits",
    "Request",
    "add_http_limit_options",
    "error_body",
    "error_code",
    "fit_fd_limit",
    "http_limit_argv",
    "json_object",
    "limits_from_args",
    "new_request_id",
    "status_line",
]
