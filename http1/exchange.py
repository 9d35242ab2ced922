"""The outcome of forwarding one request to a replica: :class:`Exchange`
(what came back and was relayed) or :class:`UpstreamError` (nothing
reached the client). :mod:`.upstream` makes them; the forwarding code, the
request ring and the balancer's verdicts read them. ``exchange.pxd`` makes
:class:`Exchange` a C struct in the compiled build.
"""

from __future__ import annotations


class UpstreamError(Exception):
    """The replica could not be reached or failed before answering.

    ``stale``: the failure was a pooled keep-alive connection that the
    replica had closed before it answered anything (the keep-alive race:
    worth one retry on a fresh connection, and no verdict on the replica).
    ``delivered``: the replica may have received the request before it
    failed (closed the connection, sent garbage, timed out): the request is
    not sent again anywhere. ``timeout``: no response within the first-byte
    timeout (a 504). ``refused``: the replica answered that it did not act
    on the request (stopping or asleep): it may go to another replica, and
    says nothing about this one's health. ``habit``: delivered, but on a
    pooled connection the replica closed just after a chunked answer, as a
    server that closes after every streamed answer does (cpp-httplib); if
    the replica process lives on, it dropped the request unread. With none
    set, nothing reached the replica (connect error)."""

    def __init__(self, message: str, stale: bool = False, delivered: bool = False,
                 timeout: bool = False, refused: bool = False, habit: bool = False) -> None:
        super().__init__(message)
        self.stale = stale
        self.delivered = delivered
        self.timeout = timeout
        self.refused = refused
        self.habit = habit


class Exchange:
    """The outcome of one forwarded request.

    ``status``: the replica's status (499 when the client left first, 502
    when the replica died mid-body); ``sent_ns`` / ``first_byte_ns``:
    ``time.monotonic_ns()`` when the request was written and when the first
    body byte came back (0: none); ``bytes_out``: body bytes relayed;
    ``retried``: a stale pooled connection was replaced; ``fault``: the
    outcome is the replica's fault (:func:`~ggmux.http1.verdict.replica_fault`
    of the head, or it died or went silent mid-body); ``timed_out``: the
    stream-idle timeout ended it; ``headers`` / ``body``: the response,
    when it was captured rather than relayed.

    What the request ring records of the answer without reading it
    (:mod:`.usage`): ``usage``, the replica's :data:`~.usage.USAGE_HEADER`
    value (head or trailer), None without one; ``sse``: it was an event
    stream, ``events`` its ``data:`` events; ``tail``: its last body read;
    ``kept``: its body's first :data:`~.upstream.KEEP_BYTES`, only when the pool
    keeps bodies (``--log-requests-bodies``), else None."""

    __slots__ = ("body", "bytes_out", "events", "fault", "first_byte_ns", "headers", "kept",
                 "retried", "sent_ns", "sse", "status", "tail", "timed_out", "usage")

    def __init__(self, status: int = 0, sent_ns: int = 0, first_byte_ns: int = 0,
                 bytes_out: int = 0, retried: bool = False, fault: bool = False,
                 timed_out: bool = False, headers: list | None = None, body: bytes = b"",
                 usage: bytes | None = None, sse: bool = False, events: int = 0,
                 tail: bytes = b"", kept: bytearray | None = None) -> None:
        self.status = status
        self.sent_ns = sent_ns
        self.first_byte_ns = first_byte_ns
        self.bytes_out = bytes_out
        self.retried = retried
        self.fault = fault
        self.timed_out = timed_out
        self.headers = headers
        self.body = body
        self.usage = usage
        self.sse = sse
        self.events = events
        self.tail = tail
        self.kept = kept

    def __repr__(self) -> str:
        return (f"Exchange(status={self.status}, bytes_out={self.bytes_out}, "
                f"fault={self.fault}, sse={self.sse})")
