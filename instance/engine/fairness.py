"""The admission order of an instance's queue: round robin by tenant.

Issue 18, finding 10: in arrival order, a client that sends many long
requests holds every slot and the next client waits behind all of them.
Here, when slots are contended, the next request to take a free slot is
the oldest one of the tenant holding the fewest slots, so a caller with
requests running waits behind one with none; among tenants holding as
many, the one served least recently goes first (never served: first), so
they take turns. A tenant is what the proxy says in
``x-ggmux-tenant`` (a keyed hash of the caller's API key; ``""`` for a
caller without a key, or a request that did not come through a proxy):
every caller without a key is one tenant, as they are one client to
ggmux.

Shared by the engine (:mod:`ggmux.instance.engine`) and the fake backend
(:mod:`ggmux.instance.fake`), so the fast tests exercise the same rule.
Cost: :meth:`FairQueue.next` looks at one request per waiting tenant;
appending and taking are O(1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class FairQueue(Generic[T]):
    """Requests waiting for a slot, one arrival-ordered queue per tenant.

    ``tenant_of(item)`` names an item's tenant. :meth:`next` gives the item
    to admit next given the slots each tenant holds now; :meth:`take`
    removes it once admitted. Iteration and :meth:`popleft` (for refusing
    or failing everything waiting) go in no particular order."""

    __slots__ = ("_by", "_last", "_n", "_seq", "_turn", "tenant_of")

    # tenants whose last turn is remembered beyond those waiting (a key-less
    # server sees as many tenants as keys its callers make up)
    REMEMBERED = 1024

    def __init__(self, tenant_of: Callable[[T], str]) -> None:
        self.tenant_of = tenant_of
        self._by: dict[str, deque[tuple[int, T]]] = {}
        self._last: dict[str, int] = {}  # tenant -> its last turn (take)
        self._n = 0
        self._seq = 0
        self._turn = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[T]:
        for q in list(self._by.values()):
            for _, item in list(q):
                yield item

    def append(self, item: T) -> None:
        self._by.setdefault(self.tenant_of(item), deque()).append((self._seq, item))
        self._seq += 1
        self._n += 1

    def extend(self, items) -> None:
        for item in items:
            self.append(item)

    def next(self, held: Mapping[str, int]) -> T | None:
        """The item to admit next: the oldest of the tenant with the fewest
        slots in ``held`` (tenant -> slots its requests hold now), among
        equals the tenant served least recently, then the earliest arrival;
        None when empty."""
        best = None
        best_key = None
        last = self._last
        for tenant, q in self._by.items():
            seq, item = q[0]
            key = (held.get(tenant, 0), last.get(tenant, -1), seq)
            if best_key is None or key < best_key:
                best, best_key = item, key
        return best

    def take(self, item: T) -> None:
        """Remove ``item`` (normally the one :meth:`next` gave: its tenant's oldest)."""
        tenant = self.tenant_of(item)
        q = self._by[tenant]
        if q[0][1] is item:
            q.popleft()
        else:
            q.remove(next(e for e in q if e[1] is item))
        if not q:
            del self._by[tenant]
        self._n -= 1
        self._last[tenant] = self._turn
        self._turn += 1
        if len(self._last) > self.REMEMBERED:
            self._last = {t: v for t, v in self._last.items() if t in self._by}

    def remove(self, item: T) -> None:
        """Remove ``item`` without it counting as a turn (it was cancelled)."""
        tenant = self.tenant_of(item)
        q = self._by[tenant]
        q.remove(next(e for e in q if e[1] is item))
        if not q:
            del self._by[tenant]
        self._n -= 1

    def popleft(self) -> T:
        """Any one waiting item, removed (the oldest of some tenant)."""
        tenant, q = next(iter(self._by.items()))
        _, item = q.popleft()
        if not q:
            del self._by[tenant]
        self._n -= 1
        return item


__all__ = ["FairQueue"]
