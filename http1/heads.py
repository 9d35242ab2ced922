"""The heads that cross the proxy: what of a client's request head reaches a
replica (:func:`request_head`) and what of a replica's response head
reaches the client (:data:`RESPONSE_DROP`, :data:`SSE_HEADERS`, applied by
:class:`~ggmux.http1.upstream.Upstream` as the head is parsed).

Hop-by-hop headers never cross (RFC 9110 7.6.1: the fixed list
:data:`HOP_BY_HOP` and whatever the ``Connection`` header names), in either
direction; the client's credentials are for ggmux alone.
"""

from __future__ import annotations

from collections.abc import Iterable

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from .connection import Header
from .request import HOP, TENANT, TOKEN, Request
from .usage import USAGE_HEADER
from .verdict import REPLICA_HEADER

# RFC 9110 7.6.1 connection-specific headers
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
    )
)

# never copied to the replica: framing, Host and request id are our own,
# the core already answered any Expect, and the client's credentials are
# for ggmux alone (issue 11: a local replica gets only its secret, an
# upstream only its own api-key), and so are the cluster's hop header and
# token (a forward to another node adds its own: proxy.cluster.hop_headers)
REQUEST_DROP = HOP_BY_HOP | {b"content-length", b"host", b"expect", b"x-request-id",
                              b"authorization", b"x-api-key", HOP, TOKEN, TENANT}
# never copied to the client: the client core sets framing and the id; the
# replica's verdict on itself is for the proxy
RESPONSE_DROP = HOP_BY_HOP | {b"content-length", b"x-request-id", REPLICA_HEADER, USAGE_HEADER}
# an SSE answer carries these whatever the replica sent, so a buffering
# reverse proxy in front does not hold the stream back (issue 14)
SSE_HEADERS = ((b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no"))


@cython.locals(req=Request)
def request_head(
    req: Request,
    port: int,
    body_len: int,
    extra: Iterable[Header] = (),
    host: bytes = b"127.0.0.1",
    target: bytes | None = None,
    auth: bytes = b"",
    tenant: bytes = b"",
) -> bytes:
    """The request head sent to a replica: same method and target (or
    ``target``), our own Host, Content-Length and ``x-request-id`` (the
    client's id), hop-by-hop headers and the client's credentials
    (``authorization``, ``x-api-key``) removed (the fixed list and those
    the client's ``Connection`` header names), ``extra`` headers appended,
    then ``auth``: whole header lines (``b"authorization: ...\\r\\n"``,
    the replica's own credential) or nothing, and ``tenant`` as
    ``x-ggmux-tenant`` when given (a client's own never passes)."""
    url = req.url if target is None else target
    parts = [b"%s %s HTTP/1.1\r\nhost: %s:%d\r\n" % (req.method, url, host, port)]
    tokens = req.conn_tokens
    for k, v in req.headers:
        if k in REQUEST_DROP or (tokens and k in tokens):
            continue
        parts.append(b"%s: %s\r\n" % (k, v))
    for k, v in extra:
        parts.append(b"%s: %s\r\n" % (k, v))
    if tenant:
        parts.append(b"%s: %s\r\n" % (TENANT, tenant))
    parts.append(b"%sx-request-id: %s\r\ncontent-length: %d\r\n\r\n"
                 % (auth, req.request_id, body_len))
    return b"".join(parts)


__all__ = ["HOP_BY_HOP", "REQUEST_DROP", "RESPONSE_DROP", "SSE_HEADERS", "request_head"]
