"""How long a stopping server lets its answers run (issue 37, item 8).

The supervisor stops instances (``exit``) and proxies (stdin EOF) at once.
An instance lets its running requests go on for its model's
``stop-timeout`` less one second, then ends each stream itself with an
error event; a proxy must not end those streams first (its abort is the
backstop), nor stop before their last bytes left; and the supervisor must
not SIGKILL a proxy that is still writing them. All three use these
figures, so the order holds whatever the presets say.
"""

from __future__ import annotations

from collections.abc import Iterable

DRAIN_TIMEOUT_S = 10.0
"""The least a proxy's drain lets running requests go on (README "Stopping")."""

DRAIN_SLACK_S = 2.0
"""Seconds a proxy's drain waits past the longest model stop-timeout."""

DRAIN_FLUSH_S = 2.0
"""Seconds past a drain's deadline for the answers' last bytes to leave."""


def drain_budget(stop_timeouts: Iterable[float], floor: float = DRAIN_TIMEOUT_S) -> float:
    """Seconds a proxy's drain lets requests run: the longest of the
    models' ``stop_timeouts`` (seconds) plus :data:`DRAIN_SLACK_S`, at least
    ``floor``."""
    return max(floor, max(stop_timeouts, default=0.0) + DRAIN_SLACK_S)
