"""The client APIs beside OpenAI's chat completions, on the proxy's port
(DESIGN.md "Client APIs").

* Translated routes (:data:`ROUTES`): the request goes through its
  adapter (:mod:`ggmux.proxy.apis.adapters`) to a chat-completion request (or
  ``/tokenize``, ``/v1/embeddings``), is forwarded by the proxy's own
  forwarding (waiting for loads, balancing, retries), and its answer is
  rewritten by :class:`~ggmux.proxy.apis.translate.TranslatedConnection`. For a
  model whose replicas speak Anthropic's and the Responses API themselves
  (kind ``cmd``, a llama-server, or ``upstream``) those two pass through
  unchanged unless its preset says ``translate = true``; Ollama's API is
  always translated (llama-server does not speak it).
* Router-level answers: Ollama's ``/api/tags``, ``/api/ps``, ``/api/show``,
  ``/api/version``; OpenAI's ``GET /v1/models/{id}``.
* Ollama's ``keep_alive``, from a caller who may administer (the admin
  key; with none set, whoever the API key let in; never a page of another
  origin: ``Proxy.admin_refusal``): ``0`` unloads the model once the
  request is answered (the supervisor's ``unload``); any other value
  replaces the model's ttl until it unloads (the supervisor's
  ``keep_alive`` command; negative: never unload for idleness). From any
  other caller it may only extend the idle timer, up to the model's ttl
  (``keep_alive`` with ``extend``; issue 18, finding 1: an API key
  unloaded models mid-stream for everyone). An empty ``prompt`` /
  ``messages`` loads the model (``done_reason: "load"``), as any request
  would, or, with ``keep_alive: 0``, unloads it (``"unload"``), as Ollama
  does: that needs the admin key (403 otherwise). Each order names the
  route it came from, for the supervisor's log. A keys-file key's
  ``models`` is checked on every translated route before anything waits,
  loads or orders, and the load form counts in the key's limits as any
  request does (a key that may not use a model never loads it, nor drains
  another tenant's model for it).
* Names: ``NAME:latest`` resolves to ``NAME`` when no model is called that
  (Ollama's default tag).
* Ollama's model management (``/api/pull``, ``/api/push``, ``/api/create``,
  ``/api/blobs/...``, ``/api/copy``, ``/api/delete``): ggmux serves the
  files its sources name and changes none of them, so these get 501 in
  Ollama's envelope saying so and where models come from (Ollama's clients
  raise any status of 400 or more as their ``ResponseError`` with the
  ``error`` text; Open WebUI shows it). A pull of a model ggmux already
  serves answers ``{"status": "success"}``: nothing to download, and a
  client that pulls before it chats goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol
from urllib.parse import unquote

import orjson

from ...http1 import HttpConnection, Request
from ...http1.limits import tokenize_body_refusal
from ...shm import layout as L
from ..bodies import BodyError, is_large, off_loop, parse_object
from ..listing import Scope, model_object, unknown_model
from ..modelinfo import ModelFacts
from .adapters import anthropic, ollama, openai, responses, tools
from .adapters.common import MAX_DEPTH, Adapter, BadRequest, Translated, check_depth, encode_body
from .translate import ApiErrors, TranslatedConnection

if TYPE_CHECKING:
    import numpy as np

    from ...http1.exchange import Exchange
    from ...shm.segment import Segment
    from ..activity import Activity
    from ..waiting import ModelWaiters

log = logging.getLogger(__name__)


class Proxy(Protocol):
    """What the client APIs need of their proxy worker
    (:class:`~ggmux.proxy.server.Proxy`): its view of the registry and the
    tables (``refresh`` brings it up to date), its waiters, the
    supervisor's queue (``command``: False when full) and its forwarding
    (:meth:`~ggmux.proxy.forward.Forwarding._forward`)."""

    names: dict[str, int]
    reg_models: list[dict]
    errors: dict[str, str]
    model_rows: np.ndarray
    replica_rows: np.ndarray
    ready: set[int]
    seg: Segment
    waiters: ModelWaiters
    activity: Activity  # the request ring's writer (a load order is a request too)
    stream_keepalive: float  # seconds (--stream-keepalive)

    def refresh(self) -> None: ...

    def pick_model(self, name: str) -> int | None: ...

    def name_for_unnamed(self) -> str | None: ...

    def command(self, cmd: dict) -> bool: ...

    def admin_refusal(self, req: Request) -> str | None: ...

    def _key_allows(self, req: Request, mdl: dict) -> bool: ...

    def _key_admit(self, conn: HttpConnection, req: Request, m: int, name: str,
                   body: dict | None, counted: bool) -> bool: ...

    def _listed(self, req: Request) -> list[dict]: ...

    def _scope(self, req: Request) -> Scope | None: ...

    def _wait_join(self, req: Request, m: int) -> tuple[int, int, int]: ...

    def _wait_served(self, req: Request, m: int, token: tuple[int, int, int]) -> None: ...

    async def _forward(
        self, conn: HttpConnection, req: Request, m: int, name: str, body: dict | None,
        touch: bool = True, stream: bool = False, capture: bool = False,
    ) -> Exchange | None: ...

# path -> (adapter, passed through to replicas that speak it natively)
ROUTES: dict[bytes, tuple[Adapter, bool]] = {
    b"/v1/messages": (anthropic.Messages(), True),
    b"/v1/messages/count_tokens": (anthropic.CountTokens(), True),
    b"/v1/responses": (responses.Responses(), True),
    b"/responses": (responses.Responses(), True),  # llama-server's, without /v1
    b"/api/chat": (ollama.Chat(), False),
    b"/api/generate": (ollama.Generate(), False),
    b"/api/embed": (ollama.Embed(), False),
    b"/api/embeddings": (ollama.Embeddings(), False),
}
NATIVE_KINDS = frozenset(("cmd", "upstream"))  # replica kinds that speak those APIs themselves
CHAT_WITH_USAGE = openai.ChatWithUsage()
_OLLAMA = ollama.Chat()  # for Ollama's error envelope
_OPENAI = CHAT_WITH_USAGE  # for OpenAI's


@dataclass(slots=True)
class Order:
    """What a request may ask of the supervisor: ``route`` it came by
    (``"POST /api/generate"``, for the supervisor's log), and ``refusal``,
    why its caller may not administer (None: it may; see
    ``Proxy.admin_refusal``)."""

    route: str
    refusal: str | None = None


# Ollama's model management routes -> what ggmux does not do (module docstring)
NOT_MANAGED = {
    b"/api/pull": "download models",
    b"/api/push": "upload models",
    b"/api/create": "create models",
    b"/api/copy": "copy models",
    b"/api/delete": "delete models",
}
MODELS_FROM = ("a model is a GGUF file in a --models-dir or the Hugging Face cache, or a "
               "--models-preset section (alias = for more names); GET /models?reload=1 "
               "rescans them")


def resolve(names: dict[str, int], name: str) -> int | None:
    """The model index ``name`` names: the name or alias itself, else
    ``NAME`` for ``NAME:latest`` (Ollama's default tag)."""
    m = names.get(name)
    if m is None and name.endswith(":latest"):
        m = names.get(name[:-7])
    return m


def wants_usage(body: dict) -> bool:
    """A streamed chat completion that asks for the usage chunk
    (``stream_options.include_usage``)."""
    so = body.get("stream_options")
    return body.get("stream") is True and isinstance(so, dict) and so.get("include_usage") is True


def handles(path: bytes) -> bool:
    """Whether :meth:`ClientApis.handle` answers ``path``."""
    return (path in ROUTES or path[:5] == b"/api/" or path[:11] == b"/v1/models/"
            or path[:14] == b"/v1/responses/")


def adapter_for(path: bytes) -> Adapter:
    """The adapter whose error envelope a request to ``path`` gets."""
    route = ROUTES.get(path)
    if route is not None:
        return route[0]
    return _OLLAMA if path[:5] == b"/api/" else _OPENAI


def send_error(conn: HttpConnection, req: Request, status: int, message: str,
               headers=()) -> None:
    """An error in the envelope of the API that ``req``'s path belongs to."""
    ctype, body = adapter_for(req.path).error(status, message)
    conn.send_response(req, status, body, ctype, headers)


def _model_path(mdl: dict) -> str | None:
    """The GGUF file of a registry model, from its arguments."""
    args = mdl.get("args") or []
    for flag in ("--model", "-m"):
        if flag in args:
            i = args.index(flag)
            if i + 1 < len(args):
                return args[i + 1]
    return None


class ClientApis:
    """The routes of the module docstring for one proxy worker."""

    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy
        self.facts = ModelFacts()

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        """Answer a request whose path :func:`handles`."""
        path, method = req.path, req.method
        route = ROUTES.get(path)
        if route is not None:
            if method != b"POST":
                send_error(conn, req, 405, f"{path.decode()} needs POST")
                return
            await self.translated(conn, req, route[0], route[1])
            return
        get = method in (b"GET", b"HEAD")
        p = self.proxy
        if path == b"/api/version" and get:
            conn.send_json(req, 200, {"version": ollama.VERSION})
        elif path == b"/api/tags" and get:
            p.refresh()
            models = [(mdl, await self._facts(mdl)) for mdl in p.reg_models
                      if not mdl.get("removed") and not mdl.get("hidden")  # as /v1/models
                      and p._key_allows(req, mdl)]  # the key's models (issue 36)
            conn.send_json(req, 200, ollama.tags(models))
        elif path == b"/api/ps" and get:
            await self._ps(conn, req)
        elif path == b"/api/show" and method == b"POST":
            await self._show(conn, req)
        elif path in NOT_MANAGED or path[:11] == b"/api/blobs/":
            self._not_managed(conn, req)
        elif path[:11] == b"/v1/models/" and get:
            self._model_object(conn, req)
        elif path[:14] == b"/v1/responses/":
            send_error(conn, req, 400, responses.NOT_STORED.format(
                what=f"{method.decode()} {path.decode('latin-1')}"))
        else:
            send_error(conn, req, 404 if path[:5] == b"/api/" else 405,
                       f"no route for {method.decode()} {path.decode('latin-1')}")

    # ---- translated requests ------------------------------------------------------
    async def translated(self, conn: HttpConnection, req: Request, adapter: Adapter,
                         native: bool = False, body: dict | None = None) -> None:
        """Forward ``req`` through ``adapter`` (module docstring); ``body`` is
        the request's JSON when the caller parsed it already."""
        p = self.proxy
        wrap = TranslatedConnection(conn, req, adapter)
        if body is None and isinstance(adapter, anthropic.CountTokens):
            refusal = tokenize_body_refusal(conn.limits, req.body, False)
            if refusal is not None:  # before parsing it (issue 31, item 1)
                wrap.send_error(req, 413, refusal)
                return
        large = is_large(conn.limits, req.body)  # parsed and translated off the loop
        if body is None:
            try:
                body = await off_loop(large, parse_object, conn.limits, req.body)
            except BodyError as e:  # not JSON (400), too many items (413): issue 37, item 11
                wrap.send_error(req, e.status, str(e))
                return
        name = body.get("model")
        p.refresh()
        if name is None:  # the only model, as a llama-server of one model serves it
            name = p.name_for_unnamed()
            if name is not None:
                body = {**body, "model": name}
        if not isinstance(name, str):
            wrap.send_error(req, 400, "'model' must be a string naming a model"
                            if name is not None else "missing 'model' in the request body")
            return
        m = p.pick_model(name)  # the name, an alias, else --model-fallback's
        if m is None:
            wrap.send_error(req, 404, unknown_model(name, p._listed(req)))
            return
        if req.key_row >= 0 and not p._key_admit(wrap, req, m, name, body, False):
            return  # a model outside the key's list: 403 before any load, wait or order
        if native and p.reg_models[m].get("kind") in NATIVE_KINDS and not p.reg_models[m].get(
                "translate"):
            await p._forward(ApiErrors(conn, adapter), req, m, name, body,
                             stream=body.get("stream") is True)
            return
        keep = None
        order = Order(f"{req.method.decode()} {req.path.decode('latin-1')}")
        try:
            await off_loop(large, check_depth, body, min(conn.limits.max_json_depth, MAX_DEPTH))
            if adapter.name == "ollama":
                keep = ollama.keep_alive_seconds(body.get("keep_alive"))
                if keep is not None:
                    order.refusal = p.admin_refusal(req)
                if isinstance(adapter, ollama.Chat) and _empty(body, adapter.generate):
                    await self._load_order(wrap, req, m, name, body, keep, adapter.generate,
                                           order)
                    return
                if (isinstance(adapter, ollama.Chat) and adapter.generate and not body.get("raw")
                        and not body.get("system") and not body.get("images")
                        and await self._without_template(m)):
                    # Ollama's template of a model without one is the prompt alone
                    # (with images: the chat path, whose default template places them)
                    body = {**body, "raw": True}
            if isinstance(adapter, anthropic.CountTokens):
                t = await self._count_request(wrap, req, adapter, m, name, body)
                if t is None:
                    return
            else:
                t = await off_loop(large, adapter.request, body)
                if t.dropped:  # issue 31 item 13: Codex's web_search by default
                    log.info("%s %s: left out the hosted tools %s (tool_choice auto; nothing "
                             "here runs them)", name, req.path.decode("latin-1"),
                             ", ".join(t.dropped))
                if (t.stream and isinstance(adapter, (anthropic.Messages, responses.Responses))
                        and p.reg_models[m].get("kind") == "llama"):
                    # the built-in instance's prompt_progress chunk comes first, once it
                    # took the request: the stream opens then (message_start with the
                    # prompt's size, as llama-server's; response.created), before the
                    # prefill (issue 31 item 12)
                    t.body["return_progress"] = True
            if name not in p.names:  # NAME:latest: the replica gets the registered name
                t.body["model"] = p.reg_models[m]["name"]
            data = await off_loop(large, encode_body, t.body)
        except BadRequest as e:  # encode_body's too: a body orjson cannot write
            wrap.send_error(req, e.status, str(e))
            return
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:
            # an adapter that met a type it does not check: a 400 that says so,
            # never orjson's message (its JSONEncodeError is a TypeError: every
            # TypeError read "nests too deep", issue 31 item 5)
            log.warning("%s: the adapter could not read the request: %r", req.path.decode(
                "latin-1"), e)
            wrap.send_error(req, 400, f"a field of the request has a type ggmux cannot "
                            f"translate ({type(e).__name__}: {e})")
            return
        if t.images and not has_projector(p.reg_models[m]):
            wrap.send_error(req, 400, tools.no_projector(name))
            return
        wrap.t = t
        req.body = data
        req.body_json = t.body  # what the replica gets (the prefix index hashes it)
        req.url = t.target
        req.method = t.method
        session = {"prompt_cache_key": t.session} if t.session else {}
        if t.stream:
            wrap.keep_alive(asyncio.get_running_loop(), p.stream_keepalive)
        try:
            await p._forward(wrap, req, m, name, session, stream=t.stream)
        finally:
            wrap.stop_keep_alive()
            if keep is not None:
                self._keep_alive(m, name, keep, order)

    async def _count_request(self, wrap: TranslatedConnection, req: Request,
                             adapter: anthropic.CountTokens, m: int, name: str,
                             body: dict) -> Translated | None:
        """The ``/tokenize`` request that counts a ``count_tokens`` body:
        of the prompt the replica's chat template renders (its
        ``/apply-template``, forwarded as any request), or, when the replica
        has no such route or cannot render, of the text alone
        (:class:`~.adapters.anthropic.CountTokens`). None after answering
        (the model failed to load, the client left, images for a model
        without a projector)."""
        p = self.proxy
        t = adapter.template_request(body)
        if t.images and not has_projector(p.reg_models[m]):
            wrap.send_error(req, 400, tools.no_projector(name))
            return None
        t.body["model"] = p.reg_models[m]["name"]
        if t.images and p.reg_models[m].get("kind") == "llama":
            # a built-in instance counts media as the embeddings its projector
            # makes (llama-server's /tokenize would count the marker's text)
            return adapter.media_request(t.body)
        req.body, req.url = encode_body(t.body), t.target
        ex = await p._forward(wrap, req, m, name, None, capture=True)
        if ex is None:
            return None
        if ex.status == 499:
            wrap.conn.finish(req)
            return None
        prompt = None
        if ex.status == 200:
            try:
                prompt = orjson.loads(ex.body).get("prompt")
            except (orjson.JSONDecodeError, AttributeError):
                prompt = None
        if isinstance(prompt, str):
            return adapter.tokenize_request(body, prompt)
        log.debug("%s: /apply-template answered %d: counting the text alone", name, ex.status)
        return adapter.request(body)

    def _keep_alive(self, m: int, name: str, seconds: float, order: Order) -> None:
        """Ollama's ``keep_alive`` after a request (module docstring): from
        a caller who may administer, 0 unloads the model and any other value
        becomes its idle timer until it unloads (the supervisor's
        ``keep_alive`` command; negative: never); from any other, the
        supervisor only extends the timer, up to the model's ttl."""
        p = self.proxy
        if order.refusal is None and seconds == 0:
            log.info("%s: keep_alive 0 (%s): unloading after the request", name, order.route)
            p.command({"op": "unload", "model": m, "route": order.route})
            return
        cmd = {"op": "keep_alive", "model": m, "route": order.route,
               "seconds": -1 if seconds == float("inf") else seconds}
        if order.refusal is not None:
            cmd["extend"] = True
        p.command(cmd)

    async def _load_order(self, wrap: TranslatedConnection, req: Request, m: int, name: str,
                          body: dict, keep: float | None, generate: bool, order: Order) -> None:
        """Ollama's empty request (:meth:`_load_or_unload`) as a request of
        its key: a keys-file key's limits admit and count it (one request,
        in flight while its model loads) before anything loads, waits or
        drains, as any other request of the key (a load is the costliest
        thing a request can cause); recorded as any request that names a
        model (its settlement gives its token reservation back: it
        generates nothing)."""
        p = self.proxy
        if req.key_row >= 0 and not p._key_admit(wrap, req, m, name, body, True):
            p.activity.record(req, m, -1, None, req.status or 429)
            return
        try:
            await self._load_or_unload(wrap, req, m, name, keep, generate, order)
        finally:
            p.activity.record(req, m, -1, None, req.status or 499)

    async def _load_or_unload(self, wrap: TranslatedConnection, req: Request, m: int, name: str,
                              keep: float | None, generate: bool, order: Order) -> None:
        """Ollama's empty request: load the model (answered once it is
        ready), or with ``keep_alive: 0`` unload it: 403 for a caller who
        may not administer (module docstring)."""
        p = self.proxy
        if keep == 0:
            if order.refusal is not None:
                wrap.send_error(req, 403, f"unloading a model {order.refusal}")
                return
            p.command({"op": "unload", "model": m, "route": order.route})
            reason = "unload"
        else:
            if m not in p.ready:
                token = p._wait_join(req, m)  # a load waits as any request (a key's penalty)
                served = False
                try:
                    outcome = await p.waiters.wait(m, req)
                    if outcome == "ready":
                        served = True
                        p._wait_served(req, m, token)
                finally:
                    if not served:
                        p.waiters.leave(m, token[0])
                if outcome == "gone":
                    wrap.conn.finish(req)
                    return
                if outcome != "ready":
                    wrap.send_error(req, 503, f"model '{name}' did not load ({outcome})",
                                    headers=[(b"retry-after", b"5")])
                    return
            reason = "load"
            if keep is not None:
                self._keep_alive(m, name, keep, order)
        out: dict = {"model": name, "created_at": ollama.created_at()}
        if generate:
            out["response"] = ""
        else:
            out["message"] = {"role": "assistant", "content": ""}
        out.update(done=True, done_reason=reason)
        wrap.conn.send_json(req, 200, out)

    async def _without_template(self, m: int) -> bool:
        """Whether model ``m`` is a GGUF file whose metadata has no chat
        template (a base model); False when that cannot be read."""
        f = await self._facts(self.proxy.reg_models[m])
        return bool(f) and not f.get("template")

    # ---- router-level answers ------------------------------------------------------
    async def _facts(self, mdl: dict) -> dict:
        path = _model_path(mdl)
        if not path:
            return {}
        return await asyncio.get_running_loop().run_in_executor(None, self.facts.get, path)

    async def _ps(self, conn: HttpConnection, req: Request) -> None:
        p = self.proxy
        p.refresh()
        loaded = []
        now_ns, wall = time.monotonic_ns(), time.time()
        for i, mdl in enumerate(p.reg_models):
            row = p.model_rows[i]
            if mdl.get("removed") or int(row[L.M_STATUS]) not in (
                    L.ModelStatus.LOADED, L.ModelStatus.SLEEPING) or not p._key_allows(req, mdl):
                continue  # (a keys-file key sees its own models only)
            facts = await self._facts(mdl)
            ttl = mdl.get("ttl")
            expires = None
            if ttl:
                reps = p.replica_rows
                slots = [int(s) for s in (reps[:, L.R_MODEL] == i).nonzero()[0]]
                used = max([int(p.seg.counters[:, s, L.C_LAST_USED_NS].max()) for s in slots]
                           + [int(row[L.M_LAST_READY_NS])])
                expires = wall + ttl - (now_ns - used) / 1e9
            loaded.append((mdl, facts, int(row[L.M_MEM_EFFECTIVE]) or mdl.get("size_bytes", 0),
                           # a request's context (ctx-size), as Ollama's num_ctx;
                           # 0: the model's trained one
                           expires, mdl.get("ctx_size") or facts.get("context_length") or 0))
        conn.send_json(req, 200, ollama.ps(loaded))

    async def _show(self, conn: HttpConnection, req: Request) -> None:
        p = self.proxy
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError:
            body = None
        name = body.get("model", body.get("name")) if isinstance(body, dict) else None
        if not isinstance(name, str):
            send_error(conn, req, 400, "body must be {\"model\": \"<name>\"}")
            return
        p.refresh()
        m = resolve(p.names, name)
        if m is None:
            send_error(conn, req, 404, unknown_model(name, p._listed(req)))
            return
        mdl = p.reg_models[m]
        if not p._key_allows(req, mdl):  # a key's models (issue 36: proxy.keyed)
            send_error(conn, req, 403, f"this key may not use model '{name}'")
            return
        facts = await self._facts(mdl)
        doc = ollama.show(mdl, facts)
        # whether chat requests have a template (measured, else the file's
        # metadata): without one a client should use /api/generate raw
        has = mdl.get("chat_template")
        if isinstance(has, bool) or facts:
            doc["has_chat_template"] = has if isinstance(has, bool) else bool(facts.get("template"))
        conn.send_json(req, 200, doc)

    def _not_managed(self, conn: HttpConnection, req: Request) -> None:
        """Ollama's model management (module docstring): 501 ``{"error":
        "ggmux does not ..."}``; ``POST /api/pull`` of a model ggmux serves
        (``model``, or Ollama's older ``name``): 200 ``{"status":
        "success"}``, one NDJSON line unless ``"stream": false``."""
        what = NOT_MANAGED.get(req.path, "create models")
        if req.path == b"/api/pull" and req.method == b"POST":
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                body = None
            name = body.get("model", body.get("name")) if isinstance(body, dict) else None
            if isinstance(name, str):
                self.proxy.refresh()
                m = resolve(self.proxy.names, name)
                if m is not None and not self.proxy.reg_models[m].get("removed"):
                    if body.get("stream") is False:
                        conn.send_json(req, 200, {"status": "success"})
                    else:
                        conn.send_response(req, 200, b'{"status":"success"}\n', ollama.NDJSON)
                    return
                what = f"download models ('{name}' is not here)"
        send_error(conn, req, 501, f"ggmux does not {what}: {MODELS_FROM}")

    def _model_object(self, conn: HttpConnection, req: Request) -> None:
        """``GET /v1/models/{id}`` (ids may contain ``/``; URL-decoded)."""
        p = self.proxy
        p.refresh()
        name = unquote(req.path[11:].decode("latin-1"))
        m = resolve(p.names, name)
        if m is None or p.reg_models[m].get("removed"):
            conn.send_error(req, 404, unknown_model(name, p._listed(req)),
                            code="model_not_found")
            return
        if not p._key_allows(req, p.reg_models[m]):  # a key's models (issue 36)
            conn.send_error(req, 403, f"this key may not use model '{name}'",
                            code="model_not_allowed")
            return
        conn.send_json(req, 200, model_object(m, p.reg_models[m], p.model_rows[m], p.errors,
                                              p.reg_models, p._scope(req)))


# llama.cpp options that give a model its multimodal projector
_PROJECTOR_FLAGS = frozenset(("--mmproj", "-mm", "--mmproj-url", "-mmu"))


def has_projector(mdl: dict) -> bool:
    """Whether a registry model can be sent images: its arguments name a
    multimodal projector (llama.cpp's ``--mmproj``, the preset's
    ``mmproj``), or it is a remote ``upstream``/``cluster`` model, whose
    server judges for itself."""
    if mdl.get("kind") in ("upstream", "cluster"):
        return True
    return any(a.split("=", 1)[0] in _PROJECTOR_FLAGS for a in mdl.get("args") or ())


def _empty(body: dict, generate: bool) -> bool:
    """Ollama's load/unload request: no prompt (generate) or no messages (chat)."""
    if generate:
        return not body.get("prompt") and not body.get("images")
    return body.get("messages") in (None, [])
