"""llama-server's router-mode routes, as llama-server answers them: the
``/models`` methods, ``GET /props``, ``/slots`` and ``/metrics`` without
``?model=``, the model a request that names none (or an unknown one)
goes to, and ``--no-models-autoload``'s refusal (issue 23). A mixin of
:class:`~ggmux.proxy.server.Proxy`, as :class:`~.forward.Forwarding` is.

The source is llama.cpp's ``tools/server/server-models.cpp``
(``server_models_routes::init_routes``) and ``server.cpp`` (the route
list): its router answers ``GET /props`` without a model with its own
props (``role: "router"``), ``DELETE /models?model=`` removes a model of
the Hugging Face cache (400 without a name, 500 for a name it does not
list or one that is not from the cache), ``POST /models`` downloads, and a
request for a model that is not running, with autoload off, gets 400
``model is not loaded``. A llama-server that serves one model ignores the
request's ``model``; ggmux sends a request without one to its only model,
and an unknown name to ``--model-fallback``.

The router's own settings come from the registry blob's ``router``
object (``models_max``, ``models_autoload``, ``model_fallback``,
``metrics``: :class:`~ggmux.supervisor.publish.Publisher`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING
from urllib.parse import parse_qs

from .. import __version__
from ..shm import layout as L
from .apis import resolve
from .cluster import annotate_models, metrics_lines
from .listing import models_list, unknown_model
from .metrics import metrics_text, scrape_replicas
from .operator.usage import usage_metrics

if TYPE_CHECKING:
    from ..http1 import HttpConnection, Request

# llama.cpp's build_info is b<build>-<commit>; ggmux's says which it is
BUILD_INFO = f"b{__version__}-ggmux"
MODELS_METHODS = b"GET, HEAD, DELETE"  # what /models answers (POST: 501)


def query_value(req: Request, key: str) -> str | None:
    """The first value of ``key`` in the request's query, or None."""
    if not req.query:
        return None
    vals = parse_qs(req.query.decode("latin-1")).get(key)
    return vals[0] if vals else None


class RouterMode:
    """The router-mode half of :class:`~ggmux.proxy.server.Proxy` (see the
    module docstring); its attributes are the proxy's."""

    # ---- which model -------------------------------------------------------------
    def only_model(self) -> int | None:
        """The index of the one model this server lists, when it lists
        exactly one (a removed model is unnamed, and a cache entry that
        ``dedup-cache-models`` hides is not listed: neither counts)."""
        ms = {m for m in self.names.values() if not self.reg_models[m].get("hidden")}
        return next(iter(ms)) if len(ms) == 1 else None

    def pick_model(self, name: str) -> int | None:
        """The model a request naming ``name`` goes to: the name or alias
        itself (:func:`~.apis.resolve`), else ``--model-fallback``'s, else None."""
        m = resolve(self.names, name)
        if m is None:
            fallback = self.router.get("model_fallback")
            if fallback:
                m = resolve(self.names, fallback)
        return m

    def name_for_unnamed(self) -> str | None:
        """The model name a request without ``model`` gets: the only
        model's (as a llama-server serving one model takes any request),
        else ``--model-fallback``'s; None when neither."""
        m = self.only_model()
        if m is not None:
            return self.reg_models[m]["name"]
        return self.router.get("model_fallback") or None

    def refuses_unloaded(self, conn: HttpConnection, req: Request, m: int) -> bool:
        """``--no-models-autoload``: True after answering llama-server's 400
        ``model is not loaded`` for a model with no replica running or
        loading; ``?autoload=1`` on the request loads it instead (llama.cpp's
        ``is_autoload``), and ``?autoload=0`` refuses even with autoload on."""
        asked = query_value(req, "autoload")
        autoload = (self.router.get("models_autoload", True) if asked is None
                    else asked in ("1", "true"))
        status = int(self.model_rows[m][L.M_STATUS])
        if status not in (L.ModelStatus.UNLOADED, L.ModelStatus.MEASURING):
            return False  # loading, loaded, asleep or stopping: waits as ever
        if autoload:
            if asked is not None and not self.router.get("models_autoload", True):
                self.command({"op": "load", "model": m})  # an explicit load
            return False
        conn.send_error(req, 400, "model is not loaded", code="model_not_loaded")
        return True

    # ---- /models --------------------------------------------------------------------
    async def _models(self, conn: HttpConnection, req: Request) -> None:
        """``/models`` and ``/v1/models``: ``GET`` the list (``?reload=1``
        rescans first), ``DELETE ?model=`` (:meth:`_delete_model`), ``POST``
        (llama-server's download) 501, anything else 405."""
        method = req.method
        if method in (b"GET", b"HEAD"):
            reload = b"reload=1" in req.query or b"reload=true" in req.query
            if reload and not await self._reload(conn, req):
                return
            self.refresh()
            # a keys-file key: only the models it may use, without their args
            listed = models_list(self.reg_models, self.model_rows, self.errors,
                                 self._scope(req))
            conn.send_json(req, 200, annotate_models(listed, self.cluster))
        elif method == b"DELETE" and req.path == b"/models":
            self._delete_model(conn, req)
        elif method == b"POST" and req.path == b"/models":
            conn.send_error(req, 501, "ggmux does not download models (llama-server's POST "
                            "/models): download with `huggingface-cli download ORG/REPO FILE` "
                            "or `llama-server -hf ORG/REPO` into the Hugging Face cache, then "
                            "GET /models?reload=1", code=501)
        else:
            allow = MODELS_METHODS if req.path == b"/models" else b"GET, HEAD"
            conn.send_error(req, 405, f"{req.path.decode()} takes {allow.decode()}",
                            headers=[(b"allow", allow)])

    def _delete_model(self, conn: HttpConnection, req: Request) -> None:
        """``DELETE /models?model=NAME``, answered as llama-server's router
        answers it (``del_router_models``, ``server_models::remove``; llama.cpp's envelope, its numeric ``code``): 400
        without a name, 500 ``model name=NAME is not found`` for one it does
        not list, 500 ``... is not removable (not from cache)`` for a model
        of a preset or a folder; a model of the Hugging Face cache gets 501:
        ggmux never deletes files (docs/differences.md)."""
        name = query_value(req, "model")
        if not name:
            conn.send_error(req, 400, "model must be a non-empty string", code=400)
            return
        self.refresh()
        m = resolve(self.names, name)
        if m is None:
            conn.send_error(req, 500, f"model name={name} is not found", code=500)
        elif self.reg_models[m].get("source") != "hf-cache":
            conn.send_error(req, 500, f"model name={name} is not removable (not from cache)",
                            code=500)
        else:
            conn.send_error(req, 501, f"model name={name}: ggmux does not delete files of the "
                            "Hugging Face cache; `huggingface-cli delete-cache` does, then GET "
                            "/models?reload=1", code=501)

    # ---- GET /props, /slots, /metrics --------------------------------------------
    async def _by_query(self, conn: HttpConnection, req: Request) -> None:
        """``GET /props|/metrics|/slots?model=``: routed by the query (they
        neither load the model nor refresh its last use). Without one: the
        only model's when there is one (a llama-server of one model), else
        ``/props`` is the router's own (:meth:`router_props`), ``/metrics``
        the whole server's, ``/slots`` 400. ``/metrics`` answers 501 with
        ``--no-metrics`` (llama-server without ``--metrics``)."""
        path = req.path
        self.refresh()
        if path == b"/metrics" and not self.router.get("metrics", True):
            conn.send_error(req, 501, "This server does not support metrics endpoint. Start "
                            "it with `--metrics`", code=501)
            return
        name = self._query_model(req)
        if name is None:
            only = self.only_model()
            if path == b"/metrics":
                await self._server_metrics(conn, req, only)
                return
            if only is None:
                if path == b"/props":
                    conn.send_json(req, 200, self.router_props())
                else:
                    conn.send_error(req, 400, f"{path.decode()} needs ?model=<name>")
                return
            name = self.reg_models[only]["name"]
        m = self.names.get(name)
        if m is None:
            conn.send_error(req, 404, unknown_model(name, self._listed(req)),
                            code="model_not_found")
        elif self._redacts(req, path):
            await self._redacted(conn, req, m, name, touch=False)
        else:
            await self._forward(conn, req, m, name, None, touch=False)

    def router_props(self) -> dict:
        """``GET /props`` without a model: llama-server's router props
        (``role``, ``max_instances``, ``models_autoload``, ``build_info``, and
        the placeholders its web UI reads)."""
        r = self.router
        return {"role": "router", "max_instances": r.get("models_max", 0),
                "models_autoload": r.get("models_autoload", True),
                "model_alias": "ggmux", "model_path": "none",
                "default_generation_settings": {"params": {}, "n_ctx": 0},
                "build_info": BUILD_INFO}

    async def _server_metrics(self, conn: HttpConnection, req: Request, only: int | None) -> None:
        """``GET /metrics``: the whole server's Prometheus text, followed,
        when the server has one model and it is loaded, by that replica's own
        (llama-server's ``llamacpp:`` families, its headers kept; no name
        clashes: ggmux's are ``ggmux_*``). A keys-file key reads the series
        of its own models and its own key only (:meth:`_scope`; the filter
        is :func:`~.metrics.metrics_text`'s ``sees``)."""
        scope = self._scope(req)  # a keys-file key: its own models and usage only
        replicas = await scrape_replicas(self.replica_rows)
        self.refresh()
        text = metrics_text(self.seg, self.reg_models, self.model_rows, self.replica_rows,
                            replicas, scope.sees if scope is not None else None, self.router)
        if scope is None:  # the nodes' figures count every tenant's models and requests
            text += "".join(metrics_lines(self.cluster)).encode()
        # per key name, the ledger (issue 36)
        text += usage_metrics(self.usage.status(),
                              None if scope is None else self.keys.name(req.key_row))
        headers: list[tuple[bytes, bytes]] = []
        if only is not None and only in self.ready and (scope is None or scope.sees(only)):
            ex = await self._forward(conn, req, only, self.reg_models[only]["name"], None,
                                     touch=False, capture=True)
            if ex is None:
                return  # answered (the replica went away meanwhile, the client left)
            if ex.status == 499:
                conn.finish(req)
                return
            if ex.status == 200:
                text += ex.body
                headers = [(k, v) for k, v in ex.headers or ()
                           if k not in (b"content-type", b"content-length",
                                        b"process-start-time-unix")]
        # llama-server's header: when the server started (Unix seconds), so a
        # scraper can tell a restart from a counter reset
        up_s = (time.monotonic_ns() - int(self.seg.header[L.H_STARTED_NS])) / 1e9
        headers.append((b"Process-Start-Time-Unix", b"%d" % int(time.time() - up_s)))
        conn.send_response(req, 200, text, b"text/plain; version=0.0.4", headers)
