"""The proxy's route table (DESIGN.md "HTTP surface"): one :class:`Route`
per path or path prefix, read by :meth:`ggmux.proxy.server.Proxy.handle`
and by the manual's route table test (docs/apis.md, tests/test_routes.py).

``Proxy.handle`` looks the request's path up (:func:`match`: the exact
path, else the first prefix that fits; no exact path starts with a
prefix, so the order of the two kinds never matters) and then checks, in
this order: ``OPTIONS`` (the CORS or ``Allow`` answer, for every path
whose route has ``preflight``, and for paths with no route; an admin
route's never grants ``*``); a ``public`` route (no key, answered while the
server stops too); the server stopping (503); the key (the admin key for an
``admin`` route, 401 in the foreign API's envelope on a ``foreign`` route);
a route whose ``guard`` says no, or no route (404); another method than the
route's (405 with ``refuse``, else 404); an admin route asked by a page of
another origin, or another node (403, ``Proxy.admin_refusal``); a POST body
that is not JSON (415; a pass-through's, of a type any page can send:
:mod:`ggmux.proxy.cors`); and then the route's handler.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import apis, passthrough
from .inference_paths import INFERENCE

GET = (b"GET", b"HEAD")
POST = (b"POST",)


@dataclass(slots=True, frozen=True)
class Route:
    """One row of the table.

    ``path``: the path itself, or with ``prefix`` every path that starts
    with it. ``handler``: the name of the :class:`~ggmux.proxy.server.Proxy`
    coroutine ``(conn, req)`` that answers it. ``methods``: those it serves
    (empty: any; the handler judges); another method gets 405 ``<path>
    needs <first method>`` with ``refuse``, else 404. ``admin``: the admin
    key is needed when one is set, always, or (``admin_query``) when the
    query holds that text (``?reload=1``), or (``admin_methods``) for those
methods (``DELETE /models``). ``public``: no key, and answered
    while the server stops. ``preflight``: ``OPTIONS`` gets the CORS answer
    instead (False: the handler answers every method). ``foreign``: a
    client API of :mod:`ggmux.proxy.apis`, whose errors before the handler
    (401) come in that API's envelope. ``guard``: the name of a ``Proxy``
    method without arguments; when it returns False the route does not
    exist (404), e.g. ``/cluster`` outside cluster mode."""

    path: bytes
    handler: str
    methods: tuple[bytes, ...] = ()
    refuse: bool = False
    admin: bool = False
    admin_query: bytes = b""
    admin_methods: tuple[bytes, ...] = ()
    public: bool = False
    preflight: bool = True
    foreign: bool = False
    guard: str = ""
    prefix: bool = False

    def needs_admin(self, query: bytes, method: bytes = b"GET") -> bool:
        """Whether a request with ``query`` and ``method`` needs the admin key here."""
        return (self.admin or (bool(self.admin_query) and self.admin_query in query)
                or method in self.admin_methods)


# the foreign APIs' paths: apis.handles() answers exactly these
_API_PREFIXES = (b"/api/", b"/v1/models/", b"/v1/responses/")

ROUTES: tuple[Route, ...] = (
    Route(b"/health", "_health", public=True, preflight=False),
    Route(b"/readyz", "_readyz", public=True, preflight=False),
    Route(b"/", "_page", public=True),
    Route(b"/ui/", "_page", public=True, prefix=True),
    *(Route(p, "_client_api", foreign=True) for p in apis.ROUTES
      if not p.startswith(_API_PREFIXES)),
    *(Route(p, "_client_api", foreign=True, prefix=True) for p in _API_PREFIXES),
    *(Route(p, "_inference", POST, refuse=True) for p in sorted(INFERENCE)),
    Route(b"/v1/models", "_models", admin_query=b"reload"),
    # GET the list, DELETE ?model= and POST as llama-server's router (.router_mode)
    Route(b"/models", "_models", admin_query=b"reload", admin_methods=(b"DELETE", b"POST")),
    # routed by ?model=; they do not load the model nor refresh its last use
    *(Route(p, "_by_query", GET) for p in (b"/props", b"/metrics", b"/slots")),
    Route(b"/models/load", "_load_or_unload", POST, refuse=True, admin=True),
    Route(b"/models/unload", "_load_or_unload", POST, refuse=True, admin=True),
    Route(b"/models/sse", "_models_sse", (b"GET",)),
    # empty the KV tiers (issue 29; .cache_admin)
    Route(b"/cache/clear", "_cache_clear", POST, refuse=True, admin=True),
    Route(passthrough.PREFIX, "_passthrough", prefix=True),
    Route(b"/ps", "_operator", GET),
    Route(b"/logs", "_operator", GET, admin=True),
    Route(b"/logs/stream", "_operator", (b"GET",), admin=True),
    Route(b"/requests", "_requests", GET, admin=True),
    Route(b"/requests/stream", "_requests", (b"GET",), admin=True),
    Route(b"/usage", "_usage", GET, admin=True),  # the usage ledger (issue 36)
    # keys with limits (issue 36; .keyed)
    Route(b"/keys", "_keys_route", admin=True),
    Route(b"/keys/", "_keys_route", admin=True, prefix=True),
    Route(b"/key/info", "_key_info", GET, refuse=True),  # a key's own limits and use
    Route(b"/cluster", "_cluster", GET, refuse=True, guard="_in_cluster"),
    Route(b"/cluster/drain", "_cluster_drain", POST, refuse=True, admin=True,
          guard="_in_cluster"),
)

_EXACT: dict[bytes, Route] = {r.path: r for r in ROUTES if not r.prefix}
_PREFIXES: tuple[Route, ...] = tuple(r for r in ROUTES if r.prefix)


def match(path: bytes) -> Route | None:
    """The route of ``path``: the exact one, else the first prefix that
    fits; None when no route has it."""
    route = _EXACT.get(path)
    if route is not None:
        return route
    for route in _PREFIXES:
        if path.startswith(route.path):
            return route
    return None
