"""``upstream`` replicas: one permanent :class:`~.state.Remote` per URL of
a model's ``upstream`` list (several GPU boxes serving one model: issue
11, finding 12), never loaded or evicted, only health-checked (every 5 s
while healthy, backing off from 0.1 s while not).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from .probe import ProbeSet
from .state import NS, Remote, State

log = logging.getLogger(__name__)


class Remotes:
    """Keeps ``state.remotes`` in line with the registry and probes them."""

    def __init__(self, state: State, probes: ProbeSet) -> None:
        self.state = state
        self.probes = probes

    def add(self) -> None:
        """One permanent replica per URL of each model's ``upstream`` list
        (the presets checked each URL: ``http://`` with a host)."""
        st = self.state
        have = {(rm.model, rm.url) for rm in st.remotes.values()}
        for i, e in enumerate(st.registry.entries):
            for url in e.upstream:
                if (i, url) in have:
                    continue
                u = urlsplit(url)
                slot = st.free_slot()
                if slot is None:
                    log.warning("no replica slot for upstream %s of %s", u.netloc, e.name)
                    continue
                path = "" if not e.check_endpoint else (
                    u.path.rstrip("/") + e.check_endpoint if e.check_endpoint.startswith("/")
                    else e.check_endpoint)
                st.remotes[slot] = Remote(slot, i, u.hostname or "127.0.0.1", u.port or 80, path,
                                          st.next_incarnation(), url=url)

    def drop_removed(self) -> None:
        """Forget the remotes of models removed from every source, and
        those whose URL is no longer in their model's ``upstream`` list
        (a cluster node's replica has no URL there: :mod:`.cluster.node` keeps it)."""
        st = self.state
        for slot, rm in list(st.remotes.items()):
            if rm.node:
                continue
            if rm.model in st.removed or rm.url not in st.registry.entries[rm.model].upstream:
                del st.remotes[slot]

    def probe_step(self, now: int) -> None:
        """Health of ``upstream`` replicas (``now``: monotonic ns); a change
        is logged and published."""
        st = self.state
        for rm in st.remotes.values():
            if rm.probe is not None and rm.probe.done:
                ok = rm.probe.ok
                if ok != rm.healthy:
                    log.log(logging.INFO if ok else logging.WARNING, "%s %s:%d for %s is %s%s",
                            f"node {rm.node}" if rm.node else "upstream", rm.host, rm.port,
                            st.name(rm.model), "healthy" if ok else "unhealthy",
                            "" if ok else f" ({rm.probe.why})")
                    rm.healthy = ok
                    st.dirty = True
                if not ok and rm.fails == 0 and not rm.healthy and not rm.reported:
                    log.warning("upstream %s:%d for %s is not answering (%s)", rm.host,
                                rm.port, st.name(rm.model), rm.probe.why)
                    rm.reported = True
                rm.fails = 0 if ok else rm.fails + 1
                rm.probe = None
                delay = 5.0 if ok else min(5.0, 0.1 * 2 ** min(rm.fails, 6))
                rm.next_probe_ns = now + int(delay * NS)
            if rm.probe is None and now >= rm.next_probe_ns:
                rm.probe = self.probes.start(rm.host, rm.port, rm.path, rm, now)
