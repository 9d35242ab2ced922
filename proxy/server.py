"""A proxy worker process: the public HTTP surface.

N identical workers bind the public address with ``SO_REUSEPORT``; the
kernel spreads connections over them. A worker resolves the request's model
through the registry blob, picks a replica from the shared-memory tables
(:mod:`ggmux.proxy.balancer`) and forwards bytes
(:mod:`ggmux.http1.upstream`). It never decides to load or evict: for a
model with no ready replica it registers a waiter in its waiters row and
asks the supervisor through the command queue, then waits to be woken (the
supervisor writes a byte on the worker's stdin after every generation bump;
stdin EOF means the supervisor is gone and the worker exits).

Forwarding (the fast path from the parser's callback, the task path with
waiting, balancing, retries, and the in-flight and breaker accounting) is
:mod:`ggmux.proxy.forward`; the worker process's entry (arguments, event
loop, keys) is :mod:`ggmux.proxy.__main__`. The worker is the only writer of
``counters[index]``, ``waiters[index]`` and ``mcounters[index]``.

Routes (llama.cpp router's, DESIGN.md "HTTP surface"): inference routed by
the body's ``model``; ``GET /props|/metrics|/slots?model=`` routed by the
query (they neither load a model nor refresh its last use); ``/v1/models``,
``/models`` (``?reload=1`` rescans the sources); ``POST /models/load``,
``/models/unload``; ``GET /models/sse``; ``GET /health``; ``GET /metrics``
(Prometheus, whole server); ``GET /requests`` and ``/requests/stream`` (the
request ring); ``/keys`` (keys with limits, :mod:`.keyed`); ``/upstream/<model>/<path>``
pass-through; the
other client APIs (Anthropic, Responses, Ollama, ``GET /v1/models/{id}``)
in :mod:`ggmux.proxy.apis`; CORS (:mod:`ggmux.proxy.cors`) on every answer.
The routes are one table, :data:`ggmux.proxy.routes.ROUTES`; the admin
routes' handlers are :mod:`.admin_routes`, the pass-through's
:mod:`.passthrough_route`; the graceful stop is :mod:`.draining`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import secrets
import time
from urllib.parse import parse_qs, urlsplit

import numpy as np
import orjson
import posix_ipc

from ..http1 import (
    HttpConnection,
    Request,
)
from ..http1.auth import authorized, secret_header
from ..http1.connections import ConnectionRegistry
from ..http1.drain import DRAIN_TIMEOUT_S
from ..http1.limits import tokenize_body_refusal
from ..http1.pool import UpstreamPool
from ..shm import layout as L
from ..shm.logring import log_ring_name
from ..shm.prefixtable import PrefixTable
from ..shm.requestring import request_ring_name
from ..shm.segment import Segment
from . import answers, apis, bodies, routes
from .accounting import Accounting, counter_rows
from .activity import Activity
from .admin_routes import AdminRoutes
from .admission import KeyAdmission
from .apis import ClientApis
from .balancer import (
    BalancerConfig,
    Candidate,
    CircuitBreaker,
)
from .cluster import (
    HOP,
    HOP_TRUSTED,
    take_hop,
)
from .cors import Cors, from_other_site, json_type, simple_type
from .drain_penalty import DEFAULT_PENALTY_S, DrainPenalty
from .draining import Draining
from .forward import NS, Forwarding
from .hosts import HostCheck
from .inference_paths import TOKEN_ROUTES
from .keyed import KeyedProxy, budgeted
from .listing import ModelEvents, unknown_model
from .operator.logs import LogTail
from .operator.page import Page
from .operator.requests import RequestLog
from .operator.usage import UsageView
from .passthrough_route import PassthroughRoute
from .prefix import PrefixRouting
from .replica_failures import ReplicaFailures
from .router_mode import RouterMode
from .waiting import ModelWaiters

log = logging.getLogger("ggmux.proxy")

# routed by ?model=; the admin key may read them too (their answers show more to it)
QUERY_ROUTED = frozenset((b"/props", b"/metrics", b"/slots"))

# llama-server's /health while its model loads (tools/server/server.cpp)
HEALTH_LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'


class Proxy(Forwarding, Accounting, ReplicaFailures, RouterMode, KeyedProxy, AdminRoutes,
            PassthroughRoute, Draining):
    """State of one worker; ``handle`` is the HTTP handler, :class:`~.forward.Forwarding`
    the forwarding (the fast path, waiting, balancing, retries, accounting)."""

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
        drain_timeout: float = DRAIN_TIMEOUT_S,
        first_byte_timeout: float = 600.0,
        stream_idle_timeout: float = 300.0,
        cors_origins: str = "*",
        tenant_secret: str | None = None,
        balancer: BalancerConfig | None = None,
        cache_scope: str = "global",
        key_table: str | None = None,
        keyed: bool = False,
        hosts: HostCheck | None = None,
        drain_penalty: float = DEFAULT_PENALTY_S,
    ) -> None:
        self.index = index
        # the Host names it answers to (DNS rebinding: .hosts); None: any
        self.hosts = hosts
        self.cors = Cors(cors_origins) if cors_origins else None
        self.apis = ClientApis(self)
        self.drain_timeout = drain_timeout
        # the HTTP server's connection registry (set by __main__): a drain
        # ends once every connection is settled
        self.connections: ConnectionRegistry | None = None
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
        # the same rows for the per-request updates (accounting.counter_rows)
        self.cw = counter_rows(self.cnt)
        self.mcw = counter_rows(self.mc)
        self.load_wait = load_wait
        self.queue_timeout = queue_timeout
        self.max_queue = max_queue
        # llama-server's form: several keys separated by commas, each its own
        # tenant (auth.tenant); the first is what this node sends other nodes
        self.api_keys = tuple(k.strip().encode() for k in (api_key or "").split(",") if k.strip())
        self.api_key = self.api_keys[0] if self.api_keys else None
        self.admin_key = admin_key.encode() if admin_key else None
        # keys the tenant hashes (auth.tenant); one per server, from the supervisor
        self.tenant_secret = tenant_secret.encode() if tenant_secret else secrets.token_bytes(16)
        self.loop = asyncio.get_event_loop()
        self.pool = UpstreamPool(self.loop, stream_idle_s=stream_idle_timeout)
        self.pool.start_sweeping()
        self.secrets: dict[int, bytes] = {}  # slot -> its instance's authorization line
        self.balancer = balancer or BalancerConfig()
        self.rng = random.Random()
        self.turns = 0  # choices made (round-robin's turn)
        # --cache-scope, for models whose preset sets none: the prefix index keeps it too
        self.cache_scope = cache_scope
        # the prefix index (issue 20), keyed by the server's secret so every proxy hashes
        # alike (the segment's name where no secret came: a proxy started alone)
        self.prefix = PrefixRouting(
            PrefixTable(self.seg.prefix, self.seg.prefix_forget, index,
                        self.seg.prefix_forget_disk),
            self.seg.sizes.prefix_block, tenant_secret.encode() if tenant_secret else shm.encode(),
        ) if self.balancer.mode == "prefix" else None
        self.breakers = [CircuitBreaker(row, self.balancer) for row in self.cw]
        self.gen = -1
        self.reg_version = -1
        self.names: dict[str, int] = {}
        self._slashed: list[str] = []  # names with "/" (pass-through matching)
        self.reg_models: list[dict] = []
        self.errors: dict[str, str] = {}
        self.remotes: dict[int, dict] = {}  # slot -> upstream replica address
        self.cluster: dict | None = None  # cluster mode: the registry blob's "cluster"
        self.router: dict = {}  # the registry blob's "router" (.router_mode)
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
                                                      self.errors, self.cluster))
        self.reload_seq = 0  # this proxy's reload requests
        self.reload_ids: list[str] = []  # the reloads the supervisor finished, newest last
        self.reload_errors: dict[str, str] = {}  # id -> why, of those that failed
        self.cache_clears: dict[str, dict] = {}  # POST /cache/clear's answers, by id
        self.page = Page()
        self.logtail = LogTail(self.loop, log_ring_name(shm))
        self.activity = Activity(request_ring_name(shm), index)
        self.pool.keep_bodies = self.activity.excerpt > 0  # --log-requests-bodies
        self.requests = RequestLog(self.loop, self.activity.ring)
        self.usage = UsageView(self.loop, "", shm)  # GET /usage (issue 36); __main__ sets its store
        # the key table (issue 36): --keys' policies and windows (keyed), and the
        # spend of priced replicas (every server)
        self.keyed = keyed and bool(key_table)
        self.keys = KeyAdmission(key_table, index) if key_table else None
        self.spend_holds: dict = {}  # Request -> its reservation of a model's budget (.keyed)
        # the keys' drain penalty (.drain_penalty): the keys file's keys only
        self.drain_penalty = (DrainPenalty(self.keys.table, drain_penalty)
                              if self.keys is not None and self.keyed and drain_penalty > 0
                              else None)
        if self.keys is not None:
            self.activity.on_end = self._request_ended
        self.refresh()

    # ---- shared-memory snapshot ------------------------------------------
    def refresh(self) -> None:
        """Re-read tables when the supervisor's generation moved; wake waiters.

        The generation read counts as seen only once the view built from it
        is whole: a read that raises (``SeqlockBusy``: the supervisor stalled
        mid-write) is retried on the next call, instead of leaving this
        proxy on its old view (a replica that became ready unseen, every
        request on the other) until the supervisor publishes again."""
        seg = self.seg
        g = seg.generation
        if g == self.gen:
            return
        self._read_registry(seg)
        g, (self.model_rows, reps) = seg.snapshot("models", "replicas")
        # the supervisor writes the registry (errors, names) before the
        # tables: tables newer than the registry read above (a failed flag
        # whose error text came with it) mean the registry moved: read it
        # again, or a model would show failed without its error
        if int(seg.header[L.H_REGISTRY_SEQ]) != self.reg_version:
            self._read_registry(seg)
        self._tables(g, reps)

    def _read_registry(self, seg: Segment) -> None:
        version, doc = seg.read_registry()
        if version != self.reg_version:
            self.reg_version = version
            self.names = doc.get("names", {})
            self._slashed = [n for n in self.names if "/" in n]
            self.reg_models = doc.get("models", [])
            self.errors = doc.get("errors", {})
            self.remotes = {int(k): v for k, v in doc.get("remotes", {}).items()}
            self.reload_ids = doc.get("reload_ids", ())
            self.reload_errors = doc.get("reload_errors", {})
            self.cache_clears = doc.get("cache_clears", {})
            self.cluster = doc.get("cluster")
            if self.cluster is not None and self.hosts is not None:
                self.hosts.set_cluster(urlsplit(self.cluster.get("url") or "").hostname or "")
            self.router = doc.get("router") or {}  # the router's settings (.router_mode)
            self.hop_slots = frozenset(k for k, v in self.remotes.items() if v.get("hop"))
            self.model_first_byte_ns = [
                int(t * NS) if isinstance(t := e.get("first_byte_timeout"), (int, float)) and t > 0
                else self.first_byte_ns for e in self.reg_models]

    def _tables(self, g: int, reps: np.ndarray) -> None:
        if self.prefix is not None:  # stopped replicas leave their prefixes to disk (issue 29)
            self.prefix.retire(self.replica_rows, reps, self.model_rows, self.remotes)
        self.replica_rows = reps
        # a draining replica (issue 34) takes no new request: its model's
        # requests wait as its waiters, in the same queue, like an unloaded one's
        serving = (reps[:, L.R_STATUS] == L.ReplicaStatus.READY) & (reps[:, L.R_DRAINING] == 0)
        ready_rows = reps[serving]
        self.ready = {int(m) for m in ready_rows[:, L.R_MODEL]}
        self.ready_local = self.ready if not self.hop_slots else {
            int(reps[s, L.R_MODEL]) for s in np.flatnonzero(serving)
            if int(s) not in self.hop_slots}
        if self.cluster is not None:
            held = np.isin(reps[:, L.R_STATUS], (L.ReplicaStatus.LOADING, L.ReplicaStatus.READY,
                                                 L.ReplicaStatus.SLEEPING))
            self.held_local = {int(reps[s, L.R_MODEL]) for s in np.flatnonzero(held)
                               if int(s) not in self.hop_slots}
        # models served by exactly one local replica without a concurrency
        # limit need no balancing: skip building candidates per request (but
        # a spending budget is checked and reserved per request: not those)
        per_model: dict[int, list[int]] = {}
        for slot in np.flatnonzero(serving):
            per_model.setdefault(int(reps[slot, L.R_MODEL]), []).append(int(slot))
        single = {}
        for m, slots in per_model.items():
            r = reps[slots[0]]
            if (len(slots) == 1 and slots[0] not in self.remotes and not r[L.R_MAX_CONCURRENCY]
                    and not (m < len(self.reg_models) and budgeted(self.reg_models[m]))):
                single[m] = Candidate(slot=slots[0], port=int(r[L.R_PORT]),
                                      incarnation=int(r[L.R_INCARNATION]))
        self.single = single
        self.secrets = {
            int(slot): secret_header(int(reps[slot, L.R_SECRET_HI]), int(reps[slot, L.R_SECRET_LO]))
            for slot in np.flatnonzero(reps[:, L.R_SECRET_HI] | reps[:, L.R_SECRET_LO])}
        self.gen = g  # the view of generation g is whole
        alive = {int(p) for p in reps[reps[:, L.R_STATUS] == L.ReplicaStatus.READY][:, L.R_PORT]}
        for port in list(self.pool.idle):
            if port not in alive:
                self.pool.drop_port(port)
        if self.waiters:
            now = time.monotonic_ns()
            self.waiters.wake(lambda m: "ready" if m in self.ready else
                              "failed" if self._in_backoff(m, now) else
                              "pinned" if self._pinned_out(m) else None)
        if self.events:
            self.events.publish()

    def _pinned_out(self, m: int) -> bool:
        """Only pinned models hold the capacity model ``m`` waits for
        (issue 34): its waiters get 503 with the cause instead of waiting."""
        return int(self.model_rows[m][L.M_WAIT_REASON]) == L.WaitReason.PINNED

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

    # ---- HTTP ------------------------------------------------------------------------
    def _authorized(self, req: Request, admin: bool = False) -> bool:
        """``Authorization: Bearer KEY`` or ``x-api-key: KEY``, compared in
        constant time (with every API key); admin routes need the admin key
        when one is set, and the admin key serves every other route too (its
        holder may then unload through Ollama's ``keep_alive: 0``: issue 18,
        finding 1)."""
        if admin and self.admin_key:
            return authorized(req, self.admin_key)
        if self.api_key is None and not self.keyed:
            return True
        ok = False
        for key in self.api_keys:
            ok |= authorized(req, key)
        if ok or self._is_admin(req):
            return True
        # a key of the keys file (issue 36): usable unless disabled or expired
        return (self.keyed and self._key_row(req) >= 0
                and self.keys.unusable(req.key_row) is None)

    def key_kinds(self) -> str:
        """The keys this server takes, for a 401's message (the page shows it
        in its key dialog): "a key of its keys file or the admin key"."""
        kinds = [k for k, on in (("a key of its keys file", self.keyed),
                                 ("an --api-key key", bool(self.api_keys)),
                                 ("the admin key", self.admin_key is not None)) if on]
        return " or ".join([", ".join(kinds[:-1]), kinds[-1]] if len(kinds) > 1 else kinds)

    def _is_admin(self, req: Request) -> bool:
        """Whether the request presents the admin key (one must be set)."""
        return self.admin_key is not None and authorized(req, self.admin_key)

    def admin_refusal(self, req: Request) -> str | None:
        """Why ``req``'s caller may not do what the admin key guards
        (unload, load, reload, logs, drain, whatever the API asks it by:
        DESIGN.md "Security defaults"; issue 18, findings 1 and 5), as the
        end of a sentence; None when it may. It may with the admin key;
        with no admin key set, whoever the API key (or, with no key, no
        key) let in may; never a request another node forwarded, nor one
        from a page of another origin than ggmux's own that
        ``--cors-origins`` does not name (:func:`~.cors.from_other_site`)."""
        if self.admin_key is not None and not authorized(req, self.admin_key):
            return "needs the admin key (--admin-key)"
        if req.key_row >= 0:  # issue 36: a keys-file key is never an admin
            if self.admin_key is None and self.api_key is None:
                return ("needs the admin key, and this server has none: start it with "
                        "--admin-key (or $GGMUX_ADMIN_KEY); a key of the keys file never can")
            return "needs the admin key, or an --api-key key (not a key of the keys file)"
        if req.hop == HOP_TRUSTED:
            return "is not taken from another node"
        if from_other_site(req, self.cors.listed if self.cors is not None else frozenset()):
            return ("is not taken from a page of another origin (--cors-origins names the "
                    "origins that may)")
        return None

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        """Answer one request through the route table (:mod:`.routes`, whose
        docstring gives the order of the checks)."""
        path = req.path
        route = routes.match(path)
        if (self.hosts is not None and not self.hosts.allows(req.host)
                and path != b"/health"):  # (probes name the pod or the service)
            why = self.hosts.refusal(req.host)
            if route is not None and route.foreign:
                apis.send_error(conn, req, 403, why)
            else:
                conn.send_error(req, 403, why, code="host_not_allowed")
            return
        admin = route is not None and route.needs_admin(req.query, req.method)
        if admin and req.origin is not None and self.cors is not None:
            req.extra_head = self.cors.headers(req.origin, admin=True)  # never "*"
        if req.method == b"OPTIONS" and (route is None or route.preflight):
            # before the key check: preflights carry no key
            if self.cors is not None:
                self.cors.options(conn, req, admin)
            else:
                conn.send_response(req, 200, b"", headers=[(b"allow", b"GET, POST, HEAD, OPTIONS")])
            return
        if route is not None and route.public:  # /health; the page holds no secret: it asks for the key
            await getattr(self, route.handler)(conn, req)
            return
        if self.stopping:
            answers.stopping(conn, req)
            return
        if self.cluster is None and req.header(HOP) is not None:
            self.refresh()  # a hop header: is this node (already) in a cluster?
        req.hop = take_hop(req, self.cluster)
        # the admin key also reads what a model's slots, props and metrics say
        # (issue 18: /slots shows request ids to it alone)
        if (not (req.hop == HOP_TRUSTED and not admin) and not self._authorized(req, admin)
                and not (path in QUERY_ROUTED and self._is_admin(req))):
            if admin and self.admin_key:
                why = "this route needs the admin key (--admin-key)"
            elif admin and self.api_key is None:  # a keys file, and no admin key
                why = ("this route needs the admin key, and this server has none: start it "
                       "with --admin-key (or $GGMUX_ADMIN_KEY)")
            else:
                why = (self._key_unusable(req)
                       or f"invalid or missing API key: this server takes {self.key_kinds()}")
            if route is not None and route.foreign:
                apis.send_error(conn, req, 401, why, headers=[(b"www-authenticate", b"Bearer")])
                return
            conn.send_error(req, 401, why, code="invalid_api_key",
                            headers=[(b"www-authenticate", b"Bearer")])
            return
        if route is None or (route.guard and not getattr(self, route.guard)()):
            conn.send_error(req, 404, f"no route for {req.method.decode()} {path.decode('latin-1')}")
            return
        if route.methods and req.method not in route.methods:
            if route.refuse:
                conn.send_error(req, 405, f"{path.decode()} needs {route.methods[0].decode()}")
            else:
                conn.send_error(req, 404,
                                f"no route for {req.method.decode()} {path.decode('latin-1')}")
            return
        if admin and (why := self.admin_refusal(req)) is not None:
            conn.send_error(req, 403, f"{path.decode()} {why}", code="forbidden")
            return
        if req.method == b"POST" and req.body and not (
                json_type(req.content_type) or (route.handler == "_passthrough"
                                                and not simple_type(req.content_type))):
            self._unsupported_type(conn, req, route)
            return
        if (route.handler == "_passthrough" and req.method == b"POST" and not req.body
                and simple_type(req.content_type) and self._other_site(req)):
            # issue 37, item 3: a page of any origin can POST with no body and
            # no preflight; a replica's route that takes one changes state
            conn.send_error(req, 403, "a POST with no body from a page of another origin "
                            "does not reach a replica (--cors-origins names the origins "
                            "that may)", code="forbidden")
            return
        await getattr(self, route.handler)(conn, req)

    def _unsupported_type(self, conn: HttpConnection, req: Request, route: routes.Route) -> None:
        """415 for a POST body whose type a page of any origin could send
        without a preflight (issue 18, finding 5; :mod:`.cors`)."""
        given = (req.content_type or b"none").decode("latin-1")[:80]
        if route.handler == "_passthrough":
            why = (f"a POST body of type {given} can come from any web page: send its real "
                   "type (application/json, ...)")
        else:
            why = (f"the request body must be JSON (Content-Type: application/json), not "
                   f"{given}; curl: -H 'content-type: application/json' or --json")
        if route.foreign:
            apis.send_error(conn, req, 415, why)
        else:
            conn.send_error(req, 415, why, code="unsupported_media_type")

    # ---- the routes' handlers (:data:`.routes.ROUTES` names them) ------------------
    async def _health(self, conn: HttpConnection, req: Request) -> None:
        """200 ``{"status":"ok"}`` while the proxies serve; 503 with
        llama-server's ``Loading model`` error while a ``load-on-startup``
        model of this node has not finished its first load (llama-server
        answers so until its model is loaded: readiness probes and its
        test suite wait on it). A first load that failed ends the wait."""
        self.refresh()
        if self._startup_loading():
            conn.send_response(req, 503, HEALTH_LOADING)
            return
        conn.send_response(req, 200, b'{"status":"ok"}')

    async def _readyz(self, conn: HttpConnection, req: Request) -> None:
        """200 ``{"status":"ok"}`` while this proxy takes requests, whatever
        the models' loads: a Kubernetes readiness probe asks whether the pod
        can serve (a request for a model that is not loaded waits for its
        load here), not whether a model is loaded, which ``/health``
        answers for ``load-on-startup`` models as llama-server does. A
        draining proxy no longer listens, so the probe fails then."""
        conn.send_response(req, 200, b'{"status":"ok"}')

    def _startup_loading(self) -> bool:
        if self.cluster is not None:  # a startup model may be placed on another node
            return False
        rows = self.model_rows
        for i, e in enumerate(self.reg_models):
            if (e.get("load_on_startup") and not e.get("removed") and i < len(rows)
                    and rows[i, L.M_LOADS] == 0 and rows[i, L.M_FAILURES] == 0
                    and rows[i, L.M_FAILED] == 0):
                return True
        return False

    async def _page(self, conn: HttpConnection, req: Request) -> None:
        self.page.serve(conn, req)

    async def _client_api(self, conn: HttpConnection, req: Request) -> None:
        await self.apis.handle(conn, req)

    async def _models_sse(self, conn: HttpConnection, req: Request) -> None:
        self.refresh()
        await self.events.subscribe(conn, req, self._scope(req))

    def _query_model(self, req: Request) -> str | None:
        if not req.query:
            return None
        vals = parse_qs(req.query.decode("latin-1")).get("model")
        return vals[0] if vals else None

    async def _inference(self, conn: HttpConnection, req: Request) -> None:
        body = req.body_json
        if body is None and req.path in TOKEN_ROUTES:
            refusal = tokenize_body_refusal(conn.limits, req.body, req.path == b"/detokenize")
            if refusal is not None:
                conn.send_error(req, 413, refusal)
                return
        if body is None:  # parsed off the loop when large, items bounded (issue 37, item 11)
            body = await bodies.read_object(conn, req)
            if body is None:
                return
        elif (why := bodies.item_refusal(conn.limits, body)) is not None:
            conn.send_error(req, 413, why)
            return
        name = body.get("model")
        if name is None:
            self.refresh()
            name = self.name_for_unnamed()  # the only model (llama-server of one model)
            if name is None:
                conn.send_error(req, 400, "missing 'model' in the request body (this server "
                                "serves several models: GET /v1/models lists them)")
                return
        if apis.wants_usage(body) and req.path in (b"/v1/chat/completions",
                                                   b"/chat/completions"):
            await self.apis.translated(conn, req, apis.CHAT_WITH_USAGE, body=body)
            return
        m = self._model(conn, req, name)
        if m is None:
            return
        await self._forward(conn, req, m, name, body, stream=body.get("stream") is True)

    def _model(self, conn: HttpConnection, req: Request, name) -> int | None:
        """Index of the model a request names, or None after answering
        400 (not a string) or 404 (unknown; names resolve only through the
        registry, so no name can reach a file)."""
        if not isinstance(name, str):
            conn.send_error(req, 400, "'model' must be a string")
            return None
        self.refresh()
        m = self.pick_model(name)  # the name, an alias, else --model-fallback's
        if m is None:
            conn.send_error(req, 404, unknown_model(name, self._listed(req)),
                            code="model_not_found")
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
