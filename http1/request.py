"""One parsed HTTP request (:class:`Request`) and reading its body as JSON.

The HTTP core (:mod:`.connection`) fills a :class:`Request` from its parser
callbacks (:mod:`.reading`); handlers read it.
"""

from __future__ import annotations

from collections.abc import Callable
from random import getrandbits
from typing import Protocol

import orjson

Header = tuple[bytes, bytes]

# cluster mode's headers (DESIGN.md "Cluster", :mod:`ggmux.proxy.cluster`): the hop
# header and the cluster token. The parser marks a request that carries
# either (``Request.hop_marked``); no replica ever gets them
HOP = b"x-ggmux-hop"
TOKEN = b"x-ggmux-cluster-token"
# who asked, for a built-in instance's fairness and prompt-cache scope: a
# keyed hash of the caller's API key (:func:`~.auth.tenant`); a client's own
# is always dropped (issue 18, findings 6 and 10)
TENANT = b"x-ggmux-tenant"


def new_request_id() -> bytes:
    """A fresh request id: 16 lower-case hex digits."""
    return b"%016x" % getrandbits(64)


class Request:
    """One parsed request.

    ``url`` is the target in origin form (``path`` and ``query`` split at
    ``?``; an absolute-form target loses its scheme and authority),
    ``headers`` a list of ``(lower-case name, value)`` (never a chunked
    trailer's fields), ``host`` the ``Host`` header (None: absent), ``body`` the whole
    body as bytes or bytearray (requests are buffered; LLM request bodies are
    small), ``request_id`` the id echoed as ``x-request-id``,
    ``content_length`` -1 when absent, ``conn_tokens`` the header names the
    client's ``Connection`` header lists (hop-by-hop, never forwarded).
    ``started_ns``: ``time.monotonic_ns()`` when the head was whole;
    ``status``: of the response sent to it, 0 before one.
    ``hop_marked``: the head carries :data:`HOP` or :data:`TOKEN` (then
    only the handler, which judges them, may forward it).
    ``on_disconnect`` is called once when the client goes away before the
    response finished; ``disconnected`` says it did. ``origin`` is the
    ``Origin`` header and ``content_type`` the ``Content-Type`` (None
    without one); ``extra_head`` header lines
    (``b"name: value\r\n"`` ...) every response head to it carries (CORS).
    """

    __slots__ = (
        "body",
        "body_json",
        "chunked",
        "conn_tokens",
        "content_length",
        "content_type",
        "disconnected",
        "expect",
        "expect_continue",
        "extra_head",
        "head_only",
        "header_bytes",
        "headers",
        "hop",
        "hop_marked",
        "host",
        "http10",
        "keep_alive",
        "key_hold",
        "key_row",
        "method",
        "on_disconnect",
        "origin",
        "path",
        "preheaded",
        "query",
        "request_id",
        "started_ns",
        "status",
        "url",
    )

    def __init__(self) -> None:
        self.method = b""
        self.url = b""
        self.headers: list[Header] = []
        self.host: bytes | None = None
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
        self.started_ns = 0  # time.monotonic_ns() when its head was whole
        self.status = 0  # of the response sent to it (0: none yet)
        self.request_id = b""
        self.preheaded = False  # a streaming head went out while the model loaded
        self.http10 = False
        self.content_length = -1
        self.chunked = False
        self.conn_tokens: tuple[bytes, ...] = ()
        self.expect: bytes | None = None
        self.origin: bytes | None = None
        self.content_type: bytes | None = None
        self.extra_head = b""
        self.hop = 0  # cluster mode: forwarded by another node (proxy.cluster.HOP_*)
        self.hop_marked = False
        self.key_row = -1  # its key's row of the key table (-1: no key of the keys file)
        self.key_hold = None  # what its key's limits counted it for (proxy.admission.Hold)

    def header(self, name: bytes, default: bytes | None = None) -> bytes | None:
        """First value of header ``name`` (lower-case bytes)."""
        for k, v in self.headers:
            if k == name:
                return v
        return default


class Answering(Protocol):
    """What :func:`json_object` needs of a connection
    (:class:`~.connection.HttpConnection`): answering with an error."""

    def send_error(self, req: Request, status: int, message: str) -> None: ...


def json_object(conn: Answering, req: Request) -> dict | None:
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
