"""The handler of the ``/upstream/<model>/<path>`` pass-through route
(:mod:`ggmux.proxy.passthrough` matches the path and names the replica's
admin routes and the answers to redact): a replica's admin route only for
the admin key, a GET of a redacted path relayed without model file paths
(also for ``/props`` and ``/slots`` with ``?model=``, :mod:`.router_mode`).
A mixin of :class:`~ggmux.proxy.server.Proxy`, as
:class:`~.router_mode.RouterMode` is; its attributes are the proxy's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from . import passthrough
from .cors import from_other_site

if TYPE_CHECKING:
    from ..http1 import HttpConnection, Request


class PassthroughRoute:
    """The pass-through's half of :class:`~ggmux.proxy.server.Proxy` (module
    docstring)."""

    async def _passthrough(self, conn: HttpConnection, req: Request) -> None:
        """``/upstream/<model>/<path>``: the request, unchanged but for the
        target, to one replica of the model (:mod:`ggmux.proxy.passthrough`:
        names may contain ``/``, the longest registered name wins; dot
        segments are resolved, so no path leaves the upstream's prefix)."""
        self.refresh()
        try:
            route = passthrough.route(req.path, req.query, self.names, self._slashed)
        except passthrough.BadPath as e:
            conn.send_error(req, 400, str(e))
            return
        if route is None:
            rest = req.path[len(passthrough.PREFIX):].decode("latin-1")
            conn.send_error(req, 404, f"no model in '/upstream/{rest}'", code="model_not_found")
            return
        name, req.url = route
        m = self.names[name]
        if passthrough.admin_target(req.url, req.method) and not self._admin_passthrough(req):
            conn.send_error(req, 403, f"{req.url.split(b'?', 1)[0].decode('latin-1')} is a "
                            "replica's admin route: it changes or shows what every tenant of "
                            "the replica shares, so it is served only to the admin key "
                            "(--admin-key; ggmux's own /cache routes and `ggmux cache` do "
                            "this work)", code="forbidden")
            return
        if self._redacts(req, req.url):
            await self._redacted(conn, req, m, name, touch=True)
            return
        await self._forward(conn, req, m, name, None)

    def _other_site(self, req: Request) -> bool:
        """:func:`~.cors.from_other_site` under this server's ``--cors-origins``."""
        return from_other_site(req, self.cors.listed if self.cors is not None else frozenset())

    def _admin_passthrough(self, req: Request) -> bool:
        """Whether ``req`` may reach a replica's admin route
        (:func:`~ggmux.proxy.passthrough.admin_target`): it presents the
        admin key (so one must be set) and passes :meth:`admin_refusal`
        (not forwarded by another node, not from another origin's page)."""
        return self._is_admin(req) and self.admin_refusal(req) is None

    def _redacts(self, req: Request, target: bytes) -> bool:
        """Whether the replica's answer to ``target`` must lose its model
        file paths (and, for ``/slots``, other clients' request ids): a GET
        of :data:`~ggmux.proxy.passthrough.REDACTED_PATHS` by a caller
        without the admin key (issue 11; issue 18, finding 6)."""
        if req.method not in (b"GET", b"HEAD"):
            return False
        return target.split(b"?", 1)[0] in passthrough.REDACTED_PATHS and not self._is_admin(req)

    async def _redacted(self, conn: HttpConnection, req: Request, m: int, name: str,
                        touch: bool) -> None:
        """Forward, capture the answer, and relay it with every model file
        path reduced to its base name (:func:`~ggmux.proxy.passthrough.redact_paths`)."""
        ex = await self._forward(conn, req, m, name, None, touch=touch, capture=True)
        if ex is None or ex.status == 499:
            if ex is not None:
                conn.finish(req)
            return
        ctype = b"application/json"
        headers = []
        for k, v in ex.headers or ():
            if k == b"content-type":
                ctype = v
            else:
                headers.append((k, v))
        body = passthrough.redact_paths(ex.body)
        if req.url.split(b"?", 1)[0] == b"/slots":
            body = passthrough.redact_slots(body)
        conn.send_response(req, ex.status, body, ctype, headers)
