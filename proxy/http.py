"""HTTP/1.1 server core on a plain ``asyncio.Protocol`` with httptools.

Shared by the proxy and the built-in instance. Modelled on uvicorn's
httptools protocol: parser callbacks fill one :class:`Request` per message,
requests on one connection are handled one at a time and answered in order
(pipelining), flow control is explicit (``pause_writing`` /
``resume_writing`` from the transport, ``pause_reading`` when too many
pipelined requests queue up), and every limit is a field of
:class:`HttpLimits` with a default.

A handler is ``async def handler(conn: HttpConnection, req: Request)``; it
must answer through ``conn`` (``send_response``, ``start_stream`` /
``send_chunk`` / ``end_stream``, or raw ``write`` followed by
``finish``) exactly once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus

import httptools
import orjson

log = logging.getLogger(__name__)

Header = tuple[bytes, bytes]


@dataclass(slots=True)
class HttpLimits:
    """Limits of one HTTP server (bytes and seconds).

    ``max_header_bytes``: request line plus headers (431 past it);
    ``max_body_bytes``: request body (413); ``header_timeout``: time to
    receive a whole head once its first byte arrived (408);
    ``body_timeout``: time to receive the body after the head (408);
    ``keepalive_timeout``: idle time before an idle keep-alive connection is
    closed; ``max_pipelined``: queued requests before reading pauses.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    header_timeout: float = 30.0
    body_timeout: float = 300.0
    keepalive_timeout: float = 75.0
    max_pipelined: int = 16


class Request:
    """One parsed request. ``url`` is the raw target (path and query),
    ``headers`` a list of ``(lower-case name, value)``, ``body`` the whole
    body (requests are buffered; LLM request bodies are small)."""

    __slots__ = (
        "method",
        "url",
        "headers",
        "body",
        "keep_alive",
        "path",
        "query",
        "disconnected",
        "on_disconnect",
        "head_only",
        "expect_continue",
        "header_bytes",
        "started_ns",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[Header] = []
        self.body = bytearray()
        self.keep_alive = True
        self.path = b""
        self.query = b""
        self.disconnected = False
        self.on_disconnect: Callable[[], None] | None = None
        self.head_only = False
        self.expect_continue = False
        self.header_bytes = 0
        self.started_ns = 0

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """First value of header ``name`` (lower-case bytes)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_STATUS_LINES = {s.value: b"HTTP/1.1 %d %s\r\n" % (s.value, s.phrase.encode()) for s in HTTPStatus}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))
    return line


def error_body(message: str, type_: str, code: int | str | None, **extra) -> bytes:
    """OpenAI's error envelope ``{"error": {"message", "type", "code"}}``."""
    err = {"message": message, "type": type_, "code": code}
    err.update(extra)
    return orjson.dumps({"error": err})


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
}


class HttpConnection(asyncio.Protocol):
    """Server side of one client connection."""

    def __init__(
        self,
        handler: Callable[["HttpConnection", Request], Awaitable[None]],
        limits: HttpLimits,
        on_close: Callable[["HttpConnection"], None] | None = None,
    ) -> None:
        self.handler = handler
        self.limits = limits
        self.loop = asyncio.get_event_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._cur: Request | None = None  # being parsed
        self._active: Request | None = None  # being answered
        self._queue: deque[Request] = deque()
        self._url_parts: list[bytes] = []
        self._closed = False
        self._reading_paused = False
        self.write_paused = False
        self._drain_waiters: list[asyncio.Future] = []
        self._on_close = on_close
        self._timer: asyncio.TimerHandle | None = None
        self._responding = False  # a response head was sent for _active
        self._task: asyncio.Task | None = None
        self.write_paused_cb: Callable[[bool], None] | None = None

    # ---- asyncio.Protocol ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._arm(self.limits.keepalive_timeout, self._idle_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._disarm()
        for req in (self._active, *self._queue):
            if req is not None and not req.disconnected:
                req.disconnected = True
                if req.on_disconnect is not None:
                    try:
                        req.on_disconnect()
                    except Exception:  # pragma: no cover - defensive
                        log.exception("disconnect callback failed")
        self._queue.clear()
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()
        if self._on_close is not None:
            self._on_close(self)

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.write_paused_cb is not None:
            self.write_paused_cb(True)

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.write_paused_cb is not None:
            self.write_paused_cb(False)
        for w in self._drain_waiters:
            if not w.done():
                w.set_result(None)
        self._drain_waiters.clear()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as e:
            if not self._closed and self.transport is not None and not self.transport.is_closing():
                self._reject(400, f"malformed HTTP request: {e}")

    # ---- parser callbacks -------------------------------------------------
    def on_message_begin(self) -> None:
        req = Request()
        req.started_ns = 0
        self._cur = req
        self._url_parts = []
        if self._active is None and not self._queue:
            self._arm(self.limits.header_timeout, self._head_timeout)

    def on_url(self, url: bytes) -> None:
        self._url_parts.append(url)
        self._cur.header_bytes += len(url)
        if self._cur.header_bytes > self.limits.max_header_bytes:
            self._reject(431, "request line too long")
            raise httptools.HttpParserError("limit")

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._cur
        req.header_bytes += len(name) + len(value) + 4
        if req.header_bytes > self.limits.max_header_bytes:
            self._reject(431, f"request headers exceed {self.limits.max_header_bytes} bytes")
            raise httptools.HttpParserError("limit")
        req.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        req = self._cur
        p = self.parser
        req.method = p.get_method()
        req.keep_alive = p.should_keep_alive()
        url = b"".join(self._url_parts)
        req.url = url
        q = url.find(b"?")
        if q >= 0:
            req.path, req.query = url[:q], url[q + 1 :]
        else:
            req.path = url
        req.head_only = req.method == b"HEAD"
        cls = [v for k, v in req.headers if k == b"content-length"]
        if len(cls) > 1 and len(set(cls)) > 1:
            self._reject(400, "conflicting Content-Length headers")
            raise httptools.HttpParserError("framing")
        if cls and any(k == b"transfer-encoding" for k, _ in req.headers):
            self._reject(400, "Content-Length together with Transfer-Encoding")
            raise httptools.HttpParserError("framing")
        if cls:
            try:
                n = int(cls[0])
            except ValueError:
                n = -1
            if n > self.limits.max_body_bytes:
                self._reject(413, f"request body exceeds {self.limits.max_body_bytes} bytes")
                raise httptools.HttpParserError("limit")
        expect = req.header(b"expect")
        if expect is not None and expect.lower() == b"100-continue":
            req.expect_continue = True
            if self._active is None and not self._queue and self.transport is not None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self._active is None and not self._queue:
            self._arm(self.limits.body_timeout, self._head_timeout)

    def on_body(self, body: bytes) -> None:
        req = self._cur
        req.body += body
        if len(req.body) > self.limits.max_body_bytes:
            self._reject(413, f"request body exceeds {self.limits.max_body_bytes} bytes")
            raise httptools.HttpParserError("limit")

    def on_message_complete(self) -> None:
        req = self._cur
        self._cur = None
        if self._active is None:
            self._disarm()
            self._start(req)
        else:
            self._queue.append(req)
            if len(self._queue) >= self.limits.max_pipelined and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    # ---- request cycle ----------------------------------------------------
    def _start(self, req: Request) -> None:
        self._active = req
        self._responding = False
        self._task = self.loop.create_task(self._run(req))

    async def _run(self, req: Request) -> None:
        try:
            await self.handler(self, req)
        except Exception:
            log.exception("handler failed for %s %s", req.method, req.url)
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

    def finish(self, req: Request) -> None:
        """The response to ``req`` is complete: close or move to the next."""
        if self._active is not req:
            return
        self._active = None
        self._responding = False
        if self._closed:
            return
        if not req.keep_alive:
            self.close()
            return
        if self._queue:
            nxt = self._queue.popleft()
            if self._reading_paused and len(self._queue) < self.limits.max_pipelined // 2:
                self._reading_paused = False
                self.transport.resume_reading()
            self._start(nxt)
        elif self._cur is None:
            self._arm(self.limits.keepalive_timeout, self._idle_timeout)

    # ---- writing ------------------------------------------------------------
    def write(self, data: bytes) -> None:
        if not self._closed:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low mark."""
        if not self.write_paused or self._closed:
            return
        fut = self.loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def head(self, req: Request, status: int, headers: Iterable[Header], framing: bytes) -> bytes:
        """Build a response head; ``framing`` is the one framing header line
        (``content-length: N`` or ``transfer-encoding: chunked``)."""
        self._responding = True
        parts = [status_line(status)]
        for k, v in headers:
            parts.append(k + b": " + v + b"\r\n")
        parts.append(framing)
        if not req.keep_alive:
            parts.append(b"connection: close\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

    def send_response(
        self,
        req: Request,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        headers: Iterable[Header] = (),
    ) -> None:
        """A complete response with ``content-length``; finishes ``req``."""
        if req.disconnected or self._closed:
            self.finish(req)
            return
        hs = [(b"content-type", content_type), *headers]
        head = self.head(req, status, hs, b"content-length: %d\r\n" % len(body))
        self.transport.write(head if req.head_only else head + body)
        self.finish(req)

    def send_json(self, req: Request, status: int, obj, headers: Iterable[Header] = ()) -> None:
        self.send_response(req, status, orjson.dumps(obj), headers=headers)

    def send_error(
        self,
        req: Request,
        status: int,
        message: str,
        code: int | str | None = None,
        headers: Iterable[Header] = (),
        **extra,
    ) -> None:
        """OpenAI error envelope with ``status``; ``code`` defaults to it."""
        body = error_body(message, ERROR_TYPES.get(status, "error"), code or status, **extra)
        self.send_response(req, status, body, headers=headers)

    def start_stream(
        self,
        req: Request,
        status: int = 200,
        content_type: bytes = b"text/event-stream",
        headers: Iterable[Header] = (),
    ) -> None:
        """Send a chunked response head; follow with send_chunk/end_stream."""
        hs = [(b"content-type", content_type), (b"cache-control", b"no-cache"), *headers]
        self.write(self.head(req, status, hs, b"transfer-encoding: chunked\r\n"))

    def send_chunk(self, data: bytes) -> None:
        if data:
            self.write(b"%x\r\n%s\r\n" % (len(data), data))

    def end_stream(self, req: Request) -> None:
        self.write(b"0\r\n\r\n")
        self.finish(req)

    # ---- errors, timeouts -------------------------------------------------
    def _reject(self, status: int, message: str) -> None:
        """Answer a request whose framing is unsure, then close."""
        if self._closed or self.transport is None:
            return
        if self._active is None and not self._responding:
            body = error_body(message, ERROR_TYPES.get(status, "error"), status)
            self.transport.write(
                status_line(status)
                + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body)
                + body
            )
        self.close()

    def close(self) -> None:
        if not self._closed and self.transport is not None:
            self._closed = True
            self.transport.close()

    def _arm(self, seconds: float, cb: Callable[[], None]) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, cb)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _idle_timeout(self) -> None:
        if self._active is None and self._cur is None:
            self.close()

    def _head_timeout(self) -> None:
        if self._active is None and self._cur is not None:
            self._reject(408, "request not received in time")
