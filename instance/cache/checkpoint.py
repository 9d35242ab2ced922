"""Context checkpoints (issue 35, DESIGN.md "KV tiers"): the part of a
sequence's state that cannot be rolled back, saved at one token count.

A sliding-window cache forgets positions older than its window, and a
recurrent (or hybrid) model's state holds no positions at all, so such a
sequence cannot be cut back to any common prefix as a full-attention KV
cache can. llama-server keeps, per slot, copies of that part
(``llama_state_seq_get_data_ext`` with ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``:
the SWA cells, or the recurrent state) taken just before a prompt batch
is decoded; a later prompt whose common prefix ends before the window
restores the newest copy at or before that prefix and reads only the rest
(``create_checkpoint`` and the rollback in tools/server/server-context.cpp).

This module holds the record, the choice of a checkpoint for a prefix and
the checkpoints' serialization beside a tier entry (its own blob, so the
entry file's format only gains an optional section). No llama.cpp here.

Blob layout (little-endian)::

    magic        8 bytes  b"GGMUXCK1"
    fp_len       u32      bytes of the fingerprint text
    fingerprint  fp_len   the model's fingerprint (hex), as the entry's
    count        u32
    count x:     n_tokens i64, pos_min i64, pos_max i64, nbytes u64,
                 xxh3 u64 of the data, then nbytes of data
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from dataclasses import dataclass

import xxhash

MAGIC = b"GGMUXCK1"
_HEAD = struct.Struct("<8sI")
_COUNT = struct.Struct("<I")
_ITEM = struct.Struct("<qqqQQ")
COUNT_MAX = 4096
"""Most checkpoints one blob may say it holds (llama-server keeps 32 per slot)."""


class CheckpointError(ValueError):
    """A blob that is not a whole, verified set of this model's checkpoints
    (torn, corrupt, another model's, over the byte bound)."""


@dataclass(slots=True, eq=False)
class Checkpoint:
    """The partial state of a sequence after its first ``n_tokens`` tokens
    (positions ``pos_min .. pos_max`` were in its memory then; both -1 for
    a recurrent state alone). ``data``: the target model's bytes
    (``llama_state_seq_get_data_ext``, partial only)."""

    n_tokens: int
    pos_min: int
    pos_max: int
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def newest_within(checkpoints: Iterable[Checkpoint], keep: int) -> Checkpoint | None:
    """The newest checkpoint a prompt sharing ``keep`` tokens with the
    sequence can restore: at most ``keep`` tokens, at least one (a state of
    nothing is a prefill). llama-server's rollback picks the newest too
    ("search for a context checkpoint", ``rbegin``)."""
    best = None
    for c in checkpoints:
        if 0 < c.n_tokens <= keep and (best is None or c.n_tokens > best.n_tokens):
            best = c
    return best


def within_bytes(checkpoints: list[Checkpoint], limit: int, n_tokens: int,
                 count: int) -> list[Checkpoint]:
    """The newest ``count`` checkpoints (of at most ``n_tokens`` tokens,
    oldest first) whose bytes sum to at most ``limit``: what a tier entry
    of ``n_tokens`` tokens carries. ``limit`` or ``count`` 0 carries none."""
    out: list[Checkpoint] = []
    total = 0
    for c in sorted(checkpoints, key=lambda c: -c.n_tokens):
        if len(out) >= count:
            break
        if c.n_tokens > n_tokens or total + c.nbytes > limit:
            continue
        out.append(c)
        total += c.nbytes
    out.reverse()
    return out


def pack(checkpoints: list[Checkpoint], fingerprint: str) -> bytes:
    """The blob of ``checkpoints`` (see the module docstring); b"" for none."""
    if not checkpoints:
        return b""
    fp = fingerprint.encode("ascii")
    parts = [_HEAD.pack(MAGIC, len(fp)), fp, _COUNT.pack(len(checkpoints))]
    for c in checkpoints:
        parts.append(_ITEM.pack(c.n_tokens, c.pos_min, c.pos_max, c.nbytes,
                                xxhash.xxh3_64_intdigest(c.data)))
        parts.append(bytes(c.data))
    return b"".join(parts)


def unpack(blob, fingerprint: str, limit: int, n_tokens: int) -> list[Checkpoint]:
    """The checkpoints of ``blob`` (bytes-like), each verified: this
    ``fingerprint``, whole, its checksum, at most ``n_tokens`` tokens (the
    entry's), all of them within ``limit`` bytes. Raises
    :class:`CheckpointError`; an empty blob is no checkpoints."""
    view = memoryview(blob).cast("B")
    if len(view) == 0:
        return []
    try:
        magic, fp_len = _HEAD.unpack_from(view, 0)
        if magic != MAGIC:
            raise CheckpointError("not a checkpoint blob")
        off = _HEAD.size
        fp = bytes(view[off:off + fp_len]).decode("ascii", "replace")
        if fp != fingerprint:
            raise CheckpointError(f"checkpoints of another model or context ({fp[:12]})")
        off += fp_len
        (count,) = _COUNT.unpack_from(view, off)
        off += _COUNT.size
        if count > COUNT_MAX:
            raise CheckpointError(f"{count} checkpoints: more than {COUNT_MAX}")
        out, total = [], 0
        for _ in range(count):
            n, pmin, pmax, nbytes, digest = _ITEM.unpack_from(view, off)
            off += _ITEM.size
            total += nbytes
            if total > limit:
                raise CheckpointError(f"checkpoints of over {limit} bytes")
            if off + nbytes > len(view):
                raise CheckpointError("torn: shorter than its checkpoints")
            data = bytes(view[off:off + nbytes])
            off += nbytes
            if xxhash.xxh3_64_intdigest(data) != digest:
                raise CheckpointError("a checkpoint does not match its checksum")
            if not 0 < n <= n_tokens:
                raise CheckpointError(f"a checkpoint of {n} tokens in an entry of {n_tokens}")
            out.append(Checkpoint(n, pmin, pmax, data))
        if off != len(view):
            raise CheckpointError("bytes after the last checkpoint")
        return out
    except struct.error:
        raise CheckpointError("torn: shorter than its header") from None


__all__ = ["Checkpoint", "CheckpointError", "newest_within", "pack", "unpack", "within_bytes"]
