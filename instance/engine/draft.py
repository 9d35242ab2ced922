"""Draft proposers for speculative decoding (issue 30): each generating slot
may propose tokens that the next decode verifies
(:mod:`ggmux.instance.engine.verify_steps`).

The types are llama.cpp's (``common/speculative.cpp``, ``common/ngram-*.cpp``,
build b11434), tried in its order of preference for each slot:

* ``ngram-simple`` (:class:`NgramSimple`): the last ``size_n`` tokens (the
  pending one included) looked up in the slot's own tokens (prompt and
  answer); the most recent earlier occurrence's next ``size_m`` tokens are
  the draft, none when fewer than ``size_n`` follow it
  (``common_ngram_simple_draft``). llama.cpp searches backwards at every
  token; here an index (n-gram -> latest start) is kept as tokens arrive,
  the same answer at O(1) a token (issue 18: no request may make the
  decode thread's work per token grow).
* ``ngram-mod`` (:class:`NgramMod`): a hashed table,
  ``hash(n_match tokens) -> next token``, fed with each request's prompt
  and answer; drafts chain lookups, kept only when at least ``n_min`` long
  (``common_ngram_mod``, ``common_speculative_impl_ngram_mod``: the same
  hash, table size, reset at 25% occupancy and after 5 low-acceptance
  rounds). llama.cpp keeps one table for every slot; here a table is
  scoped like every cache (:class:`ModTables`, issue 37, item 2: fed by
  every tenant, it let a caller who forced a token with ``logit_bias`` read
  another tenant's next tokens from ``timings.draft_n``, digit by digit):
  one table under ``--cache-scope global``, one per tenant under ``key``,
  one per request under ``none``.
* ``draft-simple`` (:class:`~.draft_model.DraftModel`): a draft model of the same
  vocabulary, loaded in this process with its own context (a sequence per
  slot); its KV mirrors each slot's verified tokens, then it decodes the
  pending token and drafts greedily, one batched ``llama_decode`` per draft
  position for all drafting slots, stopping a slot's draft below
  ``p_min`` (the top token's probability among its 10 best, as
  llama.cpp's top-k 10 draft sampler) or at ``n_max``; drafts shorter than
  ``n_min`` are dropped.

:class:`SlotSpec` is a slot's drafting state, with ggmux's adaptive pause
(:class:`~ggmux.instance.engine.spec_options.SpecConfig`).
"""

from __future__ import annotations

import logging

import numpy as np

from .draft_model import DraftModel
from .model import EngineConfig, ModelContext
from .slots import Slot
from .spec_cost import PROBE, StepCost, best_length
from .spec_options import SpecConfig

log = logging.getLogger(__name__)

MOD_TABLE = 4 * 1024 * 1024  # ngram-mod's entries (common_speculative_impl_ngram_mod)
MOD_MULT = 6364136223846793005  # common_ngram_mod::idx
MOD_RESET_OCCUPANCY = 0.25
MOD_LOW_ACCEPT = 0.25
MOD_LOW_ROUNDS = 5
MASK64 = (1 << 64) - 1
PRIOR_HITS, PRIOR_TRIES = 4.0, 5.0  # a new request's drafts: 0.8 accepted per position
RATE_DECAY = 0.7  # weight of the older verifications in the acceptance estimate
SHADOW_MAX = 8  # tokens of a shadow draft (Drafter.idle): it resolves within as many steps


class SlotSpec:
    """One slot's drafting state for its current request choice: the
    n-gram index, ``ngram-mod``'s counters, and the adaptive rule's
    (``fails`` in a row, ``pause_left`` tokens not drafted, ``pause_next``;
    ``hits`` / ``tries``: decayed counts of draft positions accepted and
    tested, whose ratio estimates the chance ``r`` that the next draft
    token is accepted; ``shadow``: a draft proposed but not verified, at
    ``shadow_at`` tokens, checked against the tokens the slot then makes;
    ``probe``: the next draft is a short one to learn ``r`` again).

    The draft length (:meth:`limit`, :func:`~.spec_cost.best_length`)
    maximises the tokens a step gives per second at ``r`` and the step's
    measured cost per batch token; it is 0 (no draft) where every length
    loses. A slot that does not draft then keeps ``r`` current from shadow
    drafts its n-gram proposers make for free (:meth:`Drafter.shadow`), so
    it drafts again when they would have been accepted; a draft model's
    proposals cost a decode, so such a slot pauses and probes instead
    (:meth:`record`)."""

    __slots__ = ("fails", "hits", "index", "indexed", "job", "mod", "mod_draft", "mod_last",
                 "mod_low", "pause_left", "pause_next", "probe", "shadow", "shadow_at", "tries")

    def __init__(self, spec: SpecConfig) -> None:
        self.job = None
        self.mod: NgramMod | None = None  # its request's ngram-mod table (ModTables)
        self.index: dict[tuple, int] = {}
        self.indexed = 0
        self.mod_last = 0
        self.mod_draft = 0
        self.mod_low = 0
        self.fails = 0
        self.pause_left = 0
        self.pause_next = spec.pause_tokens
        self.hits, self.tries = PRIOR_HITS, PRIOR_TRIES
        self.shadow: list[int] = []
        self.shadow_at = 0
        self.probe = False

    def record(self, spec: SpecConfig, drafted: int, accepted: int, shadow: bool = False) -> None:
        """A verification of ``drafted`` tokens accepted ``accepted`` (a
        ``shadow`` one: only the estimate of ``r`` learns from it)."""
        tested = accepted + (accepted < drafted)  # positions up to the first miss
        self.hits = RATE_DECAY * self.hits + accepted
        self.tries = RATE_DECAY * self.tries + tested
        if shadow:
            return
        if accepted == 0:
            self.fails += 1
            if self.fails >= spec.pause_after:
                self.pause(spec)
                self.fails = 0
        else:
            self.fails = 0
            self.pause_next = spec.pause_tokens

    def pause(self, spec: SpecConfig) -> None:
        """Draft nothing for the next ``pause_next`` tokens (doubled each
        time, up to ``pause_max``); then a probe."""
        self.pause_left = self.pause_next
        self.pause_next = min(spec.pause_max, max(1, self.pause_next * 2))
        self.probe = True

    @property
    def rate(self) -> float:
        """The estimated chance that the next draft token is accepted."""
        return min(self.hits / self.tries, 0.999) if self.tries > 0 else 0.0

    def limit(self, spec: SpecConfig, most: int, beta: float | None = None, g: int = 1) -> int:
        """The draft length now, 0 .. ``most``: :func:`~.spec_cost.best_length`
        at this slot's rate, ``beta`` (one batch token's share of the step;
        None: from ``spec.token_cost``) and ``g`` generating slots; after a
        pause, a probe of :data:`~.spec_cost.PROBE` tokens."""
        if beta is None:
            c = spec.token_cost
            beta = c / (1.0 - c + c * max(1, g)) if c < 1 else 1.0 / max(1, g)
        k = best_length(self.rate, beta, g, most)
        if self.probe:
            self.probe = False
            k = max(k, min(PROBE, most))
        return k


class NgramSimple:
    """``ngram-simple`` over one slot's tokens (see the module docstring)."""

    def __init__(self, spec: SpecConfig) -> None:
        self.n = spec.ngram_simple_size_n
        self.m = spec.ngram_simple_size_m

    def draft(self, st: SlotSpec, hist: list[int], sampled: int) -> list[int]:
        n, m = self.n, self.m
        cur = len(hist)
        if cur <= n + m + 1:
            return []
        index = st.index
        # n-grams starting at j >= 1 with a token after them (llama.cpp's search range)
        for j in range(max(1, st.indexed), cur - n):
            index[tuple(hist[j:j + n])] = j
        st.indexed = max(st.indexed, cur - n)
        j = index.get((*hist[cur - n + 1:], sampled))
        if j is None:
            return []
        copy = min(m, cur - (j + n))
        if copy < n:
            return []
        return hist[j + n:j + n + copy]


class NgramMod:
    """``ngram-mod``'s table (llama.cpp's, shared by every slot there); here
    one per cache scope (:class:`ModTables`)."""

    def __init__(self, spec: SpecConfig) -> None:
        self.n = spec.ngram_mod_n_match
        self.n_max = spec.ngram_mod_n_max
        self.n_min = spec.ngram_mod_n_min
        self.table = np.full(MOD_TABLE, -1, np.int32)
        self.used = 0

    def _hashes(self, tokens: np.ndarray) -> np.ndarray:
        """Table indices of every n-gram of ``tokens`` (uint64 wraps as C's size_t)."""
        n = self.n
        k = len(tokens) - n + 1
        h = np.zeros(k, np.uint64)
        t = tokens.astype(np.uint64)
        mult = np.uint64(MOD_MULT)
        with np.errstate(over="ignore"):
            for i in range(n):
                h = h * mult + t[i:i + k]
        return (h % np.uint64(MOD_TABLE)).astype(np.int64)

    def _idx(self, tokens) -> int:
        res = 0
        for t in tokens:
            res = (res * MOD_MULT + t) & MASK64
        return res % MOD_TABLE

    def _add(self, hist: list[int], lo: int, hi: int) -> None:
        """Add the n-grams starting at ``lo .. hi - 1`` (each with its next token)."""
        if hi <= lo:
            return
        a = np.asarray(hist[lo:hi + self.n], np.int64)
        idx = self._hashes(a[:-1])[: hi - lo]
        nxt = a[self.n:self.n + hi - lo].astype(np.int32)
        self.used += int(np.count_nonzero(self.table[idx] == -1))
        self.table[idx] = nxt

    def reset(self) -> None:
        self.table.fill(-1)
        self.used = 0

    def begin(self, st: SlotSpec, prompt: list[int]) -> None:
        st.mod_last = st.mod_draft = 0
        n = self.n
        if len(prompt) < n:
            return
        self._add(prompt, 0, len(prompt) - n)
        st.mod_last = len(prompt) - n
        if self.used / MOD_TABLE > MOD_RESET_OCCUPANCY:
            log.warning("ngram-mod table %.2f full: reset", self.used / MOD_TABLE)
            self.reset()

    def draft(self, st: SlotSpec, hist: list[int], sampled: int) -> list[int]:
        st.mod_draft = 0
        n, cur = self.n, len(hist)
        if cur < n:
            return []
        if st.mod_last + 32 < cur:  # new n-grams in chunks, as llama.cpp
            self._add(hist, st.mod_last, cur - n)
            st.mod_last = cur - n
        key = [*hist[cur - n + 1:], sampled]
        out: list[int] = []
        table = self.table
        for i in range(self.n_max):
            tok = int(table[self._idx(key[i:i + n])])
            if tok == -1:
                if i < self.n_min:
                    return []
                break
            key.append(tok)
            out.append(tok)
        st.mod_draft = len(out)
        return out

    def accepted(self, st: SlotSpec, n_accepted: int) -> None:
        if st.mod_draft <= 0:
            return
        if n_accepted / st.mod_draft < MOD_LOW_ACCEPT:
            st.mod_low += 1
            if st.mod_low >= MOD_LOW_ROUNDS:
                self.reset()
                st.mod_low = 0
                st.mod_last = 0
        else:
            st.mod_low = 0


class ModTables:
    """The ``ngram-mod`` tables of one engine, one per cache scope (issue
    37, item 2): ``scope`` is the engine's ``cache_scope``: ``global``, one
    table every request reads and feeds (llama.cpp's); ``key``, one per
    tenant (``Generation.tenant``), so no draft, and no ``draft_n``, comes
    from another tenant's text; ``none``, a request's own (the slot's
    table, emptied when a request begins). At most ``n_seq`` tables
    (16 MiB each, llama.cpp's size) are kept: a tenant that holds no slot
    loses its table first, so the memory is bounded by the slot count."""

    def __init__(self, spec: SpecConfig, scope: str, n_seq: int) -> None:
        self.spec = spec
        self.scope = scope
        self.most = max(1, n_seq)
        self.tables: dict[str, NgramMod] = {}
        self.held: dict[int, str] = {}  # slot id -> the key of its request's table

    def key(self, s: Slot) -> str:
        """The table key of slot ``s``'s request."""
        if self.scope == "global":
            return ""
        if self.scope == "key":
            return "t:" + s.job.request.tenant
        return f"s:{s.id}"

    def table(self, s: Slot) -> NgramMod:
        """The table of slot ``s``'s (new) request: its scope's, made (and
        an unheld one dropped) when missing; emptied for scope ``none``."""
        k = self.key(s)
        self.held[s.id] = k
        t = self.tables.get(k)
        if t is None:
            if len(self.tables) >= self.most:
                live = set(self.held.values())
                for old in [x for x in self.tables if x not in live]:
                    del self.tables[old]
                    if len(self.tables) < self.most:
                        break
            t = self.tables[k] = NgramMod(self.spec)
        elif self.scope == "none":
            t.reset()
        return t


class Drafter:
    """The engine's proposers for ``spec`` (:class:`SpecConfig`) over
    ``n_seq`` slots: :meth:`propose` sets each asking slot's draft;
    :meth:`verified` takes each verification's outcome."""

    def __init__(self, llama_cpp, spec: SpecConfig, target: EngineConfig, n_seq: int) -> None:
        spec.check()
        self.spec = spec
        types = spec.ordered()
        self.simple = NgramSimple(spec) if "ngram-simple" in types else None
        self.mod = (ModTables(spec, target.cache_scope, n_seq) if "ngram-mod" in types
                    else None)
        self.model = (DraftModel(llama_cpp, spec, target, n_seq) if "draft-simple" in types
                      else None)
        self.cost = StepCost(spec.token_cost)  # the engine's steps, fed by VerifySteps

    def load(self, target: ModelContext) -> None:
        if self.model is not None:
            self.model.load(target)

    def free(self) -> None:
        if self.model is not None:
            self.model.free()

    def state(self, s: Slot) -> SlotSpec:
        """Slot ``s``'s drafting state, new for a new request choice."""
        st = s.spec
        if st is None or st.job is not s.job:
            st = s.spec = SlotSpec(self.spec)
            st.job = s.job
            if self.mod is not None:
                st.mod = self.mod.table(s)
                st.mod.begin(st, s.tokens)
        return st

    def propose(self, asks: list[tuple[Slot, int]]) -> None:
        """Set ``s.draft`` (at most ``n`` tokens) for each ``(s, n)``."""
        rest = []
        for s, n in asks:
            st = s.spec
            d: list[int] = []
            if self.simple is not None:
                d = self.simple.draft(st, s.tokens, s.pending)
            if not d and st.mod is not None:
                d = st.mod.draft(st, s.tokens, s.pending)
            if d:
                s.draft = d[:n]
            elif self.model is not None:
                rest.append((s, s.tokens, s.pending, min(n, self.spec.draft_n_max)))
        if rest:
            for s, *_ in rest:
                s.draft = []
            for sid, d in self.model.draft(rest).items():
                for s, *_ in rest:
                    if s.id == sid:
                        s.draft = d
                        break

    def verified(self, s: Slot, drafted: int, accepted: int) -> None:
        st = s.spec
        st.record(self.spec, drafted, accepted)
        if st.mod is not None:
            st.mod.accepted(st, accepted)

    def idle(self, s: Slot, st: SlotSpec) -> None:
        """Slot ``s`` drafts nothing this step (its drafts would lose): with
        an n-gram proposer, a shadow draft (made now, checked against the
        tokens it then makes, never verified: free) keeps its acceptance
        estimate current, so it drafts again once they would pay; with only
        a draft model, a pause and then a probe (``SlotSpec.pause``)."""
        if self.simple is None and self.mod is None:
            if st.pause_left <= 0:
                st.pause(self.spec)
            return
        if st.shadow:
            return  # one at a time (:meth:`resolve` ends it)
        d: list[int] = []
        if self.simple is not None:
            d = self.simple.draft(st, s.tokens, s.pending)
        if not d and st.mod is not None:
            d = st.mod.draft(st, s.tokens, s.pending)
            st.mod_draft = 0  # not verified: ngram-mod's low-acceptance count ignores it
        st.shadow, st.shadow_at = d[:SHADOW_MAX], len(s.tokens) + 1

    def resolve(self, s: Slot, st: SlotSpec) -> None:
        """Check slot ``s``'s shadow draft against the tokens made since
        (the pending one included): once it misses or is matched whole, its
        outcome goes into the slot's acceptance estimate."""
        d = st.shadow
        if not d:
            return
        got = s.tokens[st.shadow_at:st.shadow_at + len(d)]
        if s.pending >= 0 and len(got) < len(d):
            got.append(s.pending)
        m = 0
        for a, b in zip(d, got):
            if a != b:
                break
            m += 1
        if m < len(got) or m == len(d):
            st.record(self.spec, len(d), m, shadow=True)
            st.shadow = []


__all__ = ["Drafter", "ModTables", "NgramMod", "NgramSimple", "SlotSpec"]
