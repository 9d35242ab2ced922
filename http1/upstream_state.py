"""The state of one replica connection: :class:`UpstreamState`, the base
of :class:`~.upstream.Upstream`.

The replica connection is three classes in a line, each a module (as the
client connection is, :mod:`.state`): this one holds every field
(``__slots__``), :class:`~.upstream_failure.UpstreamFailure` ends an
exchange short (the client leaves, the replica dies or goes silent, the
proxy stops), and :class:`~.upstream.Upstream` relays a whole exchange. A
line rather than mixins, so that the build (``compiled.py``) can make each
a C type whose fields are struct members (``upstream_state.pxd`` declares
them): a field read then costs a pointer load instead of CPython's
attribute lookup. The fields are set, and documented, in
``Upstream.__init__``.
"""

from __future__ import annotations


class UpstreamState:
    """Every field of a replica connection (see the module docstring)."""

    __slots__ = (
        "_on_gone",
        "_on_paused",
        "_resp_chunked",
        "_resp_keepalive",
        "_settle",
        "acked",
        "capture",
        "client",
        "closed",
        "conn_tokens",
        "deadline_ns",
        "err_body",
        "ex",
        "finished",
        "got_bytes",
        "head_sent",
        "headers",
        "idle_ns",
        "junk",
        "key",
        "mark",
        "on_done",
        "on_head",
        "parser",
        "paused",
        "pool",
        "req",
        "reused",
        "sent_total",
        "sse",
        "sse_error",
        "sse_tail",
        "status",
        "transport",
        "until_close",
    )
