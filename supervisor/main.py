"""The supervisor: one ``select.poll()`` loop that owns every child.

Shaped like gunicorn's arbiter: each turn waits on one poll (child pipes,
the command queue's descriptor, the signal wake-up pipe) with a timeout,
handles signals, reads child output, then runs small named steps:
``reap`` (exited children), ``escalate`` (stops and load deadlines past
due), ``schedule`` (desired vs actual: loads and evictions), ``publish``
(shared memory, generation, proxy wake-ups). No threads.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import orjson
import posix_ipc

from ..shm import layout as L
from ..shm.segment import Segment
from ..shm.seqlock import write_fields
from .memory import Amounts, Ledger, add, fmt, rss_of
from .probe import FIRST_INTERVAL_S, Probe, next_interval
from .registry import Registry, env_for_instance, instance_argv
from .scheduler import MemoryView, ModelView, ReplicaView, Scheduler, Spawn, Stop

log = logging.getLogger("ggmux.supervisor")

NS = 1_000_000_000
GiB = 1 << 30


@dataclass(slots=True)
class Config:
    """Options of ``ggmux serve`` the supervisor needs (seconds, counts)."""

    host: str = "127.0.0.1"
    port: int = 8080
    proxies: int = 1
    models_max: int = 4
    stop_timeout: float = 10.0
    term_timeout: float = 5.0  # SIGTERM -> SIGKILL
    load_timeout: float | None = None  # None: 5 min + 20 s per GiB, capped at 6 h
    load_wait: float = 300.0
    replica_slots: int = 0  # 0: derived from models_max
    shm_name: str = ""
    mq_name: str = ""
    proxy_args: list[str] = field(default_factory=list)
    proxy_env: dict[str, str] = field(default_factory=dict)  # API keys: proxies only
    memory_margin: int = 0  # bytes that must stay free on every device after a load
    host_memory: int | None = None  # replace the host's memory size (tests, containers)
    ttl: float | None = None  # default idle unload, seconds after the last request ended
    sleep_idle: float | None = None  # idle seconds before an instance sleeps
    measure_concurrency: int = 2
    spares: int = 1  # instance processes kept started and imported ahead of a load
    spare_delay: float = 3.0  # after a load, a new spare waits for idle, or this long
    models_headroom: int = 64  # model rows kept free for models a reload adds
    unload_grace: float = 0.5  # a loading replica being unloaded: exit, then SIGKILL after this


def load_budget_s(size_bytes: int, override: float | None) -> float:
    """Load deadline (s): ``override``, else 300 + 20 per GiB, capped at 6 h.

    Large checkpoints on slow disks take minutes to map; llama.cpp's router
    has no deadline at all, so a hung load holds its waiters forever.
    """
    if override is not None:
        return override
    return min(300.0 + 20.0 * size_bytes / GiB, 6 * 3600.0)


def backoff_s(failures: int) -> float:
    """Delay before the next load after ``failures`` failed loads in a row:
    1 s doubling, capped at 5 min."""
    return min(2.0 ** max(0, failures - 1), 300.0)


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


class Child:
    """A child process with non-blocking stdout/stderr line buffers."""

    __slots__ = ("err", "out", "proc", "stdin_fd", "tag")

    def __init__(self, proc: subprocess.Popen, tag: str) -> None:
        self.proc = proc
        self.tag = tag
        self.out = b""
        self.err = b""
        self.stdin_fd = proc.stdin.fileno() if proc.stdin is not None else -1

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: bytes) -> bool:
        """Write a command line to the child's stdin without blocking."""
        if self.stdin_fd < 0:
            return False
        try:
            os.write(self.stdin_fd, line)
            return True
        except (BlockingIOError, BrokenPipeError, OSError):
            return False

    def close_stdin(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.stdin_fd = -1


@dataclass(slots=True)
class Replica:
    slot: int
    model: int
    child: Child
    incarnation: int
    port: int
    status: int = L.ReplicaStatus.LOADING
    started_ns: int = 0
    ready_ns: int = 0
    deliberate: bool = False  # stop was asked for (eviction, unload, shutdown)
    stop_ns: int = 0  # when `exit` was sent
    stop_stage: int = 0  # 0 running, 1 exit sent, 2 SIGTERM sent, 3 SIGKILL sent
    deadline_ns: int = 0  # load deadline
    error: str = ""
    progress: float = 0.0
    held: Amounts = field(default_factory=dict)  # ledger bytes per device
    kill_after: float = 0.0  # seconds from `exit` to SIGTERM (stop-timeout)
    sleep_sent: bool = False
    wake_sent: bool = False
    kind: str = "instance"  # "instance" (speaks the state protocol) or "cmd" (probed)
    probe: Probe | None = None
    probe_interval: float = 0.0
    next_probe_ns: int = 0
    kill_at_ns: int = 0  # cmd instances: SIGKILL after this (stop-timeout after SIGTERM)


@dataclass(slots=True)
class Remote:
    """An ``upstream`` replica: a remote OpenAI-compatible server that is
    never loaded or evicted, only health-checked (every ``interval`` s)."""

    slot: int
    model: int
    host: str
    port: int
    path: str  # health path ("" = TCP connect only)
    incarnation: int
    healthy: bool = False
    probe: Probe | None = None
    next_probe_ns: int = 0
    fails: int = 0
    reported: bool = False  # the first failure was logged


@dataclass(slots=True)
class ModelRuntime:
    """Supervisor-side state of one model (published to the models table)."""

    failures: int = 0
    retry_at_ns: int = 0
    failed: bool = False
    exit_code: int = 0
    error: str = ""
    loads: int = 0
    evictions: int = 0
    load_ns_total: int = 0
    last_ready_ns: int = 0
    mem_min: Amounts | None = None  # measured; None until measured or unmeasurable
    mem_max: Amounts | None = None
    measure: str = "pending"  # pending | running | done | failed
    requested_ns: int = 0  # an explicit load (POST /models/load, load-on-startup) pending


class Supervisor:
    """See the module docstring. ``run()`` returns the process exit code."""

    def __init__(
        self, cfg: Config, registry: Registry, rebuild: Callable[[], Registry] | None = None
    ) -> None:
        self.cfg = cfg
        self.registry = registry
        self.rebuild = rebuild  # rescans every source: SIGHUP, GET /models?reload=1
        self.removed: set[int] = set()  # models gone from every source (rows are kept)
        self.stale: set[int] = set()  # replica slots running an outdated configuration
        self.models = [ModelRuntime() for _ in registry.entries]
        nslots = cfg.replica_slots or max(8, 2 * cfg.models_max + 4)
        self.ledger = Ledger(margin=cfg.memory_margin, host_total=cfg.host_memory)
        self.sizes = L.Sizes(
            models=len(registry) + cfg.models_headroom,
            replicas=nslots,
            proxies=cfg.proxies,
            devices=len(self.ledger.devices),
        )
        self.measuring: dict[int, Child] = {}  # model -> measure child
        self.spares: list[tuple[Child, int]] = []  # (child, port) waiting for `load`
        self.remotes: dict[int, Remote] = {}  # slot -> upstream replica
        self.probes: dict[int, tuple[Probe, object]] = {}  # fd -> (probe, replica or remote)
        self.scheduler = Scheduler(cfg.models_max)
        self.replicas: dict[int, Replica] = {}  # slot -> replica
        self.proxies: dict[int, Child] = {}  # proxy index -> child
        self.proxy_ready: set[int] = set()
        self._serving = False  # every proxy listened once
        self.startup_failed = False
        self.fds: dict[int, tuple[Child, str]] = {}
        self.poller = select.poll()
        self.incarnations = 0
        self.stopping_all = False
        self.dirty = True
        self.errors_dirty = False
        self.seg: Segment | None = None
        self.mq: posix_ipc.MessageQueue | None = None
        self._sig_r = self._sig_w = -1
        self.python = sys.executable

    # ---- setup / teardown ------------------------------------------------
    def setup(self) -> None:
        """Create the segment and queue, start the proxies.

        Raises :class:`StartupError` when the port is taken or another live
        ggmux owns the segment name: with ``SO_REUSEPORT`` a second server
        would otherwise silently share the port with the first.
        """
        cfg = self.cfg
        _check_port_free(cfg.host, cfg.port)
        _check_no_live_owner(cfg.shm_name)
        self.seg = Segment.create(cfg.shm_name, self.sizes)
        self.seg.header[L.H_SUPERVISOR_PID] = os.getpid()
        self.seg.header[L.H_MODELS_MAX] = cfg.models_max
        self._publish_registry()
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
        for i, e in enumerate(self.registry.entries):
            if e.load_on_startup:
                self.models[i].requested_ns = now + i  # keep registry order
        self._add_remotes()
        self._publish_registry()  # with the remotes' addresses
        self._calibrate()
        self._publish_all()

    def teardown(self) -> None:
        """Stop every child (exit, then SIGTERM, then SIGKILL) and remove the
        segment and queue. Safe to call twice."""
        self.stopping_all = True
        for r in list(self.replicas.values()):
            if r.stop_stage == 0:
                self._stop(r, "server shutting down")
        for c in self.proxies.values():
            c.close_stdin()  # EOF: the proxy exits
        for c in self.measuring.values():
            c.close_stdin()
        for c, _ in self.spares:
            c.close_stdin()
        deadline = time.monotonic() + self.cfg.stop_timeout + self.cfg.term_timeout
        while self.replicas or self.proxies or self.measuring or self.spares:
            self._drain_signals()
            self._reap()
            self._escalate(time.monotonic_ns())
            if time.monotonic() > deadline:
                for c in [*(r.child for r in self.replicas.values()), *self.proxies.values(),
                          *self.measuring.values(), *(c for c, _ in self.spares)]:
                    _kill(c.proc, signal.SIGKILL)
            if self.replicas or self.proxies or self.measuring or self.spares:
                self._poll_once(20)
        if self.seg is not None:
            self.seg.unlink()
            self.seg = None
        if self.mq is not None:
            try:
                self.mq.close()
                self.mq.unlink()
            except posix_ipc.ExistentialError:
                pass
            self.mq = None
        log.info("stopped")

    # ---- main loop ---------------------------------------------------------
    def run(self) -> int:
        self.setup()
        try:
            if not self.wait_proxies_ready():
                log.error("proxies did not start listening on %s:%d", self.cfg.host, self.cfg.port)
                return 1
            self._serving = True
            log.info(
                "listening on http://%s:%d (%d proxies, models_max %d, %d models)",
                self.cfg.host, self.cfg.port, self.cfg.proxies, self.cfg.models_max,
                len(self.registry),
            )
            while not self.stopping_all:
                busy = bool(self.replicas) or self._any_waiters()
                self._poll_once(50 if busy else 250)
                self.step()
        finally:
            self.teardown()
        return 1 if self.startup_failed else 0

    def step(self) -> None:
        """One turn after the poll: the named idempotent steps."""
        self._drain_signals()
        self._drain_queue()
        self._reap()
        now = time.monotonic_ns()
        self._escalate(now)
        self._probe_step(now)
        if not self.stopping_all:
            self._schedule(now)
        self._publish_if_dirty()

    def _poll_once(self, timeout_ms: int) -> None:
        try:
            events = self.poller.poll(timeout_ms)
        except InterruptedError:
            return
        for fd, ev in events:
            owner = self.fds.get(fd)
            if owner is None:
                pr = self.probes.get(fd)
                if pr is not None:
                    pr[0].on_event()
                    if pr[0].done:
                        self._unregister_probe(fd)
                continue
            child, stream = owner
            self._read_child(fd, child, stream)

    # ---- signals and commands ----------------------------------------------
    def _drain_signals(self) -> None:
        try:
            data = os.read(self._sig_r, 512)
        except (BlockingIOError, OSError):
            return
        for signum in data:
            if signum in (signal.SIGTERM, signal.SIGINT):
                if not self.stopping_all:
                    log.info("received %s: stopping", signal.Signals(signum).name)
                self.stopping_all = True
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
        op = cmd.get("op")
        if op == "want":
            return  # demand itself is read from the waiters table each tick
        if op == "reload":
            self.reload("GET /models?reload=1")
            return
        m = cmd.get("model")
        if not isinstance(m, int) or not 0 <= m < len(self.registry):
            log.warning("command %r for unknown model %r", op, m)
            return
        if op == "load":
            self.load(m, "requested by POST /models/load")
        elif op == "unload":
            self.unload(m, "requested by POST /models/unload")
        else:
            log.warning("unknown command %r", op)

    def reload(self, why: str) -> None:
        """Rescan every source (llama.cpp router's reload, llama-swap's config
        reload). New models appear; removed ones stop being listed or routed
        and unload once idle; a model whose configuration changed keeps
        serving on its old replicas until they are idle, then reloads on the
        next request. Nothing loads merely because of a reload. A source that
        fails to parse leaves everything as it was (the error is logged)."""
        if self.rebuild is None:
            log.warning("%s: no sources to rescan", why)
            return
        try:
            new = self.rebuild()
        except (OSError, ValueError) as e:
            log.error("%s: reload failed, keeping the current models: %s", why, e)
            return
        old = self.registry
        entries = list(old.entries)
        added, changed, removed = [], [], []
        seen = set()
        for e in new.entries:
            i = old.by_name.get(e.name)
            if i is None:
                if len(entries) >= self.sizes.models:
                    log.error("%s: no room for model %s (raise the model-row headroom)", why, e.name)
                    continue
                entries.append(e)
                self.models.append(ModelRuntime())
                added.append(e.name)
                seen.add(len(entries) - 1)
                continue
            seen.add(i)
            if i in self.removed:
                self.removed.discard(i)
                added.append(e.name)
            if not _same_config(e, entries[i]):
                entries[i] = e
                changed.append(e.name)
                self.models[i].measure = "pending"
                self.models[i].mem_min = self.models[i].mem_max = None
                self.stale |= {r.slot for r in self.replicas.values() if r.model == i}
        for i, e in enumerate(entries):
            if i not in seen and i not in self.removed:
                self.removed.add(i)
                removed.append(e.name)
                self.models[i].requested_ns = 0
                self.stale |= {r.slot for r in self.replicas.values() if r.model == i}
        try:
            self.registry = Registry(entries)
        except ValueError as e:
            log.error("%s: reload failed, keeping the current models: %s", why, e)
            return
        self._add_remotes()
        for slot, rm in list(self.remotes.items()):
            if rm.model in self.removed:
                del self.remotes[slot]
        log.info("%s: reloaded models: %d added %s, %d changed %s, %d removed %s", why,
                 len(added), added, len(changed), changed, len(removed), removed)
        self.errors_dirty = True

    def load(self, m: int, why: str) -> None:
        """Queue an explicit load of model ``m`` (no-op when it is running)."""
        if any(r.model == m and r.stop_stage == 0 for r in self.replicas.values()):
            return
        rt = self.models[m]
        if rt.requested_ns == 0:
            rt.requested_ns = time.monotonic_ns()
            log.info("load of %s queued: %s", self._name(m), why)

    def unload(self, m: int, why: str) -> None:
        """Stop every replica of model ``m``; a loading one is stopped at
        once (``exit``, then SIGKILL after ``unload_grace``) instead of
        after ``stop-timeout``, since it serves nothing yet."""
        self.models[m].requested_ns = 0
        for r in list(self.replicas.values()):
            if r.model == m and r.stop_stage == 0:
                loading = r.status == L.ReplicaStatus.LOADING
                self._stop(r, why, self.cfg.unload_grace if loading else None)

    # ---- child output ----------------------------------------------------------
    def _register_child(self, child: Child, stdout: bool = True, stderr: bool = True) -> None:
        for stream, f in (("out", child.proc.stdout if stdout else None),
                          ("err", child.proc.stderr if stderr else None)):
            if f is None:
                continue
            fd = f.fileno()
            fl = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
            self.fds[fd] = (child, stream)
            self.poller.register(fd, select.POLLIN | select.POLLHUP)

    def _unregister_child(self, child: Child) -> None:
        for f in (child.proc.stdout, child.proc.stderr):
            if f is None or f.closed:
                continue
            fd = f.fileno()
            # read what is left so no log line or state line is lost
            if fd in self.fds:
                self._read_child(fd, child, self.fds[fd][1])
            if fd in self.fds:
                del self.fds[fd]
                self.poller.unregister(fd)
            f.close()
        child.close_stdin()

    def _read_child(self, fd: int, child: Child, stream: str) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                data = b""
            if not data:
                if fd in self.fds:
                    del self.fds[fd]
                    self.poller.unregister(fd)
                return
            if stream == "err":
                buf = child.err + data
                *lines, child.err = buf.split(b"\n")
                for line in lines:
                    if line:
                        log.info("[%s] %s", child.tag, line.decode("utf-8", "replace"))
            else:
                buf = child.out + data
                *lines, child.out = buf.split(b"\n")
                for line in lines:
                    self._on_stdout_line(child, line)

    def _on_stdout_line(self, child: Child, line: bytes) -> None:
        if child.tag.startswith("proxy"):
            if line.strip() == b"ready":
                idx = int(child.tag.split("-", 1)[1])
                self.proxy_ready.add(idx)
            return
        if not line.startswith(b"state:"):
            log.warning("[%s] stray stdout: %r", child.tag, line[:200])
            return
        try:
            msg = orjson.loads(line[6:])
        except orjson.JSONDecodeError:
            log.warning("[%s] bad state line: %r", child.tag, line[:200])
            return
        if child.tag.startswith("measure:"):
            m = next((i for i, c in self.measuring.items() if c is child), None)
            if m is not None and msg.get("state") == "measured":
                rt = self.models[m]
                rt.mem_min = {k: int(v) for k, v in (msg.get("min") or {}).items()}
                rt.mem_max = {k: int(v) for k, v in (msg.get("max") or {}).items()}
                rt.measure = "done"
                log.info("measured %s: min %s, max %s", self._name(m), fmt(rt.mem_min),
                         fmt(rt.mem_max))
                self.dirty = True
            return
        rep = next((r for r in self.replicas.values() if r.child is child), None)
        if rep is None:
            return  # a spare announcing itself
        self._on_state(rep, msg)

    def _on_state(self, rep: Replica, msg: dict) -> None:
        state = msg.get("state")
        now = time.monotonic_ns()
        m = self.models[rep.model]
        if state == "loading":
            rep.progress = float(msg.get("progress") or 0.0)
            if rep.status == L.ReplicaStatus.SLEEPING:  # woken
                rep.status = L.ReplicaStatus.LOADING
                rep.started_ns = now
                rep.held = dict(m.mem_min or rep.held)
            self.dirty = True
        elif state == "sleeping":
            if rep.stop_stage:
                return
            rep.status = L.ReplicaStatus.SLEEPING
            rep.sleep_sent = rep.wake_sent = False
            rep.held = _amounts(msg.get("effective"))
            log.info("%s (slot %d) is asleep, holding %s", self._name(rep.model), rep.slot,
                     fmt(rep.held))
            self._calibrate()
            self.dirty = True
        elif state == "ready":
            if rep.stop_stage:
                return
            rep.status = L.ReplicaStatus.READY
            rep.ready_ns = now
            rep.progress = 1.0
            rep.sleep_sent = rep.wake_sent = False
            eff = _amounts(msg.get("effective"))
            if sum(eff.values()) > 0:
                rep.held = eff
            self._calibrate()
            m.requested_ns = 0
            m.loads += 1
            m.load_ns_total += now - rep.started_ns
            m.last_ready_ns = now
            m.failures = 0
            m.retry_at_ns = 0
            m.failed = False
            m.exit_code = 0
            if m.error:
                m.error = ""
                self.errors_dirty = True
            log.info(
                "model %s ready on port %d in %.3f s (pid %d)",
                self._name(rep.model), rep.port, (now - rep.started_ns) / NS, rep.child.pid,
            )
            self.dirty = True
        elif state == "error":
            rep.error = str(msg.get("error") or "load failed")
        else:
            log.debug("state %r from %s", state, rep.child.tag)

    # ---- spawning --------------------------------------------------------------
    def _spawn_proxy(self, idx: int) -> None:
        seg = self.seg
        seg.counters[idx] = 0  # a dead proxy's rows are zeroed before its replacement starts
        seg.waiters[idx] = 0
        cfg = self.cfg
        argv = [
            self.python, "-m", "ggmux.proxy", "--index", str(idx), "--shm", cfg.shm_name,
            "--mq", cfg.mq_name, "--host", cfg.host, "--port", str(cfg.port),
            "--load-wait", str(cfg.load_wait), *cfg.proxy_args,
        ]
        # proxies log to our stderr directly; stdout says "ready"
        child = self._start_child(argv, f"proxy-{idx}", env={**os.environ, **cfg.proxy_env},
                                  log_stderr=False)
        self.proxies[idx] = child
        log.debug("started proxy %d (pid %d)", idx, child.pid)

    def wait_proxies_ready(self, timeout: float = 30.0) -> bool:
        """Block (polling) until every proxy listens; False on timeout."""
        deadline = time.monotonic() + timeout
        while len(self.proxy_ready) < self.cfg.proxies and time.monotonic() < deadline:
            self._poll_once(50)
            self.step()
            if self.stopping_all:
                return False
        return len(self.proxy_ready) >= self.cfg.proxies

    def _free_slot(self) -> int | None:
        inflight = self.seg.counters[:, :, L.C_IN_FLIGHT].sum(axis=0)
        for s in range(self.sizes.replicas):
            if s not in self.replicas and s not in self.remotes and inflight[s] <= 0:
                return s
        return None

    def _spawn_instance(self, model: int, reason: str) -> None:
        entry = self.registry.entries[model]
        slot = self._free_slot()
        if slot is None:
            log.warning("no free replica slot for %s", entry.name)
            return
        if entry.kind == "cmd":
            self._spawn_cmd(model, slot, reason)
            return
        child = None
        # a spare was started before its model was known: a model with its own
        # `env` needs a process started with it
        while self.spares and entry.kind in ("llama", "fake") and not entry.env:
            spare, port = self.spares.pop(0)
            line = orjson.dumps({
                "model": entry.path, "name": entry.name, "ctx_size": entry.ctx_size,
                "threads": entry.threads, "n_gpu_layers": entry.n_gpu_layers,
                "fake": entry.kind == "fake", "mmproj": entry.mmproj,
                "llama_args": entry.extra_args,
            })
            if spare.proc.poll() is None and spare.send(b"load " + line + b"\n"):
                child = spare
                child.tag = f"{entry.name}#{slot}"
                break
        if child is None:
            argv = instance_argv(entry, -1, self.python)
            child, port = self._spawn_with_socket(argv, f"{entry.name}#{slot}",
                                                  env_for_instance(entry))
        self.incarnations += 1
        now = time.monotonic_ns()
        budget = load_budget_s(entry.size_bytes, self.cfg.load_timeout)
        rep = Replica(
            slot=slot, model=model, child=child, incarnation=self.incarnations, port=port,
            started_ns=now, deadline_ns=now + int(budget * NS),
            held=dict(self.models[model].mem_min or {}),
            kill_after=entry.stop_timeout,
        )
        self.replicas[slot] = rep
        log.info("loading %s in slot %d (pid %d, port %d): %s", entry.name, slot, child.pid,
                 port, reason)
        self.dirty = True

    def _spawn_cmd(self, model: int, slot: int, reason: str) -> None:
        """Start a ``cmd`` instance: any command serving an OpenAI-compatible
        API on ``${PORT}`` (llama-swap's ``cmd``). The port is chosen here
        (bound to port 0 and released just before the spawn: a command
        cannot take a passed descriptor); readiness is probed on
        ``check_endpoint``; stdout and stderr go to the log."""
        entry = self.registry.entries[model]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        line = entry.cmd.replace("${PORT}", str(port)).replace("${MODEL_ID}", entry.name)
        try:
            argv = shlex.split(line)
            # stdin is a pipe we never write: a command that watches it sees EOF
            # when the supervisor dies (ggmux's own instance does)
            child = self._start_child(argv, f"{entry.name}#{slot}", env=env_for_instance(entry))
        except (OSError, ValueError) as e:
            m = self.models[model]
            m.failed, m.failures = True, m.failures + 1
            m.retry_at_ns = time.monotonic_ns() + int(backoff_s(m.failures) * NS)
            m.error = f"cannot start {line!r}: {e}"
            self.errors_dirty = True
            log.error("%s: %s", entry.name, m.error)
            return
        child.stdin_fd = -1  # never written: `exit` is not part of a command's protocol
        self.incarnations += 1
        now = time.monotonic_ns()
        budget = load_budget_s(entry.size_bytes, self.cfg.load_timeout)
        self.replicas[slot] = Replica(
            slot=slot, model=model, child=child, incarnation=self.incarnations, port=port,
            started_ns=now, deadline_ns=now + int(budget * NS),
            held=dict(self.models[model].mem_min or {}), kill_after=entry.stop_timeout,
            kind="cmd", probe_interval=FIRST_INTERVAL_S,
            next_probe_ns=now + int(FIRST_INTERVAL_S * NS),
        )
        log.info("starting %s in slot %d (pid %d, port %d): %s: %s", entry.name, slot,
                 child.pid, port, reason, line)
        self.dirty = True

    # ---- probes -----------------------------------------------------------------------
    def _start_probe(self, host: str, port: int, path: str, owner, now: int) -> Probe:
        pr = Probe(host, port, path, now)
        if not pr.done:
            self.probes[pr.fileno()] = (pr, owner)
            self.poller.register(pr.fileno(), pr.events())
        return pr

    def _unregister_probe(self, fd: int) -> None:
        if self.probes.pop(fd, None) is not None:
            try:
                self.poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def _probe_step(self, now: int) -> None:
        """Readiness of ``cmd`` instances, health of ``upstream`` replicas."""
        for fd, (pr, _) in list(self.probes.items()):
            if pr.expired(now):
                self._unregister_probe(fd)
            elif pr.state == "reading":
                self.poller.modify(fd, pr.events())
        for r in self.replicas.values():
            if r.kind != "cmd" or r.status != L.ReplicaStatus.LOADING or r.stop_stage:
                continue
            if r.probe is not None and r.probe.done:
                if r.probe.ok:
                    self._on_state(r, {"state": "ready"})
                    r.probe = None
                    continue
                r.probe = None
                r.probe_interval = next_interval(r.probe_interval)
                r.next_probe_ns = now + int(r.probe_interval * NS)
            if r.probe is None and now >= r.next_probe_ns:
                path = self.registry.entries[r.model].check_endpoint
                r.probe = self._start_probe("127.0.0.1", r.port, path, r, now)
        for rm in self.remotes.values():
            if rm.probe is not None and rm.probe.done:
                ok = rm.probe.ok
                if ok != rm.healthy:
                    log.log(logging.INFO if ok else logging.WARNING, "upstream %s:%d for %s is %s%s",
                            rm.host, rm.port, self._name(rm.model), "healthy" if ok else "unhealthy",
                            "" if ok else f" ({rm.probe.why})")
                    rm.healthy = ok
                    self.dirty = True
                if not ok and rm.fails == 0 and not rm.healthy and not rm.reported:
                    log.warning("upstream %s:%d for %s is not answering (%s)", rm.host,
                                rm.port, self._name(rm.model), rm.probe.why)
                    rm.reported = True
                rm.fails = 0 if ok else rm.fails + 1
                rm.probe = None
                delay = 5.0 if ok else min(5.0, 0.1 * 2 ** min(rm.fails, 6))
                rm.next_probe_ns = now + int(delay * NS)
            if rm.probe is None and now >= rm.next_probe_ns:
                rm.probe = self._start_probe(rm.host, rm.port, rm.path, rm, now)

    def _add_remotes(self) -> None:
        """One permanent replica per model with an ``upstream`` URL."""
        from urllib.parse import urlsplit

        for i, e in enumerate(self.registry.entries):
            if not e.upstream or any(rm.model == i for rm in self.remotes.values()):
                continue
            u = urlsplit(e.upstream)
            port = u.port or (443 if u.scheme == "https" else 80)
            slot = self._free_slot()
            if slot is None:
                log.warning("no replica slot for upstream %s", e.upstream)
                continue
            self.incarnations += 1
            path = "" if u.scheme == "https" or not e.check_endpoint else (
                u.path.rstrip("/") + e.check_endpoint if e.check_endpoint.startswith("/") else
                e.check_endpoint)
            self.remotes[slot] = Remote(slot, i, u.hostname or "127.0.0.1", port, path,
                                        self.incarnations)

    def _start_child(
        self, argv: list[str], tag: str, *, env: dict[str, str] | None = None,
        pass_fds: tuple[int, ...] = (), log_stderr: bool = True,
    ) -> Child:
        """Start a child: stdin a pipe (commands; EOF when we die), stdout
        (and stderr, unless inherited) in the poll set, PR_SET_PDEATHSIG and
        SIGINT/SIGHUP ignored (:func:`_die_with_parent`). Raises ``OSError``
        when it cannot be started."""
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if log_stderr else None, env=env, pass_fds=pass_fds,
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads here
        )
        child = Child(proc, tag)
        os.set_blocking(child.stdin_fd, False)
        self._register_child(child, stdout=True, stderr=log_stderr)
        return child

    def _spawn_with_socket(
        self, argv: list[str], tag: str, env: dict[str, str] | None = None
    ) -> tuple[Child, int]:
        """Start an instance-protocol child with a listening socket bound here
        (127.0.0.1, port 0) and passed as ``--fd``, so no other process can
        take its port between bind and listen. ``argv``'s ``--fd`` value is
        replaced by the descriptor."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        argv = list(argv)
        argv[argv.index("--fd") + 1] = str(sock.fileno())
        try:
            child = self._start_child(argv, tag, env=env, pass_fds=(sock.fileno(),))
        finally:
            sock.close()
        return child, port

    def _spare_step(self) -> None:
        """Keep ``spares`` instance processes started and imported, but start
        one only while nothing loads: on a small machine a spare's imports
        would slow the load it is meant to speed up."""
        if len(self.spares) >= self.cfg.spares or self.stopping_all:
            return
        if any(r.status == L.ReplicaStatus.LOADING for r in self.replicas.values()):
            return
        # nor right after a load while requests are served (the one that caused
        # the load among them): a spare's imports (~0.5 s of CPU) would delay
        # their first tokens
        since = time.monotonic_ns() - max((m.last_ready_ns for m in self.models), default=0)
        busy = bool(self.seg.counters[:, :, L.C_IN_FLIGHT].any())
        if since < self.cfg.spare_delay * NS and (busy or since < NS // 4):
            return
        if not any(e.kind in ("llama", "fake") for e in self.registry.entries):
            return
        argv = [self.python, "-m", "ggmux.instance", "--spare", "--fd", "-1"]
        child, port = self._spawn_with_socket(argv, "spare")
        self.spares.append((child, port))

    def _spawn_measure(self, model: int) -> None:
        """Start a ``measure`` child: it reports the model's min/max memory."""
        entry = self.registry.entries[model]
        argv = instance_argv(entry, -1, self.python)
        i = argv.index("--fd")
        del argv[i : i + 2]
        argv.append("--measure")
        self.measuring[model] = self._start_child(argv, f"measure:{entry.name}",
                                                  env=env_for_instance(entry))
        self.models[model].measure = "running"

    def _measure_step(self) -> None:
        """Keep up to ``measure_concurrency`` measure children running,
        wanted models first."""
        if len(self.measuring) >= self.cfg.measure_concurrency:
            return
        pending = [i for i, m in enumerate(self.models) if m.measure == "pending"
                   and self.registry.entries[i].kind in ("llama", "fake")]
        if not pending:
            return
        counts, _ = self._demand()
        pending.sort(key=lambda i: (-int(counts[i]) - (self.models[i].requested_ns > 0), i))
        for i in pending[: self.cfg.measure_concurrency - len(self.measuring)]:
            self._spawn_measure(i)

    # ---- stopping ----------------------------------------------------------------
    def _stop(self, rep: Replica, reason: str, kill_after: float | None = None) -> None:
        """Ask a replica to exit; :meth:`_escalate` follows up with signals
        after ``kill_after`` seconds (default: its stop-timeout)."""
        if rep.stop_stage:
            return
        if kill_after is not None:
            rep.kill_after = kill_after
        rep.deliberate = True
        rep.stop_stage = 1
        rep.stop_ns = time.monotonic_ns()
        was_loading = rep.status == L.ReplicaStatus.LOADING
        rep.status = L.ReplicaStatus.STOPPING
        if rep.probe is not None:
            self._unregister_probe(rep.probe.fileno())
            rep.probe = None
        if rep.kind == "cmd":
            # any command: no stdin protocol; cmd-stop (llama-swap's cmdStop) or
            # SIGTERM, then SIGKILL after stop-timeout
            entry = self.registry.entries[rep.model]
            rep.stop_stage = 2
            rep.kill_at_ns = rep.stop_ns + int(rep.kill_after * NS)
            if entry.cmd_stop:
                line = (entry.cmd_stop.replace("${PID}", str(rep.child.pid))
                        .replace("${PORT}", str(rep.port)).replace("${MODEL_ID}", entry.name))
                try:
                    subprocess.Popen(shlex.split(line), stdin=subprocess.DEVNULL,
                                     env=env_for_instance(entry))
                except (OSError, ValueError) as e:
                    log.error("cmd-stop %r failed: %s; SIGTERM instead", line, e)
                    _kill(rep.child.proc, signal.SIGTERM)
            else:
                _kill(rep.child.proc, signal.SIGTERM)
        elif not rep.child.send(b"exit\n"):
            _kill(rep.child.proc, signal.SIGTERM)
            rep.stop_stage = 2
        log.info(
            "stopping %s (slot %d, pid %d%s): %s", self._name(rep.model), rep.slot,
            rep.child.pid, ", was loading" if was_loading else "", reason,
        )
        self.dirty = True

    def _escalate(self, now: int) -> None:
        cfg = self.cfg
        for rep in list(self.replicas.values()):
            if rep.stop_stage == 1 and now - rep.stop_ns > rep.kill_after * NS:
                log.warning("%s did not exit within %.1f s of 'exit': SIGTERM",
                            rep.child.tag, rep.kill_after)
                _kill(rep.child.proc, signal.SIGTERM)
                rep.stop_stage = 2
            elif rep.stop_stage == 2 and (
                now > rep.kill_at_ns if rep.kill_at_ns
                else now - rep.stop_ns > (rep.kill_after + cfg.term_timeout) * NS
            ):
                log.warning("%s ignored SIGTERM: SIGKILL", rep.child.tag)
                _kill(rep.child.proc, signal.SIGKILL)
                rep.stop_stage = 3
            elif rep.status == L.ReplicaStatus.LOADING and now > rep.deadline_ns:
                entry = self.registry.entries[rep.model]
                budget = load_budget_s(entry.size_bytes, cfg.load_timeout)
                rule = ("--load-timeout" if cfg.load_timeout is not None else
                        f"5 min + 20 s per GiB of the {entry.size_bytes / GiB:.2f} GiB "
                        "checkpoint; raise --load-timeout")
                rep.error = f"load did not finish within {budget:.0f} s ({rule})"
                log.error("%s: %s", entry.name, rep.error)
                rep.deliberate = False  # counts as a failed load
                rep.stop_stage = 3
                rep.status = L.ReplicaStatus.STOPPING
                _kill(rep.child.proc, signal.SIGKILL)
                self.dirty = True

    # ---- reaping -------------------------------------------------------------------
    def _reap(self) -> None:
        for idx, child in list(self.proxies.items()):
            code = child.proc.poll()
            if code is None:
                continue
            self._unregister_child(child)
            del self.proxies[idx]
            self.proxy_ready.discard(idx)
            if not self.stopping_all:
                if idx not in self.proxy_ready and not self._serving:
                    # it never listened: a configuration problem, not a crash
                    log.error("proxy %d exited with code %s before listening", idx, code)
                    self.stopping_all = True
                    self.startup_failed = True
                    continue
                log.error("proxy %d exited with code %s: restarting", idx, code)
                self._spawn_proxy(idx)
        for spare in list(self.spares):
            code = spare[0].proc.poll()
            if code is not None:
                self._unregister_child(spare[0])
                self.spares.remove(spare)
                if not self.stopping_all:
                    log.warning("spare instance exited with code %s", code)
        for m, child in list(self.measuring.items()):
            code = child.proc.poll()
            if code is None:
                continue
            self._unregister_child(child)
            del self.measuring[m]
            rt = self.models[m]
            if rt.measure != "done":
                rt.measure = "failed"
                log.warning("could not measure %s (exit code %s): its loads skip the memory "
                            "check", self._name(m), code)
        for slot, rep in list(self.replicas.items()):
            code = rep.child.proc.poll()
            if code is None:
                continue
            self._unregister_child(rep.child)
            del self.replicas[slot]
            self._on_replica_exit(rep, code)
            self._calibrate()
            self.dirty = True

    def _on_replica_exit(self, rep: Replica, code: int) -> None:
        m = self.models[rep.model]
        name = self._name(rep.model)
        was_loading = rep.ready_ns == 0
        if rep.deliberate:
            log.info("%s (slot %d) stopped, exit code %d", name, rep.slot, code)
            if not was_loading and not self.stopping_all:
                m.evictions += 1
            return
        m.failed = True
        m.exit_code = code
        m.requested_ns = 0
        if was_loading:
            m.failures += 1
            delay = backoff_s(m.failures)
            m.retry_at_ns = time.monotonic_ns() + int(delay * NS)
            m.error = rep.error or f"instance exited with code {code} while loading"
            log.error("%s failed to load (exit code %d, failure %d): %s; next try in %.0f s",
                      name, code, m.failures, m.error, delay)
        else:
            m.error = rep.error or f"instance crashed with exit code {code}"
            log.error("%s crashed (slot %d, exit code %d)", name, rep.slot, code)
        self.errors_dirty = True

    # ---- scheduling ------------------------------------------------------------------
    def _any_waiters(self) -> bool:
        return bool(self.seg is not None and self.seg.waiters[:, :, L.W_COUNT].any())

    def _demand(self) -> tuple[np.ndarray, np.ndarray]:
        w = self.seg.waiters
        counts = w[:, :, L.W_COUNT].sum(axis=0)
        firsts = w[:, :, L.W_FIRST_NS]
        big = np.iinfo(np.int64).max
        first = np.where(firsts > 0, firsts, big).min(axis=0)
        return counts, first

    def _schedule(self, now: int) -> None:
        """Desired vs actual: measures, wakes, loads, evictions, idle stops."""
        self._measure_step()
        counts, first = self._demand()
        for i, rt in enumerate(self.models):
            if rt.requested_ns:  # an explicit load counts as one waiter
                counts[i] += 1
                first[i] = min(int(first[i]), rt.requested_ns)
        c = self.seg.counters
        inflight = c[:, :, L.C_IN_FLIGHT].sum(axis=0)
        last_used = c[:, :, L.C_LAST_USED_NS].max(axis=0)
        for i in range(len(self.registry)):
            if int(counts[i]) != int(self.seg.models[i, L.M_WAITERS]):
                self.dirty = True
                break
        # a wanted model whose replica sleeps is woken, not loaded again
        for r in self.replicas.values():
            if (r.status == L.ReplicaStatus.SLEEPING and counts[r.model] > 0
                    and not r.wake_sent and r.stop_stage == 0):
                r.wake_sent = r.child.send(b"wake\n")
                log.info("waking %s (slot %d): %d waiting", self._name(r.model), r.slot,
                         int(counts[r.model]))
        # a model is loaded only once measured (or found unmeasurable)
        models = [
            ModelView(int(i), int(counts[i]), int(first[i]), self.models[i].retry_at_ns,
                      self.registry.entries[i].replicas)
            for i in np.flatnonzero(counts > 0)
            if self.registry.entries[i].kind != "upstream"
            and (self.models[i].measure in ("done", "failed")
                 or self.registry.entries[i].kind not in ("llama", "fake"))
        ]
        names = {L.ReplicaStatus.LOADING: "loading", L.ReplicaStatus.READY: "ready",
                 L.ReplicaStatus.SLEEPING: "sleeping", L.ReplicaStatus.STOPPING: "stopping"}
        replicas = [
            ReplicaView(r.slot, r.model, names[r.status], int(inflight[r.slot]),
                        max(int(last_used[r.slot]), r.ready_ns), r.held)
            for r in self.replicas.values()
        ]
        mem = MemoryView(
            headroom=self.ledger.headroom(self._held()),
            need={i: rt.mem_min for i, rt in enumerate(self.models) if rt.mem_min},
        )
        for act in self.scheduler.plan(models, replicas, now, mem):
            if isinstance(act, Stop):
                rep = self.replicas[act.slot]
                idle_s = (now - max(rep.ready_ns, int(last_used[act.slot]))) / NS
                self._stop(rep, f"{act.reason}, idle {idle_s:.1f} s, to make room for "
                                f"{self._name(act.for_model)} (models_max {self.cfg.models_max})")
            elif isinstance(act, Spawn):
                if act.warning:
                    log.warning("loading %s: %s", self._name(act.model), act.warning)
                self._spawn_instance(act.model, act.reason)
        self._idle_step(now, counts, inflight, last_used)
        self._spare_step()

    def _idle_step(self, now: int, counts, inflight, last_used) -> None:
        """ttl: unload a replica idle that long since its last request ended;
        sleep-idle: put it to sleep instead, keeping the process."""
        self.stale &= set(self.replicas)
        for slot in list(self.stale):
            r = self.replicas[slot]
            if r.stop_stage == 0 and inflight[slot] <= 0 and r.status != L.ReplicaStatus.LOADING:
                gone = r.model in self.removed
                self._stop(r, "model removed from its sources" if gone else
                           "configuration changed: reloads on the next request")
        for r in list(self.replicas.values()):
            if r.stop_stage or inflight[r.slot] > 0 or counts[r.model] > 0:
                continue
            if r.status not in (L.ReplicaStatus.READY, L.ReplicaStatus.SLEEPING):
                continue
            idle = (now - max(int(last_used[r.slot]), r.ready_ns)) / NS
            entry = self.registry.entries[r.model]
            ttl = entry.ttl  # --ttl is folded into every entry as a default under presets
            if ttl and ttl > 0 and idle > ttl:
                self._stop(r, f"idle {idle:.1f} s > ttl {ttl:g} s")
            elif (self.cfg.sleep_idle and idle > self.cfg.sleep_idle and not r.sleep_sent
                  and r.status == L.ReplicaStatus.READY):
                r.sleep_sent = r.child.send(b"sleep\n")
                log.info("putting %s (slot %d) to sleep: idle %.1f s > %g s", entry.name,
                         r.slot, idle, self.cfg.sleep_idle)

    # ---- memory ------------------------------------------------------------------------
    def _held(self) -> Amounts:
        held: Amounts = {}
        for r in self.replicas.values():
            held = add(held, r.held)
        return held

    def _calibrate(self) -> None:
        """Re-read device memory after a report; log what changed."""
        own = rss_of(os.getpid()) + sum(rss_of(c.pid) for c in self.proxies.values())
        self.ledger.calibrate(self._held(), own)
        self.dirty = True

    # ---- publishing ------------------------------------------------------------------
    def _name(self, model: int) -> str:
        return self.registry.entries[model].name

    def _publish_registry(self) -> None:
        from urllib.parse import urlsplit

        doc = self.registry.doc()
        if self.removed:
            doc["names"] = {k: v for k, v in doc["names"].items() if v not in self.removed}
            for i in self.removed:
                doc["models"][i]["removed"] = True
        doc["errors"] = {str(i): m.error for i, m in enumerate(self.models) if m.error}
        remotes = {}
        for slot, rm in self.remotes.items():
            e = self.registry.entries[rm.model]
            u = urlsplit(e.upstream)
            remotes[str(slot)] = {"host": rm.host, "port": rm.port, "tls": u.scheme == "https",
                                  "prefix": u.path.rstrip("/"), "api_key": e.api_key}
        doc["remotes"] = remotes  # proxies only: the segment is mode 0600
        self.seg.write_registry(doc)

    def _publish_if_dirty(self) -> None:
        if self.errors_dirty:
            self._publish_registry()
            self.errors_dirty = False
            self.dirty = True
        if self.dirty:
            self._publish_all()

    def _publish_all(self) -> None:
        seg = self.seg
        seg.begin_publish()  # readers wanting whole tables wait for end_publish
        counts, _ = self._demand()
        per_model: dict[int, list[Replica]] = {}
        for r in self.replicas.values():
            per_model.setdefault(r.model, []).append(r)
        for slot in range(self.sizes.replicas):
            r = self.replicas.get(slot)
            rm = self.remotes.get(slot)
            if rm is not None:
                entry = self.registry.entries[rm.model]
                write_fields(seg.replicas, slot, {
                    L.R_MODEL: rm.model, L.R_PORT: rm.port, L.R_PID: 0,
                    L.R_STATUS: L.ReplicaStatus.READY if rm.healthy else L.ReplicaStatus.LOADING,
                    L.R_INCARNATION: rm.incarnation, L.R_READY_NS: 1,
                    L.R_WEIGHT: round(entry.weight * 1000), L.R_PRIORITY: entry.priority,
                    L.R_MAX_CONCURRENCY: entry.max_concurrency,
                })
                continue
            if r is None:
                if int(seg.replicas[slot, L.R_MODEL]) != -1:
                    write_fields(seg.replicas, slot, {
                        L.R_MODEL: -1, L.R_STATUS: L.ReplicaStatus.FREE, L.R_PORT: 0,
                        L.R_PID: 0, L.R_INCARNATION: 0, L.R_READY_NS: 0,
                    })
                continue
            entry = self.registry.entries[r.model]
            write_fields(seg.replicas, slot, {
                L.R_MODEL: r.model, L.R_STATUS: r.status, L.R_PORT: r.port,
                L.R_PID: r.child.pid, L.R_INCARNATION: r.incarnation,
                L.R_STARTED_NS: r.started_ns, L.R_READY_NS: r.ready_ns,
                L.R_WEIGHT: round(entry.weight * 1000), L.R_PRIORITY: entry.priority,
                L.R_MAX_CONCURRENCY: entry.max_concurrency,
            })
        healthy_remote = {rm.model for rm in self.remotes.values() if rm.healthy}
        for i, m in enumerate(self.models):
            reps = per_model.get(i, [])
            statuses = {r.status for r in reps}
            if i in healthy_remote:
                statuses.add(L.ReplicaStatus.READY)
            if L.ReplicaStatus.READY in statuses:
                st = L.ModelStatus.LOADED
            elif L.ReplicaStatus.LOADING in statuses:
                st = L.ModelStatus.LOADING
            elif L.ReplicaStatus.SLEEPING in statuses:
                st = L.ModelStatus.SLEEPING
            elif L.ReplicaStatus.STOPPING in statuses:
                st = L.ModelStatus.STOPPING
            else:
                st = L.ModelStatus.UNLOADED
            loading = [r for r in reps if r.status == L.ReplicaStatus.LOADING]
            progress = int(1000 * max((r.progress for r in loading), default=0.0))
            write_fields(seg.models, i, {
                L.M_STATUS: st,
                L.M_REPLICAS: sum(1 for r in reps if r.status == L.ReplicaStatus.READY)
                + sum(1 for rm in self.remotes.values() if rm.model == i and rm.healthy),
                L.M_WAITERS: int(counts[i]),
                L.M_EXIT_CODE: m.exit_code,
                L.M_FAILED: int(m.failed),
                L.M_FAILURES: m.failures,
                L.M_RETRY_AT_NS: m.retry_at_ns,
                L.M_PROGRESS: progress,
                L.M_ETA_MS: -1,
                L.M_MEM_MIN: sum((m.mem_min or {}).values()),
                L.M_MEM_MAX: sum((m.mem_max or {}).values()),
                L.M_MEM_EFFECTIVE: sum(sum(r.held.values()) for r in reps
                                       if r.status != L.ReplicaStatus.LOADING),
                L.M_LOADS: m.loads,
                L.M_EVICTIONS: m.evictions,
                L.M_LOAD_NS_TOTAL: m.load_ns_total,
                L.M_LAST_READY_NS: m.last_ready_ns,
            })
        for k, d in enumerate(self.ledger.devices):
            write_fields(seg.devices, k, {
                L.D_KIND: d.kind, L.D_INDEX: d.index, L.D_TOTAL: d.total,
                L.D_EXTERNAL: d.external, L.D_HELD: d.held, L.D_FREE: d.free,
                L.D_CALIBRATED_NS: d.calibrated_ns,
            })
        seg.end_publish()
        self.dirty = False
        for c in self.proxies.values():
            c.send(b"g")


def _same_config(a, b) -> bool:
    """Entries equal but for where they were read (a preset edit shifts the
    line numbers of every later section)."""
    import dataclasses

    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")


def _amounts(v) -> Amounts:
    """A ``{device: bytes}`` payload from an instance, validated."""
    if not isinstance(v, dict):
        return {}
    out = {}
    for k, b in v.items():
        try:
            out[str(k)] = max(0, int(b))
        except (TypeError, ValueError):
            continue
    return out


def _noop(signum, frame) -> None:
    pass


def _kill(proc: subprocess.Popen, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies
    (prctl PR_SET_PDEATHSIG), besides the stdin-EOF rule, so a supervisor
    killed with SIGKILL never leaves children behind; and ignore SIGINT and
    SIGHUP, so a Ctrl-C or a closed terminal (or ``pkill -HUP``) reaches
    only the supervisor, which stops the children in order or reloads."""
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
