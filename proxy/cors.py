"""Browser clients: CORS (``--cors-origins``) and what pages of other
origins may not do (issue 18, finding 5: "localhost CSRF").

CORS: llama-server answers every origin, echoing it back; that is the
default here too, on the API routes (``*``: the request's ``Origin`` echoed,
with ``Vary: Origin``, as llama-server's suite expects) but *without*
``Access-Control-Allow-Credentials``: llama-server adds that for every
origin, which would let any site read answers with the browser's cookies
or HTTP authentication for ggmux (a login proxy in front of it), so ggmux
gives credentials only to origins ``--cors-origins`` lists. Echoing the
origin without credentials grants exactly what ``*`` grants. A listed
origin is echoed back with ``Access-Control-Allow-Credentials: true``,
``*`` in the list keeps answering every other origin without credentials,
and an origin that is not allowed gets no allow header (the browser then
refuses the answer). Preflights (``OPTIONS`` with ``Access-Control-Request-Method``)
get 200 (llama-server's status; an empty body) with the allowed methods
and, of the headers asked for, those ggmux reads (:data:`ACCEPTED_HEADERS`);
any other ``OPTIONS`` gets 200 with ``Allow``.

Admin routes (load, unload, reload, logs, the request ring, drain: what the admin key
guards) never answer ``*``: only an origin ``--cors-origins`` names gets
an allow header there, and a request from a page of any other origin
(:func:`from_other_site`) is refused (403) before it does anything, key or
no key. CORS alone would not stop it: a "simple" request (a form post, a
``fetch`` with a ``text/plain`` body or none, an ``<img>``) runs without a
preflight, and only its answer is hidden from the page. For the same
reason a POST body must say it is JSON (:func:`json_type`; 415 otherwise),
which no page of another origin can send without a preflight; a
pass-through to a replica (``/upstream/``) takes any type but the three a
simple request may carry (:func:`simple_type`).
"""

from __future__ import annotations

import re

# Header names go out in their canonical case, as llama-server (and nginx)
# write them: HTTP reads them in any case, but some clients, llama.cpp's own
# test suite among them, look them up in a case-sensitive map.
from ..http1 import HttpConnection, Request

ALLOW_METHODS = b"GET, POST, HEAD, DELETE, OPTIONS"  # DELETE: /models?model= (llama-server's)
PREFLIGHT_METHODS = b"GET, POST, DELETE, OPTIONS"
"""What a preflight grants: llama-server's list (HEAD, a CORS-safelisted
method, is never preflighted)."""
# the headers browsers' API clients send (OpenAI's, Anthropic's and Ollama's SDKs)
ALLOW_HEADERS = (b"authorization, content-type, x-api-key, anthropic-version, "
                 b"anthropic-beta, x-session-id, session_id, x-request-id, openai-organization, "
                 b"openai-project, x-stainless-arch, x-stainless-lang, x-stainless-os, "
                 b"x-stainless-package-version, x-stainless-runtime, "
                 b"x-stainless-runtime-version, x-stainless-retry-count, x-stainless-timeout")
# what a preflight may be granted: the headers above, those SDKs' other
# x-stainless-* ones, and a few more they send
ACCEPTED_HEADERS = frozenset(h.strip() for h in ALLOW_HEADERS.split(b",")) | {
    b"accept", b"accept-language", b"content-language", b"openai-beta",
    b"anthropic-dangerous-direct-browser-access"}
ACCEPTED_PREFIX = b"x-stainless-"
EXPOSE_HEADERS = b"x-request-id, retry-after"
MAX_AGE_S = 86400  # how long a browser may cache a preflight answer
# the media types a browser sends without a preflight (the Fetch standard's
# CORS-safelisted request-header Content-Type values); no type at all is as
# simple (a fetch with a Blob body, sendBeacon)
SIMPLE_TYPES = frozenset((b"text/plain", b"application/x-www-form-urlencoded",
                          b"multipart/form-data"))


def media_type(content_type: bytes | None) -> bytes:
    """The media type of a ``Content-Type`` value, lower case, without
    parameters (``b""`` for none)."""
    if not content_type:
        return b""
    return content_type.split(b";", 1)[0].strip().lower()


def json_type(content_type: bytes | None) -> bool:
    """Whether ``Content-Type`` says JSON: ``application/json`` or
    ``application/<x>+json``, any parameters (what the OpenAI, Anthropic
    and Ollama clients send; curl's ``-d`` sends
    ``application/x-www-form-urlencoded``)."""
    if content_type == b"application/json":  # what nearly every client sends
        return True
    mt = media_type(content_type)
    return mt == b"application/json" or (mt[:12] == b"application/" and mt[-5:] == b"+json")


def simple_type(content_type: bytes | None) -> bool:
    """Whether a body of this type (or of none) can come from a page of any
    origin without a preflight (:data:`SIMPLE_TYPES`)."""
    mt = media_type(content_type)
    return not mt or mt in SIMPLE_TYPES


def accepted_headers(asked: bytes) -> bytes:
    """Of a preflight's ``Access-Control-Request-Headers``, those ggmux
    reads (:data:`ACCEPTED_HEADERS`, ``x-stainless-*``), comma-separated."""
    names = (h.strip().lower() for h in asked.split(b","))
    return b", ".join(h for h in names if h in ACCEPTED_HEADERS
                      or (h.startswith(ACCEPTED_PREFIX) and h[len(ACCEPTED_PREFIX):].replace(
                          b"-", b"").isalnum()))


def same_origin(origin: bytes, host: bytes | None) -> bool:
    """Whether ``Origin`` names the server the request came to (its
    ``Host``): the operator's page on ggmux's own port."""
    return host is not None and origin.partition(b"://")[2].lower() == host.strip().lower()


def from_other_site(req: Request, listed: frozenset[bytes]) -> bool:
    """Whether ``req`` comes from a page of another origin than ggmux's
    own that is not in ``listed`` (``--cors-origins``): its ``Origin`` (a
    browser sends one with every POST and every CORS request, ``null``
    from sandboxed and file pages), else its ``Sec-Fetch-Site`` (sent with
    every request by current browsers, ``<img>`` and form navigations
    included). Clients that are no browser send neither."""
    origin = req.origin
    if origin is not None:
        return origin.rstrip(b"/") not in listed and not same_origin(origin, req.host)
    site = req.header(b"sec-fetch-site")
    return site is not None and site.lower() not in (b"same-origin", b"none")


LOCAL_HOSTS = (b"localhost", b"127.0.0.1", b"[::1]")
_PRINTABLE = re.compile(rb"[\x21-\x7e]{1,512}")
"""An ``Origin`` that may be echoed in a header line (else ``*`` answers)."""


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
        self._star = (b"Access-Control-Allow-Origin: *\r\nAccess-Control-Expose-Headers: "
                      + EXPOSE_HEADERS + b"\r\n")

    def named(self, origin: bytes, admin: bool = False) -> bool:
        """Whether ``--cors-origins`` names ``origin``: listed, or (not on
        an admin route, ``admin``) a page of this machine with ``localhost``."""
        return origin in self.listed or (not admin and self.localhost and is_localhost(origin))

    def headers(self, origin: bytes, admin: bool = False) -> bytes:
        """The header lines for an answer to a request from ``origin``
        (``b""`` when it is not allowed); ``admin``: an admin route's,
        where only a listed origin is allowed, never ``*``."""
        if self.named(origin, admin):
            return (b"Access-Control-Allow-Origin: " + origin
                    + b"\r\nAccess-Control-Allow-Credentials: true\r\nVary: Origin\r\n"
                    b"Access-Control-Expose-Headers: " + EXPOSE_HEADERS + b"\r\n")
        if self.any and not admin:
            if _PRINTABLE.fullmatch(origin):  # echoed, as llama-server (no credentials)
                return (b"Access-Control-Allow-Origin: " + origin + b"\r\nVary: Origin\r\n"
                        b"Access-Control-Expose-Headers: " + EXPOSE_HEADERS + b"\r\n")
            return self._star
        return b"Vary: Origin\r\n" if self.listed or self.localhost else b""

    def allows(self, origin: bytes, admin: bool = False) -> bool:
        """Whether a browser page from ``origin`` may read the answers (of
        an admin route: ``admin``)."""
        return self.named(origin, admin) or (self.any and not admin)

    def options(self, conn: HttpConnection, req: Request, admin: bool = False) -> None:
        """Answer ``OPTIONS``: a preflight with the allowed methods and
        headers (of those asked for, the ones ggmux reads:
        :func:`accepted_headers`), anything else with ``Allow``; 200 both, as
        llama-server answers.
        ``admin``: an admin route's, granted to listed origins alone."""
        hs = [(b"Allow", ALLOW_METHODS)]
        preflight = req.header(b"access-control-request-method") is not None
        if preflight and req.origin is not None and self.allows(req.origin, admin):
            asked = req.header(b"access-control-request-headers")
            hs += [(b"Access-Control-Allow-Methods", PREFLIGHT_METHODS),
                   (b"Access-Control-Allow-Headers",
                    accepted_headers(asked) if asked is not None else ALLOW_HEADERS),
                   (b"Access-Control-Max-Age", str(MAX_AGE_S).encode())]
        conn.send_response(req, 200, b"", headers=hs)
