"""A key that keeps making other tenants' models drain waits longer for the
next drain (``--drain-penalty``).

Model-level contention is the design (DESIGN.md "Scheduler"): a model
whose requests waited past its bound (``--max-wait``) drains a busy one.
But one tenant could turn that into a denial of service: with
``--max-wait 3``, six one-token requests of one key drained another key's
busy model five times in 45 s and cut its throughput by a third. So each
drain a key's requests caused counts against that key: while it has
caused ``n`` drains lately, its next request for a model that has to wait
begins to count its wait ``penalty * (2**n - 1)`` seconds after it arrived
(``--drain-penalty``, 30 s by default; at most :data:`PENALTY_CAP_S`): only
then does the bound run for it, so the next drain comes that much later
(1 s, 31 s, 91 s, 211 s ... after the bound). Its request still loads its
model at once when there is room (a free slot, an idle model to evict):
the penalty delays only a drain of a busy model. The count decays, halving
every :data:`HALF_LIFE_S` seconds (a drain stops counting after one
half-life, once it weighs under half). Keys of the keys file only (their row
of the key table holds the count): ``--api-key`` keys and the admin key
are the operator's.

A drain is counted against every key whose request waited for the model it
made room for, and was then served (several keys waiting together share
it: each caused it).

How the delay reaches the scheduler (:class:`~.waiting.ModelWaiters`): a
waiting request is counted in its proxy's waiters row at once (so a
model with room loads), but its arrival enters the row's
``W_FIRST_NS``, the time the supervisor's bound runs from, only once its
penalty has passed.
"""

from __future__ import annotations

import math

from ..shm.keytable import K_DRAINS_MILLI, K_DRAINS_MS, KeyTable

HALF_LIFE_S = 600.0
"""The drains a key caused count half as much after this many seconds."""
PENALTY_CAP_S = 3600.0
"""The longest penalty, seconds: a key is never kept from a drain longer."""
DEFAULT_PENALTY_S = 30.0
"""``--drain-penalty``'s default: a key's first drain costs it one such
wait before its next (the bound's floor, ``MAX_WAIT_FLOOR_S``, by default)."""


def decayed(milli: int, since_ms: int, now_ms: int) -> float:
    """Drains (a float) ``milli`` thousandths counted at ``since_ms`` are
    worth at ``now_ms`` (ms of the key table's clock)."""
    if milli <= 0:
        return 0.0
    age = max(0, now_ms - since_ms) / 1000
    return milli / 1000 * 0.5 ** (age / HALF_LIFE_S)


def penalty_s(base_s: float, drains: float) -> float:
    """The penalty of a key that caused ``drains`` (decayed) drains lately:
    ``base_s * (2**n - 1)``, ``n`` the drains rounded (a drain counts whole
    until it decayed under half, one half-life), at most :data:`PENALTY_CAP_S`."""
    n = int(drains + 0.5)
    if base_s <= 0 or n <= 0:
        return 0.0
    return min(PENALTY_CAP_S, base_s * (2.0 ** min(n, 30) - 1))


class DrainPenalty:
    """The drain penalty of one proxy's keys (module docstring): ``table``
    the key table, ``base_s`` ``--drain-penalty`` (0: off)."""

    __slots__ = ("base_s", "table")

    def __init__(self, table: KeyTable, base_s: float = DEFAULT_PENALTY_S) -> None:
        self.table = table
        self.base_s = base_s

    def _now_ms(self) -> int:
        return math.floor(self.table.now() * 1000)

    def delay_ns(self, row: int) -> int:
        """How long after its arrival a request of key ``row`` (-1: no key of
        the keys file) begins to count its wait for a drain, ns."""
        if row < 0 or self.base_s <= 0:
            return 0
        r = self.table.keys[row]
        drains = decayed(int(r[K_DRAINS_MILLI]), int(r[K_DRAINS_MS]), self._now_ms())
        return int(penalty_s(self.base_s, drains) * 1e9)

    def caused(self, row: int) -> None:
        """Count one drain against key ``row``, under its row's lock."""
        if row < 0:
            return
        now = self._now_ms()
        with self.table.locked(row) as r:
            drains = decayed(int(r[K_DRAINS_MILLI]), int(r[K_DRAINS_MS]), now) + 1
            r[K_DRAINS_MILLI] = round(drains * 1000)
            r[K_DRAINS_MS] = now

    def drains(self, row: int) -> float:
        """The drains key ``row`` caused lately (decayed): ``GET /keys``."""
        r = self.table.keys[row]
        return decayed(int(r[K_DRAINS_MILLI]), int(r[K_DRAINS_MS]), self._now_ms())


__all__ = ["DEFAULT_PENALTY_S", "DrainPenalty", "decayed", "penalty_s"]
