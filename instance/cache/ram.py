"""The host-RAM tier: sequence states kept in process memory, LRU, bounded
as llama-server's ``--cache-ram`` bounds its prompt cache
(``server_prompt_cache`` in tools/server/server-task.cpp):

* ``limit_mib`` > 0: the states' bytes stay within it, the oldest entries
  leaving first; a state larger than the whole limit is not kept;
* ``-1``: no byte limit, the entries' tokens within ``limit_tokens`` (the
  context's cells, llama-server's ``n_ctx``);
* ``0``: the tier is off (llama-server's default is 8192 MiB).

A new entry replaces those it contains (an older, shorter prefix of the
same scope), and an entry already contained in another is not kept
(llama-server: "prompt is already in the cache, skipping"). Not
thread-safe: :class:`~.tiers.KVTiers` holds its lock around every call.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from .entry import Entry, contains

log = logging.getLogger(__name__)


class RamTier:
    """Entries by key, least recently used first; ``bytes`` and ``tokens``
    their sums."""

    def __init__(self, limit_mib: int, limit_tokens: int) -> None:
        self.limit_bytes = max(0, limit_mib) << 20
        self.limit_tokens = limit_tokens if limit_mib < 0 else 0
        self.enabled = limit_mib != 0
        self.entries: OrderedDict[str, Entry] = OrderedDict()
        self.bytes = 0
        self.tokens = 0

    def admits(self, nbytes: int) -> bool:
        """Whether a state of ``nbytes`` may be kept at all."""
        return self.enabled and (self.limit_bytes == 0 or nbytes <= self.limit_bytes)

    def holds(self, e: Entry) -> bool:
        """Whether an entry of the same scope already contains ``e``'s tokens."""
        return any(o.scope == e.scope and contains(o.tokens, e.tokens)
                   for o in self.entries.values())

    def put(self, e: Entry) -> list[Entry]:
        """Keep ``e`` (most recently used); returns the entries pushed out to
        stay within the limits, oldest first (for the disk tier). Those
        ``e`` contains are dropped, not returned."""
        for k in [k for k, o in self.entries.items()
                  if o.scope == e.scope and contains(e.tokens, o.tokens)]:
            self._drop(k)
        out = []
        while self.entries and self._over(e.nbytes, e.n_tokens):
            out.append(self._drop(next(iter(self.entries))))
        self.entries[e.key] = e
        self.bytes += e.nbytes
        self.tokens += e.n_tokens
        return out

    def _over(self, nbytes: int, ntokens: int) -> bool:
        if self.limit_bytes and self.bytes + nbytes > self.limit_bytes:
            return True
        return bool(self.limit_tokens) and self.tokens + ntokens > self.limit_tokens

    def touch(self, key: str) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def _drop(self, key: str) -> Entry:
        e = self.entries.pop(key)
        self.bytes -= e.nbytes
        self.tokens -= e.n_tokens
        return e

    def take_all(self) -> list[Entry]:
        """Remove and return every entry, most recently used first."""
        out = list(reversed(self.entries.values()))
        self.entries.clear()
        self.bytes = self.tokens = 0
        return out


__all__ = ["RamTier"]
