"""Tokenizing with bounded work (issue 37, item 1).

llama.cpp's special-token partition (``tokenizer_st_partition``) is
quadratic in the special tokens a text holds: a chat of 30,000 ``hi``
messages (1 MB) took 124 s to be refused as over the context, and
``/tokenize`` of ``<|im_end|>`` x 20,000 with ``parse_special`` 4.7 s.
Two bounds, both exact (the ids are those of one ``llama_tokenize`` call):

* **an estimate before any work**: no token stands for more than
  :attr:`VocabFacts.max_piece` bytes, so a text of ``B`` bytes is at least
  ``B / max_piece`` tokens; a prompt that must fit ``limit`` tokens and is
  longer than ``limit * max_piece * ESTIMATE_SLACK`` bytes is refused
  (:class:`TooManyTokens`) without tokenizing (the slack covers a
  normalizer that shortens text, NFC composition). Vocabularies with
  tokens that strip the whitespace beside them (``lstrip``/``rstrip``: one
  token may then stand for any run of spaces) get no estimate;
* **pieces**: a text longer than :data:`PIECE_BYTES` is tokenized a piece
  at a time, each cut just after a special token that the partition splits
  at anyway (its text found by :attr:`VocabFacts.pattern`), so each
  call's partition sees a few hundred special tokens at most and the work
  is linear in the text; with a ``limit`` the pieces stop as soon as more
  tokens than that came out. Only SPM and BPE vocabularies, whose
  tokenizers carry no state from one raw fragment to the next but
  "the previous fragment was a special token" (true at a cut), are cut;
  ``add_special``'s BOS and EOS are added by hand, as ``llama_tokenize``
  adds them (``llama_vocab_get_add_bos``/``_eos``).

The facts of the vocabulary are read once per load, on a thread of their
own (:func:`read_facts_soon`; ``llama_token_to_piece`` and
``llama_vocab_get_attr`` of every token: 0.1-1 s for 49,152 tokens, 10 s
for gemma3's 262,144 on a machine at load 19), or on the first long text
if that comes first.
"""

from __future__ import annotations

import ctypes
import logging
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from .jobs import InvalidRequest

log = logging.getLogger(__name__)

PIECE_BYTES = 4096
"""Bytes of text per ``llama_tokenize`` call once a text is longer: at most
~400 special tokens per partition (2 ms each, against 4.7 s for 20,000 in
one call)."""
ESTIMATE_SLACK = 2
"""How much shorter than its tokens' pieces a text may be (normalizers)
before the estimate refuses it."""


class TooManyTokens(InvalidRequest):
    """A text is more than ``limit`` tokens: ``at_least`` is what is known
    of its count (the estimate's, or the pieces' so far)."""

    def __init__(self, at_least: int, limit: int) -> None:
        super().__init__(f"the text is at least {at_least} tokens (the most is {limit})")
        self.at_least = at_least
        self.limit = limit


@dataclass(slots=True)
class VocabFacts:
    """What bounds a vocabulary's tokenizing: ``max_piece`` (the longest
    token's bytes, special tokens as their text), ``strips`` (some special
    token strips the whitespace beside it: no estimate), ``cuttable`` (SPM
    or BPE: may be cut into pieces), ``pattern`` / ``pattern_special`` (a
    compiled regex over bytes finding the special tokens the partition
    splits at without / with ``parse_special``: user-defined ones /
    control, user-defined and unknown ones, each without ``rstrip``; None
    when there are none), ``add_bos``, ``add_eos``, ``bos``, ``eos``."""

    max_piece: int
    strips: bool
    cuttable: bool
    pattern: re.Pattern | None
    pattern_special: re.Pattern | None
    add_bos: bool
    add_eos: bool
    bos: int
    eos: int


def _trie_regex(texts: list[bytes]) -> re.Pattern | None:
    """One regex matching any of ``texts`` at a position, the longest
    first (a trie of alternations: sre walks it in time of the match, not
    of the number of texts)."""
    if not texts:
        return None
    trie: dict = {}
    for t in texts:
        node = trie
        for b in t:
            node = node.setdefault(b, {})
        node[-1] = True

    def walk(node: dict) -> bytes:
        ends = -1 in node
        alts = [re.escape(bytes([b])) + walk(child)
                for b, child in sorted(node.items()) if b != -1]
        if not alts:
            return b""
        body = alts[0] if len(alts) == 1 else b"(?:" + b"|".join(alts) + b")"
        return b"(?:" + body + b")?" if ends else body

    return re.compile(walk(trie))


def read_facts(L, vocab, n_vocab: int) -> VocabFacts:
    """The :class:`VocabFacts` of ``vocab`` (llama-cpp-python bindings ``L``)."""
    buf = ctypes.create_string_buffer(1024)
    special_mask = (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_USER_DEFINED
                    | L.LLAMA_TOKEN_ATTR_UNKNOWN)
    strip_mask = L.LLAMA_TOKEN_ATTR_LSTRIP | L.LLAMA_TOKEN_ATTR_RSTRIP
    most = 0
    strips = False
    user: list[bytes] = []
    every: list[bytes] = []
    for t in range(n_vocab):
        n = L.llama_token_to_piece(vocab, t, buf, len(buf), 0, True)
        if n < 0:  # longer than the buffer
            n = -n
        most = max(most, n)
        attr = L.llama_vocab_get_attr(vocab, t)
        if attr & special_mask:
            if attr & strip_mask:
                strips = True
            if attr & L.LLAMA_TOKEN_ATTR_RSTRIP or n <= 0 or n > len(buf):
                continue  # never a cut point: what follows it is its too
            text = buf.raw[:n]
            every.append(text)
            if attr & L.LLAMA_TOKEN_ATTR_USER_DEFINED:
                user.append(text)
    kind = L.llama_vocab_type(vocab)
    return VocabFacts(max(1, most), strips,
                      kind in (L.LLAMA_VOCAB_TYPE_SPM, L.LLAMA_VOCAB_TYPE_BPE),
                      _trie_regex(user), _trie_regex(every),
                      bool(L.llama_vocab_get_add_bos(vocab)),
                      bool(L.llama_vocab_get_add_eos(vocab)),
                      L.llama_vocab_bos(vocab), L.llama_vocab_eos(vocab))


def pieces(raw: bytes, pattern: re.Pattern | None, size: int = PIECE_BYTES) -> Iterator[bytes]:
    """``raw`` in pieces of about ``size`` bytes or more, each (but the
    last) ending just after a match of ``pattern``; the whole of ``raw``
    when nothing matches."""
    if pattern is None or len(raw) <= size:
        yield raw
        return
    start = 0
    pos = size
    while len(raw) - start > size:
        m = pattern.search(raw, pos)
        while m is not None and m.end() == m.start():  # (an empty match: never a cut)
            m = pattern.search(raw, m.end() + 1)
        if m is None:
            break
        yield raw[start:m.end()]
        start = m.end()
        pos = start + size
    yield raw[start:]


class Tokenizer:
    """``llama_tokenize`` with bounded work (module docstring) for one
    loaded vocabulary. ``call(raw, add_special, parse_special)`` is the
    plain tokenization (``ModelContext._tokenize_once``), ``count(...)``
    its count alone (``ModelContext._count_once``); thread-safe."""

    def __init__(self, L, vocab, n_vocab: int, call, count) -> None:
        self.L = L
        self.vocab = vocab
        self.n_vocab = n_vocab
        self.call = call
        self.count_call = count
        self._facts: VocabFacts | None = None
        self._reading = threading.Lock()

    def facts(self) -> VocabFacts:
        """The vocabulary's :class:`VocabFacts`, read on first use."""
        f = self._facts
        if f is None:
            with self._reading:
                if self._facts is None:
                    self._facts = read_facts(self.L, self.vocab, self.n_vocab)
                    log.info("vocabulary: longest token %d bytes; tokenizing past %d bytes "
                             "in pieces", self._facts.max_piece, PIECE_BYTES)
                f = self._facts
        return f

    def tokenize(self, raw: bytes, add_special: bool, parse_special: bool,
                 limit: int | None = None) -> list[int]:
        """The ids of ``raw``, as one ``llama_tokenize`` call gives them.
        Raises :class:`TooManyTokens` when ``limit`` is given and the text
        is more tokens than that (by the estimate, before any work, or as
        soon as the pieces say so)."""
        if len(raw) <= PIECE_BYTES:
            ids = self.call(raw, add_special, parse_special)
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids), limit)
            return ids
        f = self.facts()
        if limit is not None and not f.strips:
            least = len(raw) // (f.max_piece * ESTIMATE_SLACK)
            if least > limit:
                raise TooManyTokens(least, limit)
        pattern = f.pattern_special if parse_special else f.pattern
        if not f.cuttable or pattern is None:
            ids = self.call(raw, add_special, parse_special)
            if limit is not None and len(ids) > limit:
                raise TooManyTokens(len(ids), limit)
            return ids
        out: list[int] = []
        if add_special and f.add_bos:
            out.append(f.bos)
        for part in pieces(raw, pattern):
            out += self.call(part, False, parse_special)
            if limit is not None and len(out) > limit:
                raise TooManyTokens(len(out), limit)
        if add_special and f.add_eos:
            out.append(f.eos)
            if limit is not None and len(out) > limit:
                raise TooManyTokens(len(out), limit)
        return out

    def count(self, raw: bytes, add_special: bool, parse_special: bool) -> int:
        """How many tokens ``raw`` is (as :meth:`tokenize`, listing none),
        in pieces past :data:`PIECE_BYTES`."""
        if len(raw) <= PIECE_BYTES:
            return self.count_call(raw, add_special, parse_special)
        f = self.facts()
        pattern = f.pattern_special if parse_special else f.pattern
        if not f.cuttable or pattern is None:
            return self.count_call(raw, add_special, parse_special)
        n = int(add_special and f.add_bos) + int(add_special and f.add_eos)
        for part in pieces(raw, pattern):
            n += self.count_call(part, False, parse_special)
        return n


def read_facts_soon(shared, current) -> None:
    """Read the loaded vocabulary's :class:`VocabFacts` on a thread of its
    own now, so the first long prompt does not wait for them (0.1-1 s,
    more for a vocabulary of 262,144 tokens). ``shared``: the engine's
    model lock's ``shared`` (held meanwhile: the weights are not freed under
    it); ``current()``: the model's :class:`Tokenizer` now (None, or another,
    once the model was freed or loaded again: then nothing is read)."""
    tok = current()

    def run() -> None:
        try:
            with shared():
                if tok is not None and current() is tok:
                    tok.facts()
        except Exception:  # the facts are read again on first use
            log.exception("reading the vocabulary's facts failed")

    threading.Thread(target=run, name="vocab-facts", daemon=True).start()


__all__ = ["ESTIMATE_SLACK", "PIECE_BYTES", "Tokenizer", "TooManyTokens", "VocabFacts",
           "pieces", "read_facts", "read_facts_soon"]
