"""CORS for browser clients (``--cors-origins``).

llama-server answers every origin (``Access-Control-Allow-Origin: *``);
that is the default here too. ``--cors-origins`` takes a comma-separated
list: a listed origin is echoed back with ``Access-Control-Allow-Credentials:
true`` (credentials go to listed origins only, as the Fetch standard
requires: never with ``*``), ``*`` in the list keeps answering every other
origin without credentials, and an origin that is not allowed gets no allow
header (the browser then refuses the answer). Preflights (``OPTIONS`` with
``Access-Control-Request-Method``) get 204 with the allowed methods and
headers; any other ``OPTIONS`` gets 204 with ``Allow``.
"""

from __future__ import annotations

from .http import HttpConnection, Request

ALLOW_METHODS = b"GET, POST, HEAD, DELETE, OPTIONS"  # DELETE: /models?model= (llama-server's)
# the headers browsers' API clients send (OpenAI's, Anthropic's and Ollama's SDKs)
ALLOW_HEADERS = (b"authorization, content-type, x-api-key, anthropic-version, "
                 b"anthropic-beta, x-session-id, session_id, x-request-id, openai-organization, "
                 b"openai-project, x-stainless-arch, x-stainless-lang, x-stainless-os, "
                 b"x-stainless-package-version, x-stainless-runtime, "
                 b"x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout")
EXPOSE_HEADERS = b"x-request-id, retry-after"
MAX_AGE_S = 86400  # how long a browser may cache a preflight answer


LOCAL_HOSTS = (b"localhost", b"127.0.0.1", b"[::1]")


def is_localhost(origin: bytes) -> bool:
    """Whether ``origin`` is a page of this machine: ``http(s)://`` and
    ``localhost``, ``127.0.0.1`` or ``[::1]``, any port (llama-server's
    ``origin_is_localhost``, for ``--cors-origins localhost``)."""
    scheme, sep, rest = origin.lower().partition(b"://")
    if not sep or scheme not in (b"http", b"https"):
        return False
    host, colon, port = rest.rpartition(b":") if not rest.endswith(b"]") else (rest, b"", b"")
    if not colon:
        host = rest
    elif not port.isdigit():
        return False
    return host in LOCAL_HOSTS


class Cors:
    """The CORS policy of one server: ``origins`` is ``--cors-origins``
    (``"*"``, or a comma-separated list of origins, ``*`` among them
    allowed, and ``localhost``: every page of this machine,
    :func:`is_localhost`, as llama-server's keyword); an empty string
    turns CORS off."""

    __slots__ = ("_star", "any", "listed", "localhost")

    def __init__(self, origins: str = "*") -> None:
        names = [o.strip() for o in origins.split(",") if o.strip()]
        self.any = "*" in names
        self.localhost = "localhost" in names
        self.listed = frozenset(o.rstrip("/").encode() for o in names
                                if o not in ("*", "localhost"))
        self._star = (b"access-control-allow-origin: *\r\naccess-control-expose-headers: "
                      + EXPOSE_HEADERS + b"\r\n")

    def named(self, origin: bytes) -> bool:
        """Whether ``--cors-origins`` names ``origin`` (listed, or a page of
        this machine with ``localhost``)."""
        return origin in self.listed or (self.localhost and is_localhost(origin))

    def headers(self, origin: bytes) -> bytes:
        """The header lines for an answer to a request from ``origin``
        (``b""`` when it is not allowed)."""
        if self.named(origin):
            return (b"access-control-allow-origin: " + origin
                    + b"\r\naccess-control-allow-credentials: true\r\nvary: origin\r\n"
                    b"access-control-expose-headers: " + EXPOSE_HEADERS + b"\r\n")
        if self.any:
            return self._star
        return b"vary: origin\r\n" if self.listed or self.localhost else b""

    def allows(self, origin: bytes) -> bool:
        """Whether a browser page from ``origin`` may read the answers."""
        return self.any or self.named(origin)

    def options(self, conn: HttpConnection, req: Request) -> None:
        """Answer ``OPTIONS``: a preflight with the allowed methods and
        headers (the request's own ``Access-Control-Request-Headers`` are
        allowed as asked), anything else with ``Allow``; 204 both."""
        hs = [(b"allow", ALLOW_METHODS)]
        preflight = req.header(b"access-control-request-method") is not None
        if preflight and req.origin is not None and self.allows(req.origin):
            asked = req.header(b"access-control-request-headers")
            hs += [(b"access-control-allow-methods", ALLOW_METHODS),
                   (b"access-control-allow-headers", asked or ALLOW_HEADERS),
                   (b"access-control-max-age", str(MAX_AGE_S).encode())]
        conn.send_response(req, 204, b"", headers=hs)
