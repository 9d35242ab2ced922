"""Forwarding a request to a replica: the forwarding half of
:class:`~ggmux.proxy.server.Proxy` (a mixin, as
:class:`~ggmux.http1.reading.RequestReader` is of the HTTP connection).

Two paths: :meth:`Forwarding.fast` forwards, from the parser's callback and
with no task or coroutine, a request for a model that one local replica
serves and that has an idle pooled connection (the steady state of a busy
model; a third less CPU per forwarded request than the task path);
everything else, and a fast forward that failed before the replica got the
request, goes through :meth:`Forwarding._forward` (waiting for loads,
balancing, queueing, retries, errors) from the proxy's handler.

Counters: a request counts as in flight (``C_IN_FLIGHT`` of its replica's
row in this proxy's counters) from just before it is forwarded until its
response ended; a waiter is removed only after its request counts as in
flight, so a freshly loaded model is never without either and cannot be
evicted before it serves the request that loaded it. A breaker's verdict
(:meth:`~.accounting.Accounting._verdict`,
:meth:`~.replica_failures.ReplicaFailures._forward_failed`) and the
request, error and TTFT counters (:meth:`~.accounting.Accounting._account`) follow each
response.

The state it reads is the proxy's (:meth:`~ggmux.proxy.server.Proxy.refresh`
keeps it): ``names``, ``reg_models``, ``single``, ``ready``, ``ready_local``,
``held_local``, ``remotes``, ``hop_slots``, ``secrets``, ``cluster``,
``replica_rows``, ``model_rows``, ``cw``/``mcw`` (this proxy's counter rows),
``breakers``, ``pool``, ``waiters``, ``activity`` (its region of the
request ring: every request that named a model is recorded as it ends),
``prefix`` (:class:`~ggmux.proxy.prefix.PrefixRouting`, None unless
``--balance prefix``) and the options.

Prefix-aware routing (issue 20) happens only where there is a choice: a
request to a model with several ready replicas and no session key has its
prompt's chain looked up in the prefix index before :func:`choose`, and
recorded for the replica that answered it (with that replica's count of
cached tokens as the judge of the prediction). A request that had no choice
(the fast path, a model with one replica, a session key) has its prompt
recorded after the answer all the same (issue 37, item 18: a second
replica coming up must find the first one's prefixes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial

import orjson
import posix_ipc

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

# the counter words by name, not L.X: compiled, a global costs less than a module attribute
from ..http1 import HttpConnection
from ..http1.auth import tenant
from ..http1.exchange import Exchange, UpstreamError
from ..http1.heads import request_head
from ..http1.limits import tokenize_body_refusal
from ..http1.request import Request
from ..shm import layout as L
from ..shm.layout import (
    C_CIRCUIT,
    C_IN_FLIGHT,
    C_INCARNATION,
    C_LAST_USED_NS,
)
from . import answers, passthrough
from .balancer import CLOSED, Candidate, candidates_from_shm, choose, open_until, session_key
from .bodies import item_refusal
from .cluster import HOP_TRUSTED, hop_headers, judge_hop, loading_info
from .contention import queue_status
from .cors import json_type, simple_type
from .inference_paths import INFERENCE, TOKEN_ROUTES
from .prefix import GENERATION_PATHS, Prediction

log = logging.getLogger(__name__)
# after a request lost on a connection its replica closes after chunked
# answers: how long until the replica's liveness says whether it crashed
HABIT_CHECK_S = 0.02

NS = 1_000_000_000

MAX_ATTEMPTS = 6  # forwards of one request that failed before reaching a replica


class Forwarding:
    """The forwarding half of :class:`~ggmux.proxy.server.Proxy` (see the
    module docstring); its attributes are the proxy's."""

    @cython.locals(req=Request)
    def fast(self, conn: HttpConnection, req: Request) -> bool:
        """Forward ``req`` from the parser's callback, without a task, when
        nothing needs waiting or choosing (the common case; run before the
        proxy's ``handle``): an inference route or ``/upstream/<model>/...``
        for a model that exactly one local replica serves (``single``),
        whose circuit is closed and that has an idle pooled connection.

        Returns False in every other case, errors included: ``handle``
        answers those. A request forwarded by another node (hop header and
        cluster token) follows ``handle``'s hop rules: a trusted one needs
        no key, and the one local replica is what it may be served by;
        neither header reaches the replica (``heads.request_head`` drops
        them). A forward that fails before the replica got the request is
        handed to ``handle`` too, which retries as its own forwards do; one
        the replica got is answered here (502/504) and never sent again."""
        if req.origin is not None and self.cors is not None:
            req.extra_head = self.cors.headers(req.origin)
        if self.hosts is not None and not self.hosts.allows(req.host):
            return False  # handle answers 403 (DNS rebinding: .hosts)
        path = req.path
        if path in INFERENCE:
            if req.method != b"POST" or not json_type(req.content_type):
                return False  # handle answers (415 for a body that is not JSON: .cors)
            if path in TOKEN_ROUTES and tokenize_body_refusal(conn.limits, req.body,
                                                              path == b"/detokenize"):
                return False  # handle answers 413
            if len(req.body) > conn.limits.offloop_body_bytes:
                return False  # parsed off the loop by handle (issue 37, item 11)
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                return False
            if type(body) is not dict or item_refusal(conn.limits, body) is not None:
                return False  # handle answers 400 or 413
            req.body_json = body
            name = body.get("model")
            if type(name) is not str or "stream_options" in body:  # usage may need adding
                return False
            target = req.url
        elif path[:10] == b"/upstream/":
            if req.method == b"POST" and simple_type(req.content_type) and (
                    req.body or req.origin is not None or req.header(b"sec-fetch-site")):
                return False  # handle answers (415, or 403 from another site)
            try:
                route = passthrough.quick_route(path, req.query, self._slashed)
            except passthrough.BadPath:
                return False
            if (route is None or route[1].split(b"?", 1)[0] in passthrough.REDACTED_PATHS
                    or passthrough.admin_target(route[1], req.method)):
                return False
            name, target = route
        else:
            return False
        if self.stopping:
            return False
        if req.hop_marked:  # the hop rules, as handle applies them
            if self.cluster is None:
                self.refresh()
            req.hop = judge_hop(req, self.cluster)
        if ((self.api_key is not None or self.keyed) and req.hop != HOP_TRUSTED
                and not self._authorized(req)):
            return False
        self.refresh()
        m = self.names.get(name)
        if m is None:
            return False
        c = self.single.get(m)
        if c is None:
            return False
        slot = c.slot
        cw = self.cw[slot]
        inc = c.incarnation
        if cw[C_INCARNATION] != inc or cw[C_CIRCUIT] != CLOSED:
            return False
        if req.key_row >= 0 and not self._key_fast(req, m):
            return False  # a key's refusal, or a spending budget: handle answers (.keyed)
        up = self.pool.take_idle(c.port)
        if up is None:
            return False
        body = req.body
        data = request_head(req, c.port, len(body), target=target,
                            auth=self.secrets.get(slot, b""), tenant=self._tenant(req, m)) + body
        cw[C_IN_FLIGHT] += 1
        cw[C_LAST_USED_NS] = time.monotonic_ns()
        up.send(conn, req, data, partial(self._fast_done, conn, req, m, slot, inc),
                self.model_first_byte_ns[m])
        return True

    @cython.locals(req=Request, cw=cython.long[:], now=cython.longlong)
    def _fast_done(self, conn: HttpConnection, req: Request, m: int, slot: int, inc: int,
                   r: Exchange | UpstreamError) -> None:
        cw = self.cw[slot]
        now = time.monotonic_ns()
        if cw[C_INCARNATION] == inc:
            cw[C_IN_FLIGHT] -= 1
            cw[C_LAST_USED_NS] = now
        if isinstance(r, UpstreamError):
            if self.stopping:
                answers.stopping(conn, req)
                return
            if r.delivered and r.habit:  # judged once the replica could have exited
                asyncio.get_running_loop().call_later(
                    HABIT_CHECK_S, self._fast_habit, conn, req, m, slot, r)
                return
            if r.delivered:  # never sent again (issue 11)
                self._forward_failed(slot, m, r, 1)
                answers.replica_failed(conn, req, self.reg_models[m]["name"], r)
                self.activity.record(req, m, slot, None, req.status)
                return
            # the slow path retries (a stale pooled connection is no verdict
            # on the replica)
            conn.run_handler(req)
            return
        self._verdict(slot, r, now)
        self._account(cw, m, r)
        if self.prefix is not None and r.status == 200 and not r.fault:
            self._learn_alone(req, m, None, slot, inc, r)
        self.activity.record(req, m, slot, r, 0)

    def _learn_alone(self, req: Request, m: int, body: dict | None, slot: int, inc: int,
                     ex: Exchange) -> None:
        """Record ``req``'s prompt for replica ``slot`` (``inc``), which
        answered it without a choice (the fast path, the one-replica shortcut,
        a session key): issue 37, item 18, a second replica coming up found
        nothing recorded and took the warm replica's prefixes cold."""
        pred = self._predict(req, m, body, (Candidate(slot=slot, port=0, incarnation=inc),))
        if pred is not None:
            self.prefix.record(pred, slot, inc, ex)

    async def _forward(
        self, conn: HttpConnection, req: Request, m: int, name: str, body: dict | None,
        touch: bool = True, stream: bool = False, capture: bool = False,
    ) -> Exchange | None:
        """Wait for a ready replica (loading the model when ``touch``), pick
        one, forward (DESIGN.md "Balancing replicas"); returns the
        :class:`Exchange` once the response was relayed (with ``capture``:
        collected, for the caller to answer), None when this answered.

        Retries (issue 11): on another replica, or the same one again,
        only while the request cannot have reached a replica (a connect
        error, a replica that refused it because it stops); a replica that
        took it and died, hung up or timed out gets no second copy, and
        neither does its replacement: 502/504. A model whose every replica
        has an open circuit gets 503 with Retry-After at once; one whose
        replicas are all at max-concurrency, or whose half-open circuit has
        its probe out, queues until ``--queue-timeout`` (then 429), and the
        first request that finds the probe slot free is the next probe."""
        tried: set[int] = set()
        recorded = not touch or capture  # (not a request of the model's, for the ring)
        last_slot = -1
        waited = False  # a waiter registered by us is still counted
        wait_token = (0, 0, 0)  # its start, and the drains before it (._wait_join)
        wait_from = 0  # when it began waiting for its model (monotonic ns)
        queued_since = 0
        attempt = 0  # forwards that failed before the request reached a replica
        skey: str | None | bool = False  # the session key, read only when there is a choice
        pfx: Prediction | None | bool = False  # the prompt's prefix, looked up likewise
        budget = None  # a spending budget the model's priced replicas spent (.keyed)
        if self.keys is not None:
            if req.key_row >= 0 and not self._key_admit(conn, req, m, name, body,
                                                         not recorded):
                if not recorded:
                    self.activity.record(req, m, -1, None, req.status or 429)
                return None
            budget = self._over_budget(conn, req, m, body, not recorded)
            if budget is not None and self.reg_models[m].get("kind") in ("cmd", "upstream"):
                conn.send_error(req, budget.status, budget.message, code=budget.code,
                                headers=budget.headers())
                if not recorded:
                    self.activity.record(req, m, -1, None, budget.status)
                return None
        try:
            while attempt < MAX_ATTEMPTS:
                if self.stopping:
                    answers.stopping(conn, req)
                    return None
                if budget is not None and m in self.ready and not self._unpriced_ready(m):
                    # its priced replicas spent their budget: a local one serves, once loaded
                    if not await self._local_for_budget(conn, req, m, budget):
                        return None
                    continue
                if m not in (self.ready_local if req.hop else self.ready):
                    # forwarded by another node: served here (woken, loaded) or not at
                    # all, never forwarded again
                    if req.hop and m not in self.held_local:
                        conn.send_error(req, 503, f"model '{name}' is not loaded on this "
                                        "node", code="not_on_this_node",
                                        headers=[(b"retry-after", b"1")])
                        return None
                    if not touch:
                        conn.send_error(req, 503, f"model '{name}' is not loaded (POST "
                                        "/models/load loads it)", code="model_not_loaded")
                        return None
                    now = time.monotonic_ns()
                    if self._in_backoff(m, now):
                        answers.load_failed(conn, req, name, self.model_rows[m],
                                            self.errors.get(str(m), "load failed"))
                        return None
                    if self.reg_models[m].get("kind") == "upstream":
                        # nothing to load: a remote that is down answers at once
                        conn.send_error(req, 503, f"the upstream of '{name}' is not answering "
                                        "its health check", code="upstream_unavailable",
                                        headers=[(b"retry-after", b"5")])
                        return None
                    if not waited and self.refuses_unloaded(conn, req, m):
                        return None  # --no-models-autoload (.router_mode)
                    if not waited:
                        wait_token = self._wait_join(req, m)  # (a key's drain penalty)
                        waited = True
                        if not wait_from:
                            wait_from = time.monotonic_ns()
                    outcome = await self.waiters.wait(m, req, conn if stream else None, name)
                    if outcome != "ready":
                        if outcome == "gone":
                            conn.finish(req)
                        elif outcome == "pinned":
                            answers.capacity_pinned(conn, req, name, self.model_rows[m],
                                                    self._names_for(req))
                        elif outcome == "shutdown":
                            answers.stopping(conn, req)
                        elif outcome == "failed":
                            answers.load_failed(conn, req, name, self.model_rows[m],
                                                self.errors.get(str(m), "load failed"))
                        else:
                            q = queue_status(self.model_rows[m], self._names_for(req))
                            answers.still_loading(conn, req, name, self.model_rows[m],
                                                  self.load_wait,
                                                  loading_info(self.cluster, name),
                                                  q["why"] if q else "")
                        return None
                    continue
                now = time.monotonic_ns()
                c = self.single.get(m)  # the common case: one local replica, no limits
                if (c is None or c.slot in tried or self.cw[c.slot][C_CIRCUIT] != CLOSED
                        or budget is not None):
                    cands = candidates_from_shm(self.replica_rows, self.seg.counters, m,
                                                self.index, now, self.balancer)
                    if budget is not None:  # skipped as an open circuit is: the next tier serves
                        cands = [c for c in cands if not self._priced(m, c.slot)]
                        if not cands:
                            conn.send_error(req, budget.status, budget.message,
                                            code=budget.code, headers=budget.headers())
                            return None
                    if req.hop and self.hop_slots:
                        cands = [c for c in cands if c.slot not in self.hop_slots]
                    if skey is False:
                        skey = session_key(req.headers, body) if body is not None else None
                    if pfx is False:
                        pfx = self._predict(req, m, body, cands) if skey is None else None
                    share = pfx.share if pfx is not None else None
                    disk = pfx.disk if pfx is not None else None
                    self.turns += 1
                    c = choose(cands, tried, skey, self.rng, now_ns=now, config=self.balancer,
                               share=share, turn=self.turns, disk=disk)
                    if c is None and tried and attempt < MAX_ATTEMPTS - 1:
                        tried.clear()  # one replica: retry the same (the breaker guards it)
                        c = choose(cands, tried, skey, self.rng, now_ns=now,
                                   config=self.balancer, share=share, turn=self.turns,
                                   disk=disk)
                else:
                    cands = (c,)
                if c is None:
                    until = open_until(cands, now) if cands else 0
                    if until:
                        answers.circuit_open(conn, req, name, until)
                        return None
                    # every replica is at max-concurrency or its probe is out: queue
                    if not queued_since:
                        if self.queued.get(m, 0) >= self.max_queue:
                            conn.send_error(req, 429, f"too many requests queued for '{name}' "
                                            "(max-queue)", headers=[(b"retry-after", b"1")])
                            return None
                        queued_since = now
                        self.queued[m] = self.queued.get(m, 0) + 1
                    if now - queued_since > self.queue_timeout * NS or req.disconnected:
                        if req.disconnected:
                            conn.finish(req)
                        else:
                            conn.send_error(req, 429, f"every replica of '{name}' is busy "
                                            "(queue-timeout)", headers=[(b"retry-after", b"1")])
                        return None
                    await asyncio.sleep(0.005)
                    self.refresh()
                    continue
                if queued_since:
                    self.queued[m] -= 1
                    queued_since = 0
                if c.slot in self.remotes and touch and c.slot not in self.hop_slots:
                    self._want_local(m, cands)
                slot, inc = c.slot, c.incarnation
                last_slot = slot
                cnt = self.cw[slot]
                if cnt[C_INCARNATION] != inc:  # first: the reset clears the breaker too
                    self.cnt[slot] = 0
                    cnt[C_INCARNATION] = inc
                br = self.breakers[slot]
                tried.add(slot)
                probe = br.state != CLOSED
                if not br.allow(now):
                    continue  # its probe went out meanwhile: choose again (or queue)
                judged: list | None = [] if probe else None
                cnt[C_IN_FLIGHT] += 1
                if touch:
                    cnt[C_LAST_USED_NS] = now
                if waited:  # only now: the request already counts as in flight
                    self._wait_served(req, m, wait_token)
                    waited = False
                    self._waited(m, req, now - wait_from)
                held = [True]  # it counts as in flight; ended() takes it out, once

                def ended(_ex: Exchange | None, cnt=cnt, inc=inc, held=held) -> None:
                    if held[0]:
                        held[0] = False
                        if cnt[C_INCARNATION] == inc:
                            cnt[C_IN_FLIGHT] -= 1
                            if touch:
                                cnt[C_LAST_USED_NS] = time.monotonic_ns()

                try:
                    # ended() runs as the response ends, before its end leaves
                    ex = await self._send(conn, req, slot, c.port, m, judged, capture, ended)
                except UpstreamError as e:
                    attempt += 1
                    if self.stopping:
                        answers.stopping(conn, req)
                        return None
                    if e.refused:  # it stops or sleeps: no verdict, send it elsewhere
                        br.release()
                        log.info("proxy %d: %s; sending the request elsewhere", self.index, e)
                        self.gen = -1
                        self.refresh()
                    elif e.delivered and e.habit and await self._lived_on(slot):
                        # dropped unread by a replica that closes after every
                        # streamed answer (llama-server): no verdict, again
                        br.release()
                        log.info("proxy %d: %s just after a streamed answer, and the replica "
                                 "lives on: sending the request again", self.index, e)
                    elif e.delivered:
                        self._forward_failed(slot, m, e, attempt)
                        answers.replica_failed(conn, req, name, e)
                        return None
                    else:
                        self._forward_failed(slot, m, e, attempt)
                    if m in self.ready and attempt < MAX_ATTEMPTS:
                        # still listed: its exit may not have reached the
                        # supervisor yet; give it that long before the next
                        # try (10 ms doubling, 310 ms in all) instead of
                        # spending every attempt on a dead replica at once
                        await asyncio.sleep(0.005 * (1 << attempt))
                        self.refresh()
                    if req.disconnected:
                        conn.finish(req)
                        return None
                    if attempt < MAX_ATTEMPTS:
                        continue
                    answers.unreachable(conn, req, name, e)
                    return None
                finally:
                    ended(None)
                self._verdict(slot, ex, time.monotonic_ns(), judged)
                if touch:  # ?model= calls are neither use nor traffic for the metrics
                    self._account(cnt, m, ex)
                if self.prefix is not None and ex.status == 200 and not ex.fault:
                    if pfx:
                        self.prefix.learn(pfx, slot, inc, ex, cnt, self.mcw[m])
                    elif pfx is False or skey:  # no choice was weighed: record it all the same
                        self._learn_alone(req, m, body, slot, inc, ex)
                if not recorded:
                    recorded = True
                    self.activity.record(req, m, slot, ex, 0)
                return ex
            conn.send_error(req, 503, f"no replica of '{name}' stayed available")
            return None
        finally:
            if waited:
                self.waiters.leave(m, wait_token[0])
            if queued_since:
                self.queued[m] -= 1
            if not recorded:  # answered here (or the client left): recorded too
                self.activity.record(req, m, last_slot, None, req.status or 499)

    def _predict(self, req: Request, m: int, body: dict | None, cands) -> Prediction | None:
        """The prefix index's view of ``req``'s prompt among ``cands``
        (:meth:`~ggmux.proxy.prefix.PrefixRouting.predict`), or None: mode
        not ``prefix``, not a generation route, no JSON
        body, or the model's cache scope ``none``. The body is the one the
        replica gets (a translated request's chat completion). The scope is
        the model's (preset ``cache-scope``) or ``--cache-scope``; under
        ``key`` the caller's tenant seeds the chain, so no prefix routes
        another tenant's request. A model with a disk tier (issue 29) has its
        disk rows looked up too, for the local candidates."""
        if self.prefix is None or req.path not in GENERATION_PATHS:
            return None
        src = req.body_json if req.body_json is not None else body
        if type(src) is not dict:
            return None
        scope = self.reg_models[m].get("cache_scope") or self.cache_scope
        who = tenant(req, self.tenant_secret, req.hop == HOP_TRUSTED) if scope == "key" else b""
        row = self.model_rows[m]
        if int(row[L.M_CACHE_FLAGS]) & L.CACHE_DISK:
            return self.prefix.predict(src, who, scope, cands, m, int(row[L.M_CACHE_EPOCH]),
                                       self.remotes)
        return self.prefix.predict(src, who, scope, cands)

    def _want_local(self, m: int, cands) -> None:
        """A model served by a remote upstream that also has a local
        definition: ask for the local replica too (at most once a second),
        so both serve, as a llama-swap user adding a remote peer expects."""
        if self.reg_models[m].get("kind") == "upstream":
            return
        if any(c.slot not in self.remotes for c in cands):
            return
        now = time.monotonic_ns()
        if now - self.local_asked.get(m, 0) < NS:
            return
        self.local_asked[m] = now
        try:
            self.mq.send(b'{"op":"load","model":%d,"route":"a request that a remote replica '
                         b'served"}' % m, timeout=0)
        except posix_ipc.BusyError:
            pass

    async def _send(self, conn: HttpConnection, req: Request, slot: int, port: int, m: int,
                    judged: list | None = None, capture: bool = False,
                    on_end: Callable[[Exchange], None] | None = None) -> Exchange:
        """One forward to the replica in ``slot``: a local instance gets its
        secret as the bearer token, a remote upstream its own ``api-key``
        (and its path prefix); neither ever gets the client's credentials.
        ``judged``: this is a half-open circuit's probe, judged at its head.
        ``on_end``: see :meth:`~ggmux.http1.pool.UpstreamPool.forward`."""
        on_head = None
        if judged is not None:
            br = self.breakers[slot]

            def on_head(ex: Exchange) -> None:
                judged.append(ex.fault)
                br.record(not ex.fault, time.monotonic_ns())

        fb = self.model_first_byte_ns[m]
        remote = self.remotes.get(slot)
        body = bytes(req.body)
        if remote is None:
            data = request_head(req, port, len(body), auth=self.secrets.get(slot, b""),
                                tenant=self._tenant(req, m)) + body
            return await self.pool.forward(port, conn, req, data, first_byte_ns=fb,
                                           on_head=on_head, capture=capture, on_end=on_end)
        host = remote["host"]
        if remote.get("hop") and self.cluster is not None:
            # another node of the cluster: the hop header and the cluster's token
            extra, auth = hop_headers(self.cluster, self.api_key), b""
            who = tenant(req, self.tenant_secret, req.hop == HOP_TRUSTED)
        else:
            key = remote.get("api_key")
            extra, auth = (), b"authorization: Bearer %s\r\n" % key.encode() if key else b""
            who = b""
        prefix = remote.get("prefix", "").encode()
        head = request_head(req, port, len(body), extra, host.encode(), auth=auth,
                            target=prefix + req.url if prefix else None, tenant=who)
        return await self.pool.forward(port, conn, req, head + body, host, first_byte_ns=fb,
                                       on_head=on_head, capture=capture, on_end=on_end)

    def _model_name(self, m: int) -> str:
        """Model ``m``'s name, for messages ("" when unknown)."""
        return self.reg_models[m].get("name", "") if 0 <= m < len(self.reg_models) else ""

    def _tenant(self, req: Request, m: int) -> bytes:
        """``x-ggmux-tenant`` for a local replica of model ``m``: only a
        built-in instance gets one (a ``cmd`` replica is someone else's
        server)."""
        if self.reg_models[m].get("kind") not in ("llama", "fake"):
            return b""
        return tenant(req, self.tenant_secret, req.hop == HOP_TRUSTED)
