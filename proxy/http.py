"""HTTP/1.1 server core on a plain ``asyncio.Protocol`` with httptools.

Shared by the proxy and the built-in instance. Modelled on uvicorn's
httptools protocol: parser callbacks fill one :class:`Request` per message,
requests on one connection are handled one at a time and answered in order
(pipelining), flow control is explicit (``pause_writing`` /
``resume_writing`` from the transport, ``pause_reading`` when too many
pipelined requests queue up), and every limit is a field of
:class:`HttpLimits` with a default (``add_http_limit_options`` /
``limits_from_args`` turn them into command-line options, ``http_limit_argv``
back into a child's arguments, ``fit_fd_limit`` fits ``max_connections`` to
the open-file limit).

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
* a request the server cannot frame (bad syntax, conflicting lengths, bad
  chunk size, limits, timeouts, invalid UTF-8 in a header) is answered with
  an OpenAI error envelope after the responses it was pipelined behind, and
  the connection is closed: nothing after it on the connection is executed;
* closing after an error is graceful (``write_eof``, then unread input is
  discarded for ``linger_timeout`` seconds), so the client reads the error
  instead of a reset, as nginx's lingering close does.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields
from http import HTTPStatus
from random import getrandbits

import httptools
import orjson

log = logging.getLogger(__name__)

Header = tuple[bytes, bytes]

CHUNKED = b"transfer-encoding: chunked\r\n"
"""The framing line that selects a chunked body in :meth:`HttpConnection.head`."""


@dataclass(slots=True)
class HttpLimits:
    """Limits of one HTTP server (bytes, seconds, counts).

    ``max_header_bytes``: request line plus headers (414 for the target
    alone, else 431); ``max_body_bytes``: request body, by Content-Length or
    as chunks arrive (413); ``header_timeout``: time to receive a whole head
    once its first byte arrived (408); ``body_timeout``: time to receive the
    body after the head (408); ``keepalive_timeout``: idle time before a
    keep-alive connection is closed; ``send_timeout``: time a client may
    leave the server's writes blocked (slow reader) before it is cut off;
    ``max_connections``: open connections of this server, one more is
    answered 503 and closed; ``max_pipelined``: queued requests before
    reading pauses; ``linger_timeout``: how long unread input is drained
    after an error response before the socket is dropped.

    One object is shared by all connections of one server:
    ``open_connections`` is their live count (not an option).
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    header_timeout: float = 30.0
    body_timeout: float = 300.0
    keepalive_timeout: float = 75.0
    send_timeout: float = 300.0
    max_connections: int = 4096
    max_pipelined: int = 16
    linger_timeout: float = 5.0
    open_connections: int = field(default=0, init=False, repr=False, compare=False)


# (field, help) for add_http_limit_options; the flag is the field with dashes
_OPTION_HELP = {
    "max_header_bytes": "largest request head (request line + headers) in bytes; 431 past it",
    "max_body_bytes": "largest request body in bytes; 413 past it",
    "header_timeout": "seconds to receive a request head once it started; 408 past it",
    "body_timeout": "seconds to receive a request body after its head; 408 past it",
    "keepalive_timeout": "seconds an idle keep-alive connection stays open",
    "send_timeout": "seconds a client may leave a response unread before it is cut off",
    "max_connections": "open client connections per process; more are answered 503",
    "max_pipelined": "pipelined requests queued per connection before reading pauses",
    "linger_timeout": "seconds to drain unread input after an error response",
}


def _positive(kind: type) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def add_http_limit_options(
    parser: argparse.ArgumentParser, defaults: HttpLimits | None = None
) -> None:
    """Add one option per :class:`HttpLimits` field (``--max-header-bytes``,
    ``--max-body-bytes``, ``--header-timeout``, ``--body-timeout``,
    ``--keepalive-timeout``, ``--send-timeout``, ``--max-connections``,
    ``--max-pipelined``, ``--linger-timeout``) in an "HTTP limits" group;
    ``defaults`` overrides the dataclass defaults. Read them back with
    :func:`limits_from_args`."""
    d = defaults if defaults is not None else HttpLimits()
    group = parser.add_argument_group("HTTP limits")
    for name, help_ in _OPTION_HELP.items():
        value = getattr(d, name)
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_positive(type(value)),
            default=value,
            metavar="N" if isinstance(value, int) else "SECONDS",
            help=help_ + " (default: %(default)s)",
        )


def limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """:class:`HttpLimits` from options added by :func:`add_http_limit_options`
    (a field whose option is missing keeps its default)."""
    kw = {
        f.name: getattr(args, f.name)
        for f in fields(HttpLimits)
        if f.init and hasattr(args, f.name)
    }
    return HttpLimits(**kw)


def http_limit_argv(limits: HttpLimits) -> list[str]:
    """The options that recreate ``limits`` in a child process whose parser
    has :func:`add_http_limit_options` (the supervisor passes its limits to
    each proxy this way)."""
    argv = []
    for name in _OPTION_HELP:
        argv += ["--" + name.replace("_", "-"), str(getattr(limits, name))]
    return argv


def fit_fd_limit(limits: HttpLimits, per_connection: int = 2, reserve: int = 256) -> HttpLimits:
    """Make ``max_connections`` fit this process's open-file limit.

    Each client connection of a proxy holds ``per_connection`` descriptors
    (the client's and its replica's); ``reserve`` more are kept for
    everything else. The soft ``RLIMIT_NOFILE`` is raised as far as the hard
    limit allows; where that is still too low, ``max_connections`` is
    lowered (with a warning) so that the 503 answer, not a failing
    ``accept()``, is what clients over the limit see. Returns ``limits``,
    changed in place."""
    need = limits.max_connections * per_connection + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit to %d: %s", want, e)
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(1, (soft - reserve) // per_connection)
        log.warning(
            "open-file limit %d allows %d connections, not --max-connections %d",
            soft,
            fit,
            limits.max_connections,
        )
        limits.max_connections = fit
    return limits


def new_request_id() -> bytes:
    """A fresh request id: 16 lower-case hex digits."""
    return b"%016x" % getrandbits(64)


# a client's X-Request-Id is echoed only when it is short visible ASCII
_RID_CHARS = bytes(range(0x21, 0x7F))
_RID_MAX = 128


class Request:
    """One parsed request.

    ``url`` is the raw target (``path`` and ``query`` split at ``?``),
    ``headers`` a list of ``(lower-case name, value)``, ``body`` the whole
    body as bytes or bytearray (requests are buffered; LLM request bodies are
    small), ``request_id`` the id echoed as ``x-request-id``,
    ``content_length`` -1 when absent, ``conn_tokens`` the header names the
    client's ``Connection`` header lists (hop-by-hop, never forwarded).
    ``on_disconnect`` is called once when the client goes away before the
    response finished; ``disconnected`` says it did. ``origin`` is the
    ``Origin`` header (None without one); ``extra_head`` header lines
    (``b"name: value\r\n"`` ...) every response head to it carries (CORS).
    """

    __slots__ = (
        "body",
        "body_json",
        "chunked",
        "conn_tokens",
        "content_length",
        "disconnected",
        "expect",
        "expect_continue",
        "extra_head",
        "head_only",
        "header_bytes",
        "headers",
        "hop",
        "http10",
        "keep_alive",
        "method",
        "on_disconnect",
        "origin",
        "path",
        "preheaded",
        "query",
        "request_id",
        "started_ns",
        "url",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[Header] = []
        self.body: bytes | bytearray = b""
        self.body_json: dict | None = None  # the body parsed, when a fast path did
        self.keep_alive = True
        self.path = b""
        self.query = b""
        self.disconnected = False
        self.on_disconnect: Callable[[], None] | None = None
        self.head_only = False
        self.expect_continue = False
        self.header_bytes = 0
        self.started_ns = 0
        self.request_id = b""
        self.preheaded = False  # a streaming head went out while the model loaded
        self.http10 = False
        self.content_length = -1
        self.chunked = False
        self.conn_tokens: tuple[bytes, ...] = ()
        self.expect: bytes | None = None
        self.origin: bytes | None = None
        self.extra_head = b""
        self.hop = 0  # cluster mode: forwarded by another node (proxy.cluster.HOP_*)

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
    414: "invalid_request_error",
    417: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    501: "server_error",
    502: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
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
}
LLAMA_CPP_ROUTES = frozenset((b"/completion", b"/tokenize", b"/detokenize", b"/infill",
                              b"/apply-template", b"/props", b"/slots"))


def error_code(status: int, path: bytes = b"") -> int | str:
    """The ``error.code`` for ``status``: OpenAI's string style
    (:data:`ERROR_CODES`), or the number itself on a llama.cpp route."""
    if path in LLAMA_CPP_ROUTES:
        return status
    return ERROR_CODES.get(status, "server_error" if status >= 500 else "invalid_request_error")

# headers the parser callbacks look at (one dict lookup per header)
_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION, _EXPECT, _REQUEST_ID, _ORIGIN = range(1, 7)
_SPECIAL = {
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"expect": _EXPECT,
    b"x-request-id": _REQUEST_ID,
    b"origin": _ORIGIN,
}

# deadline kinds of a connection's one timer
_IDLE, _HEAD, _BODY, _LINGER = range(1, 5)


def _connection_line(req: Request) -> bytes:
    """The response's ``connection`` header line: ``close`` when this is the
    connection's last response, ``keep-alive`` for an HTTP/1.0 client that
    keeps it, none otherwise (HTTP/1.1's default)."""
    if not req.keep_alive:
        return b"connection: close\r\n"
    return b"connection: keep-alive\r\n" if req.http10 else b""


class _Reject(Exception):
    """Raised from a parser callback to stop parsing; the answer is in
    ``HttpConnection._error``."""


def json_object(conn: HttpConnection, req: Request) -> dict | None:
    """The request body as a JSON object, or None after answering 400
    (malformed JSON, invalid UTF-8, or JSON that is not an object)."""
    try:
        body = orjson.loads(req.body)
    except orjson.JSONDecodeError as e:
        conn.send_error(req, 400, f"request body is not valid JSON: {e}")
        return None
    if not isinstance(body, dict):
        conn.send_error(req, 400, "request body must be a JSON object")
        return None
    return body


class HttpConnection(asyncio.Protocol):
    """Server side of one client connection (see the module docstring)."""

    __slots__ = (
        "_active",
        "_body_ok",
        "_chunked",
        "_closed",
        "_cork",
        "_counted",
        "_cur",
        "_deadline",
        "_discard",
        "_discarded",
        "_drain_waiters",
        "_error",
        "_head_seen",
        "_in_head",
        "_lost",
        "_max_body",
        "_max_head",
        "_on_close",
        "_pending_error",
        "_queue",
        "_queued_bytes",
        "_reading_paused",
        "_responding",
        "_send_timer",
        "_task",
        "_timer",
        "_timer_at",
        "_tkind",
        "fast",
        "handler",
        "limits",
        "loop",
        "parser",
        "transport",
        "write_paused",
        "write_paused_cb",
    )

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

    # ---- asyncio.Protocol ----------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        lim = self.limits
        lim.open_connections += 1
        self._counted = True
        if lim.open_connections > lim.max_connections:
            # answered before reading anything: the request never runs
            self._discard = True
            self._write_error(
                None,
                503,
                f"server is at its connection limit ({lim.max_connections})",
                extra=b"retry-after: 1\r\n",
            )
            self._close_gracefully()
            return
        self._set_timeout(_IDLE, lim.keepalive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = self._lost = self._discard = True
        self._cork = None
        if self._counted:
            self._counted = False
            self.limits.open_connections -= 1
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

    def data_received(self, data: bytes) -> None:
        if self._discard:
            self._discarded = True
            return
        if self._in_head:
            self._head_seen += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # the request asking to upgrade is answered normally and ends the
            # connection (on_headers_complete); CONNECT was refused there
            return
        except httptools.HttpParserError as e:
            if self._discard:  # bytes after `Connection: close`: ignored
                self._discarded = True
                return
            err = self._error
            if err is None:
                err = (400, f"malformed HTTP request: {e}")
            self._reject(*err)
            return
        # httptools buffers a header line whole before calling on_header, so
        # a head that never ends is caught on the raw byte count
        if self._in_head and self._head_seen > self._max_head:
            self._reject(431, f"request head exceeds {self._max_head} bytes")
            return
        if self._cur is not None and self._active is None:
            # a request is partly here: its head (or body) clock runs from
            # its first bytes, and more bytes do not restart it. Armed here
            # rather than in the parser callbacks: a request that arrives
            # whole (the common case) then costs no clock at all.
            kind = _HEAD if self._in_head else _BODY
            if self._tkind != kind:
                self._set_timeout(kind, self.limits.header_timeout if kind == _HEAD
                                  else self.limits.body_timeout)

    # ---- parser callbacks -------------------------------------------------
    def _fail(self, status: int, message: str) -> None:
        self._error = (status, message)
        raise _Reject(message)

    def on_message_begin(self) -> None:
        self._cur = Request()

    def on_url(self, url: bytes) -> None:
        req = self._cur
        req.url = req.url + url if req.url else url
        n = req.header_bytes = req.header_bytes + len(url)
        if n > self._max_head:
            self._fail(414, f"request target exceeds {self._max_head} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._cur
        n = req.header_bytes = req.header_bytes + len(name) + len(value) + 4
        if n > self._max_head:
            self._fail(431, f"request headers exceed {self._max_head} bytes")
        name = name.lower()
        if not value.isascii():
            try:
                value.decode()
            except UnicodeDecodeError:
                self._fail(400, f"header '{name.decode()}' is not valid UTF-8")
        req.headers.append((name, value))
        kind = _SPECIAL.get(name)
        if kind is None:
            return
        if kind == _CONTENT_LENGTH:
            try:
                req.content_length = int(value)
            except ValueError:
                self._fail(400, "Content-Length is not a number")
        elif kind == _TRANSFER_ENCODING:
            req.chunked = True
        elif kind == _CONNECTION:
            v = value.lower()
            if v != b"keep-alive" and v != b"close":  # those name no header to drop
                req.conn_tokens += tuple([t.strip() for t in v.split(b",")])
        elif kind == _EXPECT:
            req.expect = value
        elif kind == _ORIGIN:
            req.origin = value
        elif 0 < len(value) <= _RID_MAX and not value.translate(None, _RID_CHARS):
            req.request_id = value

    def on_headers_complete(self) -> None:
        req = self._cur
        p = self.parser
        req.method = method = p.get_method()
        req.keep_alive = p.should_keep_alive()
        req.http10 = p.get_http_version() == "1.0"
        if not req.request_id:
            req.request_id = b"%016x" % getrandbits(64)
        url = req.url
        q = url.find(b"?")
        if q >= 0:
            req.path, req.query = url[:q], url[q + 1 :]
        else:
            req.path = url
        req.head_only = method == b"HEAD"
        self._in_head = False
        self._head_seen = 0
        if p.should_upgrade():
            if method == b"CONNECT":
                self._fail(405, "CONNECT is not supported")
            # the upgrade is declined: answer in HTTP/1.1, then close, since
            # the parser stops at an upgrade
            req.keep_alive = False
        if req.content_length > self._max_body:
            self._fail(413, f"request body exceeds {self._max_body} bytes")
        if req.expect is not None and not req.http10:
            if req.expect.lower() != b"100-continue":
                self._fail(417, f"unsupported expectation: {req.expect.decode('latin-1')}")
            if req.content_length > 0 or req.chunked:
                req.expect_continue = True
                if self._active is None:
                    self._continue(req)

    def _continue(self, req: Request) -> None:
        """Send ``100 Continue``: the head was accepted and it is its turn."""
        req.expect_continue = False
        self._out(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        req = self._cur
        b = req.body
        if not b:
            req.body = body
        else:
            if type(b) is bytes:
                b = req.body = bytearray(b)
            b += body
        if len(req.body) > self._max_body:
            self._fail(413, f"request body exceeds {self._max_body} bytes")

    def on_message_complete(self) -> None:
        req = self._cur
        self._cur = None
        self._in_head = True
        self._head_seen = 0
        if not req.keep_alive:
            self._discard = True  # nothing after it is read
        if self._active is None:
            self._start(req)
        else:
            self._queue.append(req)
            self._queued_bytes += len(req.body)
            if not self._reading_paused and (
                len(self._queue) >= self.limits.max_pipelined
                or self._queued_bytes >= self._max_body
            ):
                self._reading_paused = True
                self.transport.pause_reading()

    # ---- request cycle ----------------------------------------------------
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
        if cur is None:
            self._set_timeout(_IDLE, self.limits.keepalive_timeout)
        elif self._in_head:
            # a request is arriving behind the one just answered: its clock
            # starts now, so a slow earlier response does not time it out
            self._set_timeout(_HEAD, self.limits.header_timeout)
        else:
            if cur.expect_continue:
                self._continue(cur)
            self._set_timeout(_BODY, self.limits.body_timeout)

    # ---- writing ------------------------------------------------------------
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
        HTTP/1.0 client of a chunked response."""
        self._responding = True
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
        self._responding = True
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

    def end_stream(self, req: Request) -> None:
        """End the body of ``req`` (the last chunk when chunked); finish it."""
        if self._chunked and self._body_ok and self._active is req and not self._closed:
            self._out(b"0\r\n\r\n")
        self.finish(req)

    # ---- errors, closing, timeouts -----------------------------------------
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
        elif self._cur is not None:
            what = "request head" if kind == _HEAD else "request body"
            limit = self.limits.header_timeout if kind == _HEAD else self.limits.body_timeout
            self._reject(408, f"{what} not received within {limit:g} s")

    def _send_timeout(self) -> None:
        self._send_timer = None
        if not self._lost and self.write_paused:
            log.info("client did not read for %g s: closing", self.limits.send_timeout)
            self._closed = True
            self.transport.abort()
