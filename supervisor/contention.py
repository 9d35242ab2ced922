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

MAX_WAIT_FLOOR_S = 30.0
"""The least default bound, seconds: tens of seconds, whatever the load time."""

MAX_WAIT_LOADS = 4.0
"""The default bound in the waiting model's mean load times."""

MIN_RESIDENCY_LOADS = 3.0
"""The default minimum residency in the resident replica's own load time."""

UNKNOWN_LOAD_S = 5.0
"""The load time assumed for a model never loaded here (its first load)."""


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
