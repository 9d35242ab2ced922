"""A usage row, its totals, and the ring record -> row conversion.

One :class:`UsageRow` per request the ring recorded (issue 36): time,
key name, model, replica or upstream, node, prompt / cached /
completion tokens, TTFT, duration, status and cost. Costs are in the
currency of the prices (per million tokens, preset keys ``price-input``,
``price-cached-input``, ``price-output``); a count the replica did not
report is None (stored NULL) and costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..shm import requestring as Q

Prices = tuple[float, float, float]
"""(input, cached input, output) per million tokens; (0, 0, 0): free."""

KeyName = Callable[[int], "str | None"]
PricesOf = Callable[[str], Prices]

COLUMNS = ("time", "request_id", "key", "model", "replica", "node", "status",
           "prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "duration_ms",
           "cost", "refused")
"""The store's columns, in :meth:`UsageRow.values` order."""


@dataclass(slots=True)
class UsageRow:
    """One finished request. ``time``: its arrival, Unix seconds; ``key``:
    the key's name ("" for no policy key: the admin key, an ``--api-key``
    key, no key); ``replica``: ``local/<slot>``, an upstream's
    ``host:port``, another node's name, or "" when the proxy answered
    itself; ``node``: the node whose proxy took the request; token counts
    None when unknown; ``ttft_ms`` None when no byte came; ``cost`` in the
    prices' currency; ``refused``: its key did not admit it (a limit, a
    model it may not use), so it never counted in the key's windows (the
    other nodes' sync leaves it out too, :mod:`.sync`)."""

    time: float
    request_id: str
    key: str
    model: str
    replica: str
    node: str
    status: int
    prompt_tokens: int | None
    cached_tokens: int | None
    completion_tokens: int | None
    ttft_ms: float | None
    duration_ms: float
    cost: float
    refused: bool = False

    def values(self) -> tuple:
        """The row in :data:`COLUMNS` order (for an INSERT)."""
        return (self.time, self.request_id, self.key, self.model, self.replica, self.node,
                self.status, self.prompt_tokens, self.cached_tokens,
                self.completion_tokens, self.ttft_ms, self.duration_ms, self.cost,
                int(self.refused))


@dataclass(slots=True)
class Totals:
    """What a key used over a time range (the contract with the keys'
    windows: :meth:`~ggmux.ledger.ledger.UsageLedger.totals_since`)."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0

    def add(self, row: UsageRow) -> None:
        self.requests += 1
        self.prompt_tokens += row.prompt_tokens or 0
        self.cached_tokens += row.cached_tokens or 0
        self.completion_tokens += row.completion_tokens or 0
        self.cost += row.cost

    def merge(self, other: Totals) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.completion_tokens += other.completion_tokens
        self.cost += other.cost


def cost_of(prices: Prices, prompt: int | None, cached: int | None,
            completion: int | None) -> float:
    """A request's cost: uncached prompt tokens at the input price, cached
    ones at the cached-input price, completion tokens at the output price
    (prices per million tokens; unknown counts cost nothing)."""
    p_in, p_cached, p_out = prices
    if not (p_in or p_cached or p_out):
        return 0.0
    prompt, cached, completion = prompt or 0, cached or 0, completion or 0
    cached = min(cached, prompt)
    return ((prompt - cached) * p_in + cached * p_cached + completion * p_out) / 1e6


def _count(v) -> int | None:
    v = int(v)
    return None if v < 0 else v


@dataclass(slots=True)
class RowContext:
    """What turns ring records into rows, looked up when they are read
    (within a loop turn of the request's end): ``model_name(m)``,
    ``replica_name(slot)``, ``key_name(row)``,
    ``prices_of(model)``, this ``node``'s name."""

    model_name: Callable[[int], str]
    replica_name: Callable[[int], str]
    key_name: KeyName
    prices_of: PricesOf
    node: str

    def row(self, rec: np.ndarray) -> UsageRow:
        """The :class:`UsageRow` of ring record ``rec`` (its ``Q_WORDS`` int64 words)."""
        slot = int(rec[Q.Q_SLOT])
        model = self.model_name(int(rec[Q.Q_MODEL]))
        prompt, cached, gen = (_count(rec[Q.Q_PROMPT]), _count(rec[Q.Q_CACHED]),
                               _count(rec[Q.Q_GENERATED]))
        ttft = int(rec[Q.Q_TTFT_US])
        key_row = int(rec[Q.Q_KEY])
        key = (self.key_name(key_row) if key_row >= 0 else None) or ""
        return UsageRow(
            time=int(rec[Q.Q_WALL_NS]) / 1e9,
            request_id=rec[Q.Q_RID : Q.Q_RID + 2].tobytes().rstrip(b"\0").decode("latin-1"),
            key=key, model=model, replica=self.replica_name(slot) if slot >= 0 else "",
            node=self.node, status=int(rec[Q.Q_STATUS]),
            prompt_tokens=prompt, cached_tokens=cached, completion_tokens=gen,
            ttft_ms=None if ttft < 0 else ttft / 1000, duration_ms=int(rec[Q.Q_DURATION_US]) / 1000,
            cost=cost_of(self.prices_of(model), prompt, cached, gen) if model else 0.0,
            refused=bool(int(rec[Q.Q_FLAGS]) & Q.F_KEY_REFUSED))
