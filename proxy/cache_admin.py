"""``POST /cache/clear`` (issue 29; DESIGN.md "KV tiers"): the admin action
that empties the KV tiers of one model (``{"model": NAME}``) or of every
model (``{}``).

The proxy resolves the name and asks the supervisor (a ``cache_clear``
command with an id); the supervisor, on a worker thread, has every running
replica of the model empty its tiers (the instance's ``POST
/cache/clear``), removes the disk files of a model with none running (its
folders found by their ``model.json``) and a ``cmd`` llama-server's saved
slots, then publishes the answer under that id in the registry blob
(``cache_clears``), which this proxy waits for, as ``?reload=1`` waits for
its reload. The answer: ``{"cleared": {NAME: {"ram": entries, "disk":
entries, "replicas": n}}}`` (``errors`` where a replica did not answer).
The route needs the admin key and a JSON object body, ``{}`` for every model
(a body of another type: 415, as every state-changing route: :mod:`.routes`;
none: 400).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from typing import Protocol

from ..http1 import HttpConnection, Request, json_object

CLEAR_WAIT_S = 30.0
"""How long the route waits for the supervisor's answer (each replica's
clear is bounded by 10 s there)."""

_ids = itertools.count(1)


class ClearHost(Protocol):
    """What the route needs of the proxy (:class:`~.server.Proxy`)."""

    loop: asyncio.AbstractEventLoop
    cache_clears: dict

    def refresh(self) -> None: ...

    def _model(self, conn: HttpConnection, req: Request, name) -> int | None: ...

    def _command(self, conn: HttpConnection, req: Request, cmd: dict) -> bool: ...


async def clear_route(host: ClearHost, conn: HttpConnection, req: Request,
                      names: Callable[[int], str]) -> None:
    """Answer ``POST /cache/clear`` (module docstring). ``names(m)``: model
    ``m``'s name, for the answer's error text."""
    body = json_object(conn, req)  # `{}` for every model: an empty body is no JSON
    if body is None:
        return
    name = body.get("model")
    m = None
    if name is not None:
        m = host._model(conn, req, name)  # 400 not a string, 404 unknown: answered
        if m is None:
            return
    rid = f"{os.getpid()}-{next(_ids)}"
    if not host._command(conn, req, {"op": "cache_clear", "model": m, "id": rid,
                                     "route": "POST /cache/clear"}):
        return
    deadline = host.loop.time() + CLEAR_WAIT_S
    while rid not in host.cache_clears:
        if host.loop.time() > deadline or req.disconnected:
            conn.send_error(req, 503, f"the cache clear did not finish within {CLEAR_WAIT_S:g} s",
                            headers=[(b"retry-after", b"1")])
            return
        await asyncio.sleep(0.01)
        host.refresh()
    out = host.cache_clears[rid]
    if "error" in out:
        conn.send_error(req, 500, f"cache clear of {names(m) if m is not None else 'every model'}"
                        f" failed: {out['error']}", code="cache_clear_failed")
        return
    conn.send_json(req, 200, {"cleared": out})
