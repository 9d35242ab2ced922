"""When a draft pays (speculative decoding, :mod:`.draft`): the step's cost
measured on this machine, and the draft length that gives the most tokens
per second, none when every length loses.

A decode of ``n`` batch tokens takes about ``a + b * n`` seconds (llama.cpp's
cost per token in a batch on a CPU is far from free: smollm2-135m on one
thread, 23 ms for one token, 90 ms for nine). :class:`StepCost` fits ``a``
and ``b`` from the engine's own generation steps (exponentially weighted
least squares, so a loaded machine or a longer context moves it), since a
constant measured once on one machine made drafting lose elsewhere (0.95x
of no drafts on a file the model copied with slips, where the constant
said it paid).

A step of ``g`` generating slots gives ``g`` tokens; a draft of ``k``
tokens whose positions are each accepted with chance ``r`` (until the first
miss) adds ``E(k) = r + r^2 + ... + r^k`` tokens and ``b * k`` seconds, so
the step's tokens per second change by ``(1 + E(k) / g) / (1 + beta * k)``
with ``beta = b / (a + b * g)`` (:func:`best_length`). Drafting is worth it
only where that beats 1 by :data:`MARGIN` (the estimates are noisy: a draft
that only breaks even is not made). No llama.cpp here.
"""

from __future__ import annotations

DECAY = 0.97
"""Weight of the older samples at each new one (about the last 30 steps count)."""
MIN_SPREAD = 0.25
"""Weighted variance of the samples' batch sizes (tokens^2) below which the
slope is not fitted (steps that all had the same size say nothing about it)."""
MIN_WEIGHT = 8.0
"""Decayed sample weight (about the last eight steps) below which the fit is
not trusted and the prior stands."""
MARGIN = 1.05
"""The least gain (tokens per second, over no draft) a draft must promise."""
PROBE = 2
"""Tokens of the draft a slot makes after a pause, to learn its acceptance
again, where its proposer costs a decode (a draft model)."""


class StepCost:
    """The fit of a decode's seconds against its batch tokens (module
    docstring); ``prior`` (``SpecConfig.token_cost``) is ``b / (a + b)``
    until the samples say otherwise."""

    __slots__ = ("prior", "sn", "snn", "snt", "st", "w")

    def __init__(self, prior: float) -> None:
        self.prior = prior
        self.w = self.sn = self.snn = self.st = self.snt = 0.0

    def add(self, n: int, seconds: float) -> None:
        """One decode of ``n`` batch tokens that took ``seconds``."""
        if n <= 0 or seconds <= 0:
            return
        d = DECAY
        self.w = d * self.w + 1.0
        self.sn = d * self.sn + n
        self.snn = d * self.snn + n * n
        self.st = d * self.st + seconds
        self.snt = d * self.snt + n * seconds

    def fit(self) -> tuple[float, float] | None:
        """``(a, b)`` in seconds, or None while the samples cannot tell (too
        few sizes, or a fit that is not a cost: ``a`` or ``b`` not positive)."""
        if self.w < MIN_WEIGHT:
            return None
        mn, mt = self.sn / self.w, self.st / self.w
        var = self.snn / self.w - mn * mn
        if var < MIN_SPREAD:
            return None
        b = (self.snt / self.w - mn * mt) / var
        a = mt - b * mn
        if a <= 0 or b <= 0:
            return None
        return a, b

    def beta(self, g: int) -> float:
        """One more batch token's share of a step of ``g`` tokens' time."""
        g = max(1, g)
        f = self.fit()
        if f is None:
            c = self.prior
            return c / (1.0 - c + c * g) if c < 1 else 1.0 / g
        a, b = f
        return b / (a + b * g)


def best_length(r: float, beta: float, g: int, most: int) -> int:
    """The draft length, 0 .. ``most``, with the most tokens per second for
    acceptance ``r`` and token cost ``beta`` in a step of ``g`` slots (module
    docstring); 0 when none beats no draft by :data:`MARGIN`."""
    r = min(max(r, 0.0), 0.999)
    g = max(1, g)
    best_k, best = 0, MARGIN
    gain, p = 0.0, 1.0
    for k in range(1, most + 1):
        p *= r
        gain += p  # E(k)
        value = (1.0 + gain / g) / (1.0 + beta * k)
        if value > best:
            best_k, best = k, value
        elif p < 1e-3:
            break
    return best_k


__all__ = ["MARGIN", "PROBE", "StepCost", "best_length"]
