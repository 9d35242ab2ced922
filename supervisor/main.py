"""The supervisor: one ``select.poll()`` loop that owns every child.

Shaped like gunicorn's arbiter: each turn waits on one poll (child pipes,
the command queue's descriptor, the signal wake-up pipe, probe sockets)
with a timeout, handles signals and commands, reads child output, then runs
small named steps: ``reap`` (exited children), ``escalate`` (stops and load
deadlines past due), probes, ``schedule`` (desired vs actual: loads and
evictions, :mod:`.reconcile`), ``publish`` (shared memory, generation,
proxy wake-ups, :mod:`.publish`). No threads.

This module holds the loop, setup and teardown, signals, commands and
reloads; the proxies are :mod:`.proxies`. What it drives lives beside it: :mod:`.state` (the shared
books and records), :mod:`.children` (processes and their pipes),
:mod:`.replicas` (instances and ``cmd`` replicas, stop and escalation),
:mod:`.spares`, :mod:`.remotes` (``upstream`` replicas), :mod:`.measure`,
:mod:`.reconcile` and :mod:`.publish`.
"""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import socket
import time
from collections.abc import Callable

import orjson
import posix_ipc

from ..http1.drain import DRAIN_FLUSH_S, drain_budget
from ..ledger.leftover import read_leftover
from ..ledger.sync import LedgerSync
from ..shm import layout as L
from ..shm.keytable import NO_KEYS_BLOB, TableShape, key_table_name
from ..shm.logring import log_ring_name
from ..shm.requestring import RequestRing, RingShape, request_ring_name
from ..shm.segment import Segment
from .children import ChildSet
from .cluster.node import ClusterNode
from .config import Config
from .jobs import Jobs
from .keys import KeyRegistry, model_prices
from .keys_file import builtin_hashes
from .kv_events import KVEventsChild
from .ledger_wiring import close_ledger, open_ledger, start_windows
from .logs import install as install_ring_handler
from .measure import Measurer
from .probe import ProbeSet
from .proxies import ProxyChildren
from .publish import Publisher
from .reconcile import Reconciler
from .registry import Registry
from .reload import plan_reload
from .remotes import Remotes
from .replicas import Replicas, backoff_s, load_budget_s
from .state import ModelRuntime, State
from .watch import ConfigWatch

__all__ = ["Config", "StartupError", "Supervisor", "backoff_s", "load_budget_s"]

log = logging.getLogger("ggmux.supervisor")


class StartupError(RuntimeError):
    """The server cannot start (port taken, a live server owns the name)."""


def _check_port_free(host: str, port: int) -> None:
    """Bind once *without* SO_REUSEPORT: fails if anything listens there."""
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(fam, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(f"cannot listen on {host}:{port}: {e.strerror}") from e


def _check_no_live_owner(name: str) -> None:
    """A segment whose supervisor is alive belongs to a running server."""
    try:
        seg = Segment.attach(name)
    except (posix_ipc.ExistentialError, ValueError):
        return  # none, or not ours / old layout: replaced as stale
    try:
        pid = int(seg.header[L.H_SUPERVISOR_PID])
    finally:
        seg.close()
    if pid and pid != os.getpid():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        raise StartupError(f"shared memory {name} belongs to a running ggmux (pid {pid})")


class Supervisor(ProxyChildren):
    """See the module docstring. ``run()`` returns the process exit code.

    ``rebuild`` rescans every source (SIGHUP, ``GET /models?reload=1``);
    ``None``: nothing to rescan.
    """

    def __init__(
        self, cfg: Config, registry: Registry, rebuild: Callable[[], Registry] | None = None
    ) -> None:
        self.cfg = cfg
        self.rebuild = rebuild  # rescans every source: SIGHUP, GET /models?reload=1
        self.state = State(cfg, registry)
        self.poller = select.poll()
        self.children = ChildSet(self.poller)
        self.probes = ProbeSet(self.poller)
        self.jobs = Jobs()  # blocking steps of the KV tiers, off the loop (issue 29)
        self.replicas = Replicas(self.state, self.children, self.probes, self.jobs)
        self.remotes = Remotes(self.state, self.probes)
        self.measurer = Measurer(self.state, self.children)
        self.reconciler = Reconciler(self.state, self.replicas, self.measurer)
        self.publisher = Publisher(self.state)
        self.watch = ConfigWatch(cfg.watch_paths, cfg.watch_interval) if cfg.watch_paths else None
        self.cluster: ClusterNode | None = None
        if cfg.cluster is not None:
            self.cluster = ClusterNode(
                cfg.cluster, self.state, self.children, load=self.load, unload=self.unload,
                apply_entries=self.apply_cluster_entries, drain_timeout=cfg.drain_timeout,
                log_level=cfg.log_level)
            self.reconciler.gate = self.cluster.allows
        self.kv_events = (KVEventsChild(cfg.kv_events, self.children, cfg.log_level)
                          if cfg.kv_events is not None else None)  # the KV events' publisher
        self.proxy_ready: set[int] = set()
        self._serving = False  # every proxy listened once
        self.startup_failed = False
        self.mq: posix_ipc.MessageQueue | None = None
        self.request_ring: RequestRing | None = None
        self.usage = None  # the usage ledger (issue 36; .ledger), None: --ledger off
        self.keys: KeyRegistry | None = None  # --keys (issue 36)
        self.sync: LedgerSync | None = None  # --ledger-sync: keys' windows across nodes
        self._sig_r = self._sig_w = -1

    # ---- setup / teardown ------------------------------------------------
    def setup(self) -> None:
        """Create the segment and queue, start the proxies.

        Raises :class:`StartupError` when the port is taken or another live
        ggmux owns the segment name: with ``SO_REUSEPORT`` a second server
        would otherwise silently share the port with the first.
        """
        cfg, st = self.cfg, self.state
        _check_port_free(cfg.host, cfg.port)
        _check_no_live_owner(cfg.shm_name)
        # a server of this name that died (kill -9) left its ring: its last
        # requests' rows, read before anything of the name is made again
        leftover = read_leftover(cfg.shm_name) if cfg.ledger else None
        # the key table, before any proxy attaches it: the keys' windows (--keys)
        # and every server's priced replicas' spend
        try:
            self.keys = KeyRegistry.open(
                cfg.keys_file, key_table_name(cfg.shm_name),
                TableShape(cfg.keys_max, cfg.proxies, st.sizes.models) if cfg.keys_file
                else TableShape(1, cfg.proxies, st.sizes.models, NO_KEYS_BLOB),
                builtin_hashes(cfg.proxy_keys))
        except (OSError, ValueError) as e:
            raise StartupError(f"--keys: {e}") from None
        st.seg = Segment.create(cfg.shm_name, st.sizes)
        install_ring_handler().open(log_ring_name(cfg.shm_name), cfg.log_ring_bytes)
        # the proxies' record of their requests: they write it, we only make and remove it
        self.request_ring = RequestRing.create(
            request_ring_name(cfg.shm_name),
            RingShape(cfg.proxies, max(1, cfg.requests_kept), cfg.request_excerpt))
        # --- usage ledger (issue 36): rows from the ring, key names and prices from the keys
        try:
            self.usage = open_ledger(
                st, self.request_ring, self.jobs,
                key_name=lambda row: k.name_of(row) if (k := getattr(self, "keys", None)) else None,
                prices_of=lambda model: model_prices(st.registry, model))
        except ValueError as e:
            raise StartupError(f"--ledger: {e}") from None
        if self.usage is not None and leftover is not None:  # before the windows' seed
            self.usage.recover(leftover.rows(self.usage.ctx))
        if self.usage is not None and self.keys is not None:  # restart keeps the windows,
            self.sync = start_windows(cfg, self.keys, self.usage, self.jobs)  # nodes share them
        # --- end usage ledger ---
        st.seg.header[L.H_SUPERVISOR_PID] = os.getpid()
        st.seg.header[L.H_MODELS_MAX] = cfg.models_max
        self.publisher.registry()
        try:
            posix_ipc.unlink_message_queue(cfg.mq_name)
        except posix_ipc.ExistentialError:
            pass
        self.mq = posix_ipc.MessageQueue(
            cfg.mq_name, posix_ipc.O_CREX, mode=0o600, max_messages=10, max_message_size=512
        )
        self.mq.block = False
        self.poller.register(self.mq.mqd, select.POLLIN)
        self._sig_r, self._sig_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, _noop)
        self.poller.register(self._sig_r, select.POLLIN)
        for i in range(cfg.proxies):
            self._spawn_proxy(i)
        now = time.monotonic_ns()
        for i, e in enumerate(st.registry.entries):
            if e.load_on_startup:
                st.models[i].requested_ns = now + i  # keep registry order
        self.remotes.add()
        if self.cluster is not None:
            self.cluster.start()  # its view is in the registry blob from the start
        if self.kv_events is not None:
            self.kv_events.start()
        self.publisher.registry()  # with the remotes' addresses
        st.calibrate()
        self.replicas.kv.scan_all()  # the models' disk tiers, before any replica runs
        self.publisher.tables()

    def _children_left(self) -> bool:
        st = self.state
        return bool(st.replicas or st.proxies or self.measurer.measuring
                    or self.replicas.spares.pool
                    or (self.cluster is not None and self.cluster.alive())
                    or (self.kv_events is not None and self.kv_events.alive()))

    def teardown(self) -> None:
        """Stop every child (exit, then SIGTERM, then SIGKILL) and remove the
        segment and queue. Safe to call twice."""
        st = self.state
        st.stopping_all = True
        for r in list(st.replicas.values()):
            if r.stop_stage == 0:
                self.replicas.stop(r, "server shutting down")
        for c in st.proxies.values():
            c.close_stdin()  # EOF: the proxy exits
        self.measurer.close()
        self.replicas.spares.close()
        if self.cluster is not None:
            self.cluster.close()
        if self.kv_events is not None:  # it exits at EOF; the instances' last events are lost
            self.kv_events.close()
        # each replica's exit -> SIGTERM (its save to the disk tier, or a cmd
        # llama-server's slot save first, included: issue 29), then SIGTERM -> SIGKILL
        # and the proxies' drain (issue 37, item 8): never SIGKILL a proxy
        # still writing the last bytes of an answer
        proxies = drain_budget(e.stop_timeout for e in st.registry.entries) + DRAIN_FLUSH_S
        budget = max([self.cfg.stop_timeout, proxies, *(
            r.kill_after + self.replicas.kv.save_bound(r) for r in st.replicas.values())])
        deadline = time.monotonic() + budget + self.cfg.term_timeout
        while self._children_left():
            self._drain_signals()
            self.jobs.step()  # a cmd replica's slots saved: its SIGTERM
            self._reap()
            self.replicas.escalate(time.monotonic_ns())
            if time.monotonic() > deadline:
                agent = [self.cluster.child] if self.cluster and self.cluster.child else []
                for c in [*(r.child for r in st.replicas.values()), *st.proxies.values(),
                          *self.measurer.measuring.values(),
                          *(c for c, _ in self.replicas.spares.pool), *agent]:
                    c.kill(signal.SIGKILL)
                if self.kv_events is not None:
                    self.kv_events.kill()
            if self._children_left():
                self._poll_once(20)
        self.replicas.close()
        if self.sync is not None:
            self.sync.close()
        if self.usage is not None:  # the proxies are gone: the ring's last records
            close_ledger(self.usage)
            self.usage = None
        if st.seg is not None:
            st.seg.unlink()
            st.seg = None
        if self.keys is not None:
            self.keys.close()
            self.keys = None
        if self.request_ring is not None:
            self.request_ring.unlink()
            self.request_ring.close()
            self.request_ring = None
        if self.mq is not None:
            try:
                self.mq.close()
                self.mq.unlink()
            except posix_ipc.ExistentialError:
                pass
            self.mq = None
        log.info("stopped")
        install_ring_handler().close_ring()

    # ---- main loop ---------------------------------------------------------
    def run(self) -> int:
        """Set up, serve until SIGTERM/SIGINT (or a proxy that never
        listened), tear down. Returns the exit code (0, or 1 on a failed
        start); raises :class:`StartupError` from :meth:`setup`."""
        self.setup()
        try:
            c = self.cluster
            if c is not None and not c.wait_verdict(self._poll_once, c.o.node_stale
                                                   + 2 * c.o.heartbeat + 5.0):
                self.startup_failed = True
                raise StartupError(c.refusal)
            if not self.wait_proxies_ready():
                if self.state.stopping_all and not self.startup_failed:
                    # SIGTERM/SIGINT while proxies still started: a stop, not
                    # a failed start (issue 31, item 10)
                    return 0
                log.error("proxies did not start listening on %s:%d", self.cfg.host, self.cfg.port)
                return 1
            self._serving = True
            log.info(
                "listening on http://%s:%d (%d proxies, models_max %d, %d models)",
                self.cfg.host, self.cfg.port, self.cfg.proxies, self.cfg.models_max,
                len(self.state.registry),
            )
            while not self.state.stopping_all:
                busy = bool(self.state.replicas) or self.state.any_waiters()
                self._poll_once(50 if busy else 250)
                self.step()
            if self.cluster is not None and self.cluster.fatal:
                raise StartupError(self.cluster.refusal)
        finally:
            self.teardown()
        return 1 if self.startup_failed else 0

    def step(self) -> None:
        """One turn after the poll: the named idempotent steps."""
        self._drain_signals()
        self._drain_queue()
        self.jobs.step()
        if self.usage is not None:
            self.usage.step()
        if self.sync is not None and not self.state.stopping_all:
            self.sync.step()
            if self.usage is not None:
                self.usage.note_sync(self.sync.syncs, self.sync.clash)
        self._reap()
        now = time.monotonic_ns()
        self.replicas.escalate(now)
        self._probe_step(now)
        if self.cluster is not None and not self.state.stopping_all:
            self.cluster.step(now)
        if self.kv_events is not None:
            self.kv_events.step()
        if not self.state.stopping_all:
            if self.watch is not None and (why := self.watch.check(now)):
                self.reload(why)
            self.replicas.hung_step(now)
            self.reconciler.step(now)
        self.publisher.if_dirty()

    def _poll_once(self, timeout_ms: int) -> None:
        try:
            events = self.poller.poll(timeout_ms)
        except InterruptedError:
            return
        for fd, _ in events:
            if not self.children.on_event(fd):
                self.probes.on_event(fd)

    def _reap(self) -> None:
        self._reap_proxies()
        self.replicas.spares.reap()
        self.measurer.reap()
        self.replicas.reap()
        if self.cluster is not None:
            self.cluster.reap()
        if self.kv_events is not None:
            self.kv_events.reap()

    def _probe_step(self, now: int) -> None:
        """Readiness of ``cmd`` instances, health of ``upstream`` replicas."""
        self.probes.step(now)
        self.replicas.probe_step(now)
        self.remotes.probe_step(now)

    # ---- signals and commands ----------------------------------------------
    def _drain_signals(self) -> None:
        try:
            data = os.read(self._sig_r, 512)
        except (BlockingIOError, OSError):
            return
        for signum in data:
            if (signum == signal.SIGTERM and self.cluster is not None
                    and not self.cluster.draining and not self.cluster.off):
                self.cluster.drain("SIGTERM; a second one stops at once")
            elif signum in (signal.SIGTERM, signal.SIGINT):
                if not self.state.stopping_all:
                    log.info("received %s: stopping", signal.Signals(signum).name)
                self.state.stopping_all = True
            elif signum == signal.SIGHUP:
                self.reload("SIGHUP")

    def _drain_queue(self) -> None:
        mq = self.mq
        if mq is None:
            return
        while True:
            try:
                msg, _ = mq.receive(0)
            except posix_ipc.BusyError:
                return
            try:
                cmd = orjson.loads(msg)
            except orjson.JSONDecodeError:
                log.warning("bad command %r", msg[:80])
                continue
            self._command(cmd)

    def _command(self, cmd: dict) -> None:
        """One order from a proxy's queue. ``route`` names the request it
        came from (``"POST /api/generate"``), for the log line; the proxy
        has judged the caller (issue 18, finding 1): ``keep_alive`` with
        ``extend`` comes from one without the admin key (:meth:`keep_alive`)."""
        op = cmd.get("op")
        if op == "want":
            return  # demand itself is read from the waiters table each tick
        route = cmd.get("route")
        route = route[:120] if isinstance(route, str) and route else None
        if op == "reload":
            self.reload(route or "GET /models?reload=1", cmd.get("id"))
            return
        if op == "keys":
            if self.keys is not None:
                self.keys.command(cmd)
            return
        if op == "unload_idle":
            self.unload_idle(f"requested by {route or 'POST /models/unload *'}")
            return
        if op == "cache_clear":
            self._cache_clear(cmd)
            return
        if op == "drain":
            if self.cluster is not None:
                self.cluster.drain(route or "POST /cluster/drain")
            return
        m = cmd.get("model")
        if not isinstance(m, int) or not 0 <= m < len(self.state.registry):
            log.warning("command %r for unknown model %r", op, m)
            return
        if op == "load":
            self.load(m, f"requested by {route or 'POST /models/load'}")
        elif op == "unload":
            self.unload(m, f"requested by {route or 'POST /models/unload'}")
        elif op == "keep_alive":
            s = cmd.get("seconds")
            if isinstance(s, (int, float)) and not isinstance(s, bool) and not math.isnan(s):
                self.keep_alive(m, float("inf") if s < 0 else float(s),
                                cmd.get("extend") is True, route or "an Ollama request")
        else:
            log.warning("unknown command %r", op)

    def _cache_clear(self, cmd: dict) -> None:
        """``POST /cache/clear`` (issue 29): empty the KV tiers of model
        ``cmd["model"]`` (None: every model); the answer is published under
        ``cmd["id"]`` (:meth:`~.kvtiers.cache.KvCache.clear`)."""
        st = self.state
        m, rid = cmd.get("model"), cmd.get("id")
        if not isinstance(rid, str) or not rid:
            log.warning("cache_clear without an id")
            return
        if m is None:
            models = [i for i in range(len(st.registry)) if i not in st.removed]
        elif isinstance(m, int) and 0 <= m < len(st.registry):
            models = [m]
        else:
            log.warning("cache_clear of unknown model %r", m)
            return
        log.info("emptying the KV tiers of %s: %s", "every model" if m is None else st.name(m),
                 cmd.get("route") or "POST /cache/clear")
        self.replicas.kv.clear(models, rid[:64])

    def keep_alive(self, m: int, seconds: float, extend: bool, route: str) -> None:
        """Ollama's ``keep_alive`` of a request to model ``m``: ``seconds``
        (inf: never) become its idle timer, instead of its ``ttl``, until it
        unloads. ``extend`` (a caller without the admin key, issue 18
        finding 1): the timer may only grow, and at most to the ``ttl`` the
        operator set (none: never), so such a caller can neither make the
        model unload sooner for everyone nor keep it beyond the ttl."""
        st = self.state
        rt = st.models[m]
        ttl = st.registry.entries[m].ttl
        ttl = ttl if ttl and ttl > 0 else float("inf")
        if extend:
            now = rt.keep_alive_s if rt.keep_alive_s is not None else ttl
            seconds = max(now, min(seconds, ttl))
            if seconds == now:
                log.debug("%s: keep_alive from %s (no admin key) leaves the idle timer at %s",
                          st.name(m), route, _seconds(now))
                return
        rt.keep_alive_s = seconds
        log.info("%s: keep_alive %s from %s: idle timer until it unloads", st.name(m),
                 _seconds(seconds), route)

    def reload(self, why: str, rid: str | None = None) -> None:
        """Rescan every source (llama.cpp router's reload, llama-swap's config
        reload). New models appear; removed ones stop being listed or routed
        and unload once idle; a model whose configuration changed keeps
        serving on its old replicas until they are idle, then reloads on the
        next request. Nothing loads merely because of a reload. A reload
        that fails (a source that does not parse, an alias two models claim)
        changes nothing; the error is logged. ``rid``, a proxy's reload id,
        is published once the reload ran, with the error when it failed
        (``reload_errors``), so ``GET /models?reload=1`` answers with the
        list it produced or says why there is none (issue 23), or why the keys file did not."""
        st = self.state
        keys_err = self.keys.reload(why) if self.keys is not None else None
        error = self._reload(why)
        error = "; ".join(filter(None, (error and f"the models are unchanged: {error}",
                                        keys_err))) or None
        if rid is not None:
            st.reload_ids.append(str(rid))
            kept = set(st.reload_ids)
            st.reload_errors = {k: v for k, v in st.reload_errors.items() if k in kept}
            if error is not None:
                st.reload_errors[str(rid)] = error
            st.errors_dirty = True  # republish the registry: the id, and the new list

    def _reload(self, why: str) -> str | None:
        """Rescan and apply; the error when the reload failed, else None."""
        if self.rebuild is None:
            log.warning("%s: no sources to rescan", why)
            return None
        try:
            new = self.rebuild()
        except (OSError, ValueError) as e:
            log.error("%s: reload failed, keeping the current models: %s", why, e)
            return str(e)
        except Exception as e:  # a bug in a source's reader must not end the server
            log.exception("%s: reload failed, keeping the current models", why)
            return f"{type(e).__name__}: {e}"
        return self._apply(new, why)

    def apply_cluster_entries(self, entries: list, why: str) -> None:
        """Cluster mode: make the registry's ``cluster``-kind entries (models
        only other nodes have) exactly ``entries``, without rescanning the
        local sources (the same bookkeeping as a reload)."""
        st = self.state
        local = [e for i, e in enumerate(st.registry.entries)
                 if e.kind != "cluster" and i not in st.removed]
        try:
            new = Registry(local + entries)
        except ValueError as e:
            log.error("%s: cannot register the cluster's models: %s", why, e)
            return
        self._apply(new, why)

    def _apply(self, new: Registry, why: str) -> str | None:
        """Merge registry ``new`` into the running one (see :meth:`reload`):
        the merge is planned first (:func:`.reload.plan_reload`) and
        committed only when it is valid. Returns the error of a merge that
        failed (nothing changed), else None."""
        st = self.state
        if self.cluster is not None and why != "cluster":
            names = {e.name for e in new.entries}
            keep = [e for i, e in enumerate(st.registry.entries)
                    if e.kind == "cluster" and i not in st.removed and e.name not in names]
            if keep:
                try:
                    new = Registry(new.entries + keep)
                except ValueError:
                    pass
        try:
            plan = plan_reload(st.registry, st.removed, new, st.sizes.models)
        except ValueError as e:
            log.error("%s: reload failed, keeping the current models: %s", why, e)
            return str(e)
        for name in plan.skipped:
            log.error("%s: no room for model %s (raise the model-row headroom)", why, name)
        st.models.extend(ModelRuntime() for _ in range(plan.new_rows))
        for i in plan.changed:
            st.models[i].measure = "pending"
            st.models[i].mem_min = st.models[i].mem_max = None
        for i in plan.gone:
            st.models[i].requested_ns = 0
        outdated = plan.changed | plan.gone
        st.stale |= {r.slot for r in st.replicas.values() if r.model in outdated}
        st.registry, st.removed = plan.registry, plan.removed
        self.measurer.recheck()  # a touched model file is measured again
        self.remotes.add()
        self.remotes.drop_removed()
        log.info("%s: reloaded models: %d added %s, %d changed %s, %d removed %s", why,
                 len(plan.added), plan.added, len(plan.edited), plan.edited,
                 len(plan.dropped), plan.dropped)
        st.errors_dirty = True
        return None

    def load(self, m: int, why: str) -> None:
        """Queue an explicit load of model ``m`` (no-op when it is running)."""
        st = self.state
        if any(r.model == m and r.stop_stage == 0 for r in st.replicas.values()):
            return
        rt = st.models[m]
        if rt.requested_ns == 0:
            rt.requested_ns = time.monotonic_ns()
            log.info("load of %s queued: %s", st.name(m), why)

    def unload_idle(self, why: str) -> None:
        """Unload every model that is idle: replicas running, none with a
        request in flight, no request waiting for it (``POST /models/unload``
        of ``"*"``, ``ggmux unload --all``). A busy model keeps serving."""
        st = self.state
        inflight = st.in_flight()
        waiting, _ = st.demand()
        busy = {r.model for r in st.replicas.values() if inflight[r.slot] > 0}
        for m in sorted({r.model for r in st.replicas.values() if r.stop_stage == 0}):
            if m not in busy and waiting[m] <= 0:
                self.unload(m, why)

    def unload(self, m: int, why: str) -> None:
        """Stop every replica of model ``m``; a loading one is stopped at
        once (``exit``, then SIGKILL after ``unload_grace``) instead of
        after ``stop-timeout``, since it serves nothing yet."""
        st = self.state
        st.models[m].requested_ns = 0
        for r in list(st.replicas.values()):
            if r.model == m and r.stop_stage == 0:
                loading = r.status == L.ReplicaStatus.LOADING
                self.replicas.stop(r, why, self.cfg.unload_grace if loading else None)


def _noop(signum, frame) -> None:
    pass


def _seconds(s: float) -> str:
    return "forever" if s == float("inf") else f"{s:g} s"
