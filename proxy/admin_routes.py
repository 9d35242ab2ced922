"""The handlers of the proxy's admin routes (:data:`.routes.ROUTES`): load
and unload (``POST /models/load|unload``), ``POST /cache/clear``, the
cluster's ``/cluster`` and ``/cluster/drain``, the reload that
``?reload=1`` asks for, ``/ps`` and ``/logs``, ``/requests`` and
``/usage``. A mixin of :class:`~ggmux.proxy.server.Proxy`, as
:class:`~.router_mode.RouterMode` is; its attributes are the proxy's.
"""

from __future__ import annotations

import asyncio
import os
from typing import TYPE_CHECKING

import numpy as np

from ..http1 import json_object
from ..shm import layout as L
from . import apis
from .cache_admin import clear_route
from .cluster import cluster_view, drain_route
from .listing import unknown_model
from .metrics import scrape_replicas
from .operator.overview import add_drafts, drafting_models, overview

if TYPE_CHECKING:
    from ..http1 import HttpConnection, Request

RELOAD_WAIT_S = 30.0  # ?reload=1 waits this long for the rescan (a cache of many models is slow)
DRAFT_SCRAPE_S = 0.5
"""Seconds ``/ps`` waits for a drafting replica's counters (a busy one is left out)."""


class AdminRoutes:
    """The admin routes' half of :class:`~ggmux.proxy.server.Proxy` (module
    docstring)."""

    async def _load_or_unload(self, conn: HttpConnection, req: Request) -> None:
        self._load_unload(conn, req, req.path.rsplit(b"/", 1)[1].decode())

    def _load_unload(self, conn: HttpConnection, req: Request, op: str) -> None:
        """``POST /models/load`` / ``/models/unload`` with ``{"model": name}``:
        asks the supervisor and returns at once (llama.cpp router's
        ``{"success": true}``); progress shows in ``/v1/models``. Unload of
        ``"*"`` unloads every model that is idle (no request in flight, none
        waiting)."""
        body = json_object(conn, req)
        if body is None:
            return
        name = body.get("model")
        if not isinstance(name, str):
            conn.send_error(req, 400, 'body must be {"model": "<name>"}')
            return
        if name == "*" and op == "unload":  # every idle model (ggmux unload --all)
            if self._command(conn, req, {"op": "unload_idle"}):
                conn.send_json(req, 200, {"success": True, "model": "*", "op": op})
            return
        m = self._model(conn, req, name)
        if m is None:
            return
        if self._command(conn, req, {"op": op, "model": m}):
            conn.send_json(req, 200, {"success": True, "model": name, "op": op})

    async def _cache_clear(self, conn: HttpConnection, req: Request) -> None:
        await clear_route(self, conn, req, lambda m: self.reg_models[m]["name"])

    async def _cluster(self, conn: HttpConnection, req: Request) -> None:
        conn.send_json(req, 200, cluster_view(self.cluster))

    async def _cluster_drain(self, conn: HttpConnection, req: Request) -> None:
        drain_route(conn, req, self._command)

    def _in_cluster(self) -> bool:
        self.refresh()
        return self.cluster is not None

    async def _reload(self, conn: HttpConnection, req: Request) -> bool:
        """Ask the supervisor to rescan every source and wait until the
        registry it publishes says this reload ran (its id in
        ``reload_ids``), so ``?reload=1`` answers with the new list (issue
        15). False after answering 503 when the queue is full or no answer
        came within :data:`RELOAD_WAIT_S`, or 500 when the reload failed and
        changed nothing (as llama-server's router answers the exception of a
        reload: ``ex_wrapper``, ``server_error``; issue 23), or when the keys
        file did not read (the supervisor's error says which)."""
        self.reload_seq += 1
        rid = f"{os.getpid()}-{self.reload_seq}"
        if not self._command(conn, req, {"op": "reload", "id": rid,
                                         "route": f"GET {req.path.decode()}?reload=1"}):
            return False
        deadline = self.loop.time() + RELOAD_WAIT_S
        while rid not in self.reload_ids:
            if self.loop.time() > deadline or req.disconnected:
                conn.send_error(req, 503, f"the reload did not finish within {RELOAD_WAIT_S:g} s",
                                headers=[(b"retry-after", b"1")])
                return False
            await asyncio.sleep(0.01)
            self.refresh()
        error = self.reload_errors.get(rid)
        if error is not None:
            conn.send_error(req, 500, f"reload failed: {error}",
                            code="reload_failed")
            return False
        return True

    async def _operator(self, conn: HttpConnection, req: Request) -> None:
        """``GET /ps`` (:mod:`.operator.overview`), ``GET /logs`` and
        ``/logs/stream`` (:mod:`.operator.logs`; ``?model=`` a name or alias)."""
        self.refresh()
        if req.path == b"/ps":
            doc = overview(self.seg, self.reg_models, self.model_rows, self.replica_rows,
                           self.remotes, self.errors, cluster=self.cluster,
                           scope=self._scope(req))
            spec = drafting_models(self.reg_models)
            if spec:  # their replicas' draft counters: speculation's acceptance
                rows = self.replica_rows[np.isin(self.replica_rows[:, L.R_MODEL], list(spec))]
                add_drafts(doc, self.reg_models, await scrape_replicas(rows, DRAFT_SCRAPE_S))
            conn.send_json(req, 200, doc)
            return
        name = self._query_model(req)
        if name is not None:
            m = self.names.get(name)
            if m is None:
                conn.send_error(req, 404, unknown_model(name, self.reg_models),
                                code="model_not_found")
                return
            name = self.reg_models[m]["name"]
        if req.path == b"/logs":
            self.logtail.text(conn, req, name)
        else:
            await self.logtail.stream(conn, req, name)

    async def _requests(self, conn: HttpConnection, req: Request) -> None:
        """``GET /requests`` and ``/requests/stream`` (:mod:`.operator.requests`;
        ``?model=`` a name or alias)."""
        self.refresh()
        m = None
        name = self._query_model(req)
        if name is not None:
            m = apis.resolve(self.names, name)
            if m is None:
                conn.send_error(req, 404, unknown_model(name, self.reg_models),
                                code="model_not_found")
                return
        view = self._request_view
        if req.path == b"/requests":
            self.requests.list(conn, req, view, m)
        else:
            await self.requests.stream(conn, req, view, m)

    async def _usage(self, conn: HttpConnection, req: Request) -> None:
        """``GET /usage``: the usage ledger's totals (:mod:`.operator.usage`)."""
        await self.usage.answer(conn, req)

    def _request_view(self) -> tuple[list[dict], dict[int, dict]]:
        self.refresh()
        return self.reg_models, self.remotes
