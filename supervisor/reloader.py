"""The supervisor's reloads: every source rescanned (SIGHUP, ``GET
/models?reload=1``, ``--watch-config``), or a cluster's view of the other
nodes' models, merged into the running registry through a plan
(:func:`.reload.plan_reload`) that is committed only when it is valid. A
mixin of :class:`~ggmux.supervisor.main.Supervisor`; its attributes are the
supervisor's.
"""

from __future__ import annotations

import logging

from .registry import Registry
from .reload import plan_reload
from .state import ModelRuntime

log = logging.getLogger("ggmux.supervisor")


class Reloader:
    """The reloads of :class:`~ggmux.supervisor.main.Supervisor` (module
    docstring)."""

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
