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
from .measure import Measurer
from .replicas import Replicas
from .scheduler import MemoryView, ModelView, ReplicaView, Scheduler, Spawn, Stop
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
        # a model is loaded only once measured (or found unmeasurable)
        models = [
            ModelView(int(i), int(wanted[i]), int(first[i]), st.models[i].retry_at_ns,
                      st.registry.entries[i].replicas)
            for i in np.flatnonzero(wanted > 0)
            if i < len(st.registry.entries)
            and st.registry.entries[i].kind not in ("upstream", "cluster")
            and (self.gate is None or self.gate(int(i)))
            and (st.models[i].measure in ("done", "failed")
                 or st.registry.entries[i].kind not in ("llama", "fake"))
        ]
        replicas = [
            ReplicaView(r.slot, r.model, _STATUS_NAMES[r.status], int(inflight[r.slot]),
                        max(int(last_used[r.slot]), r.ready_ns), r.held)
            for r in st.replicas.values()
        ]
        mem = MemoryView(
            headroom=st.ledger.headroom(st.held()),
            need={i: rt.mem_min for i, rt in enumerate(st.models) if rt.mem_min},
        )
        for act in self.scheduler.plan(models, replicas, now, mem):
            if isinstance(act, Stop):
                rep = st.replicas[act.slot]
                idle_s = (now - max(rep.ready_ns, int(last_used[act.slot]))) / NS
                self.replicas.stop(rep, f"{act.reason}, idle {idle_s:.1f} s, to make room for "
                                        f"{st.name(act.for_model)} "
                                        f"(models_max {st.cfg.models_max})")
            elif isinstance(act, Spawn):
                if act.warning:
                    log.warning("loading %s: %s", st.name(act.model), act.warning)
                self.replicas.spawn(act.model, act.reason)
        self._idle_step(now, counts, inflight, last_used)
        self.replicas.spares.step()

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
