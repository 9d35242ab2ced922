"""How a response leaves a connection: status lines, OpenAI's error
envelope, and :class:`ResponseWriter`, the writing half of
:class:`~.connection.HttpConnection`.

:class:`ResponseWriter` is the second class of the connection's line
(:mod:`.state`) with one job: framing and writing the responses of one
connection (a whole response, a chunked stream, or a head and raw bytes;
corked writes; the error answer of a request that cannot be framed). Its
fields are :class:`~.state.ConnectionState`'s (``transport``, ``_cork``,
``_chunked``, ``_body_ok``, ``_responding``, ``_closed``, ``_lost``, ...);
``finish`` and ``_active`` are the request cycle's
(:class:`~.connection.HttpConnection`).
"""

from __future__ import annotations

from collections.abc import Iterable
from http import HTTPStatus

import orjson

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from .request import Header, Request, new_request_id
from .state import ConnectionState

CHUNKED = b"transfer-encoding: chunked\r\n"
"""The framing line that selects a chunked body in :meth:`HttpConnection.head`."""


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
    414: "invalid_request_error",
    415: "invalid_request_error",  # issue 31, item 14: the API's own type, as every 4xx here
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",  # llama.cpp's ERROR_TYPE_NOT_SUPPORTED
    502: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
    505: "invalid_request_error",
}
# HTTP status -> OpenAI-style string ``error.code`` (issue 14: one code
# style). llama.cpp's numeric code (the status) stays on llama.cpp's own
# routes, LLAMA_CPP_ROUTES, where llama.cpp's web UI and tools read it.
ERROR_CODES = {
    400: "invalid_request_error",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    414: "request_too_large",
    417: "expectation_failed",
    429: "rate_limit_exceeded",
    431: "request_too_large",
    500: "server_error",
    501: "not_implemented",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "gateway_timeout",
    505: "http_version_not_supported",
}
LLAMA_CPP_ROUTES = frozenset((b"/completion", b"/tokenize", b"/detokenize", b"/infill",
                              b"/apply-template", b"/props", b"/slots"))


def error_code(status: int, path: bytes = b"") -> int | str:
    """The ``error.code`` for ``status``: OpenAI's string style
    (:data:`ERROR_CODES`), or the number itself on a llama.cpp route."""
    if path in LLAMA_CPP_ROUTES:
        return status
    return ERROR_CODES.get(status, "server_error" if status >= 500 else "invalid_request_error")


@cython.locals(req=Request)
def _connection_line(req: Request) -> bytes:
    """The response's ``connection`` header line: ``close`` when this is the
    connection's last response, ``keep-alive`` for an HTTP/1.0 client that
    keeps it, none otherwise (HTTP/1.1's default)."""
    if not req.keep_alive:
        return b"connection: close\r\n"
    return b"connection: keep-alive\r\n" if req.http10 else b""


class ResponseWriter(ConnectionState):
    """The writing half of :class:`~.connection.HttpConnection` (see the module
    docstring)."""

    __slots__ = ()

    def _out(self, data: bytes) -> None:
        cork = self._cork
        if cork is None:
            self.transport.write(data)
        else:
            cork.append(data)

    def write(self, data: bytes) -> None:
        """Raw bytes of the current response (nothing once closing)."""
        if not self._closed:
            self._out(data)

    def cork(self) -> None:
        """Collect writes until :meth:`uncork` and send them in one go: the
        forwarder corks around each read from a replica, so a response head
        and its body leave in one syscall instead of two or three."""
        if self._cork is None:
            self._cork = []

    def uncork(self) -> None:
        """Send what was written since :meth:`cork`."""
        out = self._cork
        if out is None:
            return
        self._cork = None
        if out and not self._lost:
            if len(out) == 1:
                self.transport.write(out[0])
            else:
                self.transport.writelines(out)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its low mark."""
        if not self.write_paused or self._closed:
            return
        fut = self.loop.create_future()
        self._drain_waiters.append(fut)
        await fut

    def head(self, req: Request, status: int, headers: Iterable[Header], framing: bytes) -> bytes:
        """Build a response head and set how its body is framed.

        ``framing`` is the one framing header line: ``b"content-length: N\\r\\n"``
        or :data:`CHUNKED`. ``headers`` must not carry framing,
        ``connection`` or ``x-request-id`` (the core sets them). Afterwards
        :meth:`send_chunk` / :meth:`end_stream` frame the body to match: no
        body for HEAD, 204, 304 and 1xx; raw and close-delimited for an
        HTTP/1.0 client of a chunked response. Sets ``req.status``."""
        self._responding = True
        req.status = status
        if status < 200 or status == 204 or status == 304:
            framing = b""
            self._chunked = False
            self._body_ok = False
        else:
            self._body_ok = not req.head_only
            if framing == CHUNKED:
                if req.http10:  # no chunks in HTTP/1.0: the close ends the body
                    framing = b""
                    req.keep_alive = False
                    self._chunked = False
                else:
                    self._chunked = True
            else:
                self._chunked = False
        parts = [status_line(status)]
        for k, v in headers:
            parts.append(b"%s: %s\r\n" % (k, v))
        parts.append(b"%sx-request-id: %s\r\n%s%s\r\n" % (framing, req.request_id,
                                                            _connection_line(req), req.extra_head))
        return b"".join(parts)

    @cython.locals(req=Request)
    def send_response(
        self,
        req: Request,
        status: int,
        body: bytes,
        content_type: bytes = b"application/json",
        headers: Iterable[Header] = (),
    ) -> None:
        """A complete response with ``content-length``; finishes ``req``
        (``req.status`` says what it was)."""
        if req.disconnected or self._closed:
            self.finish(req)
            return
        self._responding = True
        req.status = status
        if status == 204 or status == 304:
            framing = b""
            body = b""
        else:
            framing = b"content-length: %d\r\n" % len(body)
        head = b"%scontent-type: %s\r\n%sx-request-id: %s\r\n%s%s" % (
            status_line(status),
            content_type,
            framing,
            req.request_id,
            _connection_line(req),
            req.extra_head,
        )
        for k, v in headers:
            head += b"%s: %s\r\n" % (k, v)
        if req.head_only or not body:
            self._out(head + b"\r\n")
        elif len(body) > 16384:  # no copy of a big body
            self._out(head + b"\r\n")
            self._out(body)
        else:
            self._out(b"%s\r\n%s" % (head, body))
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
        """OpenAI error envelope with ``status``; ``code`` defaults to
        :func:`error_code` of the status (and the request's route)."""
        body = error_body(message, ERROR_TYPES.get(status, "error"),
                          code or error_code(status, req.path), **extra)
        self.send_response(req, status, body, headers=headers)

    def start_stream(
        self,
        req: Request,
        status: int = 200,
        content_type: bytes = b"text/event-stream",
        headers: Iterable[Header] = (),
    ) -> None:
        """Send a chunked response head; follow with send_chunk/end_stream.
        Streams carry ``Cache-Control: no-cache`` and ``X-Accel-Buffering:
        no``, so a buffering reverse proxy in front (nginx) does not hold
        them back."""
        hs = [(b"content-type", content_type), (b"cache-control", b"no-cache"),
              (b"x-accel-buffering", b"no"), *headers]
        self.write(self.head(req, status, hs, CHUNKED))

    def send_chunk(self, data: bytes) -> None:
        """Body bytes of the current response, framed as its head said."""
        if data and self._body_ok and not self._closed:
            if self._chunked:
                self._out(b"%x\r\n%s\r\n" % (len(data), data))
            else:
                self._out(data)

    def end_stream(self, req: Request, trailer: bytes = b"") -> None:
        """End the body of ``req`` (the last chunk when chunked, with
        ``trailer``: whole header lines, ``b"name: value\r\n"`` ...); finish it."""
        if self._chunked and self._body_ok and self._active is req and not self._closed:
            self._out(b"0\r\n%s\r\n" % trailer if trailer else b"0\r\n\r\n")
        self.finish(req)

    def _write_error(
        self, req: Request | None, status: int, message: str, extra: bytes = b""
    ) -> None:
        body = error_body(message, ERROR_TYPES.get(status, "error"),
                          error_code(status, req.path if req is not None else b""))
        rid = req.request_id if req is not None and req.request_id else new_request_id()
        self._out(
            b"%scontent-type: application/json\r\ncontent-length: %d\r\nx-request-id: %s\r\n"
            b"%sconnection: close\r\n\r\n%s" % (status_line(status), len(body), rid, extra, body)
        )
