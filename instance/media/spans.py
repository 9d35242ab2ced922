"""A prompt's media spans and the placeholder ids that stand for them.

libmtmd cuts a prompt with media into chunks: text (token ids) and media
(an image's or a clip's embeddings, ``n_tokens`` of them). The engine keeps
a prompt as one list of ids, so that every cache of prompts (a slot's
prompt cache, the RAM and disk tiers, context checkpoints, prefix-aware
routing's index) compares prompts with media as it compares text: each
media embedding stands as a **placeholder id**, a negative int32 (no
vocabulary id is negative) made from the media's content hash (SHA-256 of
its bytes, libmtmd's bitmap id, which llama-server gives every bitmap
"to prevent cache poisoning") and its index in the span. The same image
at the same place is the same ids, so a cached prefix covers it; another
image differs at its first placeholder, so it is never a hit. Each
placeholder takes 31 bits of a digest of (hash, index): a span of ``n``
placeholders carries ``31 n`` bits of the hash into every comparison (an
image of 64 embeddings: all 256 of SHA-256's), so a made-up image that
matches another's first placeholder still differs at the next.

A :class:`MediaSpan` holds its libmtmd chunk (a copy the span owns, freed
with it) until the engine has read its embeddings into the slot.
"""

from __future__ import annotations

import hashlib
import weakref
from dataclasses import dataclass, field

import numpy as np

PLACEHOLDER_MASK = 0x7FFFFFFF


def placeholders(media_id: str, n: int) -> list[int]:
    """The ``n`` placeholder ids of the media whose content hash (hex) is
    ``media_id``: negative int32s, one per embedding."""
    seed = hashlib.sha256(media_id.encode("ascii", "replace")).digest()
    # 8 words a digest: one digest per 8 placeholders, over (hash, block)
    out = np.empty(((n + 7) // 8) * 8, np.uint32)
    for b in range(len(out) // 8):
        d = hashlib.sha256(seed + b.to_bytes(4, "little")).digest()
        out[b * 8:(b + 1) * 8] = np.frombuffer(d, "<u4")
    ids = -1 - (out[:n].astype(np.int64) & (PLACEHOLDER_MASK - 1))
    return ids.tolist()


@dataclass(eq=False)
class MediaSpan:
    """One media chunk of a prompt: its placeholders are ``prompt[start :
    start + n_tokens]``; ``n_pos``: positions it takes (equal to
    ``n_tokens`` but for M-RoPE models); ``kind``: ``image`` or ``audio``;
    ``media_id``: its content hash (hex); ``chunk``: the owned libmtmd
    chunk (a ctypes pointer), None once released; ``embd``: its
    embeddings, ``(n_tokens, n_embd)`` float32, once encoded."""

    start: int
    n_tokens: int
    n_pos: int
    kind: str
    media_id: str
    chunk: object = None
    embd: np.ndarray | None = None
    _free: object = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    def own(self, chunk, free) -> None:
        """Take ``chunk`` (a libmtmd chunk copy), freed by ``free(chunk)``
        at :meth:`release` or when the span is collected."""
        self.chunk = chunk
        self._free = weakref.finalize(self, free, chunk)

    def release(self) -> None:
        """Free the libmtmd chunk (its embeddings, if read, stay)."""
        f, self._free, self.chunk = self._free, None, None
        if f is not None:
            f()


def span_at(spans: tuple[MediaSpan, ...], i: int) -> MediaSpan | None:
    """The span that starts at token ``i``, or None."""
    for s in spans:
        if s.start == i:
            return s
        if s.start > i:
            return None
    return None


def next_start(spans: tuple[MediaSpan, ...], i: int) -> int | None:
    """The start of the first span at or after token ``i``, or None."""
    for s in spans:
        if s.start >= i:
            return s.start
    return None


def floor_outside(spans: tuple[MediaSpan, ...], n: int) -> int:
    """``n`` tokens of a prompt moved back to the start of the span it
    falls inside (a prefix that keeps part of an image keeps none of it:
    an image's embeddings are read together)."""
    for s in spans:
        if s.start < n < s.end:
            return s.start
        if s.start >= n:
            break
    return n
