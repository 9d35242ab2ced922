"""Keys with limits in the proxy (issue 36): the mixin of
:class:`~ggmux.proxy.server.Proxy` that applies a keys-file key's policy
(:mod:`.admission`) to a request, filters the model lists by it, counts
priced replicas' spend, and answers the admin routes ``/keys``.

Routes (admin key; with none set, an ``--api-key`` key, never a key of the
keys file):

* ``GET /keys``: every key's policy (no secret, no hash) and its current
  windows; ``GET /keys/NAME`` one.
* ``POST /keys`` ``{"name": ..., "models": "a, b*", "rpm": 60, ...}`` (any
  setting of the keys file but the secret): a new key; the answer holds its
  secret, once: only its hash is kept.
* ``POST /keys/NAME/rotate``: a new secret (the old one stops working; the
  windows stay); ``/disable``, ``/enable``; ``DELETE /keys/NAME``.

And for any key, about itself: ``GET /key/info`` (:mod:`.key_info`).

The proxy makes the secret and sends only its hash to the supervisor
(``{"op": "keys", ...}`` on the command queue), which edits the keys file
and publishes the policies; the route answers once the key table says that
edit ran (its ``done`` ids).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets

import numpy as np
import orjson

from ..http1 import HttpConnection, Request, json_object
from ..http1.auth import given_key
from ..shm import layout as L
from ..shm.keytable import DEFAULT_RESERVE_TOKENS, period_end, periods
from .admission import (
    KeyAdmission,
    Refusal,
    cost_nano,
    prompt_estimate,
    requested_tokens,
    worst_cost,
)
from .contention import OTHER_MODEL
from .drain_penalty import DrainPenalty
from .key_info import key_view, unlimited_view

log = logging.getLogger(__name__)

EDIT_WAIT_S = 10.0  # an admin edit waits this long for the supervisor's answer
SETTINGS = ("models", "rpm", "tpm", "max-parallel", "tokens-per-day", "tokens-per-week",
            "tokens-per-month", "input-weight", "cached-weight", "output-weight",
            "spend-per-month", "reserve-tokens", "expires", "disabled")


def budgeted(mdl: dict) -> bool:
    """Whether registry entry ``mdl`` has a spending budget for its priced
    replicas (``spend-per-day|week|month``)."""
    return bool(mdl.get("spend_per_day") or mdl.get("spend_per_week")
                or mdl.get("spend_per_month"))


class KeyScope:
    """What a keys-file key may see of the models (every route that lists
    or describes models: ``/v1/models``, ``/ps``, ``/api/ps``, ``/metrics``,
    ``/models/sse``, a waiting model's reason): :meth:`sees` its own models
    only, and :meth:`name` says ``another model`` (:data:`~.contention.OTHER_MODEL`)
    for one it may not use, so a tenant never learns which other tenant's
    model holds the capacity, nor what the others run. Live: it reads the
    proxy's registry and the key's policy as they are when asked (a reload
    changes both)."""

    __slots__ = ("proxy", "req")

    def __init__(self, proxy: KeyedProxy, req: Request) -> None:
        self.proxy = proxy
        self.req = req

    def sees(self, i: int) -> bool:
        """Whether the key may use model ``i`` (the registry's index)."""
        models = self.proxy.reg_models
        return 0 <= i < len(models) and self.proxy._key_allows(self.req, models[i])

    def name(self, i: int) -> str:
        """Model ``i``'s name for messages: its own, or ``another model``
        when the key may not use it ("" when there is no model ``i``)."""
        models = self.proxy.reg_models
        if not 0 <= i < len(models):
            return ""
        return models[i].get("name", "") if self.sees(i) else OTHER_MODEL


class KeyedProxy:
    """The keys half of :class:`~ggmux.proxy.server.Proxy` (module docstring);
    ``self.keys`` is its :class:`~.admission.KeyAdmission` (the key table:
    the windows of ``--keys``' keys and the spend of priced replicas), and
    ``self.keyed`` whether a keys file is set."""

    keys: KeyAdmission | None
    spend_holds: dict  # Request -> SpendHold: the budgets its worst case holds
    drain_penalty: DrainPenalty | None  # --drain-penalty, for the keys of the keys file

    def _key_row(self, req: Request) -> int:
        """Set and return ``req.key_row`` from the key it presents (-1: none
        of the keys file's)."""
        given = given_key(req)
        row = self.keys.row_of(given) if given else -1
        req.key_row = row
        return row

    def _key_unusable(self, req: Request) -> str | None:
        """Why the keys-file key ``req`` presents opens nothing (disabled,
        expired), or None."""
        if not self.keyed:
            return None
        given = given_key(req)
        row = self.keys.row_of(given) if given else -1
        return self.keys.unusable(row) if row >= 0 else None

    def _key_allows(self, req: Request, mdl: dict) -> bool:
        return req.key_row < 0 or self.keys.may_use(req.key_row,
                                                    (mdl["name"], *mdl.get("aliases", ())))

    def _scope(self, req: Request) -> KeyScope | None:
        """What ``req``'s caller may see of the models: None (everything)
        unless it presents a key of the keys file (:class:`KeyScope`)."""
        return KeyScope(self, req) if req.key_row >= 0 else None

    def _names_for(self, req: Request):
        """``name(i)`` of the models as ``req``'s caller may read them in a
        message (a waiting model's reason): :meth:`KeyScope.name`, or the
        registry's name for a caller who sees every model."""
        scope = self._scope(req)
        return scope.name if scope is not None else self._model_name

    def _listed(self, req: Request) -> list[dict]:
        """The models ``req``'s caller may see (an unknown model's 404 lists
        some): all, or its key's."""
        if req.key_row < 0:
            return self.reg_models
        return [e for e in self.reg_models if self._key_allows(req, e)]

    def _key_admit(self, conn: HttpConnection, req: Request, m: int, name: str,
                   body: dict | None, counted: bool) -> bool:
        """The key's policy for a request of model ``m``: False after
        answering 403 (a model the key may not use) or 429 (a limit); with
        ``counted`` (the request will be recorded, so settled) its limits
        count it (``req.key_hold``)."""
        mdl = self.reg_models[m]
        if not self._key_allows(req, mdl):
            conn.send_error(req, 403, f"key '{self.keys.name(req.key_row)}' may not use model "
                            f"'{name}' (the key's models setting)", code="model_not_allowed")
            return False
        hold = req.key_hold
        if hold is not None and hasattr(hold, "retry_after"):  # refused on the fast path
            req.key_hold = None
            conn.send_error(req, hold.status, hold.message, code=hold.code,
                            headers=hold.headers())
            return False
        if not counted or hold is not None:
            return True
        got = self.keys.admit(req.key_row, self._limits_source(conn, req, body),
                              len(req.body), self.reg_models[m])
        if hasattr(got, "retry_after"):
            conn.send_error(req, got.status, got.message, code=got.code, headers=got.headers())
            return False
        req.key_hold = got
        return True

    def _limits_source(self, conn: HttpConnection, req: Request, body: dict | None):
        """The JSON whose limit fields (``max_tokens``, ...) a reservation
        reads: what the replica gets (``req.body_json``, parsed already),
        else ``body``; a body nobody parsed (a pass-through's) is parsed
        here only when small: a large one would stop the loop (orjson holds
        the GIL) for every other tenant's stream, and reserves the key's
        ``reserve-tokens``."""
        if req.body_json is not None:
            return req.body_json
        if body is None and req.body and len(req.body) <= conn.limits.offloop_body_bytes:
            try:
                return orjson.loads(req.body)
            except orjson.JSONDecodeError:
                return None
        return body

    def _key_fast(self, req: Request, m: int) -> bool:
        """The key's policy on the fast path (:meth:`~.forward.Forwarding.fast`):
        True when the request is admitted (``req.key_hold``); False leaves it
        to the handler: a model the key may not use, a model with a spending
        budget, or a refusal (kept in ``req.key_hold``, answered there)."""
        mdl = self.reg_models[m]
        if not self._key_allows(req, mdl) or budgeted(mdl):
            return False
        req.key_hold = self.keys.admit(req.key_row, req.body_json, len(req.body), mdl)
        return not hasattr(req.key_hold, "retry_after")

    def _priced(self, m: int, slot: int) -> bool:
        """Whether replica ``slot`` of model ``m`` is priced: a ``cmd`` model's
        replica or an ``upstream`` one (never a built-in instance, nor another
        node of the cluster)."""
        mdl = self.reg_models[m]
        if not (mdl.get("price_input") or mdl.get("price_cached_input")
                or mdl.get("price_output")):
            return False
        if mdl.get("kind") in ("cmd", "upstream"):
            return True
        rm = self.remotes.get(slot)
        return rm is not None and not rm.get("hop")

    def _over_budget(self, conn: HttpConnection, req: Request, m: int, body: dict | None,
                     counted: bool):
        """Model ``m``'s spending budget for ``req``: the refusal when its
        priced replicas spent it, or when this request's worst case
        (:func:`~.admission.worst_cost`) would pass it; else None, and, for
        a ``counted`` request (one that is recorded, so settled), that worst
        case is reserved until it ends (``spend_holds``; settled in
        :meth:`_request_ended` to the real cost, 0 when a replica that is
        not priced served it). Reserved, not just checked: 30 concurrent
        requests all found the budget unspent and spent 20 times it."""
        mdl = self.reg_models[m]
        if self.keys is None or not budgeted(mdl):
            return None
        if not counted:
            return self.keys.over_budget(m, mdl)
        p = self.keys.by_row.get(req.key_row)
        src = self._limits_source(conn, req, body)
        gen = requested_tokens(src, p.reserve if p is not None else DEFAULT_RESERVE_TOKENS)
        got = self.keys.reserve_budget(
            m, mdl, worst_cost(mdl, prompt_estimate(src, len(req.body)), gen))
        if isinstance(got, Refusal):
            return got
        self.spend_holds[req] = got
        return None

    def _wait_join(self, req: Request, m: int) -> tuple[int, int, int]:
        """Count ``req`` as a waiter of model ``m``, its wait for a drain
        starting after its key's drain penalty (:mod:`.drain_penalty`);
        returns ``(its start, drains of every model, swaps of m)`` for
        :meth:`_wait_served`."""
        delay = self.drain_penalty.delay_ns(req.key_row) if self.drain_penalty else 0
        rows = self.model_rows
        return (self.waiters.join(m, delay), int(rows[:, L.M_DRAINS].sum()),
                int(rows[m, L.M_SWAPS]))

    def _wait_served(self, req: Request, m: int, token: tuple[int, int, int]) -> None:
        """``req``, waiting for model ``m`` since :meth:`_wait_join` gave
        ``token``, is taken by a replica: it no longer waits, and when a
        drain made room for ``m`` meanwhile (a model was drained, and a
        load of ``m`` swapped one out), its key caused it."""
        self.waiters.leave(m, token[0])
        rows = self.model_rows
        if (req.key_row >= 0 and self.drain_penalty is not None
                and int(rows[:, L.M_DRAINS].sum()) > token[1]
                and int(rows[m, L.M_SWAPS]) > token[2]):
            self.drain_penalty.caused(req.key_row)

    def _unpriced_ready(self, m: int) -> bool:
        """Whether model ``m`` has a ready replica that is not priced."""
        rows = self.replica_rows
        for s in np.flatnonzero((rows[:, L.R_MODEL] == m)
                                & (rows[:, L.R_STATUS] == L.ReplicaStatus.READY)):
            if not self._priced(m, int(s)):
                return True
        return False

    async def _local_for_budget(self, conn: HttpConnection, req: Request, m: int,
                                budget) -> bool:
        """Model ``m``'s priced replicas are over budget and no other replica
        is ready: ask for a local one and wait for it (``--load-wait``);
        False after answering (the budget's 429 when none came in time, or
        the client left)."""
        deadline = self.loop.time() + self.load_wait
        self.command({"op": "load", "model": m, "route": "an upstream over its spending budget"})
        while not self._unpriced_ready(m):
            if req.disconnected:
                conn.finish(req)
                return False
            if self.loop.time() > deadline:
                conn.send_error(req, budget.status, budget.message, code=budget.code,
                                headers=budget.headers())
                return False
            await asyncio.sleep(0.02)
            self.refresh()
        return True

    def _request_ended(self, req: Request, m: int, slot: int, prompt: int, cached: int,
                       gen: int) -> None:
        """:class:`~.activity.Activity`'s end hook: the spend of a priced
        replica's answer, and the key's settlement."""
        nano = 0
        if slot >= 0 and prompt + gen > 0 and self._priced(m, slot):
            nano = cost_nano(self.reg_models[m], prompt, cached, gen)
        budget = self.spend_holds.pop(req, None)
        if budget is not None:
            self.keys.settle_budget(m, budget, nano)
        elif nano:
            self.keys.add_spend(m, nano)
        hold = req.key_hold
        if hold is not None:
            req.key_hold = None
            self.keys.settle(hold, prompt, cached, gen, nano)

    # ---- /key/info -----------------------------------------------------------------------
    async def _key_info(self, conn: HttpConnection, req: Request) -> None:
        """``GET /key/info``: the presented key's own limits and use
        (:mod:`.key_info`); the route's key check let it in."""
        row = self._key_row(req) if self.keyed else -1
        if row < 0:
            kind = ("admin" if self._is_admin(req) else
                    "api-key" if self.api_key is not None or self.keyed else "none")
            conn.send_json(req, 200, unlimited_view(kind))
            return
        self.keys.refresh()
        _gen, doc = self.keys.table.policies()
        policy = next((d for d in doc.get("keys", ()) if d.get("row") == row), None)
        if policy is None:
            conn.send_error(req, 401, "the key was removed", code="invalid_api_key")
            return
        table = self.keys.table
        now = table.now()
        ids = periods(now)
        resets = {kind: table.real_seconds(max(period_end(kind, pid) - now, 0.0))
                  for kind, pid in zip(("minute", "day", "week", "month"), ids)}
        shown = {k: v for k, v in policy.items() if k not in ("sha256", "row")}
        conn.send_json(req, 200, key_view(shown, self.keys.usage(row), resets))

    # ---- /keys --------------------------------------------------------------------------
    async def _keys_route(self, conn: HttpConnection, req: Request) -> None:
        if not self.keyed:
            conn.send_error(req, 404, "this server has no keys file (ggmux serve --keys FILE)",
                            code="no_keys_file")
            return
        if req.key_row >= 0 or (self.admin_key is None and self._key_row(req) >= 0):
            conn.send_error(req, 403, "a key of the keys file cannot manage keys (the admin "
                            "key, or an --api-key key when no admin key is set, can)",
                            code="forbidden")
            return
        self.keys.refresh()
        parts = [p for p in req.path.decode("latin-1").split("/") if p][1:]
        method = req.method
        if method in (b"GET", b"HEAD") and len(parts) <= 1:
            shown = self._keys_shown()
            if parts:
                one = [k for k in shown if k["name"] == parts[0]]
                if not one:
                    conn.send_error(req, 404, f"no key '{parts[0]}'", code="key_not_found")
                    return
                conn.send_json(req, 200, one[0])
                return
            conn.send_json(req, 200, {"object": "list", "data": shown})
            return
        if method == b"POST" and not parts:
            body = json_object(conn, req)
            if body is None:
                return
            name = body.get("name")
            fields = {}
            for k, v in body.items():
                k = k.replace("_", "-")
                if k == "name":
                    continue
                if k not in SETTINGS or isinstance(v, (dict, list)) and k != "models":
                    conn.send_error(req, 400, f"unknown key setting '{k}' (known: "
                                    f"{', '.join(SETTINGS)})")
                    return
                fields[k] = ", ".join(v) if isinstance(v, list) else (
                    str(v).lower() if isinstance(v, bool) else str(v))
            await self._key_edit(conn, req, "create", name, fields)
            return
        if method == b"POST" and len(parts) == 2 and parts[1] in ("rotate", "disable", "enable"):
            await self._key_edit(conn, req, parts[1], parts[0], None)
            return
        if method == b"DELETE" and len(parts) == 1:
            await self._key_edit(conn, req, "delete", parts[0], None)
            return
        conn.send_error(req, 405, "/keys takes GET, POST /keys, POST /keys/NAME/rotate|disable|"
                        "enable and DELETE /keys/NAME")

    def _keys_shown(self) -> list[dict]:
        _gen, doc = self.keys.table.policies()
        out = []
        for d in doc.get("keys", ()):
            k = {k: v for k, v in d.items() if k not in ("sha256", "row")}
            k["usage"] = self.keys.usage(d["row"])
            if self.drain_penalty is not None:  # its drain penalty's count (.drain_penalty)
                k["usage"]["drains_caused"] = round(self.drain_penalty.drains(d["row"]), 2)
            out.append(k)
        return out

    async def _key_edit(self, conn: HttpConnection, req: Request, op: str, name,
                        fields: dict | None) -> None:
        if not isinstance(name, str) or not name:
            conn.send_error(req, 400, 'a key needs a name: {"name": "alice", ...}')
            return
        secret = None
        sha = None
        if op in ("create", "rotate"):
            secret = "sk-ggmux-" + secrets.token_urlsafe(24)
            sha = hashlib.sha256(secret.encode()).hexdigest()
        self.key_edits = getattr(self, "key_edits", 0) + 1
        eid = f"{os.getpid()}-{self.key_edits}"
        cmd = {"op": "keys", "id": eid, "do": op, "name": name}
        if sha:
            cmd["sha256"] = sha
        if fields:
            cmd["fields"] = fields
        if len(orjson.dumps(cmd)) > 480:
            conn.send_error(req, 413, "the key's settings are too long for one edit (create it "
                            "with fewer, or in the keys file)")
            return
        if not self._command(conn, req, cmd):
            return
        deadline = self.loop.time() + EDIT_WAIT_S
        while True:
            self.keys.refresh()
            if eid in self.keys.done:
                break
            if self.loop.time() > deadline or req.disconnected:
                conn.send_error(req, 503, f"the key edit did not finish within {EDIT_WAIT_S:g} s",
                                headers=[(b"retry-after", b"1")])
                return
            await asyncio.sleep(0.01)
        err = self.keys.done[eid]
        if err is not None:
            status = 404 if err.startswith("no key") else 409 if "exists" in err else 400
            conn.send_error(req, status, err, code="key_edit_failed")
            return
        out = {"name": name, "op": op, "success": True}
        if secret is not None:
            out["key"] = secret  # shown once: only its hash is kept
        conn.send_json(req, 201 if op == "create" else 200, out)


__all__ = ["KeyedProxy"]
