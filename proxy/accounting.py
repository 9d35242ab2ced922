"""The accounting of each forwarded request, in this proxy's shared-memory
counters: the breaker's verdict on a relayed response
(:meth:`Accounting._verdict`), the request, error and TTFT counters per
replica and per model (:meth:`Accounting._account`), and the time a request
waited for its model (:meth:`Accounting._waited`). A mixin of
:class:`~ggmux.proxy.server.Proxy` on the hot path, compiled as
:mod:`.forward` is (:data:`ggmux.compiled.HOT_MODULES`,
``proxy/accounting.pxd``); its attributes are the proxy's.
"""

from __future__ import annotations

from bisect import bisect_left

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

from ..http1.exchange import Exchange
from ..http1.request import Request
from ..shm import layout as L

# the counter words by name, not L.X: compiled, a global costs less than a module attribute
from ..shm.layout import (
    C_ANSWER_NS,
    C_ERRORS,
    C_REQUESTS,
    C_TIMEOUT_NS,
    C_TTFT_COUNT,
    C_TTFT_EWMA_US,
    C_TTFT_LAST_US,
    C_TTFT_SUM_US,
    MC_BUCKET0,
    MC_ERRORS,
    MC_RECENT0,
    MC_RECENT_N,
    MC_REQUESTS,
    MC_TTFT_COUNT,
    MC_TTFT_SUM_US,
    TTFT_RECENT,
)

TTFT_ALPHA = 0.2  # EWMA weight of the newest sample
# bucket bounds in microseconds; an index past the last is the +Inf bucket
_TTFT_BUCKETS_US = tuple(b * 1000 for b in L.TTFT_BUCKETS_MS)
_WAIT_BUCKETS_US = tuple(int(b * 1_000_000) for b in L.WAIT_BUCKETS_S)
WAIT_HEADER = b"x-ggmux-wait-ms"
"""Response header: how long the request waited for its model's capacity
or load before a replica took it, milliseconds (issue 34); only on a request
that waited."""


@cython.locals(v=cython.long[:])
def counter_rows(table) -> list:
    """One object per row of counter ``table`` (an int64 ``(rows, words)``
    array, this proxy's part of the segment) for the per-request updates.
    Compiled: Cython memoryviews of the rows, which a function typing its
    row ``cython.long[:]`` takes as they are (a Python memoryview, or a
    numpy row, is wrapped anew and its buffer format parsed at every such
    call: about 2,500 instructions, three or four times a request); pure
    Python: memoryviews (a Python-level word costs a fifth of a numpy
    scalar's get and set)."""
    if not cython.compiled:
        return [memoryview(row) for row in table]
    out = []
    for row in table:
        v = row
        out.append(v)
    return out


class Accounting:
    """The accounting half of :class:`~ggmux.proxy.server.Proxy` (module
    docstring)."""

    @cython.locals(ex=Exchange, cw=cython.long[:])
    def _verdict(self, slot: int, ex: Exchange, now: int, judged: list | None = None) -> None:
        """The breaker's verdict on a relayed response: a fault
        (:func:`~ggmux.proxy.balancer.replica_fault`, a replica that died or
        went silent mid-body) fails, anything else succeeds, and a client
        that left before the first byte gives none (the probe slot is only
        released). ``judged``: the probe's head already gave its verdict
        (the list holds it); only a fault after that still counts. Also
        stamps the replica's last answer or timeout (hung-replica restarts)."""
        br = self.breakers[slot]
        cw = self.cw[slot]
        if ex.timed_out:
            cw[C_TIMEOUT_NS] = now
        elif ex.status != 499:
            cw[C_ANSWER_NS] = now
        if judged:
            if ex.fault and not judged[0]:
                br.record(False, now)
        elif ex.status == 499 and not ex.first_byte_ns:
            br.release()
        else:
            br.record(not ex.fault, now)

    def _waited(self, m: int, req: Request, ns: int) -> None:
        """A request that waited ``ns`` for model ``m`` is taken by a
        replica: count the wait in the model's histogram
        (:data:`~ggmux.shm.layout.WAIT_BUCKETS_S`) and tell the client in
        :data:`WAIT_HEADER` (issue 34). Requests that left or gave up while
        waiting never get here."""
        us = max(0, ns) // 1000
        mc = self.mcw[m]
        mc[L.MC_WAIT_COUNT] += 1
        mc[L.MC_WAIT_SUM_US] += us
        mc[L.MC_WAIT_BUCKET0 + bisect_left(_WAIT_BUCKETS_US, us)] += 1
        req.extra_head = bytes(req.extra_head) + b"%s: %d\r\n" % (WAIT_HEADER, us // 1000)

    @cython.locals(cnt=cython.long[:], mc=cython.long[:], ex=Exchange,
                   us=cython.longlong, old=cython.longlong, k=cython.longlong)
    def _account(self, cnt: memoryview, m: int, ex: Exchange) -> None:
        """Count one forwarded request: requests, errors, TTFT (EWMA, last,
        sum, count; microseconds) per replica, and per model the TTFT
        histogram in :data:`~ggmux.shm.layout.TTFT_BUCKETS_MS` and the ring
        of its :data:`~ggmux.shm.layout.TTFT_RECENT` last samples."""
        cnt[C_REQUESTS] += 1
        mc = self.mcw[m]
        mc[MC_REQUESTS] += 1
        if ex.status >= 500:
            cnt[C_ERRORS] += 1
            mc[MC_ERRORS] += 1
        if ex.first_byte_ns and ex.sent_ns:
            us = (ex.first_byte_ns - ex.sent_ns) // 1000
            if us > 0:
                old = cnt[C_TTFT_EWMA_US]
                cnt[C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
                cnt[C_TTFT_LAST_US] = us
                cnt[C_TTFT_SUM_US] += us
                cnt[C_TTFT_COUNT] += 1
                mc[MC_TTFT_COUNT] += 1
                mc[MC_TTFT_SUM_US] += us
                # bucket i counts TTFT <= TTFT_BUCKETS_MS[i] ms (and above the one before)
                mc[MC_BUCKET0 + bisect_left(_TTFT_BUCKETS_US, us)] += 1
                k = mc[MC_RECENT_N]  # the recent samples' ring (/ps's p50)
                mc[MC_RECENT0 + k % TTFT_RECENT] = us
                mc[MC_RECENT_N] = k + 1
