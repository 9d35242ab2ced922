"""Forwarding one request to a replica and streaming its answer back.

An :class:`Upstream` is a keep-alive connection to one replica, kept in a
:class:`UpstreamPool` between requests. Its httptools response-parser
callbacks write straight to the client's transport (no queue, no task per
chunk):

* the response head is rewritten (hop-by-hop headers dropped, exactly one
  framing header: the upstream's ``content-length``, else chunked);
* backpressure both ways: a client whose transport pauses writing pauses
  reading from the upstream until it resumes;
* a client that disconnects closes the upstream connection, which ends the
  generation in the instance;
* an upstream that dies mid-body ends the client's response with an SSE
  error event and an unterminated chunked body (never a clean end); before
  the head it becomes a 502.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import httptools

from .http import HttpConnection, Request, error_body, status_line

log = logging.getLogger(__name__)

# RFC 9110 7.6.1 connection-specific headers, plus framing we set ourselves
HOP_BY_HOP = frozenset(
    (
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"content-length",
        b"host",
        b"expect",
    )
)


class UpstreamError(Exception):
    """The replica could not be reached or failed before answering."""


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a replica (see module docstring)."""

    def __init__(self, pool: "UpstreamPool", key: int) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = None
        self.client: HttpConnection | None = None
        self.req: Request | None = None
        self.done: asyncio.Future | None = None
        self.closed = False
        self.first_byte_ns = 0
        self.complete = True
        self.head_sent = False
        self.chunked = False
        self.sse = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self._resp_keepalive = True
        self.bytes_out = 0

    # ---- asyncio.Protocol ----------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.done is not None and not self.done.done():
            if not self.complete:
                # it may still be a complete close-delimited body
                try:
                    self.parser.feed_data(b"")
                except Exception:
                    pass
            if not self.done.done():
                self._fail("replica closed the connection" if exc is None else f"replica connection lost: {exc}")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(f"bad response from replica: {e}")
            self.transport.close()

    def pause_writing(self) -> None:  # request bodies are small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # ---- one exchange ------------------------------------------------------------
    def send(self, client: HttpConnection, req: Request, data: bytes) -> asyncio.Future:
        """Write a whole request; the future resolves when the response was
        forwarded (result: status) or fails with :class:`UpstreamError`
        before anything reached the client."""
        self.client = client
        self.req = req
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers = []
        self.chunked = False
        self.head_sent = False
        self.complete = False
        self.first_byte_ns = 0
        self.sse = False
        self.bytes_out = 0
        self.done = client.loop.create_future()
        client.write_paused_cb = self._client_paused
        req.on_disconnect = self._client_gone
        self.transport.write(data)
        if client.write_paused:
            self.transport.pause_reading()
        return self.done

    def _client_paused(self, paused: bool) -> None:
        t = self.transport
        if t is None or self.closed:
            return
        if paused:
            t.pause_reading()
        else:
            t.resume_reading()

    def _client_gone(self) -> None:
        # closing the upstream connection is how the instance learns the client
        # left: it stops generating instead of finishing for nobody
        if self.transport is not None:
            self.transport.close()
        if self.done is not None and not self.done.done():
            self.done.set_result(499)

    # ---- parser callbacks --------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        p = self.parser
        self.status = p.get_status_code()
        self._resp_keepalive = p.should_keep_alive()
        client, req = self.client, self.req
        framing = None
        out = []
        for k, v in self.headers:
            if k == b"content-length":
                framing = b"content-length: " + v + b"\r\n"
            elif k in HOP_BY_HOP:
                continue
            else:
                if k == b"content-type" and v.startswith(b"text/event-stream"):
                    self.sse = True
                out.append((k, v))
        if framing is None:
            framing = b"transfer-encoding: chunked\r\n"
            self.chunked = True
        rid = req.header(b"x-request-id")
        if rid is not None:
            out.append((b"x-request-id", rid))
        head = client.head(req, self.status, out, framing)
        self.head_sent = True
        client.write(head)

    def on_body(self, body: bytes) -> None:
        if self.first_byte_ns == 0:
            self.first_byte_ns = time.monotonic_ns()
        client = self.client
        if self.req.head_only:
            return
        if self.chunked:
            client.write(b"%x\r\n%s\r\n" % (len(body), body))
        else:
            client.write(body)
        self.bytes_out += len(body)
        if client.write_paused and not self.closed:
            self.transport.pause_reading()

    def on_message_complete(self) -> None:
        self.complete = True
        client, req = self.client, self.req
        if self.chunked and not req.head_only:
            client.write(b"0\r\n\r\n")
        client.write_paused_cb = None
        req.on_disconnect = None
        self.client = self.req = None
        done = self.done
        self.done = None
        if self._resp_keepalive and not self.closed:
            self.pool.release(self)
        elif self.transport is not None:
            self.transport.close()
        client.finish(req)
        if done is not None and not done.done():
            done.set_result(self.status)

    # ---- failure ---------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        client, req, done = self.client, self.req, self.done
        self.done = None
        if client is None or done is None or done.done():
            return
        client.write_paused_cb = None
        req.on_disconnect = None
        if not self.head_sent:
            done.set_exception(UpstreamError(why))
            return
        # mid-body: tell an SSE client why, then cut the body short so no
        # client can mistake it for a clean end
        if self.chunked and self.sse:
            ev = b"data: " + error_body(why, "server_error", 502) + b"\n\n"
            client.write(b"%x\r\n%s\r\n" % (len(ev), ev))
        client.close()
        client.finish(req)
        done.set_result(502)


class UpstreamPool:
    """Idle keep-alive connections per replica port."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_idle: int = 64) -> None:
        self.loop = loop
        self.idle: dict[int, deque[Upstream]] = {}
        self.max_idle = max_idle

    async def acquire(self, port: int, host: str = "127.0.0.1") -> Upstream:
        """An idle connection to ``port`` or a new one.

        Raises :class:`UpstreamError` when the replica refuses."""
        q = self.idle.get(port)
        while q:
            up = q.pop()
            if not up.closed and up.transport is not None and not up.transport.is_closing():
                return up
        try:
            _, up = await self.loop.create_connection(lambda: Upstream(self, port), host, port)
        except OSError as e:
            raise UpstreamError(f"cannot connect to replica on port {port}: {e}") from e
        return up

    def release(self, up: Upstream) -> None:
        q = self.idle.setdefault(up.key, deque())
        if len(q) >= self.max_idle:
            up.transport.close()
            return
        q.append(up)

    def forget(self, up: Upstream) -> None:
        q = self.idle.get(up.key)
        if q is not None:
            try:
                q.remove(up)
            except ValueError:
                pass

    def drop_port(self, port: int) -> None:
        """Close idle connections to a replica that went away."""
        q = self.idle.pop(port, None)
        while q:
            up = q.pop()
            if up.transport is not None:
                up.transport.close()


def request_head(req: Request, port: int, body_len: int, extra: Callable | None = None) -> bytes:
    """The request head sent to a replica: same method and target, our own
    Host and Content-Length, hop-by-hop headers removed."""
    parts = [req.method, b" ", req.url, b" HTTP/1.1\r\nhost: 127.0.0.1:%d\r\n" % port]
    for k, v in req.headers:
        if k not in HOP_BY_HOP:
            parts.append(k + b": " + v + b"\r\n")
    parts.append(b"content-length: %d\r\n\r\n" % body_len)
    return b"".join(parts)


__all__ = ["Upstream", "UpstreamPool", "UpstreamError", "request_head", "status_line"]
