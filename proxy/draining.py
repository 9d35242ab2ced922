"""A proxy's graceful stop: on stdin's EOF (the supervisor is stopping, or
gone) it stops accepting, lets the requests being answered finish within
the drain budget, ends what is left with :data:`STOPPING`, and stops its
loop once every connection is settled (:meth:`Draining.drain`). A mixin of
:class:`~ggmux.proxy.server.Proxy`; its attributes are the proxy's.
"""

from __future__ import annotations

import logging

from ..http1.drain import DRAIN_FLUSH_S, drain_budget
from ..shm import layout as L
from .waiting import MAX_WAITERS

log = logging.getLogger("ggmux.proxy")

STOPPING = "the server is stopping"


class Draining:
    """The graceful stop's half of :class:`~ggmux.proxy.server.Proxy`
    (module docstring)."""

    def drain(self) -> None:
        """Stdin EOF (the supervisor is stopping, or gone): stop accepting,
        let the requests being answered finish, then answer whatever is
        left and stop.

        Nothing accepted is dropped without an answer (issue 11): requests
        waiting for a load or a replica get 503 ``shutting_down`` at once,
        and so does a request that arrives meanwhile on a kept-alive
        connection; at the deadline each exchange still in flight ends with
        that 503, or mid-stream with an SSE error event saying the server
        is stopping. A supervisor killed outright takes its instances with
        it, so their requests fail fast and this is quick.

        The order (issue 37, item 8): the deadline is the longest
        ``stop-timeout`` of the models plus ``DRAIN_SLACK_S`` (at least
        ``drain_timeout``), so an instance, which ends its own streams one
        second before its stop-timeout, ends them first, with its own final
        event, and this proxy's abort is only the backstop; and the loop
        stops only once every connection is settled (the last bytes of each
        answer written out, :meth:`ConnectionRegistry.unsettled`), not when
        the requests stop counting in flight, which they do before their
        last bytes leave; at most ``DRAIN_FLUSH_S`` after the deadline."""
        if self.stopping:
            return  # a SIGTERM with the supervisor gone, then stdin's EOF
        log.info("proxy %d: draining %d request(s), then exiting", self.index,
                 int(self.cnt[:, L.C_IN_FLIGHT].sum()))
        self.stopping = True
        self.pool.closing = STOPPING
        if self.server is not None:
            self.server.close()
        self.waiters.shutdown()  # no load will come now
        budget = self.drain_budget()
        deadline = self.loop.time() + budget
        aborted = [False]

        def check() -> None:
            inflight = self.cnt[:, L.C_IN_FLIGHT]  # a corrupt cell (< 0, huge) is not a request
            busy = bool(((inflight > 0) & (inflight <= MAX_WAITERS)).any()) or bool(self.waiters)
            unsettled = self.connections.unsettled() if self.connections is not None else 0
            now = self.loop.time()
            if not busy and not unsettled:
                self.loop.stop()
            elif now > deadline + DRAIN_FLUSH_S:
                log.warning("proxy %d: %d connection(s) still unsettled %g s after the drain's "
                            "end: closing", self.index, unsettled, DRAIN_FLUSH_S)
                self.loop.stop()
            elif now > deadline and not aborted[0]:
                aborted[0] = True
                n = self.pool.abort_all(STOPPING)
                log.warning("proxy %d: %d request(s) still running after %g s: ended with "
                            "'%s'", self.index, n, budget, STOPPING)
                self.loop.call_later(0.05, check)
            else:
                self.loop.call_later(0.05, check)

        check()

    def drain_budget(self) -> float:
        """Seconds a drain lets running requests go on (see :meth:`drain`
        and :func:`~ggmux.http1.drain.drain_budget`)."""
        return drain_budget((t for e in self.reg_models
                             if isinstance(t := e.get("stop_timeout"), (int, float))),
                            self.drain_timeout)
