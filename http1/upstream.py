"""Forwarding one request to a replica and streaming its answer back.

An :class:`Upstream` is a keep-alive connection to one replica, kept in a
:class:`~ggmux.http1.pool.UpstreamPool` between requests. Its httptools response-parser
callbacks write straight to the client's connection (no queue, no task per
chunk):

* the response head is rewritten: hop-by-hop headers dropped (RFC 9110
  7.6.1: the fixed list and whatever ``Connection`` names, in both
  directions), exactly one framing header (the replica's
  ``content-length``, else chunked, which the client core turns into a
  close-delimited body for HTTP/1.0), the client's ``x-request-id``
  forwarded to the replica and echoed back;
* backpressure both ways: a client whose transport pauses writing pauses
  reading from the replica until it resumes, so a slow reader holds at most
  the transport's high-water mark plus one read;
* :meth:`~ggmux.http1.pool.UpstreamPool.forward` retries once, on a fresh connection, when a
  pooled connection turns out to have been closed by the replica before it
  got the request (the keep-alive race every pooling proxy has, or a
  replica that died while idle);
* the replica's verdict on itself: :data:`~ggmux.http1.verdict.REPLICA_HEADER`
  (``fault``: its own failure; ``refused``: it is stopping or asleep and did
  not act on the request, which may go elsewhere), read from the head and
  not relayed;
* an exchange that ends short (the client leaves, the replica dies or goes
  silent, the proxy stops) is :mod:`.upstream_failure`'s: whether the
  replica got the request (never sent twice when it may have), the SSE
  error event and the cut body, the timeouts.

:class:`Upstream` is the last class of a line of three, each a module, as
the client connection's is: its fields are
:class:`~.upstream_state.UpstreamState`'s, its endings short
:class:`~.upstream_failure.UpstreamFailure`'s.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import httptools

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from .connection import CHUNKED, Header, HttpConnection, status_line
from .delivery import bytes_acked
from .exchange import Exchange, UpstreamError
from .heads import HOP_BY_HOP, RESPONSE_DROP, SSE_HEADERS, request_head
from .request import Request
from .upstream_failure import EOF_SETTLE_S, UpstreamFailure
from .usage import USAGE_HEADER
from .verdict import REPLICA_HEADER, replica_fault


class Pool(Protocol):
    """What an :class:`Upstream` needs of the pool that holds it
    (:class:`~ggmux.http1.pool.UpstreamPool`): the connections with an
    exchange in flight (``active``), the replicas seen closing after a
    chunked answer, the stream-idle limit (ns; 0: none), why a cut stream
    ends while the proxy stops (``closing``; empty: it does not), whether
    each answer's first :data:`KEEP_BYTES` are kept (``keep_bodies``), and
    taking a connection back (``release``) or dropping it (``forget``)."""

    active: set[Upstream]
    closes_after_chunked: set[int | tuple[str, int]]
    stream_idle_ns: int
    closing: str
    keep_bodies: bool

    def release(self, up: Upstream) -> None: ...

    def forget(self, up: Upstream) -> None: ...


_ERROR_EVENT = b'data: {"error"'  # how an SSE error event begins (llama.cpp's, ggmux's)
_ERROR_EVENT_LEN = len(_ERROR_EVENT)
KEEP_BYTES = 64 << 10  # of an answer's body kept for the request ring's excerpt (when kept)


class Upstream(UpstreamFailure):
    """One keep-alive connection to a replica (see module docstring): an
    asyncio protocol (uvloop calls it as one; no asyncio base class, so
    that the build can make it a C type: ``upstream.pxd``)."""

    __slots__ = ()

    def __init__(self, pool: Pool, key: int | tuple[str, int]) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser: httptools.HttpResponseParser | None = None
        self.client: HttpConnection | None = None  # set while an exchange runs
        self.req: Request | None = None
        self.on_done: Callable[[Exchange | UpstreamError], None] | None = None
        self.on_head: Callable[[Exchange], None] | None = None
        self.ex = Exchange()
        self.closed = False
        self.reused = False  # taken from the pool (may be stale)
        self.got_bytes = False  # the replica answered something to this request
        self.head_sent = False
        self.capture = False  # collect the response into the Exchange, relay nothing
        self.sse = False
        self.sse_error = False  # an error event was relayed: the stream told its end
        self.sse_tail = b""  # the last bytes relayed, for an event split across reads
        self.status = 0
        self.headers: list[Header] = []
        self.conn_tokens: tuple[bytes, ...] = ()
        self.mark: bytes | None = None  # the replica's REPLICA_HEADER
        self.until_close = False  # body ends when the replica closes
        self.paused = False
        self._resp_keepalive = True
        self._resp_chunked = False  # the last answer came chunked
        self.idle_ns = 0  # when it last went back to the pool
        self.err_body: bytearray | None = None
        self.finished = False  # the response is whole (completed at the end of the read)
        self.junk = False  # the replica sent more than the response: not reused
        self.deadline_ns = 0  # the exchange times out after this (0: never)
        self.sent_total = 1  # bytes written on this connection, the SYN counted as TCP does
        self.acked = -1  # bytes_acked when the replica closed (-1: unknown)
        self._settle: asyncio.TimerHandle | None = None  # judging a close with no answer
        self._on_paused = self._client_paused  # bound once, not per request
        self._on_gone = self._client_gone

    @property
    def first_byte_ns(self) -> int:
        """First body byte of the current (or last) exchange, 0 if none."""
        return self.ex.first_byte_ns

    # ---- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:  # (asyncio.BaseProtocol's: requests are small)
        pass

    def resume_writing(self) -> None:
        pass

    def eof_received(self) -> bool:
        # the socket is still open here: what did the replica acknowledge?
        if self.client is not None and not self.got_bytes:
            self.acked = bytes_acked(self.transport)
            # a reset may follow the FIN (the request was unread): keep the
            # socket a moment to see it (see upstream_failure's docstring)
            self._settle = asyncio.get_running_loop().call_later(EOF_SETTLE_S, self._eof_settled)
            return True
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if self._settle is not None:
            self._settle.cancel()
            self._settle = None
        self.closed = True
        self.pool.forget(self)
        if self.client is None:
            self._closes_after_stream()
            return
        if self.until_close and self.head_sent and exc is None:
            self._complete()  # a close-delimited body ends here
        elif exc is None:
            if self.acked < 0 and not self.got_bytes:
                self.acked = bytes_acked(self.transport)
            self._fail("replica closed the connection")
        else:
            # a reset: the replica's socket was gone, or closed with our
            # request unread (a clean close after reading it is a FIN)
            self._fail(f"replica connection lost: {exc}",
                       delivered=False if isinstance(exc, ConnectionResetError) else None)

    def data_received(self, data: bytes) -> None:
        client = self.client
        if client is None:
            # bytes on an idle connection: the replica is confused, drop it
            self.closed = True
            self.transport.close()
            return
        self.got_bytes = True
        idle = self.pool.stream_idle_ns
        if idle:
            self.deadline_ns = time.monotonic_ns() + idle
        client.cork()  # what this read produces leaves in one write
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.closed = True
            self.transport.close()
            if not self.finished:
                self._fail(f"bad response from replica: {e}")
            # else: bytes after a whole response; it stands, the connection goes
        finally:
            if self.finished and self.client is client:
                # completed only now that the parser is done with this read: the
                # connection may go straight to the next (pipelined) request,
                # which must not see the rest of this read
                self._complete()
            else:
                client.uncork()

    # ---- one exchange ------------------------------------------------------------
    @cython.locals(req=Request)
    def send(
        self,
        client: HttpConnection,
        req: Request,
        data: bytes,
        on_done: Callable[[Exchange | UpstreamError], None],
        first_byte_ns: int = 0,
        on_head: Callable[[Exchange], None] | None = None,
        capture: bool = False,
    ) -> None:
        """Write a whole request and relay the response to ``client``.

        ``on_done`` is called exactly once, possibly before this returns:
        with the :class:`Exchange` when the response was relayed (status
        499: the client left first; 502: the replica died mid-body; 504: it
        went silent mid-body), or with an :class:`UpstreamError` when
        nothing reached the client. ``first_byte_ns``: no response byte
        within this many nanoseconds ends it (0: no limit). ``on_head`` is
        called with the Exchange (``status``, ``fault`` set) when the head
        arrives. ``capture``: nothing is relayed; the Exchange comes back
        with ``headers`` (as relayed) and ``body``, for the caller to
        answer (a failure is then always an UpstreamError)."""
        self.client = client
        self.req = req
        if self.parser is None:  # kept across keep-alive exchanges
            self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = []
        self.conn_tokens = ()
        self.mark = None
        self.head_sent = False
        self.got_bytes = False
        self.sse = False
        self.sse_error = False
        self.sse_tail = b""
        self.until_close = False
        self.err_body = None
        self.finished = False
        self.capture = capture
        self.on_head = on_head
        now = time.monotonic_ns()
        self.ex = Exchange(sent_ns=now)
        if self.pool.keep_bodies:
            self.ex.kept = bytearray()
        self.deadline_ns = now + first_byte_ns if first_byte_ns else 0
        self.sent_total += len(data)
        self.on_done = on_done
        self.pool.active.add(self)
        client.write_paused_cb = self._on_paused
        req.on_disconnect = self._on_gone
        try:
            self.transport.write(data)
        except RuntimeError as e:  # closed under us since acquire(): nothing went out
            self.closed = True
            self._fail(f"replica connection closed: {e}", delivered=False)
            return
        if client.write_paused:
            self._client_paused(True)

    def _client_paused(self, paused: bool) -> None:
        if self.closed or paused == self.paused:
            return
        self.paused = paused
        if paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    # ---- parser callbacks --------------------------------------------------------
    # Once the response is whole (``finished``), anything more the replica
    # sends in the same read is junk: ignored, and the connection is not
    # reused (an answer nobody asked for must not become the next request's).
    def on_message_begin(self) -> None:
        if self.finished:
            self.junk = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.finished:
            return
        if self.head_sent:  # a trailer: only the usage line is read, nothing relayed
            if name.lower() == USAGE_HEADER:
                self.ex.usage = value
            return
        name = name.lower()
        if name == b"connection":
            v = value.lower()
            if v != b"keep-alive" and v != b"close":  # those name no header to drop
                self.conn_tokens += tuple([t.strip() for t in v.split(b",")])
        self.headers.append((name, value))

    @cython.locals(req=Request)
    def on_headers_complete(self) -> None:
        if self.finished:
            return
        p = self.parser
        status = p.get_status_code()
        if status < 200:  # interim (100 Continue ...): not forwarded
            self.headers = []
            self.conn_tokens = ()
            return
        self.status = status
        self._resp_keepalive = p.should_keep_alive()
        self._resp_chunked = False
        client, req = self.client, self.req
        framing = CHUNKED
        upstream_chunked = False
        tokens = self.conn_tokens
        out = []
        for k, v in self.headers:
            if k in RESPONSE_DROP:
                if k == b"content-length":
                    framing = b"content-length: %s\r\n" % v
                elif k == b"transfer-encoding":
                    upstream_chunked = True
                    self._resp_chunked = True
                elif k == REPLICA_HEADER:
                    self.mark = v.strip().lower()
                elif k == USAGE_HEADER:
                    self.ex.usage = v
                continue
            if tokens and k in tokens:
                continue
            if k == b"content-type" and v.startswith(b"text/event-stream"):
                self.sse = True
            out.append((k, v))
        if self.sse:
            self.ex.sse = True
            names = {k for k, _ in out}
            out += [h for h in SSE_HEADERS if h[0] not in names]
        if status >= 500:
            if self.mark == b"refused":
                # it did not act on the request (stopping, asleep): the
                # caller may send it elsewhere; this response is not relayed
                self.finished = True  # the rest of this read is ignored
                self.closed = True
                self.transport.close()
                _, _, done = self._detach()
                if done is not None:
                    done(UpstreamError(f"the replica did not take the request ({status})",
                                       refused=True))
                return
            self.ex.fault = replica_fault(status, self.mark)
        self.until_close = (
            framing is CHUNKED
            and not upstream_chunked
            and status != 204
            and status != 304
            and not req.head_only
        )
        if self.on_head is not None:
            self.ex.status = status
            self.on_head(self.ex)
        if self.capture:
            self.head_sent = True  # (to the caller, not the client)
            self.ex.headers = out
            self.err_body = bytearray()
            if req.head_only:
                self.parser = None
                self.finished = True
            return
        if req.preheaded:
            # the proxy already sent a 200 SSE head (keep-alives while the
            # model loaded): relay the body into it; an error answer becomes
            # an SSE error event
            self.head_sent = True
            self.sse = True
            if status >= 400:
                self.err_body = bytearray()
            return
        client.write(client.head(req, status, out, framing))
        self.head_sent = True
        if req.head_only:
            # the parser cannot be told the request was HEAD and would wait
            # for the body the headers announce; the next send gets a new one
            self.parser = None
            self.finished = True

    @cython.locals(ex=Exchange)
    def on_body(self, body: bytes) -> None:
        if self.finished:  # a body after HEAD's head, or after the response
            self.junk = True
            return
        client = self.client
        if self.err_body is not None:
            self.err_body += body
            return
        ex = self.ex
        if self.sse:
            # llama-server's prompt_progress chunks (return_progress, which the
            # proxy asks of the built-in instance for a translated stream) are
            # neither a first token nor a token: TTFT and the counted tokens
            # skip them (issue 37: the requests log showed 30 s of TTFT and 10
            # tokens for a request that decoded none in 297 s)
            n = body.count(b"data: ")
            if n:
                n -= body.count(b'"prompt_progress"')
                if n > 0:
                    ex.events += n
                    if not ex.first_byte_ns:
                        ex.first_byte_ns = time.monotonic_ns()
            if not self.sse_error:
                self._watch_errors(body)
        elif not ex.first_byte_ns:
            ex.first_byte_ns = time.monotonic_ns()
        client.send_chunk(body)
        ex.bytes_out += len(body)
        ex.tail = body  # the usage, when the replica sends no usage line
        kept = ex.kept
        if kept is not None and len(kept) < KEEP_BYTES:
            kept += body
        if client.write_paused and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def _watch_errors(self, body: bytes) -> None:
        """Note an error event in the relayed SSE body (the replica's own
        word on why its stream ends, e.g. an instance that stops): a cut
        that follows adds no second one (issue 18, finding 11)."""
        # (find, not `in`: on bytes, CPython 3.11's `in` first tries its
        # operand as an integer, building and dropping a TypeError)
        if body.find(_ERROR_EVENT) >= 0 or (self.sse_tail and (
                self.sse_tail + body[:_ERROR_EVENT_LEN]).find(_ERROR_EVENT) >= 0):
            self.sse_error = True
        self.sse_tail = body[-_ERROR_EVENT_LEN:]

    def on_message_complete(self) -> None:
        if self.status == 0 or self.finished:  # interim response, or junk
            return
        self.finished = True  # data_received completes the exchange

    @cython.locals(req=Request, ex=Exchange)
    def _complete(self) -> None:
        client, req, done = self._detach()
        # this exchange's outcome, taken before the connection can be reused:
        # ending the response may start the client's next pipelined request,
        # which may take this very connection (and a new Exchange) at once
        ex = self.ex
        ex.status = self.status
        err = self.err_body
        self.err_body = None
        if self.paused and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        if (self._resp_keepalive and not self.closed and not self.until_close and not self.junk
                and not (self._resp_chunked and self.key in self.pool.closes_after_chunked)):
            self.pool.release(self)
        elif not self.closed:
            self.closed = True
            self.transport.close()
        if self.capture:
            ex.body = bytes(err) if err is not None else b""
        elif err is not None:
            client.send_chunk(b"data: " + (bytes(err) or b'{"error":{}}') + b"\n\n")
            client.close()  # an error: no clean end
            client.finish(req)
        else:
            client.cork()  # (a close-delimited body ends outside data_received)
            client.end_stream(req)
        # the bookkeeping (the in-flight count) before the end leaves: a
        # client that saw its response end must never find it still in flight
        # (issue 22: GET /ps right after a stream showed it, on a busy host)
        if done is not None:
            done(ex)
        client.uncork()


__all__ = [
    "HOP_BY_HOP",
    "Upstream",
    "request_head",
    "status_line",
]
