"""Local replicas: spawning instances and ``cmd`` commands, their state
lines and readiness probes, stopping (``exit``, then SIGTERM, then
SIGKILL), load deadlines, hung replicas, and what an exit means for the
model (eviction, failed load with backoff, crash).

Every local replica gets a secret of its own at spawn (issue 11: no way
around the API key on the same host): an instance through a ``--keys-fd``
pipe or, a spare, in its ``load`` line; a ``cmd`` command whose line names
``${API_KEY_FILE}`` as a file holding it (mode 0600, in a 0700 folder; made
for llama-server's ``--api-key-file``). The proxies read it from the
replicas table and send it as the bearer token. A ``cmd`` line without
``${API_KEY_FILE}`` gets no secret (and its port takes any local caller).
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time

from ..http1.auth import keys_pipe, new_secret
from ..shm import layout as L
from .children import Child, ChildSet, state_line
from .jobs import Jobs
from .kvtiers.cache import KvCache
from .kvtiers.files import cmd_line, stop_budget
from .memory import Amounts, fmt
from .priority import give_back, lower, usable_nice
from .probe import FIRST_INTERVAL_S, ProbeSet, next_interval
from .registry import env_for_instance, instance_argv
from .spares import Spares
from .state import NS, GiB, Replica, State

log = logging.getLogger(__name__)


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


class Replicas:
    """The lifecycle of the replicas in ``state.replicas``: spawn (from a
    spare when one fits), state lines, readiness probes of ``cmd``
    instances, stop and escalation, reaping. Owns the spare pool."""

    def __init__(self, state: State, children: ChildSet, probes: ProbeSet,
                 jobs: Jobs | None = None) -> None:
        self.state = state
        self.children = children
        self.probes = probes
        self.jobs = jobs if jobs is not None else Jobs()
        self.kv = KvCache(state, self.jobs)  # the KV tiers' figures and jobs (issue 29)
        self.spares = Spares(state, children, on_line=self.on_line)
        self._key_dir = ""  # 0700 folder of cmd instances' key files, made when needed
        # loads yield the CPU to serving replicas (issue 31, item 11); 0: off
        self.load_nice = self.spares.load_nice = usable_nice(state.cfg.load_nice)

    # ---- state lines ---------------------------------------------------------
    def on_line(self, child: Child, line: bytes) -> None:
        """A stdout line of an instance, a spare or a ``cmd`` command."""
        msg = state_line(child, line)
        if msg is None:
            return
        rep = next((r for r in self.state.replicas.values() if r.child is child), None)
        if rep is None:
            return  # a spare announcing itself
        self.on_state(rep, msg)

    def on_state(self, rep: Replica, msg: dict) -> None:
        """Apply a state message (``loading``, ``sleeping``, ``ready``,
        ``error``, ``cache``) of ``rep``."""
        st = self.state
        state = msg.get("state")
        if state == "cache":  # its KV tiers' sizes (issue 29)
            self.kv.on_line(rep, msg)
            return
        now = time.monotonic_ns()
        m = st.models[rep.model]
        if state == "loading":
            rep.progress = float(msg.get("progress") or 0.0)
            if rep.status == L.ReplicaStatus.SLEEPING:  # woken
                rep.status = L.ReplicaStatus.LOADING
                rep.started_ns = now
                rep.held = dict(m.mem_min or rep.held)
                if rep.nice is None:  # reading its weights back is a load too
                    rep.nice = lower(rep.child.pid, self.load_nice)
            st.dirty = True
        elif state == "sleeping":
            if rep.stop_stage:
                return
            rep.status = L.ReplicaStatus.SLEEPING
            rep.sleep_sent = rep.wake_sent = False
            rep.held = _amounts(msg.get("effective"))
            log.info("%s (slot %d) is asleep, holding %s", st.name(rep.model), rep.slot,
                     fmt(rep.held))
            st.calibrate()
            st.dirty = True
        elif state == "ready":
            if rep.stop_stage:
                return
            rep.status = L.ReplicaStatus.READY
            rep.ready_ns = now
            if rep.nice is not None:
                give_back(rep.child.pid, rep.nice)
                rep.nice = None
            rep.progress = 1.0
            rep.sleep_sent = rep.wake_sent = False
            slots = msg.get("slots")
            rep.slots = slots if isinstance(slots, int) and slots > 0 else 0
            eff = _amounts(msg.get("effective"))
            if sum(eff.values()) > 0:
                rep.held = eff
            st.calibrate()
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
                st.errors_dirty = True
            log.info(
                "model %s ready on port %d in %.3f s (pid %d)",
                st.name(rep.model), rep.port, (now - rep.started_ns) / NS, rep.child.pid,
            )
            st.dirty = True
        elif state == "error":
            rep.error = str(msg.get("error") or "load failed")
        else:
            log.debug("state %r from %s", state, rep.child.tag)

    # ---- spawning ------------------------------------------------------------
    def spawn(self, model: int, reason: str) -> None:
        """Start a replica of ``model`` in a free slot (logged, no-op when
        every slot is taken): a ``cmd`` command, a spare told to load, or a
        new instance process."""
        st = self.state
        entry = st.registry.entries[model]
        slot = st.free_slot()
        if slot is None:
            log.warning("no free replica slot for %s", entry.name)
            return
        if entry.kind == "cmd":
            self._spawn_cmd(model, slot, reason)
            return
        tag = f"{entry.name}#{slot}"
        secret, hi, lo = new_secret()
        taken = self.spares.take(entry, tag, slot, secret)
        nice = None  # the nice value to give back once ready
        if taken is not None:
            child, port = taken
            nice = self.spares.nice.pop(child.pid, None)  # lowered since its start
            if nice is None:
                nice = lower(child.pid, self.load_nice)
        else:
            fd = keys_pipe({"secret": secret})
            argv = [*instance_argv(entry, -1, st.python), "--slot", str(slot),
                    "--keys-fd", str(fd)]
            try:
                child, port = self.children.start_with_socket(
                    argv, tag, on_line=self.on_line, env=env_for_instance(entry),
                    pass_fds=(fd,), nice=self.load_nice)
            finally:
                os.close(fd)
            if self.load_nice:
                nice = os.getpriority(os.PRIO_PROCESS, 0)  # ours, which it had before
        now = time.monotonic_ns()
        budget = load_budget_s(entry.size_bytes, st.cfg.load_timeout)
        rep = Replica(
            slot=slot, model=model, child=child, incarnation=st.next_incarnation(), port=port,
            started_ns=now, deadline_ns=now + int(budget * NS),
            held=dict(st.models[model].mem_min or {}),
            # exit -> SIGTERM leaves the save of its slots to its disk tier its time
            kill_after=stop_budget(entry), secret_hi=hi, secret_lo=lo, nice=nice,
        )
        st.replicas[slot] = rep
        log.info("loading %s in slot %d (pid %d, port %d): %s", entry.name, slot, child.pid,
                 port, reason)
        st.dirty = True

    def _spawn_cmd(self, model: int, slot: int, reason: str) -> None:
        """Start a ``cmd`` instance: any command serving an OpenAI-compatible
        API on ``${PORT}`` (llama-swap's ``cmd``). The port is chosen here
        (bound to port 0 and released just before the spawn: a command
        cannot take a passed descriptor); readiness is probed on
        ``check_endpoint``; stdout and stderr go to the log."""
        st = self.state
        entry = st.registry.entries[model]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        line = entry.cmd.replace("${PORT}", str(port)).replace("${MODEL_ID}", entry.name)
        line = cmd_line(entry, line)  # its slot-save-path (issue 29)
        hi = lo = 0
        key_file = ""
        if "${API_KEY_FILE}" in line:
            secret, hi, lo = new_secret()
            key_file = self._write_key_file(slot, secret)
            line = line.replace("${API_KEY_FILE}", shlex.quote(key_file))
        try:
            argv = shlex.split(line)
            # stdin is a pipe we never write: a command that watches it sees EOF
            # when the supervisor dies (ggmux's own instance does)
            child = self.children.start(argv, f"{entry.name}#{slot}", on_line=self.on_line,
                                        env=env_for_instance(entry), nice=self.load_nice,
                                        group=True)
        except (OSError, ValueError) as e:
            m = st.models[model]
            m.failed, m.failures = True, m.failures + 1
            m.retry_at_ns = time.monotonic_ns() + int(backoff_s(m.failures) * NS)
            m.error = f"cannot start {line!r}: {e}"
            st.errors_dirty = True
            log.error("%s: %s", entry.name, m.error)
            _remove(key_file)
            return
        child.stdin_fd = -1  # never written: `exit` is not part of a command's protocol
        now = time.monotonic_ns()
        budget = load_budget_s(entry.size_bytes, st.cfg.load_timeout)
        st.replicas[slot] = Replica(
            slot=slot, model=model, child=child, incarnation=st.next_incarnation(), port=port,
            started_ns=now, deadline_ns=now + int(budget * NS),
            held=dict(st.models[model].mem_min or {}), kill_after=entry.stop_timeout,
            kind="cmd", probe_interval=FIRST_INTERVAL_S,
            next_probe_ns=now + int(FIRST_INTERVAL_S * NS),
            secret_hi=hi, secret_lo=lo, key_file=key_file,
            nice=os.getpriority(os.PRIO_PROCESS, 0) if self.load_nice else None,
        )
        log.info("starting %s in slot %d (pid %d, port %d): %s: %s", entry.name, slot,
                 child.pid, port, reason, line)
        st.dirty = True

    def _write_key_file(self, slot: int, secret: str) -> str:
        """A new file holding ``secret`` (mode 0600) in the supervisor's
        0700 key folder; its path."""
        if not self._key_dir or not os.path.isdir(self._key_dir):
            self._key_dir = tempfile.mkdtemp(prefix="ggmux-keys-")  # mode 0700
        path = os.path.join(self._key_dir, f"replica-{slot}-{time.monotonic_ns()}.key")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secret.encode() + b"\n")
        finally:
            os.close(fd)
        return path

    def close(self) -> None:
        """Remove the key folder (teardown, after every replica exited)."""
        if self._key_dir:
            for name in os.listdir(self._key_dir) if os.path.isdir(self._key_dir) else ():
                _remove(os.path.join(self._key_dir, name))
            try:
                os.rmdir(self._key_dir)
            except OSError:
                pass
            self._key_dir = ""

    def probe_step(self, now: int) -> None:
        """Readiness of loading ``cmd`` instances: ready on a 200 from
        ``check_endpoint``, else probe again after a growing interval."""
        for r in self.state.replicas.values():
            if r.kind != "cmd" or r.status != L.ReplicaStatus.LOADING or r.stop_stage:
                continue
            if r.restoring:  # its saved slots first (issue 29), within their bound
                if now > r.restore_until_ns:
                    log.warning("%s: restoring its slots took too long (cache-save-timeout): "
                                "ready without waiting", r.child.tag)
                    r.restoring = False
                    self.on_state(r, {"state": "ready"})
                continue
            if r.probe is not None and r.probe.done:
                if r.probe.ok:
                    r.probe = None
                    if not self.kv.restore(r, self._ready_after_restore(r)):
                        self.on_state(r, {"state": "ready"})
                    continue
                r.probe = None
                r.probe_interval = next_interval(r.probe_interval)
                r.next_probe_ns = now + int(r.probe_interval * NS)
            if r.probe is None and now >= r.next_probe_ns:
                path = self.state.registry.entries[r.model].check_endpoint
                r.probe = self.probes.start("127.0.0.1", r.port, path, r, now)

    def _ready_after_restore(self, rep: Replica):
        def then() -> None:
            if not rep.stop_stage and self.state.replicas.get(rep.slot) is rep:
                self.on_state(rep, {"state": "ready"})
        return then

    # ---- stopping ------------------------------------------------------------
    def stop(self, rep: Replica, reason: str, kill_after: float | None = None) -> None:
        """Ask a replica to exit; :meth:`escalate` follows up with signals
        after ``kill_after`` seconds (default: its stop-timeout)."""
        if rep.stop_stage:
            return
        st = self.state
        if kill_after is not None:
            rep.kill_after = kill_after
        rep.deliberate = True
        rep.stop_stage = 1
        rep.stop_ns = time.monotonic_ns()
        was_loading = rep.status == L.ReplicaStatus.LOADING
        rep.status = L.ReplicaStatus.STOPPING
        if rep.probe is not None:
            self.probes.drop(rep.probe.fileno())
            rep.probe = None
        if rep.kind == "cmd":
            # a llama-server with slot-save-path saves its slots first (issue 29),
            # within cache-save-timeout (escalate stops waiting past it)
            if was_loading or not self.kv.save(rep, lambda: self._terminate_cmd(rep)):
                self._terminate_cmd(rep)
        elif not rep.child.send(b"exit\n"):
            rep.child.kill(signal.SIGTERM)
            rep.stop_stage = 2
        log.info(
            "stopping %s (slot %d, pid %d%s): %s", st.name(rep.model), rep.slot,
            rep.child.pid, ", was loading" if was_loading else "", reason,
        )
        st.dirty = True

    def _terminate_cmd(self, rep: Replica) -> None:
        """Stop a ``cmd`` replica: it has no stdin protocol; ``cmd-stop``
        (llama-swap's cmdStop) or SIGTERM, then SIGKILL after stop-timeout."""
        if rep.stop_stage >= 2 or self.state.replicas.get(rep.slot) is not rep:
            return  # stopped already, or gone while its slots were saved
        entry = self.state.registry.entries[rep.model]
        rep.stop_stage = 2
        rep.kill_at_ns = time.monotonic_ns() + int(rep.kill_after * NS)
        if entry.cmd_stop:
            line = (entry.cmd_stop.replace("${PID}", str(rep.child.pid))
                    .replace("${PORT}", str(rep.port)).replace("${MODEL_ID}", entry.name))
            try:
                subprocess.Popen(shlex.split(line), stdin=subprocess.DEVNULL,
                                 env=env_for_instance(entry))
            except (OSError, ValueError) as e:
                log.error("cmd-stop %r failed: %s; SIGTERM instead", line, e)
                rep.child.kill(signal.SIGTERM)
        else:
            rep.child.kill(signal.SIGTERM)

    def escalate(self, now: int) -> None:
        """Stops past due: SIGTERM after ``kill_after`` s of ``exit``,
        SIGKILL after ``term_timeout`` more; a load past its deadline is
        killed and counts as a failed load."""
        st = self.state
        cfg = st.cfg
        for rep in list(st.replicas.values()):
            if rep.kind == "cmd" and rep.stop_stage == 1:  # saving its slots (issue 29)
                if self.kv.save_overdue(rep, now):
                    self._terminate_cmd(rep)
            elif rep.stop_stage == 1 and now - rep.stop_ns > rep.kill_after * NS:
                log.warning("%s did not exit within %.1f s of 'exit': SIGTERM",
                            rep.child.tag, rep.kill_after)
                # an instance ignores SIGTERM (a group-wide one must not cut
                # its streams: issue 37, item 9); `term` is ours
                rep.child.send(b"term\n")
                rep.child.kill(signal.SIGTERM)
                rep.stop_stage = 2
            elif rep.stop_stage == 2 and (
                now > rep.kill_at_ns if rep.kill_at_ns
                else now - rep.stop_ns > (rep.kill_after + cfg.term_timeout) * NS
            ):
                log.warning("%s ignored SIGTERM: SIGKILL", rep.child.tag)
                rep.child.kill(signal.SIGKILL)
                rep.stop_stage = 3
            elif rep.status == L.ReplicaStatus.LOADING and now > rep.deadline_ns:
                entry = st.registry.entries[rep.model]
                budget = load_budget_s(entry.size_bytes, cfg.load_timeout)
                rule = ("--load-timeout" if cfg.load_timeout is not None else
                        f"5 min + 20 s per GiB of the {entry.size_bytes / GiB:.2f} GiB "
                        "checkpoint; raise --load-timeout")
                rep.error = f"load did not finish within {budget:.0f} s ({rule})"
                log.error("%s: %s", entry.name, rep.error)
                rep.deliberate = False  # counts as a failed load
                rep.stop_stage = 3
                rep.status = L.ReplicaStatus.STOPPING
                rep.child.kill(signal.SIGKILL)
                st.dirty = True

    def hung_step(self, now: int) -> None:
        """Restart a local replica that hangs (issue 11): a proxy's request
        to it timed out (``--first-byte-timeout``, ``--stream-idle-timeout``:
        ``C_TIMEOUT_NS``), it answered no request since (``C_ANSWER_NS``), and
        nothing is in flight to it any more. It is killed at once (a hung
        process may not read ``exit``, a stopped one takes no SIGTERM) and
        its model loaded again; ``/v1/models`` shows the cause until then."""
        st = self.state
        cnt = st.seg.counters
        for rep in list(st.replicas.values()):
            if rep.status != L.ReplicaStatus.READY or rep.stop_stage:
                continue
            rows = cnt[:, rep.slot, :]
            mine = rows[rows[:, L.C_INCARNATION] == rep.incarnation]
            if not len(mine):
                continue
            timed_out = int(mine[:, L.C_TIMEOUT_NS].max())
            if (not timed_out or timed_out <= int(mine[:, L.C_ANSWER_NS].max())
                    or int(mine[:, L.C_IN_FLIGHT].sum()) > 0):
                continue
            log.warning("%s (slot %d, pid %d) hangs: a request to it timed out %.1f s ago and "
                        "it answered none since; killing and restarting it", st.name(rep.model),
                        rep.slot, rep.child.pid, (now - timed_out) / NS)
            rep.error = ("hung: its requests timed out (--first-byte-timeout, "
                         "--stream-idle-timeout); restarted")
            rep.restart = True
            rep.stop_stage = 3
            rep.stop_ns = now
            rep.status = L.ReplicaStatus.STOPPING
            rep.child.kill(signal.SIGKILL)
            st.dirty = True

    # ---- reaping -------------------------------------------------------------
    def reap(self) -> None:
        """Forget replicas that exited and record what that means."""
        st = self.state
        for slot, rep in list(st.replicas.items()):
            code = self.children.reap(rep.child)
            if code is None:
                continue
            rep.child.kill_leftovers()  # a cmd's server that outlived its wrapper shell
            del st.replicas[slot]
            _remove(rep.key_file)
            self._on_exit(rep, code)
            self.kv.on_exit(rep)  # its disk tier's size, now that none may write it
            st.calibrate()
            st.dirty = True

    def _on_exit(self, rep: Replica, code: int) -> None:
        st = self.state
        m = st.models[rep.model]
        name = st.name(rep.model)
        was_loading = rep.ready_ns == 0
        if not any(r.model == rep.model and r is not rep for r in st.replicas.values()):
            m.keep_alive_s = None  # unloaded: the next load has the preset's ttl again
        if rep.deliberate:
            log.info("%s (slot %d) stopped, exit code %d", name, rep.slot, code)
            if not was_loading and not st.stopping_all:
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
        if rep.restart:
            m.requested_ns = time.monotonic_ns()  # load it again
        st.errors_dirty = True


def _remove(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass


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
