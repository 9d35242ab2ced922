"""The supervisor: one ``select.poll()`` loop that owns every child.

Shaped like gunicorn's arbiter: each turn waits on one poll (child pipes,
the command queue's descriptor, the signal wake-up pipe, probe sockets)
with a timeout, handles signals and commands, reads child output, then runs
small named steps: ``reap`` (exited children), ``escalate`` (stops and load
deadlines past due), probes, ``schedule`` (desired vs actual: loads and
evictions, :mod:`.reconcile`), ``publish`` (shared memory, generation,
proxy wake-ups, :mod:`.publish`). No threads.

This module holds the loop, setup and teardown and signals; the proxies'
commands through the queue are :mod:`.commands`, reloads :mod:`.reloader`
and the proxies :mod:`.proxies` (mixins of :class:`Supervisor`). What it
drives lives beside it: :mod:`.state` (the shared books and records),
:mod:`.children` (processes and their pipes), :mod:`.replicas` (instances
and ``cmd`` replicas, stop and escalation), :mod:`.spares`,
:mod:`.remotes` (``upstream`` replicas), :mod:`.measure`, :mod:`.reconcile`
and :mod:`.publish`.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import time
from collections.abc import Callable

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
from .commands import QueueCommands
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
from .reloader import Reloader
from .remotes import Remotes
from .replicas import Replicas, backoff_s, load_budget_s
from .state import State
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


class Supervisor(ProxyChildren, QueueCommands, Reloader):
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

    # ---- signals -------------------------------------------------------------
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


def _noop(signum, frame) -> None:
    pass
