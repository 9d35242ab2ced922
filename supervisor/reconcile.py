"""Desired vs actual, once per loop turn: the demand the proxies publish
(waiters per model) and explicit loads become :mod:`.scheduler` views, its
plan is carried out (wakes, loads, evictions), then idle replicas are
unloaded (``ttl``), put to sleep (``sleep-idle``) or, when stale, stopped.
The decisions themselves are :class:`~.scheduler.Scheduler`'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from ..shm import layout as L
from .contention import Returns, max_wait_s, min_residency_s
from .measure import Measurer
from .replicas import Replicas
from .scheduler import (
    NO_START,
    Drain,
    MemoryView,
    ModelView,
    ReplicaView,
    Scheduler,
    Spawn,
    Stop,
    Undrain,
)
from .state import NS, State

log = logging.getLogger(__name__)

_STATUS_NAMES = {L.ReplicaStatus.LOADING: "loading", L.ReplicaStatus.READY: "ready",
                 L.ReplicaStatus.SLEEPING: "sleeping", L.ReplicaStatus.STOPPING: "stopping"}


class Reconciler:
    """Carries out the scheduler's plan with ``replicas`` and keeps
    ``measurer`` and the spare pool going (see the module docstring)."""

    def __init__(self, state: State, replicas: Replicas, measurer: Measurer) -> None:
        self.state = state
        self.replicas = replicas
        self.measurer = measurer
        self.scheduler = Scheduler(state.cfg.models_max)
        # cluster mode: may this model load here? (ClusterNode.allows)
        self.gate: Callable[[int], bool] | None = None
        # models for which a replica was stopped (evicted or drained) and that have
        # not loaded since: their next load is a swap (issue 34's counter)
        self.made_room: set[int] = set()
        self.returns = Returns(state.cfg.demand_grace)  # whose clients come back (--demand-grace)

    def step(self, now: int) -> None:
        """Desired vs actual: measures, wakes, loads, evictions, idle stops
        (``now``: monotonic ns)."""
        st = self.state
        self.measurer.step()
        counts, first = st.demand()
        for i, rt in enumerate(st.models):
            if rt.requested_ns:  # an explicit load counts as one waiter
                counts[i] += 1
                first[i] = min(int(first[i]), rt.requested_ns)
        inflight = st.in_flight()
        last_used = st.last_used(now)
        for i in range(min(len(st.registry), len(counts))):
            if int(counts[i]) != int(st.seg.models[i, L.M_WAITERS]):
                st.dirty = True
                break
        # a wanted model whose replica sleeps is woken, not loaded again
        for r in st.replicas.values():
            if (r.status == L.ReplicaStatus.SLEEPING and counts[r.model] > 0
                    and not r.wake_sent and r.stop_stage == 0):
                r.wake_sent = r.child.send(b"wake\n")
                log.info("waking %s (slot %d): %d waiting", st.name(r.model), r.slot,
                         int(counts[r.model]))
        wanted = counts
        if not st.cfg.models_autoload:
            # llama.cpp's --no-models-autoload: requests wait for a running
            # model; only an explicit load (POST /models/load, load-on-startup)
            # starts one
            running = {r.model for r in st.replicas.values() if r.stop_stage == 0}
            wanted = np.zeros_like(counts)
            for i in running:
                wanted[i] = counts[i]
            for i, rt in enumerate(st.models):
                if rt.requested_ns:
                    wanted[i] = counts[i]
        cfg = st.cfg
        # a model is loaded only once measured (or found unmeasurable)
        models = [
            ModelView(int(i), int(wanted[i]), int(first[i]), st.models[i].retry_at_ns,
                      st.registry.entries[i].replicas,
                      int(NS * max_wait_s(st.registry.entries[i].max_wait, cfg.max_wait,
                                          st.models[i].loads, st.models[i].load_ns_total)))
            for i in np.flatnonzero(wanted > 0)
            if i < len(st.registry.entries)
            and st.registry.entries[i].kind not in ("upstream", "cluster")
            and (self.gate is None or self.gate(int(i)))
            and (st.models[i].measure in ("done", "failed")
                 or st.registry.entries[i].kind not in ("llama", "fake"))
        ]
        demand: dict[int, int] = {int(i): int(counts[i]) for i in np.flatnonzero(counts > 0)}
        for r in st.replicas.values():
            demand[r.model] = demand.get(r.model, 0) + int(inflight[r.slot])
        self.returns.step(now, demand, {r.model for r in st.replicas.values()
                                        if not r.stop_stage})
        waiting = int(counts.sum())
        replicas = [self._view(r, int(inflight[r.slot]), int(last_used[r.slot]), now,
                               waiting - int(counts[r.model]) if r.model < len(counts)
                               else waiting)
                    for r in st.replicas.values()]
        mem = MemoryView(
            headroom=st.ledger.headroom(st.held()),
            need={i: rt.mem_min for i, rt in enumerate(st.models) if rt.mem_min},
        )
        made_room = self.made_room  # models for which another was stopped: a swap when they load
        for act in self.scheduler.plan(models, replicas, now, mem):
            if isinstance(act, Stop):
                rep = st.replicas[act.slot]
                idle_s = (now - max(rep.ready_ns, int(last_used[act.slot]))) / NS
                if act.drained:
                    why = (f"{act.reason}, drained {(now - rep.drain_ns) / NS:.1f} s, to make "
                           f"room for {st.name(act.for_model)}")
                else:
                    why = f"{act.reason}, idle {idle_s:.1f} s, to make room for " \
                          f"{st.name(act.for_model)}"
                self.replicas.stop(rep, f"{why} (models_max {cfg.models_max})")
                made_room.add(act.for_model)
            elif isinstance(act, Drain):
                rep = st.replicas[act.slot]
                rep.draining, rep.drain_for, rep.drain_ns = True, act.for_model, now
                st.models[act.model].drains += 1
                st.dirty = True
                log.info("draining %s (slot %d, %d in flight) for %s: %s", st.name(act.model),
                         act.slot, int(inflight[act.slot]), st.name(act.for_model), act.reason)
            elif isinstance(act, Undrain):
                rep = st.replicas[act.slot]
                rep.draining, rep.drain_for, rep.drain_ns = False, -1, 0
                st.dirty = True
                log.info("%s (slot %d) takes requests again: %s", st.name(act.model), act.slot,
                         act.reason)
            elif isinstance(act, Spawn):
                if act.warning:
                    log.warning("loading %s: %s", st.name(act.model), act.warning)
                if act.model in made_room:
                    made_room.discard(act.model)
                    st.models[act.model].swaps += 1
                self.replicas.spawn(act.model, act.reason)
        self._publish_waits(counts, first)
        self._idle_step(now, counts, inflight, last_used)
        self.replicas.spares.step()

    def _view(self, r, inflight: int, last_used: int, now: int, others: int) -> ReplicaView:
        """The scheduler's view of replica ``r`` (its model's pin, eviction
        priority and minimum residency, from its own load time; its grace
        when its model's clients come back and the hold pays for the
        ``others`` requests waiting for other models,
        :class:`~.contention.Returns`)."""
        st = self.state
        e = st.registry.entries[r.model]
        load_s = (r.ready_ns - r.started_ns) / NS if r.ready_ns and r.started_ns else 0.0
        stopping = r.stop_stage or r.status == L.ReplicaStatus.STOPPING
        used = max(last_used, r.ready_ns)
        grace = 0
        if inflight <= 0 and r.ready_ns and self.returns.pays(r.model, load_s, others):
            until = used + int(NS * self.returns.hold_s(r.model))
            grace = until if until > now else 0
        return ReplicaView(
            r.slot, r.model, "stopping" if stopping else _STATUS_NAMES[r.status], inflight,
            used, r.held, ready_ns=r.ready_ns, draining=r.draining,
            drain_for=r.drain_for, pinned=e.pin, eviction_priority=e.eviction_priority,
            min_residency_ns=int(NS * min_residency_s(e.min_residency, st.cfg.min_residency,
                                                      load_s)), grace_until_ns=grace)

    def _publish_waits(self, counts, first) -> None:
        """Copy the scheduler's reasons to the models' runtime (published to
        the models table: ``ps``, ``/v1/models``, ``/metrics``)."""
        st = self.state
        waits = self.scheduler.waits
        for i, rt in enumerate(st.models):
            if i >= len(counts):
                break
            w = waits.get(i)
            reason, holder, eta = (w.reason, w.holder, w.eta_ns) if w else (0, -1, 0)
            f = int(first[i]) if counts[i] > 0 and first[i] < NO_START else 0
            if (rt.wait_reason, rt.wait_holder, rt.wait_eta_ns, rt.wait_first_ns) != \
                    (reason, holder, eta, f):
                rt.wait_reason, rt.wait_holder, rt.wait_eta_ns, rt.wait_first_ns = \
                    reason, holder, eta, f
                st.dirty = True

    def _idle_step(self, now: int, counts, inflight, last_used) -> None:
        """ttl: unload a replica idle that long since its last request ended;
        sleep-idle: put it to sleep instead, keeping the process."""
        st = self.state
        st.stale &= set(st.replicas)
        for slot in list(st.stale):
            r = st.replicas[slot]
            if r.stop_stage == 0 and inflight[slot] <= 0 and r.status != L.ReplicaStatus.LOADING:
                gone = r.model in st.removed
                self.replicas.stop(r, "model removed from its sources" if gone else
                                   "configuration changed: reloads on the next request")
        for r in list(st.replicas.values()):
            if r.stop_stage or inflight[r.slot] > 0 or counts[r.model] > 0:
                continue
            if r.status not in (L.ReplicaStatus.READY, L.ReplicaStatus.SLEEPING):
                continue
            idle = (now - max(int(last_used[r.slot]), r.ready_ns)) / NS
            entry = st.registry.entries[r.model]
            ttl = entry.ttl  # --ttl is folded into every entry as a default under presets
            keep = st.models[r.model].keep_alive_s
            if keep is not None:  # an Ollama request's keep_alive wins until the unload
                ttl = keep
            if ttl and ttl > 0 and idle > ttl:
                self.replicas.stop(r, f"idle {idle:.1f} s > ttl {ttl:g} s")
            elif (st.cfg.sleep_idle and idle > st.cfg.sleep_idle and not r.sleep_sent
                  and r.status == L.ReplicaStatus.READY):
                r.sleep_sent = r.child.send(b"sleep\n")
                log.info("putting %s (slot %d) to sleep: idle %.1f s > %g s", entry.name,
                         r.slot, idle, st.cfg.sleep_idle)
