"""A replica's verdict on its own error answer, and the rule that judges
an answer the replica did not mark (issue 11): what the upstream client
(:mod:`.upstream`) records per exchange and the balancer's circuit breaker
(:mod:`ggmux.proxy.balancer`) counts.
"""

from __future__ import annotations

REPLICA_HEADER = b"x-ggmux-replica"
"""Response header in which a replica judges its own error answer (issue 11):
``fault`` (the replica failed: it counts against its circuit), ``refused``
(it did not act on the request because it is stopping or asleep: the proxy
may send the request elsewhere, and no verdict), ``request`` (the request
caused it: no fault). The built-in instance sets it; the proxy reads it and
does not relay it."""

GATEWAY_FAULTS = frozenset((502, 503, 504))
"""Statuses that count as the replica's fault when it does not say
otherwise: Envoy's gateway errors (``consecutive_gateway_failure``), what a
server or the gateway in front of it answers when it cannot serve at all."""


def replica_fault(status: int, mark: bytes | None) -> bool:
    """Whether a response with ``status`` counts against the replica's
    circuit (issue 11, finding 2: client mistakes must not open circuits).

    ``mark``: the replica's :data:`REPLICA_HEADER`, lower-case, or None.
    Below 500: never. Marked: only ``fault``. Unmarked: only
    :data:`GATEWAY_FAULTS`; a plain 500 (llama-server answers bad grammars
    and other request errors so), 501 (a route it lacks) or any other 5xx
    is the request's. Connect errors, a replica that dies with the request
    and timeouts count too; the proxy records those itself."""
    if status < 500:
        return False
    if mark is not None:
        return mark == b"fault"
    return status in GATEWAY_FAULTS
