"""The bounds of the contention policy per model (issue 34): how long its
waiters wait for capacity that other models hold (``max-wait``) and how long
it keeps its capacity once swapped in while it has demand
(``min-residency``). Pure functions of the options and measured load times;
:mod:`.reconcile` feeds them to :mod:`.scheduler`.

Why these defaults: a swap costs the incoming model one load (``L``). A
time slice of at least :data:`MIN_RESIDENCY_LOADS` x ``L`` keeps loading at
most ``1 / (1 + MIN_RESIDENCY_LOADS)`` (25 %) of wall time when models take
turns at saturation; a bound of :data:`MAX_WAIT_LOADS` x ``L``, never under
:data:`MAX_WAIT_FLOOR_S`, makes a waiting model drain the holder only when
its clients have waited several loads' worth, so short bursts are grouped
instead of swapped (llama-swap #612: "a max wait time, so nothing waits
forever, and a minimum loaded time").
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_WAIT_FLOOR_S = 30.0
"""The least default bound, seconds: tens of seconds, whatever the load time."""

MAX_WAIT_LOADS = 4.0
"""The default bound in the waiting model's mean load times."""

MIN_RESIDENCY_LOADS = 3.0
"""The default minimum residency in the resident replica's own load time."""

UNKNOWN_LOAD_S = 5.0
"""The load time assumed for a model never loaded here (its first load)."""

DEMAND_GRACE_S = 2.0
"""The default ``--demand-grace``: a closed-loop client (a chat, an agent,
a script) thinks 0-2 s between an answer and its next request."""

RETURN_START = 0.5
"""A model's share of idle spells its clients ended within the grace,
before any was seen: undecided, so a model holds only once its clients came
back within the grace (a round robin's clients, which never come back in
time, never make a waiting model wait for a grace)."""

HOLD_MIN_S = 0.25
"""The shortest hold of a model whose clients come back (:meth:`Returns.hold_s`):
a return gap measured near zero still leaves room for a client's network
and its next request's parse."""

RETURN_WEIGHT = 0.5
"""Weight of the newest spell in that share (the last two or three count)."""


def max_wait_s(preset: float | None, option: float | None, loads: int,
               load_ns_total: int) -> float:
    """The bound of a model's wait, seconds: its preset's ``max-wait``, else
    ``--max-wait``, else :data:`MAX_WAIT_LOADS` x its mean load time (from
    ``loads`` completed loads taking ``load_ns_total`` ns together;
    :data:`UNKNOWN_LOAD_S` before the first), at least
    :data:`MAX_WAIT_FLOOR_S`. 0 means no bound (it waits for idle capacity)."""
    if preset is not None:
        return preset
    if option is not None:
        return option
    mean = load_ns_total / loads / 1e9 if loads > 0 else UNKNOWN_LOAD_S
    return max(MAX_WAIT_FLOOR_S, MAX_WAIT_LOADS * mean)


def min_residency_s(preset: float | None, option: float | None, load_s: float) -> float:
    """How long a replica that took ``load_s`` seconds to load keeps its
    capacity while it has demand: its model's ``min-residency``, else
    ``--min-residency``, else :data:`MIN_RESIDENCY_LOADS` x ``load_s``."""
    if preset is not None:
        return preset
    if option is not None:
        return option
    return MIN_RESIDENCY_LOADS * max(0.0, load_s)


@dataclass(slots=True)
class Returns:
    """Whether each model's clients come back within ``grace_s`` of its
    last request: per model, the start of its current idle spell (nothing
    in flight, nobody waiting; monotonic ns) and the decayed share of its
    spells that ended within the grace.

    Why: a model idle between two requests of the same client looked
    free, so the next request for another model evicted it ("idle 0.0 s")
    and the client's next request swapped it back. A model *holds* (its
    idle replica counts as having demand for the grace) only while its
    spells mostly end within the grace, so clients that moved on to
    another model (round robin) do not make the waiting model wait for
    nothing."""

    grace_s: float = DEMAND_GRACE_S
    idle_since: dict[int, int | None] = field(default_factory=dict)  # None: counted already
    share: dict[int, float] = field(default_factory=dict)
    gap: dict[int, float] = field(default_factory=dict)  # mean seconds of spells that returned

    def step(self, now_ns: int, demand: dict[int, int], loaded: set[int]) -> None:
        """One tick: ``demand`` is requests waiting or in flight per model,
        ``loaded`` the models with a replica up or loading."""
        if self.grace_s <= 0:
            return
        grace = int(self.grace_s * 1e9)
        for m in list(self.idle_since):
            start = self.idle_since[m]
            if demand.get(m, 0) > 0:  # its clients are back: the spell ends
                if start is not None:
                    back = now_ns - start <= grace
                    self._count(m, back)
                    if back:
                        self.gap[m] = ((1 - RETURN_WEIGHT) * self.mean_gap(m)
                                       + RETURN_WEIGHT * (now_ns - start) / 1e9)
                del self.idle_since[m]
            elif start is not None and now_ns - start > grace:
                self._count(m, False)  # past the grace: counted once, then wait for demand
                self.idle_since[m] = None
        for m in loaded:
            if demand.get(m, 0) <= 0 and m not in self.idle_since:
                self.idle_since[m] = now_ns

    def _count(self, m: int, returned: bool) -> None:
        old = self.share.get(m, RETURN_START)
        self.share[m] = (1 - RETURN_WEIGHT) * old + RETURN_WEIGHT * float(returned)

    def holds(self, m: int) -> bool:
        """Whether model ``m``'s idle replica is held through its grace."""
        return self.grace_s > 0 and self.share.get(m, RETURN_START) > 0.5

    def pays(self, m: int, load_s: float, waiting: int) -> bool:
        """Whether holding model ``m`` (it :meth:`holds`; its replica took
        ``load_s`` seconds to load) pays while ``waiting`` requests for
        other models wait for its capacity. A hold costs each of them about
        the model's mean return gap (its clients' think time when they come
        back); it saves a returning client the model's reload, as often as
        its clients come back: hold only when ``share x load_s >= waiting x
        gap``. A round robin's clients come back to a small model after a
        second (the other model's turn): not worth holding a waiter for; a
        burst's come back within tens of milliseconds, and a model that
        loads in 10 s is worth a few waiters' think time."""
        if not self.holds(m):
            return False
        return self.share.get(m, RETURN_START) * load_s >= waiting * self.mean_gap(m)

    def hold_s(self, m: int) -> float:
        """How long model ``m``'s idle replica is held: three of its mean
        return gaps (most returns come within them), at least
        :data:`HOLD_MIN_S`, at most the grace."""
        return min(self.grace_s, max(HOLD_MIN_S, 3 * self.mean_gap(m)))

    def mean_gap(self, m: int) -> float:
        """Model ``m``'s mean return gap (seconds), half the grace until one
        return was measured."""
        return self.gap.get(m, self.grace_s / 2)
