"""What a proxy tells clients about models: the OpenAI model list with
llama.cpp router's ``status`` object (``GET /v1/models``) and its live form,
``GET /models/sse`` (one ``event: model`` per status change)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import numpy as np
import orjson

from ..http1 import HttpConnection, Request
from ..shm import layout as L
from .cluster import annotate_model
from .contention import queue_status

SSE_KEEPALIVE_S = 15.0


class Scope(Protocol):
    """What one caller may see of the models (:class:`~.keyed.KeyScope`, a
    keys-file key's): ``sees(i)`` whether model ``i`` is shown to it at
    all, ``name(i)`` a model's name as it may read it (a waiting model's
    holder). A scoped caller's model objects carry no ``status.args``
    (this machine's paths and options)."""

    def sees(self, i: int) -> bool: ...

    def name(self, i: int) -> str: ...


def model_status(i: int, row: np.ndarray, mdl: dict, errors: dict[str, str],
                 names: list[dict] | None = None, scope: Scope | None = None) -> dict:
    """llama.cpp router's ``status`` object of model ``i`` from its models-table
    ``row``: ``value`` (unloaded, loading, loaded, sleeping, stopping),
    ``args``; ``failed``, ``exit_code`` and ``error`` after a crash;
    ``progress`` (0..1) while loading; ``cache`` (``ram_bytes``, its
    running replicas' host-RAM tiers, and ``disk_bytes``, its disk tier on
    this node) for a model with a KV tier (issue 29); ``queue`` while
    requests wait for it (issue 34, :func:`~.contention.queue_status`: waiters,
    the oldest wait, and why; ``names``: the registry's models, for the
    holder's name; with a ``scope``, the holder as its caller may read it,
    and no ``args``)."""
    st = int(row[L.M_STATUS])
    status: dict = {"value": L.ModelStatus.NAMES[st],
                    "args": mdl.get("args", []) if scope is None else []}
    ram, disk = int(row[L.M_CACHE_RAM_BYTES]), int(row[L.M_CACHE_DISK_BYTES])
    if ram or disk or row[L.M_CACHE_FLAGS]:
        status["cache"] = {"ram_bytes": ram, "disk_bytes": disk}
    if row[L.M_FAILED]:
        status["failed"] = True
        status["exit_code"] = int(row[L.M_EXIT_CODE])
        if str(i) in errors:
            status["error"] = errors[str(i)]
    if st == L.ModelStatus.LOADING:
        status["progress"] = int(row[L.M_PROGRESS]) / 1000
    name_of: Callable[[int], str] = (scope.name if scope is not None
                                     else lambda h: _name(names, h))
    q = queue_status(row, name_of)
    if q is not None:
        status["queue"] = q
    return status


def _name(models: list[dict] | None, i: int) -> str:
    """Model ``i``'s name in the registry's ``models`` ("" when unknown)."""
    if models is None or not 0 <= i < len(models):
        return ""
    return models[i].get("name", "")


def model_object(i: int, mdl: dict, row: np.ndarray, errors: dict[str, str],
                 names: list[dict] | None = None, scope: Scope | None = None) -> dict:
    """OpenAI's model object for model ``i`` (``created``: its file's
    modification time) with llama.cpp router's ``status`` and ggmux's
    ``aliases`` and, once the model is measured, ``has_chat_template``
    (whether its GGUF has ``tokenizer.chat_template``: without one, chat
    requests have no template to use, and a client should use
    ``/v1/completions``) and, for a model with a multimodal projector,
    ``modalities`` (``{"vision", "audio"}``, llama-server's ``/props``
    shape) and ``capabilities`` (those of them it reads). ``scope``: as
    :func:`model_status` shows it."""
    out = {
        "id": mdl["name"],
        "object": "model",
        "created": mdl.get("created", 0),
        "owned_by": "ggmux",
        "aliases": mdl.get("aliases", []),
        "status": model_status(i, row, mdl, errors, names, scope),
    }
    if isinstance(mdl.get("chat_template"), bool):
        out["has_chat_template"] = mdl["chat_template"]
    mods = mdl.get("modalities")
    if isinstance(mods, dict):  # measured: what its projector reads beside text
        out["modalities"] = {"vision": bool(mods.get("vision")), "audio": bool(mods.get("audio"))}
        out["capabilities"] = media_capabilities(mods)
    return out


def media_capabilities(modalities: dict) -> list[str]:
    """``["vision", "audio"]``, those a model's projector reads (Ollama's
    ``capabilities`` names, llama-server's ``/props`` ``modalities``)."""
    return [k for k in ("vision", "audio") if modalities.get(k)]


def models_list(reg_models: list[dict], model_rows: np.ndarray, errors: dict[str, str],
                scope: Scope | None = None) -> dict:
    """OpenAI model list (``{"object": "list", "data": [...]}``) of
    :func:`model_object`; models a reload removed are left out, and so are
    cache entries a preset's ``dedup-cache-models`` hides (still served by
    name, as llama-server's router skips ``meta.hidden`` in its list), and,
    with a ``scope``, the models it does not see."""
    data = [model_object(i, mdl, model_rows[i], errors, reg_models, scope)
            for i, mdl in enumerate(reg_models)
            if not mdl.get("removed") and not mdl.get("hidden")
            and (scope is None or scope.sees(i))]
    return {"object": "list", "data": data}


NAMES_SHOWN = 5
"""How many model names an unknown model's 404 lists (:func:`unknown_model`)."""


def unknown_model(name: str, reg_models: list[dict], shown: int = NAMES_SHOWN) -> str:
    """The 404 message for ``name``, which no model or alias has: it lists
    the first ``shown`` names ``GET /v1/models`` lists (:func:`models_list`)
    and how many more there are, so a new user sees a name that works
    (issue 31, item 14). The caller passed the route's key check already,
    and any key that passes it may ``GET /v1/models``: the message shows no
    caller more than it may list."""
    names = [m["name"] for m in reg_models if not m.get("removed") and not m.get("hidden")]
    msg = f"model '{name}' not found"
    if not names:
        return msg + "; no model is configured"
    more = len(names) - shown
    return (f"{msg}; models here: {', '.join(names[:shown])}"
            + (f" and {more} more (GET /v1/models)" if more > 0 else ""))


class ModelEvents:
    """The ``GET /models/sse`` subscribers of one proxy.

    :meth:`publish` runs after every table refresh and sends one
    ``event: model`` per model whose status changed since the last event:
    ``{"id", "status"}``, ``has_chat_template`` once the model is measured
    (:func:`model_object`), and in cluster mode ``status.node`` and
    ``nodes`` as ``/v1/models`` has them (:func:`~.cluster.annotate_model`),
    so an event never takes back what the list said; a comment every
    :data:`SSE_KEEPALIVE_S` seconds keeps idle streams open. A subscriber
    with a :class:`Scope` (a keys-file key) gets the events of the models
    it sees only, as its ``/v1/models`` shows them. ``state()``
    returns ``(reg_models, model_rows, errors, cluster)`` as of now
    (``cluster``: the registry blob's cluster object, None outside
    cluster mode)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, state) -> None:
        self.loop = loop
        self.state = state
        self.subs: set[tuple[HttpConnection, Request, Scope | None]] = set()
        self.last: dict[int, bytes] = {}
        self.timer: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(self.subs)

    def _event(self, i: int, scope: Scope | None = None) -> bytes:
        reg_models, rows, errors, cluster = self.state()
        mdl = reg_models[i]
        ev = {"id": mdl["name"],
              "status": model_status(i, rows[i], mdl, errors, reg_models, scope)}
        if isinstance(mdl.get("chat_template"), bool):  # known once measured: an event then
            ev["has_chat_template"] = mdl["chat_template"]
        data = orjson.dumps(annotate_model(ev, cluster))
        return b"event: model\ndata: " + data + b"\n\n"

    async def subscribe(self, conn: HttpConnection, req: Request,
                        scope: Scope | None = None) -> None:
        """Serve one subscriber (``scope``: what it may see; None: all):
        one event per model with its current status, then changes as they
        happen, for as long as the client stays."""
        reg_models = self.state()[0]
        conn.start_stream(req)
        for i, mdl in enumerate(reg_models):
            if not mdl.get("removed") and (scope is None or scope.sees(i)):
                conn.send_chunk(self._event(i, scope))
        self.last = {i: self._event(i) for i in range(len(reg_models))}
        sub = (conn, req, scope)
        self.subs.add(sub)
        gone = self.loop.create_future()
        req.on_disconnect = lambda: gone.done() or gone.set_result(None)
        if self.timer is None:
            self.timer = self.loop.call_later(SSE_KEEPALIVE_S, self._keepalive)
        try:
            await gone  # the stream lasts as long as the client stays
        finally:
            self.subs.discard(sub)
            conn.finish(req)

    def publish(self) -> None:
        """Send the status of every model that changed since its last event."""
        for i, mdl in enumerate(self.state()[0]):
            if mdl.get("removed"):
                continue
            ev = self._event(i)
            if self.last.get(i) != ev:
                self.last[i] = ev
                for conn, _, scope in list(self.subs):
                    if scope is None:
                        conn.send_chunk(ev)
                    elif scope.sees(i):
                        conn.send_chunk(self._event(i, scope))

    def _keepalive(self) -> None:
        self.timer = None
        if not self.subs:
            return
        for conn, _, _ in list(self.subs):
            conn.send_chunk(b": keep-alive\n\n")
        self.timer = self.loop.call_later(SSE_KEEPALIVE_S, self._keepalive)
