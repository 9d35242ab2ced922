"""The commands the proxies send the supervisor through its message queue
(``{"op": ...}``, JSON): explicit loads and unloads, Ollama's
``keep_alive``, emptying the KV tiers, the keys' admin edits, a reload, a
cluster drain; read each turn of the loop (:meth:`QueueCommands._drain_queue`).
A mixin of :class:`~ggmux.supervisor.main.Supervisor`; its attributes are
the supervisor's (reloads are :mod:`.reloader`'s).
"""

from __future__ import annotations

import logging
import math
import time

import orjson
import posix_ipc

from ..shm import layout as L

log = logging.getLogger("ggmux.supervisor")


class QueueCommands:
    """The queue's commands of :class:`~ggmux.supervisor.main.Supervisor`
    (module docstring)."""

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


def _seconds(s: float) -> str:
    return "forever" if s == float("inf") else f"{s:g} s"
