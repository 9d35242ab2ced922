"""Publishing to shared memory: the registry blob (models, names, errors,
remotes' addresses), the replicas, models and devices tables under one
publish (generation bump, :meth:`~ggmux.shm.segment.Segment.begin_publish`
/ ``end_publish``), then a ``g`` wake-up line to every proxy. The
supervisor is the only writer of the segment.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from ..shm import layout as L
from ..shm.seqlock import write_fields
from .kvtiers.files import tiers_of
from .state import NODE_PRIORITY, Replica, State


class Publisher:
    """Writes what ``state`` holds to ``state.seg``."""

    def __init__(self, state: State) -> None:
        self.state = state
        self._flags: tuple[object, list[int]] = (None, [])  # (registry, M_CACHE_FLAGS per model)

    def _cache_flags(self) -> list[int]:
        """``M_CACHE_FLAGS`` of each registered model, worked out once per
        registry (a reload makes a new one)."""
        reg = self.state.registry
        if self._flags[0] is not reg:
            self._flags = (reg, [L.CACHE_DISK if tiers_of(e).on_disk else 0
                                 for e in reg.entries])
        return self._flags[1]

    def registry(self) -> None:
        """Write the registry blob: removed models unnamed and marked, the
        models' errors and (once measured) whether each has a chat template,
        the remotes' addresses and keys (proxies only: the segment is mode
        0600)."""
        st = self.state
        doc = st.registry.doc()
        if st.removed:
            doc["names"] = {k: v for k, v in doc["names"].items() if v not in st.removed}
            for i in st.removed:
                doc["models"][i]["removed"] = True
        doc["errors"] = {str(i): m.error for i, m in enumerate(st.models) if m.error}
        for i, m in enumerate(st.models):  # measured: whether it has a chat template
            if m.chat_template is not None and i < len(doc["models"]):
                doc["models"][i]["chat_template"] = m.chat_template
            if m.modalities is not None and i < len(doc["models"]):
                doc["models"][i]["modalities"] = m.modalities
        remotes = {}
        for slot, rm in st.remotes.items():
            if rm.node:  # another cluster node: its own public port, hop header added
                remotes[str(slot)] = {"host": rm.host, "port": rm.port, "tls": False,
                                      "prefix": "", "api_key": None, "hop": True,
                                      "node": rm.node}
                continue
            e = st.registry.entries[rm.model]
            u = urlsplit(rm.url)
            remotes[str(slot)] = {"host": rm.host, "port": rm.port, "tls": u.scheme == "https",
                                  "prefix": u.path.rstrip("/"), "api_key": e.api_key}
        doc["remotes"] = remotes  # proxies only: the segment is mode 0600
        doc["reload_ids"] = list(st.reload_ids)  # the reloads done (GET /models?reload=1)
        doc["reload_errors"] = dict(st.reload_errors)  # and why, for those that failed
        doc["cache_clears"] = dict(st.cache_clears)  # POST /cache/clear's answers, by id
        # the router's own settings, for GET /props without a model (llama.cpp router)
        doc["router"] = {"models_max": st.cfg.models_max,
                         "models_autoload": st.cfg.models_autoload,
                         "model_fallback": st.cfg.model_fallback, "metrics": st.cfg.metrics,
                         "metrics_compat": st.cfg.metrics_compat,
                         "kv_block_size": st.cfg.kv_block_size}
        if st.cluster_doc is not None:
            doc["cluster"] = st.cluster_doc
        st.seg.write_registry(doc)

    def if_dirty(self) -> None:
        """Publish what changed since the last publish (nothing if nothing)."""
        st = self.state
        if st.errors_dirty:
            self.registry()
            st.errors_dirty = False
            st.dirty = True
        if st.dirty:
            self.tables()

    def tables(self) -> None:
        """Write the replicas, models and devices tables as one publish and
        wake the proxies."""
        st = self.state
        seg = st.seg
        seg.begin_publish()  # readers wanting whole tables wait for end_publish
        counts, _ = st.demand()
        per_model: dict[int, list[Replica]] = {}
        for r in st.replicas.values():
            per_model.setdefault(r.model, []).append(r)
        for slot in range(st.sizes.replicas):
            r = st.replicas.get(slot)
            rm = st.remotes.get(slot)
            if rm is not None:
                entry = st.registry.entries[rm.model]
                write_fields(seg.replicas, slot, {
                    L.R_MODEL: rm.model, L.R_PORT: rm.port, L.R_PID: 0,
                    L.R_STATUS: L.ReplicaStatus.READY if rm.healthy else L.ReplicaStatus.LOADING,
                    L.R_INCARNATION: rm.incarnation, L.R_READY_NS: 1,
                    L.R_WEIGHT: round(entry.weight * 1000),
                    L.R_PRIORITY: entry.priority + (NODE_PRIORITY if rm.node else 0),
                    L.R_MAX_CONCURRENCY: entry.max_concurrency,
                    L.R_SECRET_HI: 0, L.R_SECRET_LO: 0, L.R_DRAINING: 0,
                })
                continue
            if r is None:
                if int(seg.replicas[slot, L.R_MODEL]) != -1:
                    write_fields(seg.replicas, slot, {
                        L.R_MODEL: -1, L.R_STATUS: L.ReplicaStatus.FREE, L.R_PORT: 0,
                        L.R_PID: 0, L.R_INCARNATION: 0, L.R_READY_NS: 0,
                        L.R_SECRET_HI: 0, L.R_SECRET_LO: 0, L.R_DRAINING: 0,
                    })
                continue
            entry = st.registry.entries[r.model]
            write_fields(seg.replicas, slot, {
                L.R_MODEL: r.model, L.R_STATUS: r.status, L.R_PORT: r.port,
                L.R_PID: r.child.pid, L.R_INCARNATION: r.incarnation,
                L.R_STARTED_NS: r.started_ns, L.R_READY_NS: r.ready_ns,
                L.R_WEIGHT: round(entry.weight * 1000), L.R_PRIORITY: entry.priority,
                L.R_MAX_CONCURRENCY: entry.max_concurrency, L.R_SLOTS: r.slots,
                L.R_SECRET_HI: r.secret_hi, L.R_SECRET_LO: r.secret_lo,
                L.R_DRAINING: int(r.draining), L.R_DRAIN_FOR: r.drain_for,
                L.R_DRAIN_NS: r.drain_ns,
            })
        healthy_remote = {rm.model for rm in st.remotes.values() if rm.healthy}
        flags = self._cache_flags()
        for i, m in enumerate(st.models):
            reps = per_model.get(i, [])
            statuses = {r.status for r in reps}
            if i in healthy_remote:
                statuses.add(L.ReplicaStatus.READY)
            if L.ReplicaStatus.READY in statuses:
                status = L.ModelStatus.LOADED
            elif L.ReplicaStatus.LOADING in statuses:
                status = L.ModelStatus.LOADING
            elif L.ReplicaStatus.SLEEPING in statuses:
                status = L.ModelStatus.SLEEPING
            elif L.ReplicaStatus.STOPPING in statuses:
                status = L.ModelStatus.STOPPING
            else:
                status = L.ModelStatus.UNLOADED
            loading = [r for r in reps if r.status == L.ReplicaStatus.LOADING]
            progress = int(1000 * max((r.progress for r in loading), default=0.0))
            write_fields(seg.models, i, {
                L.M_STATUS: status,
                L.M_REPLICAS: sum(1 for r in reps if r.status == L.ReplicaStatus.READY)
                + sum(1 for rm in st.remotes.values() if rm.model == i and rm.healthy),
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
                # KV tiers (issue 29): RAM of its running replicas, its disk tier
                L.M_CACHE_RAM_BYTES: sum(r.cache_ram for r in reps),
                L.M_CACHE_DISK_BYTES: m.cache_disk_bytes,
                L.M_CACHE_FLAGS: flags[i] if i < len(flags) else 0,
                L.M_CACHE_EPOCH: m.cache_epoch,
                L.M_WAIT_REASON: m.wait_reason,
                L.M_WAIT_HOLDER: m.wait_holder + 1,
                L.M_WAIT_ETA_NS: m.wait_eta_ns,
                L.M_WAIT_FIRST_NS: m.wait_first_ns,
                L.M_SWAPS: m.swaps,
                L.M_DRAINS: m.drains,
            })
        for k, d in enumerate(st.ledger.devices):
            write_fields(seg.devices, k, {
                L.D_KIND: d.kind, L.D_INDEX: d.index, L.D_TOTAL: d.total,
                L.D_EXTERNAL: d.external, L.D_HELD: d.held, L.D_FREE: d.free,
                L.D_CALIBRATED_NS: d.calibrated_ns,
            })
        seg.end_publish()
        st.dirty = False
        for c in st.proxies.values():
            c.send(b"g")
