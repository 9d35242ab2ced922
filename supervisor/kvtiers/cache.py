"""The supervisor's part in the KV tiers (issue 29): what each model holds
outside its slots, and the jobs around it.

* The ``cache`` state line of an instance (``ram_bytes``, ``disk_bytes``,
  ``ram_entries``, ``disk_entries``; at most once a second, on change)
  becomes the replica's RAM bytes and the model's disk bytes
  (``M_CACHE_RAM_BYTES``, ``M_CACHE_DISK_BYTES``, published by
  :mod:`.publish`).
* While no replica of a model runs, its disk bytes come from a scan of its
  folders (:func:`~.files.disk_use`, or its slot files for a ``cmd``
  llama-server): at start and after its last replica exited.
* A ``cmd`` llama-server with ``slot-save-path`` saves its slots before its
  SIGTERM (:meth:`KvCache.save`) and restores them before it is ready
  (:meth:`KvCache.restore`), best effort, each bounded by the model's
  ``cache-save-timeout``.
* ``POST /cache/clear`` (a proxy's ``cache_clear`` command): running
  replicas empty their tiers (the instance's ``POST /cache/clear``, a
  llama-server's slot files removed), models with none running have their
  disk files removed; the answer is published in the registry blob under
  ``cache_clears`` by the command's id, and each model's ``M_CACHE_EPOCH``
  is bumped (the proxies drop its disk rows of the prefix index).

Every blocking step runs on a :class:`~.jobs.Jobs` thread.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

from ...http1.auth import secret_text
from ...shm import layout as L
from ..jobs import Jobs
from ..state import NS, Replica, State
from . import files as T

log = logging.getLogger(__name__)

CLEARS_KEPT = 32  # answers of cache clears kept in the registry blob
CLEAR_TIMEOUT_S = 10.0
"""Bound of one cache clear: each running replica's ``POST /cache/clear``."""
GRACE_S = 0.5
"""Past a save's or a restore's bound, the supervisor goes on after this
much more (the job's own HTTP timeout ends it about then)."""


def _int(v) -> int:
    try:
        return max(0, int(v))
    except (TypeError, ValueError):
        return 0


class KvCache:
    """See the module docstring. ``state``: the supervisor's books;
    ``jobs``: where blocking steps run."""

    def __init__(self, state: State, jobs: Jobs) -> None:
        self.state = state
        self.jobs = jobs

    # ---- figures -----------------------------------------------------------
    def on_line(self, rep: Replica, msg: dict) -> None:
        """An instance's ``cache`` state line."""
        st = self.state
        ram = _int(msg.get("ram_bytes"))
        m = st.models[rep.model]
        disk = _int(msg.get("disk_bytes"))
        if ram != rep.cache_ram or disk != m.cache_disk_bytes:
            grew = ram != rep.cache_ram
            rep.cache_ram = ram
            m.cache_disk_bytes = disk
            st.dirty = True
            if grew:  # the host-RAM tier is memory the replica holds (State.held)
                st.calibrate()
        m.cache_disk_ns = time.monotonic_ns()

    def scan(self, *models: int) -> None:
        """Learn the disk bytes of ``models`` from their folders (one job)."""
        st = self.state
        todo = []
        for model in models:
            entry = st.registry.entries[model]
            t = T.tiers_of(entry)
            if t.on_disk:
                todo.append((model, entry, t))
        if not todo:
            return
        started = time.monotonic_ns()

        def run() -> list[T.DiskUse]:
            out = []
            for _, entry, t in todo:
                use = T.disk_use(t.disk_dir, entry.name) if t.disk_dir else T.DiskUse()
                if t.slot_dir:
                    s = T.slot_use(t.slot_dir, entry)
                    use.entries += s.entries
                    use.bytes += s.bytes
                out.append(use)
            return out

        def done(uses) -> None:
            if isinstance(uses, Exception):
                log.warning("cannot scan the disk tiers: %s", uses)
                return
            for (model, entry, _), use in zip(todo, uses, strict=True):
                if model >= len(st.models) or st.models[model].cache_disk_ns > started:
                    continue  # a replica reported since: its figure is newer
                m = st.models[model]
                if m.cache_disk_bytes != use.bytes:
                    m.cache_disk_bytes = use.bytes
                    st.dirty = True
                log.debug("%s: %d cache entries, %d bytes on disk", entry.name, use.entries,
                          use.bytes)

        self.jobs.start(f"scan {len(todo)} disk tiers", run, done)

    def scan_all(self) -> None:
        """Scan every model with a disk tier (at start), in one job."""
        st = self.state
        self.scan(*(i for i in range(len(st.registry.entries)) if i not in st.removed))

    def on_exit(self, rep: Replica) -> None:
        """A replica exited: its RAM tier is gone; when it was the model's
        last, the disk figure comes from a scan from now on."""
        st = self.state
        if not any(r.model == rep.model for r in st.replicas.values()):
            self.scan(rep.model)

    # ---- a cmd llama-server's slots -------------------------------------------
    def save(self, rep: Replica, then: Callable[[], None]) -> bool:
        """Before a ``cmd`` replica is stopped: save its slots (a job), then
        call ``then`` (on the loop). False, and nothing started, when the
        model has no ``slot-save-path`` or the replica never became ready
        (nothing to save)."""
        st = self.state
        entry = st.registry.entries[rep.model]
        t = T.tiers_of(entry)
        if not t.slot_dir or not rep.ready_ns or rep.kind != "cmd":
            return False
        rep.saving = True
        secret = secret_text(rep.secret_hi, rep.secret_lo)

        def done(res) -> None:
            if not rep.saving:
                return  # past its bound: it was stopped without waiting for this
            rep.saving = False
            _report(entry.name, rep, "saved", res)
            then()

        self.jobs.start(f"save {entry.name}#{rep.slot}",
                        lambda: T.save_slots(rep.port, secret, entry, t.save_timeout), done)
        return True

    def save_bound(self, rep: Replica) -> float:
        """Seconds ``rep`` may spend saving its slots before its SIGTERM
        (a ``cmd`` replica saving now; 0 otherwise: an instance's save is
        inside its ``kill_after``)."""
        if not rep.saving:
            return 0.0
        return T.tiers_of(self.state.registry.entries[rep.model]).save_timeout + GRACE_S

    def save_overdue(self, rep: Replica, now: int) -> bool:
        """Whether ``rep``'s slot save ran past its bound (then it is no
        longer waited for)."""
        if not rep.saving:
            return False
        t = T.tiers_of(self.state.registry.entries[rep.model])
        if now - rep.stop_ns <= (t.save_timeout + GRACE_S) * NS:
            return False
        log.warning("%s: saving its slots took over %.1f s (cache-save-timeout): stopping it "
                    "without waiting", rep.child.tag, t.save_timeout)
        rep.saving = False
        return True

    def restore(self, rep: Replica, then: Callable[[], None]) -> bool:
        """A ``cmd`` replica answered its readiness probe: restore its
        saved slots (a job), then call ``then`` (on the loop). False, and
        nothing started, when there is nothing to restore."""
        st = self.state
        entry = st.registry.entries[rep.model]
        t = T.tiers_of(entry)
        if not t.slot_dir or rep.kind != "cmd":
            return False
        try:
            names = os.listdir(t.slot_dir)
        except OSError:
            return False
        prefix = T.slot_prefix(entry)
        if not any(n.startswith(prefix) for n in names):
            return False
        rep.restoring = True
        rep.restore_until_ns = time.monotonic_ns() + int((t.save_timeout + GRACE_S) * NS)
        secret = secret_text(rep.secret_hi, rep.secret_lo)

        def done(res) -> None:
            if not rep.restoring:
                return
            rep.restoring = False
            _report(entry.name, rep, "restored", res)
            then()

        self.jobs.start(f"restore {entry.name}#{rep.slot}",
                        lambda: T.restore_slots(rep.port, secret, entry, t.slot_dir,
                                                t.save_timeout), done)
        return True

    # ---- emptying ---------------------------------------------------------------
    def clear(self, models: list[int], rid: str) -> None:
        """Empty the tiers of ``models`` (a job); publish the answer under
        ``rid`` (module docstring)."""
        st = self.state
        plan = []
        for m in models:
            entry = st.registry.entries[m]
            t = T.tiers_of(entry)
            running = [(r.port, secret_text(r.secret_hi, r.secret_lo)) for r in
                       st.replicas.values() if r.model == m and r.kind == "instance"
                       and r.status in (L.ReplicaStatus.READY, L.ReplicaStatus.SLEEPING)
                       and not r.stop_stage]
            live = any(r.model == m and r.stop_stage == 0 for r in st.replicas.values())
            plan.append((m, entry, t, running, live))

        def run() -> dict:
            deadline = time.monotonic() + CLEAR_TIMEOUT_S
            out = {}
            for _m, entry, t, running, live in plan:
                res = {"ram": 0, "disk": 0, "replicas": 0}
                errors = []
                for port, secret in running:
                    try:
                        doc = T.call_json(port, secret, "POST", "/cache/clear", {}, deadline)
                        got = doc.get("cleared") if isinstance(doc, dict) else None
                        if isinstance(got, dict):
                            res["ram"] += _int(got.get("ram"))
                            res["disk"] += _int(got.get("disk"))
                        res["replicas"] += 1
                    except (OSError, ValueError) as e:
                        errors.append(f"replica on port {port}: {e}")
                if t.disk_dir and not live:  # nobody writes there now
                    res["disk"] += T.clear_disk(t.disk_dir, entry.name)
                if t.slot_dir:  # a llama-server restores them only at its next load
                    res["disk"] += T.clear_slots(t.slot_dir, entry)
                if errors:
                    res["errors"] = errors
                out[entry.name] = res
            return out

        def done(out) -> None:
            if isinstance(out, Exception):
                log.error("cache clear failed: %s", out)
                out = {"error": f"{type(out).__name__}: {out}"}
            for m, entry, *_ in plan:
                st.models[m].cache_epoch += 1
                st.models[m].cache_disk_ns = 0  # the next scan's figure counts
                log.info("%s: KV tiers emptied: %s", entry.name, out.get(entry.name))
            self.scan(*(m for m, *_ in plan))
            st.cache_clears[rid] = out
            while len(st.cache_clears) > CLEARS_KEPT:
                st.cache_clears.pop(next(iter(st.cache_clears)))
            st.errors_dirty = True  # republish the registry blob: the answer
            st.dirty = True

        self.jobs.start("cache clear", run, done)


def _report(name: str, rep: Replica, what: str, res) -> None:
    if isinstance(res, Exception):
        log.warning("%s (slot %d): slots not %s: %s", name, rep.slot, what, res)
        return
    if res.done:
        log.info("%s (slot %d): %s %d slot(s) (%s tokens) in %.2f s", name, rep.slot, what,
                 len(res.done), "+".join(str(n) for _, n in res.done), res.seconds)
    for e in res.errors:
        log.warning("%s (slot %d): a slot not %s (the next request is served by prefill): %s",
                    name, rep.slot, what, e)
