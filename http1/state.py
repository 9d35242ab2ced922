"""The state of one client connection: :class:`ConnectionState`, the base
of :class:`~.connection.HttpConnection`.

The connection is three classes in a line, each a module: this one holds
every field (``__slots__``), :class:`~.response.ResponseWriter` writes
responses, :class:`~.reading.RequestReader` reads requests, and
:class:`~.connection.HttpConnection` runs the request cycle. A line rather
than mixins, so that the build (``compiled.py``) can make each a C type
whose fields are struct members (``state.pxd`` declares them): a field read
then costs a pointer load instead of CPython's attribute lookup. The fields
are set, and documented, in ``HttpConnection.__init__``.
"""

from __future__ import annotations


class ConnectionState:
    """Every field of a client connection (see the module docstring)."""

    __slots__ = (
        "_active",
        "_body_ok",
        "_body_until",
        "_chunk_at",
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
        "_idle",
        "_in_head",
        "_ip",
        "_ip_idle",
        "_lost",
        "_max_body",
        "_max_head",
        "_on_close",
        "_pending_error",
        "_queue",
        "_queued_bytes",
        "_reading_paused",
        "_reg",
        "_responding",
        "_send_timer",
        "_tail",
        "_task",
        "_timer",
        "_timer_at",
        "_tkind",
        "fast",
        "handler",
        "limits",
        "loop",
        "parser",
        "receiving",
        "sheddable",
        "transport",
        "write_paused",
        "write_paused_cb",
    )
