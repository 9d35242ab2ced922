"""A proxy worker process: the public HTTP surface.

N identical workers bind the public address with ``SO_REUSEPORT``; the
kernel spreads connections over them. A worker resolves the request's model
through the registry blob, picks a replica from the shared-memory tables
(:mod:`ggmux.proxy.balancer`) and forwards bytes
(:mod:`ggmux.proxy.upstream`). It never decides to load or evict: for a
model with no ready replica it registers a waiter in its waiters row and
asks the supervisor through the command queue, then waits to be woken (the
supervisor writes a byte on the worker's stdin after every generation bump;
stdin EOF means the supervisor is gone and the worker exits).

Two paths: :meth:`Proxy.fast` forwards, from the parser's callback and
with no task or coroutine, a request for a model that one local replica
serves and that has an idle pooled connection (the steady state of a busy
model; a third less CPU per forwarded request than the task path);
everything else, and a fast forward that failed before the first byte,
goes to :meth:`Proxy.handle` (waiting for loads, balancing, queueing,
retries, errors).

Counters: the worker is the only writer of ``counters[index]``,
``waiters[index]`` and ``mcounters[index]``. A request counts as in flight
from just before it is forwarded until its response ended; a waiter is
removed only after its request counts as in flight, so a freshly loaded
model is never without either and cannot be evicted before it serves the
request that loaded it.

Routes (llama.cpp router's, DESIGN.md "HTTP surface"): inference routed by
the body's ``model``; ``GET /props|/metrics|/slots?model=`` routed by the
query (they neither load a model nor refresh its last use); ``/v1/models``,
``/models`` (``?reload=1`` rescans the sources); ``POST /models/load``,
``/models/unload``; ``GET /models/sse``; ``GET /health``; ``GET /metrics``
(Prometheus, whole server); ``/upstream/<model>/<path>`` pass-through; the
other client APIs (Anthropic, Responses, Ollama, ``GET /v1/models/{id}``)
in :mod:`ggmux.proxy.apis`; CORS (:mod:`ggmux.proxy.cors`) on every answer.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import signal
import sys
import time
from bisect import bisect_left
from urllib.parse import parse_qs

import numpy as np
import orjson
import posix_ipc
from setproctitle import setproctitle

from ..shm import layout as L
from ..shm.logring import log_ring_name
from ..shm.segment import Segment
from . import answers, apis, passthrough
from .apis import ClientApis
from .auth import authorized, read_keys, secret_header
from .balancer import (
    CLOSED,
    BalancerConfig,
    Candidate,
    CircuitBreaker,
    candidates_from_shm,
    choose,
    open_until,
    session_key,
)
from .cluster import (
    HOP,
    HOP_TRUSTED,
    annotate_models,
    cluster_view,
    drain_route,
    hop_headers,
    judge_hop,
    loading_info,
    metrics_lines,
    take_hop,
)
from .cors import Cors
from .http import (
    HttpConnection,
    HttpLimits,
    Request,
    add_http_limit_options,
    fit_fd_limit,
    json_object,
    limits_from_args,
)
from .listing import ModelEvents, models_list
from .logs import LogTail
from .metrics import metrics_text
from .overview import overview
from .page import Page
from .pool import UpstreamPool
from .upstream import Exchange, UpstreamError, request_head
from .waiting import ModelWaiters

log = logging.getLogger("ggmux.proxy")

NS = 1_000_000_000

# routed by the JSON body's "model" (llama.cpp router's list)
INFERENCE = frozenset(
    (
        b"/v1/chat/completions",
        b"/chat/completions",
        b"/v1/completions",
        b"/completions",
        b"/v1/embeddings",
        b"/embeddings",
        b"/embedding",
        b"/completion",
        b"/tokenize",
        b"/detokenize",
        b"/infill",
        b"/rerank",
        b"/v1/rerank",
        b"/reranking",
        b"/apply-template",
    )
)  # /v1/messages, /v1/responses, /api/*: apis.ROUTES
# routed by ?model=; they do not load the model nor refresh its last use
QUERY_ROUTED = frozenset((b"/props", b"/metrics", b"/slots"))

TTFT_ALPHA = 0.2  # EWMA weight of the newest sample
RELOAD_WAIT_S = 30.0  # ?reload=1 waits this long for the rescan (a cache of many models is slow)
MAX_ATTEMPTS = 6  # forwards of one request that failed before reaching a replica
STOPPING = "the server is stopping"
GC_GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)
# bucket bounds in microseconds; an index past the last is the +Inf bucket
_TTFT_BUCKETS_US = tuple(b * 1000 for b in L.TTFT_BUCKETS_MS)


class Proxy:
    """State of one worker; ``handle`` is the HTTP handler."""

    def __init__(
        self,
        index: int,
        shm: str,
        mq: str,
        load_wait: float,
        queue_timeout: float = 30.0,
        max_queue: int = 64,
        api_key: str | None = None,
        admin_key: str | None = None,
        stream_keepalive: float = 5.0,
        drain_timeout: float = 10.0,
        first_byte_timeout: float = 600.0,
        stream_idle_timeout: float = 300.0,
        cors_origins: str = "*",
    ) -> None:
        self.index = index
        self.cors = Cors(cors_origins) if cors_origins else None
        self.apis = ClientApis(self)
        self.drain_timeout = drain_timeout
        self.stopping = False  # draining: new requests get 503
        # first-byte timeout, ns: the default, and per model (preset key)
        self.first_byte_ns = int(first_byte_timeout * NS)
        self.model_first_byte_ns: list[int] = []
        self.server: asyncio.AbstractServer | None = None
        self.stream_keepalive = stream_keepalive
        self.seg = Segment.attach(shm)
        self.mq = posix_ipc.MessageQueue(mq)
        self.mq.block = False
        self.cnt = self.seg.counters[index]  # (replicas, C_WORDS), ours alone
        self.mc = self.seg.mcounters[index]  # (models, MC_WORDS), ours alone
        # the same rows as int64 memoryviews for the per-request updates: a
        # Python-level word costs a fifth of a numpy scalar's get + set
        self.cw = [memoryview(row) for row in self.cnt]
        self.mcw = [memoryview(row) for row in self.mc]
        self.load_wait = load_wait
        self.queue_timeout = queue_timeout
        self.max_queue = max_queue
        self.api_key = api_key.encode() if api_key else None
        self.admin_key = admin_key.encode() if admin_key else None
        self.loop = asyncio.get_event_loop()
        self.pool = UpstreamPool(self.loop, stream_idle_s=stream_idle_timeout)
        self.pool.start_sweeping()
        self.secrets: dict[int, bytes] = {}  # slot -> its instance's authorization line
        self.balancer = BalancerConfig()
        self.rng = random.Random()
        self.breakers = [CircuitBreaker(row, self.balancer) for row in self.cw]
        self.gen = -1
        self.reg_version = -1
        self.names: dict[str, int] = {}
        self._slashed: list[str] = []  # names with "/" (pass-through matching)
        self.reg_models: list[dict] = []
        self.errors: dict[str, str] = {}
        self.remotes: dict[int, dict] = {}  # slot -> upstream replica address
        self.cluster: dict | None = None  # cluster mode: the registry blob's "cluster"
        self.hop_slots: frozenset[int] = frozenset()  # remotes that are other nodes
        self.ready_local: set[int] = set()  # models with a ready replica on this node
        self.held_local: set[int] = set()  # cluster mode: ... loading, ready or asleep here
        self.ready: set[int] = set()  # models with a ready replica
        self.single: dict[int, Candidate] = {}  # model -> its only replica
        self.model_rows = np.zeros((self.seg.sizes.models, L.M_WORDS), dtype=np.int64)
        self.replica_rows = np.zeros((self.seg.sizes.replicas, L.R_WORDS), dtype=np.int64)
        self.waiters = ModelWaiters(self.loop, self.seg.waiters[index], self.mq, load_wait,
                                    stream_keepalive,
                                    lambda m: int(self.model_rows[m][L.M_PROGRESS]))
        self.queued: dict[int, int] = {}  # model -> requests queued for a free replica
        self.local_asked: dict[int, int] = {}  # model -> when a local replica was last asked
        self.events = ModelEvents(self.loop, lambda: (self.reg_models, self.model_rows,
                                                      self.errors))
        self.reload_seq = 0  # this proxy's reload requests
        self.reload_ids: list[str] = []  # the reloads the supervisor finished, newest last
        self.page = Page()
        self.logtail = LogTail(self.loop, log_ring_name(shm))
        self.refresh()

    # ---- shared-memory snapshot ------------------------------------------
    def refresh(self) -> None:
        """Re-read tables when the supervisor's generation moved; wake waiters."""
        seg = self.seg
        g = seg.generation
        if g == self.gen:
            return
        self.gen = g
        version, doc = seg.read_registry()
        if version != self.reg_version:
            self.reg_version = version
            self.names = doc.get("names", {})
            self._slashed = [n for n in self.names if "/" in n]
            self.reg_models = doc.get("models", [])
            self.errors = doc.get("errors", {})
            self.remotes = {int(k): v for k, v in doc.get("remotes", {}).items()}
            self.reload_ids = doc.get("reload_ids", ())
            self.cluster = doc.get("cluster")
            self.hop_slots = frozenset(k for k, v in self.remotes.items() if v.get("hop"))
            self.model_first_byte_ns = [
                int(t * NS) if isinstance(t := e.get("first_byte_timeout"), (int, float)) and t > 0
                else self.first_byte_ns for e in self.reg_models]
        g, (self.model_rows, reps) = seg.snapshot("models", "replicas")
        self.gen = g
        self.replica_rows = reps
        ready_rows = reps[reps[:, L.R_STATUS] == L.ReplicaStatus.READY]
        self.ready = {int(m) for m in ready_rows[:, L.R_MODEL]}
        self.ready_local = self.ready if not self.hop_slots else {
            int(reps[s, L.R_MODEL]) for s in np.flatnonzero(reps[:, L.R_STATUS] ==
                                                            L.ReplicaStatus.READY)
            if int(s) not in self.hop_slots}
        if self.cluster is not None:
            held = np.isin(reps[:, L.R_STATUS], (L.ReplicaStatus.LOADING, L.ReplicaStatus.READY,
                                                 L.ReplicaStatus.SLEEPING))
            self.held_local = {int(reps[s, L.R_MODEL]) for s in np.flatnonzero(held)
                               if int(s) not in self.hop_slots}
        # models served by exactly one local replica without a concurrency
        # limit need no balancing: skip building candidates per request
        per_model: dict[int, list[int]] = {}
        for slot in np.flatnonzero(reps[:, L.R_STATUS] == L.ReplicaStatus.READY):
            per_model.setdefault(int(reps[slot, L.R_MODEL]), []).append(int(slot))
        single = {}
        for m, slots in per_model.items():
            r = reps[slots[0]]
            if len(slots) == 1 and slots[0] not in self.remotes and not r[L.R_MAX_CONCURRENCY]:
                single[m] = Candidate(slot=slots[0], port=int(r[L.R_PORT]),
                                      incarnation=int(r[L.R_INCARNATION]))
        self.single = single
        self.secrets = {
            int(slot): secret_header(int(reps[slot, L.R_SECRET_HI]), int(reps[slot, L.R_SECRET_LO]))
            for slot in np.flatnonzero(reps[:, L.R_SECRET_HI] | reps[:, L.R_SECRET_LO])}
        alive = {int(p) for p in ready_rows[:, L.R_PORT]}
        for port in list(self.pool.idle):
            if port not in alive:
                self.pool.drop_port(port)
        if self.waiters:
            now = time.monotonic_ns()
            self.waiters.wake(lambda m: "ready" if m in self.ready else
                              "failed" if self._in_backoff(m, now) else None)
        if self.events:
            self.events.publish()

    def _in_backoff(self, m: int, now: int) -> bool:
        row = self.model_rows[m]
        return bool(row[L.M_FAILED]) and int(row[L.M_RETRY_AT_NS]) > now

    def on_notify(self) -> None:
        try:
            data = os.read(0, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.loop.remove_reader(0)
            self.drain()
            return
        self.refresh()

    def drain(self) -> None:
        """Stdin EOF (the supervisor is stopping, or gone): stop accepting,
        let the requests being answered finish, for ``drain_timeout``
        seconds at most (instances finish their generation on ``exit``
        too), then answer whatever is left and stop.

        Nothing accepted is dropped without an answer (issue 11): requests
        waiting for a load or a replica get 503 ``shutting_down`` at once,
        and so does a request that arrives meanwhile on a kept-alive
        connection; at the deadline each exchange still in flight ends with
        that 503, or mid-stream with an SSE error event saying the server
        is stopping. A supervisor killed outright takes its instances with
        it, so their requests fail fast and this is quick."""
        log.info("proxy %d: draining %d request(s), then exiting", self.index,
                 int(self.cnt[:, L.C_IN_FLIGHT].sum()))
        self.stopping = True
        self.pool.closing = STOPPING
        if self.server is not None:
            self.server.close()
        self.waiters.shutdown()  # no load will come now
        deadline = self.loop.time() + self.drain_timeout

        def check() -> None:
            if self.cnt[:, L.C_IN_FLIGHT].sum() <= 0 and not self.waiters:
                self.loop.stop()
            elif self.loop.time() > deadline:
                n = self.pool.abort_all(STOPPING)
                log.warning("proxy %d: %d request(s) still running after %g s: ended with "
                            "'%s'", self.index, n, self.drain_timeout, STOPPING)
                self.loop.call_later(0.1, self.loop.stop)  # the answers leave first
            else:
                self.loop.call_later(0.05, check)

        check()

    # ---- HTTP ------------------------------------------------------------------------
    def _authorized(self, req: Request, admin: bool = False) -> bool:
        """``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in
        constant time; admin routes need the admin key when one is set."""
        return authorized(req, self.admin_key if admin and self.admin_key else self.api_key)

    def _is_admin(self, req: Request) -> bool:
        """Whether the request presents the admin key (one must be set)."""
        return self.admin_key is not None and authorized(req, self.admin_key)

    def fast(self, conn: HttpConnection, req: Request) -> bool:
        """Forward ``req`` from the parser's callback, without a task, when
        nothing needs waiting or choosing (the common case; run before
        :meth:`handle`): an inference route or ``/upstream/<model>/...`` for
        a model that exactly one local replica serves (:attr:`single`),
        whose circuit is closed and that has an idle pooled connection.

        Returns False, having changed nothing, in every other case, errors
        included: :meth:`handle` answers those. A request forwarded by
        another node (hop header and cluster token) follows the hop rules
        of :meth:`handle`: a trusted one needs no key, and a model that one
        local replica serves is what it may be served by; neither header
        reaches the replica (``upstream.request_head`` drops them). A forward that fails
        before the replica got the request is handed to :meth:`handle`
        too, which retries as its own forwards do; one the replica got is
        answered here (502/504) and never sent again."""
        if req.origin is not None and self.cors is not None:
            req.extra_head = self.cors.headers(req.origin)
        path = req.path
        if path in INFERENCE:
            if req.method != b"POST":
                return False
            try:
                body = orjson.loads(req.body)
            except orjson.JSONDecodeError:
                return False
            if type(body) is not dict:
                return False
            req.body_json = body
            name = body.get("model")
            if type(name) is not str or "stream_options" in body:  # usage may need adding
                return False
            target = req.url
        elif path[:10] == b"/upstream/":
            try:
                route = passthrough.quick_route(path, req.query, self._slashed)
            except passthrough.BadPath:
                return False
            if route is None or route[1].split(b"?", 1)[0] in passthrough.REDACTED_PATHS:
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
        if (self.api_key is not None and req.hop != HOP_TRUSTED
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
        if cw[L.C_INCARNATION] != inc or cw[L.C_CIRCUIT] != CLOSED:
            return False
        up = self.pool.take_idle(c.port)
        if up is None:
            return False
        body = req.body
        data = request_head(req, c.port, len(body), target=target,
                            auth=self.secrets.get(slot, b"")) + body
        cw[L.C_IN_FLIGHT] += 1
        cw[L.C_LAST_USED_NS] = time.monotonic_ns()
        up.send(conn, req, data, lambda r: self._fast_done(conn, req, m, slot, inc, r),
                self.model_first_byte_ns[m])
        return True

    def _fast_done(self, conn: HttpConnection, req: Request, m: int, slot: int, inc: int,
                   r: Exchange | UpstreamError) -> None:
        cw = self.cw[slot]
        now = time.monotonic_ns()
        if cw[L.C_INCARNATION] == inc:
            cw[L.C_IN_FLIGHT] -= 1
            cw[L.C_LAST_USED_NS] = now
        if isinstance(r, UpstreamError):
            if self.stopping:
                answers.stopping(conn, req)
                return
            if r.delivered:  # never sent again (issue 11)
                self._forward_failed(slot, m, r, 1)
                answers.replica_failed(conn, req, self.reg_models[m]["name"], r)
                return
            # the slow path retries (a stale pooled connection is no verdict
            # on the replica)
            conn.run_handler(req)
            return
        self._verdict(slot, r, now)
        self._account(cw, m, r)

    def _forward_failed(self, slot: int, m: int, err: UpstreamError, attempt: int) -> None:
        """A forward to ``slot`` failed before anything reached the client:
        a fault for its breaker (and, for a timeout, the hung-replica clock)
        and the error counters; the tables are re-read, since the replica
        may be gone."""
        now = time.monotonic_ns()
        cw = self.cw[slot]
        self.breakers[slot].record(False, now)
        if err.timeout:
            cw[L.C_TIMEOUT_NS] = now
            # its TTFT was at least the timeout: a sample that steers the
            # balancer to the other replicas at once (the circuit needs
            # three faults), until the replica has been left alone for
            # ttft_forget_s and is tried again
            us = self.model_first_byte_ns[m] // 1000
            old = cw[L.C_TTFT_EWMA_US]
            cw[L.C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
            cw[L.C_TTFT_COUNT] += 1
        cw[L.C_ERRORS] += 1
        self.mcw[m][L.MC_ERRORS] += 1
        log.warning("proxy %d: %s (attempt %d)", self.index, err, attempt)
        self.gen = -1
        self.refresh()

    def _verdict(self, slot: int, ex: Exchange, now: int, judged: list | None = None) -> None:
        """The breaker's verdict on a relayed response: a fault
        (:func:`~ggmux.proxy.balancer.replica_fault`, a replica that died or
        went silent mid-body) fails, anything else succeeds, and a client
        that left before the first byte gives none (the probe slot is only
        released). ``judged``: the probe's head already gave its verdict
        (the list holds it); only a fault after that still counts. Also
        stamps the replica's last answer or timeout (hung-replica restarts)."""
        br = self.breakers[slot]
        cw = self.cw[slot]
        if ex.timed_out:
            cw[L.C_TIMEOUT_NS] = now
        elif ex.status != 499:
            cw[L.C_ANSWER_NS] = now
        if judged:
            if ex.fault and not judged[0]:
                br.record(False, now)
        elif ex.status == 499 and not ex.first_byte_ns:
            br.release()
        else:
            br.record(not ex.fault, now)

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        path = req.path
        if path == b"/health":
            conn.send_response(req, 200, b'{"status":"ok"}')
            return
        if req.method == b"OPTIONS":  # before the key check: preflights carry no key
            if self.cors is not None:
                self.cors.options(conn, req)
            else:
                conn.send_response(req, 204, b"", headers=[(b"allow", b"GET, POST, HEAD, OPTIONS")])
            return
        if Page.wants(path):  # the page holds no secret: it asks for the key
            self.page.serve(conn, req)
            return
        if self.stopping:
            answers.stopping(conn, req)
            return
        admin = path in (b"/models/load", b"/models/unload", b"/logs", b"/logs/stream",
                     b"/cluster/drain") or (
            path in (b"/models", b"/v1/models") and b"reload" in req.query)
        if self.cluster is None and req.header(HOP) is not None:
            self.refresh()  # a hop header: is this node (already) in a cluster?
        req.hop = take_hop(req, self.cluster)
        if not (req.hop == HOP_TRUSTED and not admin) and not self._authorized(req, admin):
            if apis.handles(path):
                apis.send_error(conn, req, 401, "invalid or missing API key",
                                headers=[(b"www-authenticate", b"Bearer")])
                return
            conn.send_error(req, 401, "invalid or missing API key", code="invalid_api_key",
                            headers=[(b"www-authenticate", b"Bearer")])
            return
        if apis.handles(path):
            await self.apis.handle(conn, req)
        elif path in INFERENCE:
            if req.method != b"POST":
                conn.send_error(req, 405, f"{path.decode()} needs POST")
                return
            await self._inference(conn, req)
        elif path in (b"/v1/models", b"/models"):
            reload = b"reload=1" in req.query or b"reload=true" in req.query
            if reload and not await self._reload(conn, req):
                return
            self.refresh()
            conn.send_json(req, 200, annotate_models(
                models_list(self.reg_models, self.model_rows, self.errors), self.cluster))
        elif path in QUERY_ROUTED and req.method in (b"GET", b"HEAD"):
            name = self._query_model(req)
            if name is None and path == b"/metrics":
                self.refresh()
                text = metrics_text(self.seg, self.reg_models, self.model_rows,
                                    self.replica_rows)
                text += "".join(metrics_lines(self.cluster)).encode()
                conn.send_response(req, 200, text, b"text/plain; version=0.0.4")
            elif name is None:
                conn.send_error(req, 400, f"{path.decode()} needs ?model=<name>")
            else:
                m = self.names.get(name)
                if m is None:
                    conn.send_error(req, 404, f"model '{name}' not found", code="model_not_found")
                elif self._redacts(req, path):
                    await self._redacted(conn, req, m, name, touch=False)
                else:
                    await self._forward(conn, req, m, name, None, touch=False)
        elif path in (b"/models/load", b"/models/unload"):
            if req.method != b"POST":
                conn.send_error(req, 405, f"{path.decode()} needs POST")
                return
            self._load_unload(conn, req, path.rsplit(b"/", 1)[1].decode())
        elif path == b"/models/sse" and req.method == b"GET":
            self.refresh()
            await self.events.subscribe(conn, req)
        elif path.startswith(b"/upstream/"):
            await self._passthrough(conn, req)
        elif (path in (b"/ps", b"/logs") and req.method in (b"GET", b"HEAD")
              or path == b"/logs/stream" and req.method == b"GET"):
            await self._operator(conn, req)
        elif path in (b"/cluster", b"/cluster/drain") and self._in_cluster():
            if path == b"/cluster/drain":
                drain_route(conn, req, self._command)
            elif req.method in (b"GET", b"HEAD"):
                conn.send_json(req, 200, cluster_view(self.cluster))
            else:
                conn.send_error(req, 405, "/cluster needs GET")
        else:
            conn.send_error(req, 404, f"no route for {req.method.decode()} {path.decode('latin-1')}")

    async def _reload(self, conn: HttpConnection, req: Request) -> bool:
        """Ask the supervisor to rescan every source and wait until the
        registry it publishes says this reload ran (its id in
        ``reload_ids``), so ``?reload=1`` answers with the new list (issue
        15). False after answering 503 when the queue is full or no answer
        came within :data:`RELOAD_WAIT_S`."""
        self.reload_seq += 1
        rid = f"{os.getpid()}-{self.reload_seq}"
        if not self._command(conn, req, {"op": "reload", "id": rid}):
            return False
        deadline = self.loop.time() + RELOAD_WAIT_S
        while rid not in self.reload_ids:
            if self.loop.time() > deadline or req.disconnected:
                conn.send_error(req, 503, f"the reload did not finish within {RELOAD_WAIT_S:g} s",
                                headers=[(b"retry-after", b"1")])
                return False
            await asyncio.sleep(0.01)
            self.refresh()
        return True

    async def _operator(self, conn: HttpConnection, req: Request) -> None:
        """``GET /ps`` (:mod:`.overview`), ``GET /logs`` and
        ``/logs/stream`` (:mod:`.logs`; ``?model=`` a name or alias)."""
        self.refresh()
        if req.path == b"/ps":
            conn.send_json(req, 200, overview(self.seg, self.reg_models, self.model_rows,
                                              self.replica_rows, self.remotes, self.errors))
            return
        name = self._query_model(req)
        if name is not None:
            m = self.names.get(name)
            if m is None:
                conn.send_error(req, 404, f"model '{name}' not found", code="model_not_found")
                return
            name = self.reg_models[m]["name"]
        if req.path == b"/logs":
            self.logtail.text(conn, req, name)
        else:
            await self.logtail.stream(conn, req, name)

    def _in_cluster(self) -> bool:
        self.refresh()
        return self.cluster is not None

    def _query_model(self, req: Request) -> str | None:
        if not req.query:
            return None
        vals = parse_qs(req.query.decode("latin-1")).get("model")
        return vals[0] if vals else None

    async def _inference(self, conn: HttpConnection, req: Request) -> None:
        body = req.body_json
        if body is None:
            body = json_object(conn, req)
        if body is None:
            return
        name = body.get("model")
        if name is None:
            conn.send_error(req, 400, "missing 'model' in the request body")
            return
        if apis.wants_usage(body) and req.path in (b"/v1/chat/completions",
                                                   b"/chat/completions"):
            await self.apis.translated(conn, req, apis.CHAT_WITH_USAGE, body=body)
            return
        m = self._model(conn, req, name)
        if m is None:
            return
        await self._forward(conn, req, m, name, body, stream=body.get("stream") is True)

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
        if self._redacts(req, req.url):
            await self._redacted(conn, req, m, name, touch=True)
            return
        await self._forward(conn, req, m, name, None)

    def _redacts(self, req: Request, target: bytes) -> bool:
        """Whether the replica's answer to ``target`` must lose its model
        file paths: a GET of :data:`~ggmux.proxy.passthrough.REDACTED_PATHS`
        by a caller without the admin key (issue 11)."""
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
        conn.send_response(req, ex.status, passthrough.redact_paths(ex.body), ctype, headers)

    def _model(self, conn: HttpConnection, req: Request, name) -> int | None:
        """Index of the model a request names, or None after answering
        400 (not a string) or 404 (unknown; names resolve only through the
        registry, so no name can reach a file)."""
        if not isinstance(name, str):
            conn.send_error(req, 400, "'model' must be a string")
            return None
        self.refresh()
        m = apis.resolve(self.names, name)
        if m is None:
            conn.send_error(req, 404, f"model '{name}' not found", code="model_not_found")
        return m

    def command(self, cmd: dict) -> bool:
        """Send ``cmd`` to the supervisor's queue; False when it is full."""
        try:
            self.mq.send(orjson.dumps(cmd), timeout=0)
            return True
        except posix_ipc.BusyError:
            log.warning("proxy %d: supervisor queue full, %r not sent", self.index, cmd)
            return False

    def _command(self, conn: HttpConnection, req: Request, cmd: dict) -> bool:
        if self.command(cmd):
            return True
        conn.send_error(req, 503, "supervisor queue is full, try again",
                        headers=[(b"retry-after", b"1")])
        return False

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

    # ---- forwarding -------------------------------------------------------------------
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
        waited = False  # a waiter registered by us is still counted
        queued_since = 0
        attempt = 0  # forwards that failed before the request reached a replica
        skey: str | None | bool = False  # the session key, read only when there is a choice
        try:
            while attempt < MAX_ATTEMPTS:
                if self.stopping:
                    answers.stopping(conn, req)
                    return None
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
                    if not waited:
                        self.waiters.join(m)
                        waited = True
                    outcome = await self.waiters.wait(m, req, conn if stream else None, name)
                    if outcome != "ready":
                        if outcome == "gone":
                            conn.finish(req)
                        elif outcome == "shutdown":
                            answers.stopping(conn, req)
                        elif outcome == "failed":
                            answers.load_failed(conn, req, name, self.model_rows[m],
                                                self.errors.get(str(m), "load failed"))
                        else:
                            answers.still_loading(conn, req, name, self.model_rows[m],
                                                  self.load_wait,
                                                  loading_info(self.cluster, name))
                        return None
                    continue
                now = time.monotonic_ns()
                c = self.single.get(m)  # the common case: one local replica, no limits
                if c is None or c.slot in tried or self.cw[c.slot][L.C_CIRCUIT] != CLOSED:
                    cands = candidates_from_shm(self.replica_rows, self.seg.counters, m,
                                                self.index, now, self.balancer)
                    if req.hop and self.hop_slots:
                        cands = [c for c in cands if c.slot not in self.hop_slots]
                    if skey is False:
                        skey = session_key(req.headers, body) if body is not None else None
                    c = choose(cands, tried, skey, self.rng, now_ns=now, config=self.balancer)
                    if c is None and tried and attempt < MAX_ATTEMPTS - 1:
                        tried.clear()  # one replica: retry the same (the breaker guards it)
                        c = choose(cands, tried, skey, self.rng, now_ns=now,
                                   config=self.balancer)
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
                cnt = self.cw[slot]
                if cnt[L.C_INCARNATION] != inc:  # first: the reset clears the breaker too
                    self.cnt[slot] = 0
                    cnt[L.C_INCARNATION] = inc
                br = self.breakers[slot]
                tried.add(slot)
                probe = br.state != CLOSED
                if not br.allow(now):
                    continue  # its probe went out meanwhile: choose again (or queue)
                judged: list | None = [] if probe else None
                cnt[L.C_IN_FLIGHT] += 1
                if touch:
                    cnt[L.C_LAST_USED_NS] = now
                if waited:
                    self.waiters.leave(m)  # only now: the request already counts as in flight
                    waited = False
                try:
                    ex = await self._send(conn, req, slot, c.port, m, judged, capture)
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
                    if cnt[L.C_INCARNATION] == inc:
                        cnt[L.C_IN_FLIGHT] -= 1
                        if touch:
                            cnt[L.C_LAST_USED_NS] = time.monotonic_ns()
                self._verdict(slot, ex, time.monotonic_ns(), judged)
                if touch:  # ?model= calls are neither use nor traffic for the metrics
                    self._account(cnt, m, ex)
                return ex
            conn.send_error(req, 503, f"no replica of '{name}' stayed available")
            return None
        finally:
            if waited:
                self.waiters.leave(m)
            if queued_since:
                self.queued[m] -= 1

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
            self.mq.send(b'{"op":"load","model":%d}' % m, timeout=0)
        except posix_ipc.BusyError:
            pass

    async def _send(self, conn: HttpConnection, req: Request, slot: int, port: int, m: int,
                    judged: list | None = None, capture: bool = False) -> Exchange:
        """One forward to the replica in ``slot``: a local instance gets its
        secret as the bearer token, a remote upstream its own ``api-key``
        (and its path prefix); neither ever gets the client's credentials.
        ``judged``: this is a half-open circuit's probe, judged at its head."""
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
            data = request_head(req, port, len(body), auth=self.secrets.get(slot, b"")) + body
            return await self.pool.forward(port, conn, req, data, first_byte_ns=fb,
                                           on_head=on_head, capture=capture)
        host = remote["host"]
        if remote.get("hop") and self.cluster is not None:
            # another node of the cluster: the hop header and the cluster's token
            extra, auth = hop_headers(self.cluster, self.api_key), b""
        else:
            key = remote.get("api_key")
            extra, auth = (), b"authorization: Bearer %s\r\n" % key.encode() if key else b""
        prefix = remote.get("prefix", "").encode()
        head = request_head(req, port, len(body), extra, host.encode(), auth=auth,
                            target=prefix + req.url if prefix else None)
        return await self.pool.forward(port, conn, req, head + body, host, first_byte_ns=fb,
                                       on_head=on_head, capture=capture)

    def _account(self, cnt: memoryview, m: int, ex: Exchange) -> None:
        """Count one forwarded request: requests, errors, TTFT (EWMA, last,
        sum, count; microseconds) per replica, and per model the TTFT
        histogram in :data:`~ggmux.shm.layout.TTFT_BUCKETS_MS`."""
        cnt[L.C_REQUESTS] += 1
        mc = self.mcw[m]
        mc[L.MC_REQUESTS] += 1
        if ex.status >= 500:
            cnt[L.C_ERRORS] += 1
            mc[L.MC_ERRORS] += 1
        if ex.first_byte_ns and ex.sent_ns:
            us = (ex.first_byte_ns - ex.sent_ns) // 1000
            if us > 0:
                old = cnt[L.C_TTFT_EWMA_US]
                cnt[L.C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
                cnt[L.C_TTFT_LAST_US] = us
                cnt[L.C_TTFT_SUM_US] += us
                cnt[L.C_TTFT_COUNT] += 1
                mc[L.MC_TTFT_COUNT] += 1
                mc[L.MC_TTFT_SUM_US] += us
                # bucket i counts TTFT <= TTFT_BUCKETS_MS[i] ms (and above the one before)
                mc[L.MC_BUCKET0 + bisect_left(_TTFT_BUCKETS_US, us)] += 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ggmux.proxy")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--mq", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--load-wait", type=float, default=300.0)
    ap.add_argument("--queue-timeout", type=float, default=30.0)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--stream-keepalive", type=float, default=5.0)
    ap.add_argument("--first-byte-timeout", type=float, default=600.0)
    ap.add_argument("--stream-idle-timeout", type=float, default=300.0)
    ap.add_argument("--keys-fd", type=int, default=None,
                    help="inherited pipe holding {\"api_key\", \"admin_key\"} as JSON")
    ap.add_argument("--cors-origins", default="*")
    ap.add_argument("--log-level", default="INFO")
    add_http_limit_options(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setproctitle(f"ggmux: proxy {args.index} :{args.port}")
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        # the supervisor reads our stderr: it adds the time and the tag
        format="%(levelname)s %(name)s: %(message)s",
    )
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # keys come through a pipe, never argv or the environment (issue 11)
    keys = read_keys(args.keys_fd) if args.keys_fd is not None else {}
    proxy = Proxy(
        args.index, args.shm, args.mq, args.load_wait, args.queue_timeout, args.max_queue,
        api_key=keys.get("api_key") or None, admin_key=keys.get("admin_key") or None,
        stream_keepalive=args.stream_keepalive, first_byte_timeout=args.first_byte_timeout,
        stream_idle_timeout=args.stream_idle_timeout, cors_origins=args.cors_origins,
    )
    del keys
    limits: HttpLimits = fit_fd_limit(limits_from_args(args))
    server = loop.run_until_complete(
        loop.create_server(
            lambda: HttpConnection(proxy.handle, limits, fast=proxy.fast), args.host, args.port,
            reuse_port=True, backlog=2048,
        )
    )
    proxy.server = server
    os.set_blocking(0, False)
    loop.add_reader(0, proxy.on_notify)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    # the objects of start-up live as long as the process: out of the
    # collector's sight (gc.freeze), and young collections rarer, since a
    # request's objects die by reference count and few survive to be scanned
    # (4% more forwarded requests/s under wrk)
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    os.write(1, b"ready\n")
    prof = None
    if os.environ.get("GGMUX_PROFILE"):  # developer aid: cProfile stats at exit
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        loop.run_forever()
    finally:
        server.close()
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{os.environ['GGMUX_PROFILE']}.{args.index}")
    return 0
