"""One cached prefix in a tier: the token ids a sequence's KV holds, whose
cache scope made it, and where its bytes are (RAM or a disk file)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .entry_file import FileHeader


@dataclass(slots=True, eq=False)
class Entry:
    """``tokens``: int32 ids at positions ``0 ..`` of the saved sequence;
    ``scope``: the tenant under ``cache_scope`` ``key``, ``""`` under
    ``global``; ``pos_min``: the sequence's first position still in its KV
    (a sliding-window cache forgets older ones; 0 otherwise); ``nbytes``:
    the state's bytes; ``t_used``: the last save or restore
    (``time.monotonic()`` in RAM, wall time on disk). ``data``: the state
    (RAM tier); ``path`` and ``header``: its file (disk tier);
    ``checkpoints``: its context checkpoints in RAM (issue 35;
    :class:`~.checkpoint.Checkpoint`, their bytes counted in ``nbytes``)."""

    key: str
    scope: str
    tokens: np.ndarray
    pos_min: int
    nbytes: int
    t_used: float
    data: bytearray | None = None
    path: str | None = None
    header: FileHeader | None = None
    checkpoints: list | None = None

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def ckpt_tokens(self) -> tuple[int, ...]:
        """The token count of each of its checkpoints (RAM's, or its file's)."""
        if self.checkpoints is not None:
            return tuple(c.n_tokens for c in self.checkpoints)
        return self.header.ckpt_tokens if self.header is not None else ()


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two int32 arrays."""
    n = min(a.size, b.size)
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def contains(outer: np.ndarray, inner: np.ndarray) -> bool:
    """Whether ``inner`` is a prefix of ``outer`` (or equal)."""
    return inner.size <= outer.size and common_prefix(outer, inner) == inner.size


__all__ = ["Entry", "common_prefix", "contains"]
