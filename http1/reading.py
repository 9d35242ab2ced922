"""The reading half of :class:`~.connection.HttpConnection`: bytes in, requests
out, through httptools' parser callbacks.

:class:`RequestReader`, the third class of the connection's line
(:mod:`.state`), has one job: feeding a connection's input to its parser
and turning the callbacks into :class:`~.request.Request` objects,
enforcing the head and body limits and RFC 9112's edges on the way
(trailers, versions, Host, absolute-form targets, chunk sizes: the module
docstring of :mod:`.connection` lists them). Its fields are
:class:`~.state.ConnectionState`'s; it calls the request cycle of
:class:`~.connection.HttpConnection` (``_start``, ``_continue``'s turn,
``_reject``, ``_set_timeout``).
"""

from __future__ import annotations

import re
from random import getrandbits
from time import monotonic_ns

import httptools

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from .request import HOP, TOKEN, Request
from .response import ResponseWriter

# a client's X-Request-Id is echoed only when it is short visible ASCII
_RID_CHARS = bytes(range(0x21, 0x7F))
_RID_MAX = 128

# headers the parser callbacks look at (one dict lookup per header)
(_CONTENT_LENGTH, _TRANSFER_ENCODING, _CONNECTION, _EXPECT, _REQUEST_ID, _HOST, _ORIGIN,
 _HOP, _CONTENT_TYPE) = range(1, 10)
_SPECIAL = {
    b"content-length": _CONTENT_LENGTH,
    b"transfer-encoding": _TRANSFER_ENCODING,
    b"connection": _CONNECTION,
    b"expect": _EXPECT,
    b"x-request-id": _REQUEST_ID,
    b"host": _HOST,
    b"origin": _ORIGIN,
    b"content-type": _CONTENT_TYPE,
    HOP: _HOP,
    TOKEN: _HOP,
}
_VERSIONS = frozenset(("1.1", "1.0"))  # RFC 9112 2.3: the versions this server speaks
# a chunk-size line as llhttp accepts it (RFC 9112 7.1: size, extensions, CRLF)
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]+)[ \t]*(?:;[^\r\n]*)?\r\n")
MAX_CHUNK_LINE = 4096
"""Longest chunk-size line (size and extensions), bytes; a longer one gets 413."""

# deadline kinds of a connection's one timer
_IDLE, _HEAD, _BODY, _LINGER = range(1, 5)

# llhttp errors that have a status of their own (else 400)
_PARSER_ERRORS = {
    "Invalid HTTP version": (505, "HTTP version not supported (HTTP/1.1 and HTTP/1.0 are)"),
    "Chunk size overflow": (413, "chunk size overflows"),
}


class _Reject(Exception):
    """Raised from a parser callback to stop parsing; the answer is in
    ``HttpConnection._error``."""


class RequestReader(ResponseWriter):
    """The reading half of :class:`~.connection.HttpConnection` (see the module
    docstring)."""

    __slots__ = ()

    @cython.locals(cur=Request)
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
                err = _PARSER_ERRORS.get(str(e)) or (400, f"malformed HTTP request: {e}")
                if err[0] == 413:
                    err = (413, f"{err[1]}: request body exceeds {self._max_body} bytes")
            self._reject(*err)
            return
        # httptools buffers a header line whole before calling on_header, so
        # a head that never ends is caught on the raw byte count
        if self._in_head and self._head_seen > self._max_head:
            self._reject(431, f"request head exceeds {self._max_head} bytes")
            return
        if self._chunk_at >= 0:  # a chunk's size line came in this read
            self._check_chunk(data)
            if self._discard:
                return
        cur = self._cur
        if cur is not None and cur.chunked and not self._in_head:
            # a chunk's size line may continue in the next read
            tail = self._tail
            self._tail = (data[-MAX_CHUNK_LINE:] if len(data) >= MAX_CHUNK_LINE or not tail
                          else (tail + data)[-MAX_CHUNK_LINE:])
        if self._cur is not None and self._active is None:
            # a request is partly here: its head (or body) clock runs from
            # its first bytes, and more bytes do not restart it; a body's
            # read clock restarts with each read. Armed here rather than in
            # the parser callbacks: a request that arrives whole (the common
            # case) then costs no clock at all.
            if not self._in_head:
                self._body_progress()
            elif self._tkind != _HEAD:
                self._set_timeout(_HEAD, self.limits.header_timeout)

    def _body_progress(self) -> None:
        """The body of ``_cur`` is arriving (bytes came, or its head ended)
        and its request is not being answered: time it out after
        ``body_read_timeout`` s without bytes or ``body_timeout`` s in all,
        and make it the last to be shed for a stalled body (issue 31,
        item 7; nginx's ``client_body_timeout``)."""
        lim = self.limits
        now = self.loop.time()
        if self._tkind != _BODY:
            self._body_until = now + lim.body_timeout
        wait = lim.body_read_timeout
        if now + wait > self._body_until:
            wait = self._body_until - now
        self._set_timeout(_BODY, wait)
        self.receiving = True
        self._reg.progress(self, self._ip)

    @cython.locals(cur=Request)
    def _check_chunk(self, data: bytes) -> None:
        """413 now for a chunk whose announced size does not fit what is
        left of the body limit (RFC 9112 7.1; issue 11, finding 11: a size
        of ``ffffffffffffffff`` used to wait ``body_timeout`` for bytes that
        never come).

        Runs when a chunk is still open at the end of a read whose bytes
        hold its size line. httptools does not tell the size, but it tells
        where the line ends: every byte after it in this read went to
        ``on_body`` for this chunk. The line is read from there back to the
        line feed before it (in this read or in ``_tail``)."""
        at, self._chunk_at = self._chunk_at, -1
        cur = self._cur
        if cur is None:
            return
        end = len(data) - (len(cur.body) - at)
        buf = self._tail + data[:end] if self._tail else data[:end]
        if not buf.endswith(b"\n"):
            return  # the last chunk (size 0): its trailers are arriving
        start = buf.rfind(b"\n", 0, len(buf) - 1) + 1
        if start == 0 and len(buf) >= MAX_CHUNK_LINE:
            self._reject(413, f"chunk-size line exceeds {MAX_CHUNK_LINE} bytes")
            return
        m = _CHUNK_LINE.fullmatch(buf, start)
        if m is not None and at + int(m.group(1), 16) > self._max_body:
            self._reject(413, f"chunk of {int(m.group(1), 16)} bytes: request body exceeds "
                              f"{self._max_body} bytes")

    # ---- parser callbacks -------------------------------------------------
    def _fail(self, status: int, message: str) -> None:
        self._error = (status, message)
        raise _Reject(message)

    def on_message_begin(self) -> None:
        self._cur = Request()

    @cython.locals(req=Request)
    def on_url(self, url: bytes) -> None:
        req = self._cur
        req.url = req.url + url if req.url else url
        n = req.header_bytes = req.header_bytes + len(url)
        if n > self._max_head:
            self._fail(414, f"request target exceeds {self._max_head} bytes")

    @cython.locals(req=Request)
    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._cur
        n = req.header_bytes = req.header_bytes + len(name) + len(value) + 4
        if n > self._max_head:
            self._fail(431, f"request headers exceed {self._max_head} bytes")
        if not self._in_head:
            # a chunked trailer's field (RFC 9110 6.5: never merged into the
            # header section unless its definition allows, and none of the
            # fields this server reads does): no key, session id or framing
            # can come from it, and it is not forwarded
            return
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
        elif kind == _HOST:  # on every request: tested early
            if req.host is not None:  # RFC 9112 3.2
                self._fail(400, "more than one Host header")
            req.host = value
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
        elif kind == _CONTENT_TYPE:
            req.content_type = value
        elif kind == _HOP:
            req.hop_marked = True
        elif 0 < len(value) <= _RID_MAX and not value.translate(None, _RID_CHARS):
            req.request_id = value

    @cython.locals(req=Request)
    def on_headers_complete(self) -> None:
        req = self._cur
        req.started_ns = monotonic_ns()
        p = self.parser
        version = p.get_http_version()
        if version not in _VERSIONS:  # llhttp also takes 0.9 and 2.0
            self._fail(505, f"HTTP/{version} is not supported (HTTP/1.1 and HTTP/1.0 are)")
        self.sheddable = False  # a whole head (its stale entry goes when met)
        req.method = method = p.get_method()
        req.keep_alive = p.should_keep_alive()
        req.http10 = version == "1.0"
        if not req.request_id:
            req.request_id = b"%016x" % getrandbits(64)
        url = req.url
        if url[0] != 0x2F and url != b"*" and method != b"CONNECT":  # not "/...": RFC 9112 3.2
            url = req.url = self._origin_form(url)
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
        if req.host is None and not req.http10:
            self._fail(400, "an HTTP/1.1 request needs a Host header (RFC 9112 3.2)")
        if req.content_length > self._max_body:
            self._fail(413, f"request body exceeds {self._max_body} bytes")
        if req.expect is not None and not req.http10:
            if req.expect.lower() != b"100-continue":
                self._fail(417, f"unsupported expectation: {req.expect.decode('latin-1')}")
            if req.content_length > 0 or req.chunked:
                req.expect_continue = True
                if self._active is None:
                    self._continue(req)

    def _origin_form(self, url: bytes) -> bytes:
        """The path and query of an absolute-form target (RFC 9112 3.2.2:
        a server must accept ``http://host/path``; the target's authority,
        not ``Host``, names the origin, and ggmux serves one)."""
        sep = url.find(b"://")
        if sep <= 0 or url[:sep].lower() not in (b"http", b"https"):
            self._fail(400, f"bad request target {url[:200].decode('latin-1')!r}")
        rest = url[sep + 3:]
        i = min((j for j in (rest.find(b"/"), rest.find(b"?")) if j >= 0), default=-1)
        if i < 0:
            return b"/"
        return rest[i:] if rest[i] == 0x2F else b"/" + rest[i:]

    def on_chunk_header(self) -> None:
        # the size is checked once this read is in (_check_chunk)
        self._chunk_at = len(self._cur.body)

    def on_chunk_complete(self) -> None:
        self._chunk_at = -1

    @cython.locals(req=Request)
    def _continue(self, req: Request) -> None:
        """Send ``100 Continue``: the head was accepted and it is its turn."""
        req.expect_continue = False
        self._out(b"HTTP/1.1 100 Continue\r\n\r\n")

    @cython.locals(req=Request)
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

    @cython.locals(req=Request)
    def on_message_complete(self) -> None:
        req = self._cur
        self._cur = None
        self._in_head = True
        self._head_seen = 0
        self.receiving = False
        if self._tail:
            self._tail = b""
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
