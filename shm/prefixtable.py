"""The prefix index in shared memory: which replica served which prompt prefix, and when.

DESIGN.md "Prefix-aware routing" (issue 20). Each proxy owns one part of
the ``prefix`` table, ``(buckets, ways, X_WORDS)`` int64 words, and is its
only writer; every proxy reads every part, so a prefix learned through
proxy 0 routes a request that comes through proxy 3.

An entry says: a replica served a prompt whose prefix ends with the block
whose *chain hash* is ``h`` (:mod:`ggmux.proxy.prefix`: a chain hash covers
every block before its own, so one entry stands for the whole prefix up to
it), last at ``X_USED_NS`` (``time.monotonic_ns()``). Its name ``X_KEY`` is
``h`` mixed with the replica's slot and incarnation (:func:`replica_salt`;
a respawned replica, whose cache is empty, matches nothing), so a request
looks up, for each candidate replica, the key of each of its blocks, and
the deepest block found is how much of its prompt that replica holds.

Layout: an entry lives in bucket ``(key >> 32) & (buckets - 1)``, in any of its
``ways``; a full bucket gives up the way used longest ago (LRU by time), so
a part is bounded (``--prefix-index-entries``) and keeps what was used last.

No lock on the read path: an entry is named by one aligned word, which a
reader sees whole, old or new; the owner writes the other words first and
the key last, so a reader that sees a key sees the time written with it
(x86-64 keeps stores in order; :func:`~ggmux.shm.seqlock.fence` elsewhere).
A time read one update late only moves an entry across a forget time (a
replica's cache bonus for one request): the index guides routing, it never
decides what a replica reuses.

Corrections: ``prefix_forget[proxy, slot]`` is a time written by that proxy
when a replica it expected to hold a prefix reported (almost) no cached
tokens: its cache dropped entries at least that old (the engine reuses the
slot used longest ago), so every reader ignores the replica's entries last
used at or before the latest such time over all proxies.

When a proxy dies its part and its forget row are zeroed with its counter
rows, before its replacement starts (the supervisor's rule for per-proxy
rows); the other parts keep routing.

Disk rows (issue 29, DESIGN.md "KV tiers"): a model with a disk tier keeps
its prefixes in files every replica of it on this node restores from, so an
entry may name the node's disk instead of a replica: ``X_REPLICA`` is
:func:`disk_word` (``DISK_SLOT`` and the model) and the key is mixed with
:func:`disk_salt` (the model and the epoch of its tiers, bumped when they
are emptied: older disk rows then match nothing). A proxy turns its entries
of a replica that stopped into disk rows (:meth:`PrefixTable.to_disk`),
and records one when an answer says its prefix came from disk. A predicted
disk hit that came back a miss distrusts the model's older disk rows
(``prefix_forget_disk[proxy, model]``), as ``prefix_forget`` does a
replica's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import layout as L
from .seqlock import NEEDS_FENCE, fence

_M64 = (1 << 64) - 1
WAYS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
"""Ways a bucket may have, and the integer that holds one bool per way."""
BUCKET_SHIFT = 32  # a key's bucket is taken from its upper half (the best-mixed bits)


def replica_word(slot: int, incarnation: int) -> int:
    """``X_REPLICA`` of replica ``slot`` (< 2**16) in its ``incarnation``."""
    return slot | incarnation << L.X_INC_SHIFT


def disk_word(model: int) -> int:
    """``X_REPLICA`` of a disk row of model ``model`` (module docstring)."""
    return L.DISK_SLOT | model << L.X_INC_SHIFT


def disk_salt(model: int, epoch: int) -> int:
    """What a chain hash is mixed with to name a disk row of ``model`` in
    the ``epoch`` of its tiers (``M_CACHE_EPOCH``)."""
    return _splitmix(disk_word(model) ^ (epoch & 0xFFFFFF) << 40)


def replica_salt(slot: int, incarnation: int) -> int:
    """What a chain hash is mixed with to name an entry of this replica: an
    even int64 (chain hashes are odd, so no key is 0), splitmix64 of its
    :func:`replica_word`."""
    return _splitmix(replica_word(slot, incarnation))


def _splitmix(word: int) -> int:
    z = (word + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    z = (z ^ (z >> 31)) & ~1
    return z - (1 << 64) if z >> 63 else z


@dataclass(slots=True)
class Found:
    """What the index holds of one prompt for each candidate, in the order
    given: ``depth`` the blocks of the deepest entry found (0: none; 1: the
    first block), ``used_ns`` that entry's last use (0: none)."""

    depth: list[int]
    used_ns: list[int]


class PrefixTable:
    """One proxy's view of the prefix index: reads every part, writes part ``me``.

    ``table``: the segment's ``prefix`` array ``(proxies, buckets, ways,
    X_WORDS)``; ``forget``: its ``prefix_forget`` array ``(proxies,
    replicas)``; ``me``: this proxy's index (only :meth:`record` and
    :meth:`forget_before` write, and only there).
    """

    __slots__ = ("_any", "forget", "forget_disk", "keys", "mask", "me", "own", "table", "ways")

    def __init__(self, table: np.ndarray, forget: np.ndarray, me: int,
                 forget_disk: np.ndarray | None = None) -> None:
        self.table = table
        self.forget = forget
        # the disk rows' forget times, (proxies, models) (issue 29)
        self.forget_disk = forget_disk if forget_disk is not None else np.zeros(
            (table.shape[0], 1), dtype=np.int64)
        self.me = me
        self.own = table[me]
        self.keys = table[..., L.X_KEY]  # (proxies, buckets, ways), a view
        self.mask = table.shape[1] - 1
        self.ways = table.shape[2]
        if self.ways not in WAYS:
            raise ValueError(f"prefix index ways must be one of {sorted(WAYS)}, not {self.ways}")
        self._any = WAYS[self.ways]

    # ---- read ---------------------------------------------------------------
    def lookup(self, chain: np.ndarray, salts: np.ndarray, slots: list[int],
               disk_model: int = -1) -> Found:
        """How deep into ``chain`` (int64 chain hashes, block 0 first) each
        candidate replica's entries go, over every proxy's part.
        ``salts``: int64 ``(candidates,)``, their :func:`replica_salt`;
        ``slots``: their replica slots, whose forget times (the latest over
        proxies) leave out older entries. With ``disk_model`` (>= 0) the last
        salt is that model's :func:`disk_salt`, and its forget time the
        model's disk one (``slots`` then has one entry fewer). A fixed
        number of numpy calls over ``proxies x candidates x blocks x ways``
        words."""
        keys = chain ^ salts[:, None]  # (c, n)
        rows = self.table.take((keys >> BUCKET_SHIFT) & self.mask, axis=1)  # (p, c, n, w, X)
        hit = rows[..., L.X_KEY] == keys[None, :, :, None]  # (p, c, n, w), a new array
        forget = self.forget
        if disk_model >= 0:
            times = np.append(forget.max(axis=0).take(slots),
                              self.forget_disk[:, disk_model].max())
            if times.any():
                hit &= rows[..., L.X_USED_NS] > times[None, :, None, None]
        elif forget.any():
            hit &= rows[..., L.X_USED_NS] > forget.max(axis=0).take(slots)[None, :, None, None]
        # a bucket's ways as one integer: nonzero when any of them hit
        held = hit.view(self._any).reshape(hit.shape[:3]).max(axis=0) != 0  # (c, n)
        c, n = held.shape
        depth = [0] * c
        used_ns = [0] * c
        if not held.any():
            return Found(depth, used_ns)
        deepest = (n - 1 - held[:, ::-1].argmax(axis=1)).tolist()
        for j, ok in enumerate(held.any(axis=1).tolist()):
            if ok:
                d = deepest[j]
                depth[j] = d + 1
                # the last use of the deepest entry: what a miss there forgets
                used_ns[j] = int(rows[:, j, d, :, L.X_USED_NS][hit[:, j, d, :]].max())
        return Found(depth, used_ns)

    # ---- write (this proxy's part only) ---------------------------------------
    def record(self, chain: np.ndarray, slot: int, incarnation: int, now_ns: int) -> None:
        """Replica ``slot`` (``incarnation``) served a prompt whose chain is
        ``chain``: every block's entry in this proxy's part is refreshed to
        ``now_ns`` or written, a full bucket giving up its way used longest
        ago (blocks of one chain that fall in one bucket take its oldest
        ways in turn; past ``ways`` of them the rest are not kept)."""
        if chain.shape[0]:
            self._put(chain ^ replica_salt(slot, incarnation), replica_word(slot, incarnation),
                      np.arange(1, chain.shape[0] + 1), now_ns)

    def record_disk(self, chain: np.ndarray, model: int, epoch: int, now_ns: int) -> None:
        """Model ``model``'s disk tier holds the prompt whose chain is
        ``chain`` (an answer restored it from there): its disk rows, as
        :meth:`record` writes a replica's."""
        if chain.shape[0]:
            self._put(chain ^ disk_salt(model, epoch), disk_word(model),
                      np.arange(1, chain.shape[0] + 1), now_ns)

    def put_many(self, keys: np.ndarray, words: np.ndarray, blocks: np.ndarray,
                 used_ns: np.ndarray) -> None:
        """Many chains' entries at once (int64 ``(n,)`` each: keys already
        salted, their ``X_REPLICA`` words, block numbers and times), as
        :meth:`record` writes one chain's; a key given twice (two prompts
        sharing a prefix) is written once, with its latest time."""
        if not keys.shape[0]:
            return
        order = np.lexsort((used_ns, keys))  # by key, the latest use last
        k = keys[order]
        last = np.ones(k.shape[0], dtype=bool)
        np.not_equal(k[1:], k[:-1], out=last[:-1])
        pick = order[last]
        pick.sort()  # each chain's blocks in order again, as record's
        self._put(keys[pick], words[pick], blocks[pick], used_ns[pick])

    def to_disk(self, slot: int, incarnation: int, model: int, epoch: int) -> int:
        """Replica ``slot`` (``incarnation``) of ``model``, whose tiers
        spill to disk, stopped: this proxy's entries of it become disk rows
        of the model (same chains, blocks and last use); the number moved."""
        own = self.own
        mine = np.flatnonzero((own[..., L.X_REPLICA] == replica_word(slot, incarnation)).ravel()
                              & (own[..., L.X_KEY] != 0).ravel())
        if not mine.size:
            return 0
        flat = own.reshape(-1, own.shape[-1])
        keys = flat[mine, L.X_KEY].copy()
        blocks = flat[mine, L.X_BLOCKS].copy()
        used = flat[mine, L.X_USED_NS].copy()
        flat[mine, L.X_KEY] = 0  # first: no reader takes them for the replica's any more
        moved = keys ^ replica_salt(slot, incarnation) ^ disk_salt(model, epoch)
        order = np.argsort(blocks, kind="stable")  # a chain's blocks in order, as record's
        self._put(moved[order], disk_word(model), blocks[order], used[order])
        return int(mine.size)

    def _put(self, keys: np.ndarray, word, blocks: np.ndarray, now_ns) -> None:
        """Refresh or write the entries ``keys`` (int64 ``(n,)``) of
        ``word`` (``X_REPLICA``: an int, or ``(n,)`` words) at ``blocks``
        (``X_BLOCKS``, (n,)), used at ``now_ns`` (an int, or ``(n,)``
        times): :meth:`record`'s rules."""
        n = keys.shape[0]
        own = self.own
        if not np.isscalar(now_ns):
            now_ns = np.asarray(now_ns, dtype=np.int64)
        b = (keys >> BUCKET_SHIFT) & self.mask
        rows = own[b]  # (n, ways, X_WORDS) copy
        match = rows[:, :, L.X_KEY] == keys[:, None]
        has = match.any(axis=1)
        old = np.flatnonzero(has)
        if old.size:
            hw = match[old].argmax(axis=1)
            t = now_ns if np.isscalar(now_ns) else np.maximum(now_ns[old], rows[old, hw,
                                                                             L.X_USED_NS])
            own[b[old], hw, L.X_USED_NS] = t  # one word each
            if old.size == n:
                return
            rows[old, hw, L.X_USED_NS] = t  # not among the oldest now
        new = np.flatnonzero(~has)
        nb = b[new]
        # the k-th new block of this chain in one bucket takes the bucket's k-th oldest way
        order = np.argsort(nb, kind="stable")
        sb = nb[order]
        idx = np.arange(sb.size)
        start = np.empty(sb.size, dtype=bool)
        start[0] = True
        np.not_equal(sb[1:], sb[:-1], out=start[1:])
        occ = np.empty_like(idx)
        occ[order] = idx - np.maximum.accumulate(np.where(start, idx, 0))
        keep = occ < self.ways
        if not keep.all():
            new, nb, occ = new[keep], nb[keep], occ[keep]
        way = np.argsort(rows[new, :, L.X_USED_NS], axis=1, kind="stable")[
            np.arange(new.size), occ]
        own[nb, way, L.X_USED_NS] = now_ns if np.isscalar(now_ns) else now_ns[new]
        own[nb, way, L.X_REPLICA] = word if np.isscalar(word) else word[new]
        own[nb, way, L.X_BLOCKS] = blocks[new]
        if NEEDS_FENCE:
            fence()
        own[nb, way, L.X_KEY] = keys[new]  # last: a reader that sees it sees the rest

    def forget_before(self, slot: int, used_ns: int) -> None:
        """Distrust replica ``slot``'s entries last used at or before
        ``used_ns`` (this proxy's forget row; readers take the latest)."""
        row = self.forget[self.me]
        row[slot] = max(row[slot], used_ns)

    def forget_disk_before(self, model: int, used_ns: int) -> None:
        """Distrust model ``model``'s disk rows last used at or before
        ``used_ns`` (this proxy's row of ``prefix_forget_disk``)."""
        row = self.forget_disk[self.me]
        if model < row.shape[0]:
            row[model] = max(row[model], used_ns)

    def entries(self, proxy: int | None = None) -> int:
        """Entries in use: in ``proxy``'s part, or in every part (None)."""
        k = self.keys if proxy is None else self.keys[proxy]
        return int(np.count_nonzero(k))


__all__ = ["Found", "PrefixTable", "disk_salt", "disk_word", "replica_salt", "replica_word"]
