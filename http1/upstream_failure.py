"""How an exchange on a replica connection ends short:
:class:`UpstreamFailure`, the second class of the replica connection's line
(:mod:`.upstream_state`; :class:`~.upstream.Upstream` relays the whole
exchanges). Its fields are :class:`~.upstream_state.UpstreamState`'s.

* a client that disconnects closes the replica connection, which ends the
  generation in the instance (the Exchange gets status 499);
* a replica that dies mid-body ends the client's response with an SSE
  error event and an unterminated chunked body (never a clean end); before
  the head it is an :class:`~.exchange.UpstreamError` (a 502 for the
  caller), which says whether the replica may have received the request
  (``delivered``: then it is never sent again, issue 11: a request that
  crashes its replica must not crash the replacement too), as the kernel
  tells (:mod:`~ggmux.http1.delivery`: a clean close after the replica's
  TCP acknowledged every byte we wrote was delivered; a reset, or nothing
  acknowledged, was not).
  A server that shuts its socket down with the request unread sends a FIN
  and then the reset (cpp-httplib does so after every streamed answer of
  llama-server: ``shutdown``, then ``close``), so a close with no answer
  is judged :data:`EOF_SETTLE_S` later, by whether a reset followed. A
  server that reads and drops it before closing (cpp-httplib drains the
  socket after every streamed answer of llama-server) cannot be told from
  one that died with it: a replica seen closing an idle connection just
  after a chunked answer (within :data:`CLOSES_AFTER_STREAM_S`) is
  remembered (``UpstreamPool.closes_after_chunked``), and its connections
  are closed after a chunked answer instead of being pooled;
* timeouts (issue 11, a hung replica): no response byte within the
  model's first-byte timeout, or nothing for ``stream_idle_ns`` once it
  answered, ends the exchange (504, or an SSE error event mid-stream); one
  sweep a quarter second checks the exchanges in flight
  (:class:`~ggmux.http1.pool.UpstreamPool`), so a request costs no timer;
* a proxy that stops ends every exchange in flight with a 503
  ``shutting_down`` (:data:`STOPPING_CODE`), or an SSE error event
  mid-stream.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from .connection import ERROR_CODES, HttpConnection, error_body
from .delivery import peer_reset
from .exchange import UpstreamError
from .request import Request
from .upstream_state import UpstreamState

log = logging.getLogger(__name__)

EOF_SETTLE_S = 0.01  # after a close with no answer, how long a reset may take to follow
CLOSES_AFTER_STREAM_S = 0.1  # an idle close this soon after a chunked answer: the server's habit
STOPPING_CODE = "shutting_down"  # the error code of "the server is stopping", everywhere


class UpstreamFailure(UpstreamState):
    """The ways an exchange of :class:`~.upstream.Upstream` ends short (see
    the module docstring); ``time_out`` and ``abort`` are the pool's to
    call."""

    __slots__ = ()

    def _detach(self) -> tuple[HttpConnection, Request, Callable | None]:
        client, req, done = self.client, self.req, self.on_done
        self.client = self.req = self.on_done = self.on_head = None
        self.pool.active.discard(self)
        if client is not None:
            client.write_paused_cb = None
            req.on_disconnect = None
        return client, req, done

    def _client_gone(self) -> None:
        # closing the replica connection is how the instance learns the
        # client left: it stops generating instead of finishing for nobody
        _, _, done = self._detach()
        self.closed = True
        self.transport.close()
        if done is not None:
            self.ex.status = 499
            done(self.ex)

    def _closes_after_stream(self) -> bool:
        """Whether the replica closed this connection within
        :data:`CLOSES_AFTER_STREAM_S` of the chunked answer before (its
        habit); the pool then remembers the replica so."""
        if not (self._resp_chunked and self.idle_ns
                and time.monotonic_ns() - self.idle_ns < CLOSES_AFTER_STREAM_S * 1e9):
            return False
        if self.key not in self.pool.closes_after_chunked:
            log.info("replica %s closes its connection after a chunked answer: "
                     "not pooled after one from now on", self.key)
            self.pool.closes_after_chunked.add(self.key)
        return True

    def _eof_settled(self) -> None:
        """:data:`EOF_SETTLE_S` after a close with no answer: a reset means
        the replica never read the request."""
        self._settle = None
        if self.closed:
            return
        reset = peer_reset(self.transport)
        self.closed = True
        self.pool.forget(self)
        self._fail("replica closed the connection" + (" (reset: request unread)" if reset else ""),
                   delivered=False if reset else None)
        self.transport.close()

    def _fail(self, why: str, delivered: bool | None = None) -> None:
        """Nothing more will come for the exchange. ``delivered``: whether
        the replica got the request; None: decide (see the module
        docstring); False: certainly not (a write that failed, a reset)."""
        client, req, done = self._detach()
        if client is None or done is None:
            return
        habit = False
        if not self.head_sent or self.capture:
            if self.got_bytes:
                delivered = True  # it answered something: it had the request
            elif delivered is None:
                # no answer at all, then a clean close: delivered if the
                # replica's TCP took every byte (it read the request, then
                # died or hung up); unknown, a pooled connection counts as
                # the keep-alive race and a fresh one as delivered
                acked = self.acked
                delivered = acked >= self.sent_total if acked >= 0 else not self.reused
                # most likely the server's habit, not a crash
                habit = delivered and self.reused and self._closes_after_stream()
            stale = self.reused and not self.got_bytes and not delivered
            done(UpstreamError(why, stale=stale, delivered=delivered, habit=habit))
            return
        if self.pool.closing:  # the replica went with the server
            self._cut(client, req, done, self.pool.closing, 503, "unavailable_error", False,
                      code=STOPPING_CODE)
            return
        # the code a 502 before the head gets too (proxy.answers.replica_failed)
        self._cut(client, req, done, why, 502, "server_error", code="replica_died")

    def _cut(self, client: HttpConnection, req: Request, done: Callable, why: str,
             status: int, type_: str, fault: bool = True, code: str | None = None) -> None:
        """End a relayed body short: an SSE client is told why in an error
        event (``code``: the status's own unless given; none when the
        replica's own error event already went out, so a stream carries
        exactly one), then the body is cut (no terminating chunk) so no
        client can mistake it for a clean end (an HTTP/1.0 client, whose
        body ends at the close, has only the event to go by)."""
        if self.sse and not self.sse_error:
            code = code or ERROR_CODES.get(status, status)
            client.send_chunk(b"data: " + error_body(why, type_, code) + b"\n\n")
        ex = self.ex
        ex.status = status
        ex.fault = fault
        client.close()
        client.finish(req)
        done(ex)

    def time_out(self) -> None:
        """The exchange's deadline passed (see :class:`~ggmux.http1.pool.UpstreamPool`):
        before the response head, an :class:`UpstreamError` with
        ``timeout`` (the caller answers 504); mid-body, the body is cut with
        an SSE error event and the Exchange has status 504 and
        ``timed_out``. Either way the connection is closed, which ends the
        generation in an instance that is merely slow."""
        client, req, done = self._detach()
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if client is None or done is None:
            return
        pool = self.pool
        if not self.got_bytes or not self.head_sent or self.capture:
            limit = (f"{pool.stream_idle_ns / 1e9:g} s (--stream-idle-timeout)" if self.got_bytes
                     else "the first-byte timeout (--first-byte-timeout)")
            done(UpstreamError(f"no response from the replica within {limit}",
                               delivered=True, timeout=True))
            return
        self.ex.timed_out = True
        self._cut(client, req, done, "the replica sent nothing for "
                  f"{pool.stream_idle_ns / 1e9:g} s (--stream-idle-timeout)", 504, "timeout_error")

    def abort(self, why: str) -> None:
        """End the exchange now because the proxy stops (issue 11: nothing
        accepted is dropped without an answer): before the head the client
        gets a 503 ``shutting_down``, mid-body an SSE error event and a cut
        body. The Exchange (status 503, no fault) goes to ``on_done``."""
        client, req, done = self._detach()
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if client is None or done is None:
            return
        if self.head_sent and not self.capture:
            self._cut(client, req, done, why, 503, "unavailable_error", fault=False,
                      code=STOPPING_CODE)
            return
        self.ex.status = 503
        if req.preheaded:
            client.send_chunk(b"data: " + error_body(why, "unavailable_error", STOPPING_CODE)
                              + b"\n\n")
            client.close()
            client.finish(req)
        else:
            client.send_error(req, 503, why, code=STOPPING_CODE,
                              headers=[(b"retry-after", b"5")])
        done(self.ex)
