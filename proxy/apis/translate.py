"""The relay mode of a translated request: a replica's chat-completion
answer, rewritten into the client's API as it streams.

:class:`TranslatedConnection` stands in for the client's
:class:`~ggmux.http1.HttpConnection` wherever the forwarding code
writes a response (the proxy's ``_forward`` and the
:class:`~ggmux.http1.upstream.Upstream` relay), so that code has no branch
for any API: it writes OpenAI's answer (a head, SSE or JSON body, an error
envelope, a keep-alive comment while the model loads) and this object
writes the adapter's translation to the real connection instead:

* a 200 SSE answer to a streaming request: the client's stream head goes
  out at once (``Cache-Control: no-cache``, ``X-Accel-Buffering: no``), each
  replica event is parsed (:class:`~.adapters.common.SseEvents`) and fed to
  the adapter's :class:`~.adapters.common.StreamState`, ``[DONE]`` or the end
  of the body closes it; an error event, from the replica or the proxy,
  becomes the API's error event and the connection is closed (never a
  clean end);
* any other answer is buffered whole (LLM answers without streaming are
  small) and translated at its end: a 200 JSON answer by the adapter (or,
  to a streaming request, played through the stream state), an error
  answer into the API's envelope with the replica's status; a replica that
  dies before the end gets a 502 in the API's envelope, since nothing went
  out yet;
* an answer that cannot be translated (``choices`` of the wrong shape, a
  tool call whose arguments are no JSON object: :data:`~.adapters.common.
  UNTRANSLATABLE`) is a 502 in the API's envelope, or, once the stream
  began, the API's error event and no clean end; ``req.status`` then says
  502, which the request ring records (issue 31 item 4);
* a streamed answer without content for ``--stream-keepalive`` seconds (a
  long prefill) opens and gets the API's keep-alive events
  (:meth:`TranslatedConnection.keep_alive`; issue 31 item 12); every
  answer names the hosted tools the model did not see
  (:data:`~.adapters.common.DROPPED_TOOLS_HEADER`; issue 31 item 13);
* backpressure is the real connection's: ``write_paused`` and
  ``write_paused_cb`` are its own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import orjson

from ...http1 import Header, HttpConnection, Request
from .adapters.common import (
    DROPPED_TOOLS_HEADER,
    UNTRANSLATABLE,
    Adapter,
    BadReply,
    SseEvents,
    StreamState,
    Translated,
    reason,
)
from .adapters.tools import reply

log = logging.getLogger(__name__)

class ApiErrors:
    """The client connection unchanged, but for the proxy's own errors
    (unknown model, a load that failed, every replica busy), which take the
    API's envelope: how an API passed through to a replica that speaks it
    answers when the proxy, not the replica, refuses."""

    __slots__ = ("adapter", "conn")

    def __init__(self, conn: HttpConnection, adapter: Adapter) -> None:
        self.conn = conn
        self.adapter = adapter

    def __getattr__(self, name: str):
        return getattr(self.conn, name)

    @property
    def write_paused_cb(self):
        return self.conn.write_paused_cb

    @write_paused_cb.setter
    def write_paused_cb(self, cb) -> None:
        self.conn.write_paused_cb = cb

    def send_error(self, req: Request, status: int, message: str, code=None,
                   headers: Iterable[Header] = (), **_extra) -> None:
        ctype, body = self.adapter.error(status, message)
        self.conn.send_response(req, status, body, ctype, headers)


def _as_chunk(obj: dict) -> dict:
    """A whole chat completion as one chunk (a replica that ignored
    ``stream``); raises :class:`BadReply` where :func:`~.adapters.tools.reply`
    would (no choice, a choice of the wrong shape)."""
    reply(obj)
    choices = []
    for ch in obj["choices"]:
        if isinstance(ch, dict):
            delta = ch.get("message") if isinstance(ch.get("message"), dict) else None
            choices.append({"index": ch.get("index", 0), "delta": delta, "text": ch.get("text"),
                            "finish_reason": ch.get("finish_reason")})
    out = {"choices": choices}
    if "usage" in obj:
        out["usage"] = obj["usage"]
    return out


class TranslatedConnection:
    """The client connection as a translated request's forwarding sees it
    (module docstring). One per request; ``t`` is set once the request was
    translated (errors before that use only ``adapter.error``)."""

    __slots__ = ("adapter", "buf", "conn", "ended", "interval", "loop", "req", "sse", "state",
                 "status", "t", "timer")

    def __init__(self, conn: HttpConnection, req: Request, adapter: Adapter,
                 t: Translated | None = None):
        self.conn = conn
        self.req = req
        self.adapter = adapter
        self.t = t
        self.state: StreamState | None = None  # set once our stream head went out
        self.sse: SseEvents | None = None
        self.buf: bytearray | None = None  # a whole answer being collected
        self.status = 0
        self.ended = False  # the stream's closing bytes went out
        self.timer: asyncio.TimerHandle | None = None  # the prefill keep-alive's
        self.loop: asyncio.AbstractEventLoop | None = None
        self.interval = 0.0

    # ---- the prefill keep-alive (issue 31 item 12) -------------------------------------
    def keep_alive(self, loop: asyncio.AbstractEventLoop, interval: float) -> None:
        """Keep a streamed answer alive with the API's own events while the
        replica has sent no content (a long prefill, a load): every
        ``interval`` seconds (``--stream-keepalive``; 0: off) without
        content, the stream opens if it did not (the 200 SSE head, marked
        ``req.preheaded`` so the relay pours the replica's answer into it,
        an error answer as the API's error event) with the API's opening
        events, then one keep-alive event per interval
        (:meth:`~.adapters.common.StreamState.keepalive`: Anthropic ``ping``,
        Responses ``response.in_progress``). An API without keep-alive
        events (Ollama's NDJSON) is left alone: nothing opens early."""
        if interval <= 0 or self.t is None or not self.t.stream:
            return
        if not self.adapter.stream(self.t).keepalive():  # an API without such events
            return
        self.loop, self.interval = loop, interval
        self.timer = loop.call_later(interval, self._tick)

    def stop_keep_alive(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _tick(self) -> None:
        self.timer = None
        req = self.req
        if self.ended or self.buf is not None or req.disconnected:
            return
        state = self.state
        if state is None:
            if req.status:  # an answer went out already (an error)
                return
            req.preheaded = True
            self.start_stream(req)
            state = self.state
        if state.failed:
            return
        out = state.keepalive()
        if not out:  # content flows: no more keep-alives needed
            return
        self.conn.send_chunk(out)
        self.timer = self.loop.call_later(self.interval, self._tick)

    # ---- the connection interface the relay uses --------------------------------
    @property
    def write_paused(self) -> bool:
        return self.conn.write_paused

    @property
    def write_paused_cb(self):
        return self.conn.write_paused_cb

    @write_paused_cb.setter
    def write_paused_cb(self, cb) -> None:
        self.conn.write_paused_cb = cb

    def cork(self) -> None:
        self.conn.cork()

    def uncork(self) -> None:
        self.conn.uncork()

    def head(self, req: Request, status: int, headers: Iterable[Header], framing: bytes) -> bytes:
        """Record the replica's answer head; nothing is written yet (the
        translated head goes out from here for a stream, else at the end)."""
        self.status = status
        sse = any(k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)
        if status == 200 and sse and self.t is not None and self.t.stream:
            self.start_stream(req)
        else:
            self.buf = bytearray()
        return b""

    def _headers(self) -> list[Header]:
        """Headers every translated answer carries: the hosted tools left
        out of what the model saw (:data:`DROPPED_TOOLS_HEADER`)."""
        t = self.t
        if t is None or not t.dropped:
            return []
        return [(DROPPED_TOOLS_HEADER, ", ".join(t.dropped).encode("latin-1", "replace"))]

    def write(self, data: bytes) -> None:
        if data:  # only the (empty) head from :meth:`head` comes this way
            self.conn.write(data)

    def start_stream(self, req: Request, *_args, **_kw) -> None:
        """Send the API's stream head (also while the model loads: the
        proxy's keep-alives go into the same stream)."""
        if self.state is not None:
            return
        self.state = self.adapter.stream(self.t)
        self.sse = SseEvents()
        self.conn.start_stream(req, content_type=self.state.content_type,
                               headers=self._headers())

    def send_chunk(self, data: bytes) -> None:
        """Body bytes of the replica's answer (or the proxy's SSE comment
        and error events on a stream it opened)."""
        if self.buf is not None:
            self.buf += data
            return
        state = self.state
        if state is None or self.ended or state.failed:
            return
        for ev in self.sse.feed(data):
            if ev == b"[DONE]":
                self._close_stream()
                return
            if ev[:1] == b":":  # a keep-alive comment (the proxy's while the model loads)
                if state.content_type == b"text/event-stream":
                    self.conn.send_chunk(ev + b"\n\n")
                continue
            out = state.event(ev)
            if out:
                self.conn.send_chunk(out)
            if state.failed:
                self._failed()
                return

    def _close_stream(self) -> None:
        if not self.ended:
            self.ended = True
            state = self.state
            try:
                out = state.end()
            except UNTRANSLATABLE as e:
                out = state.untranslatable(e)
            self.conn.send_chunk(out)
            if state.failed:
                self._failed()

    def _failed(self) -> None:
        """The stream ended with the API's error event for an answer that
        could not be translated: the request ring records the 502 a whole
        answer would have got (``req.status``; issue 31 item 4)."""
        if self.req.status < 400:
            self.req.status = 502

    def end_stream(self, req: Request) -> None:
        """The replica's answer ended cleanly: close the stream, or
        translate the whole answer."""
        self.stop_keep_alive()
        if self.buf is not None:
            self._whole(req)
            return
        state = self.state
        if state is None:
            self.conn.end_stream(req)
            return
        if not state.failed:
            self._close_stream()
        if state.failed:  # never a clean end after the API's error event
            self.conn.close()
            self.conn.finish(req)
            return
        self.conn.end_stream(req)

    def finish(self, req: Request) -> None:
        self.stop_keep_alive()
        self.conn.finish(req)

    def close(self) -> None:
        """The relay gives up mid-answer (the replica died, or sent an
        error into a stream the proxy had opened)."""
        self.stop_keep_alive()
        if self.buf is not None:
            # nothing went out yet: a proper error answer instead of a cut
            self.buf = None
            self.send_error(self.req, 502, "the replica failed before its answer was complete")
            return
        self.conn.close()

    # ---- what the proxy uses -------------------------------------------------------
    def send_error(self, req: Request, status: int, message: str, code=None,
                   headers: Iterable[Header] = (), **_extra) -> None:
        """The proxy's error, in the API's envelope (an error event when the
        stream already began)."""
        self.stop_keep_alive()
        if self.state is not None:
            if not self.ended:
                self.conn.send_chunk(self.state.error(status, message))
            self.conn.close()
            self.conn.finish(req)
            return
        ctype, body = self.adapter.error(status, message)
        self.conn.send_response(req, status, body, ctype, [*headers, *self._headers()])

    def send_response(self, req: Request, status: int, body: bytes,
                      content_type: bytes = b"application/json",
                      headers: Iterable[Header] = ()) -> None:
        self.conn.send_response(req, status, body, content_type, [*headers, *self._headers()])

    # ---- whole answers ---------------------------------------------------------------
    def _whole(self, req: Request) -> None:
        data, status = bytes(self.buf), self.status
        self.buf = None
        adapter, t = self.adapter, self.t
        if status >= 400:
            ctype, body = adapter.replica_error(status, data)
            self.conn.send_response(req, status, body, ctype, self._headers())
            return
        if status != 200:
            self.conn.send_response(req, status, data, headers=self._headers())
            return
        try:
            obj = orjson.loads(data)
            if not isinstance(obj, dict):
                raise BadReply("the replica's answer is not a JSON object")
            if t.stream:  # the replica answered whole: play it through the stream
                # (translated first: an answer that cannot be is a plain 502)
                state = adapter.stream(t)
                out = state.chunk(_as_chunk(obj)) + state.end()
                if state.failed:
                    raise BadReply(state.why)
                self.state = state
                self.sse = SseEvents()
                self.conn.start_stream(req, content_type=state.content_type,
                                       headers=self._headers())
                self.ended = True
                self.conn.send_chunk(out)
                self.conn.end_stream(req)
                return
            out = adapter.response(obj, t)
        except (orjson.JSONDecodeError, *UNTRANSLATABLE) as e:
            why = reason(e) if not isinstance(e, orjson.JSONDecodeError) else str(e)
            log.warning("untranslatable answer from the replica for %s: %s",
                        req.path.decode("latin-1"), why)
            ctype, body = adapter.error(502, f"the replica's answer could not be translated: "
                                             f"{why}")
            self.conn.send_response(req, 502, body, ctype, self._headers())
            return
        self.conn.send_response(req, 200, orjson.dumps(out), headers=self._headers())
