"""What the proxy does when a forward to a replica failed before anything
reached the client: the fault counted for the replica's breaker and error
counters (:meth:`ReplicaFailures._forward_failed`), and, for a request lost
on a connection the replica closes after chunked answers, whether the
replica lives on (:meth:`ReplicaFailures._alive`) and so may get it again.
A mixin of :class:`~ggmux.proxy.server.Proxy`, as
:class:`~.forward.Forwarding` is (whose hot path calls it only on a
failure); its attributes are the proxy's.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..http1 import HttpConnection
from ..http1.exchange import UpstreamError
from ..http1.request import Request
from ..shm import layout as L
from ..shm.layout import C_ERRORS, C_TIMEOUT_NS, C_TTFT_COUNT, C_TTFT_EWMA_US, MC_ERRORS
from . import answers
from .accounting import TTFT_ALPHA
from .forward import HABIT_CHECK_S

log = logging.getLogger("ggmux.proxy.forward")


class ReplicaFailures:
    """The failures' half of :class:`~ggmux.proxy.server.Proxy` (module
    docstring)."""

    def _fast_habit(self, conn: HttpConnection, req: Request, m: int, slot: int,
                    r: UpstreamError) -> None:
        """A fast forward lost on a connection the replica closes after
        chunked answers: the slow path sends it again if the replica lives
        on, else it is the replica's death (502, never sent again)."""
        if self.stopping:
            answers.stopping(conn, req)
        elif self._alive(slot):
            log.info("proxy %d: %s just after a streamed answer, and the replica lives on: "
                     "sending the request again", self.index, r)
            conn.run_handler(req)
        else:
            self._forward_failed(slot, m, r, 1)
            answers.replica_failed(conn, req, self.reg_models[m]["name"], r)
            self.activity.record(req, m, slot, None, req.status)

    async def _lived_on(self, slot: int) -> bool:
        """:meth:`_alive` :data:`HABIT_CHECK_S` from now (a replica that died
        with the request has exited by then)."""
        await asyncio.sleep(HABIT_CHECK_S)
        return self._alive(slot)

    def _alive(self, slot: int) -> bool:
        """Whether the local process of replica ``slot`` is still running
        (not gone, not a zombie); False for a remote one (no pid)."""
        pid = int(self.replica_rows[slot, L.R_PID])
        if pid <= 0:
            return False
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return False
        return state not in (b"Z", b"X", b"x")

    def _forward_failed(self, slot: int, m: int, err: UpstreamError, attempt: int) -> None:
        """A forward to ``slot`` failed before anything reached the client:
        a fault for its breaker (and, for a timeout, the hung-replica clock)
        and the error counters; the tables are re-read, since the replica
        may be gone."""
        now = time.monotonic_ns()
        cw = self.cw[slot]
        self.breakers[slot].record(False, now)
        if err.timeout:
            cw[C_TIMEOUT_NS] = now
            # its TTFT was at least the timeout: a sample that steers the
            # balancer to the other replicas at once (the circuit needs
            # three faults), until the replica has been left alone for
            # ttft_forget_s and is tried again
            us = self.model_first_byte_ns[m] // 1000
            old = cw[C_TTFT_EWMA_US]
            cw[C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
            cw[C_TTFT_COUNT] += 1
        cw[C_ERRORS] += 1
        self.mcw[m][MC_ERRORS] += 1
        log.warning("proxy %d: %s (attempt %d)", self.index, err, attempt)
        self.gen = -1
        self.refresh()
