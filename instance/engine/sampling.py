"""Per-request sampling for the engine: llama.cpp sampler chains and
log-probabilities (stop strings: :mod:`ggmux.instance.engine.stops`).

Pure helpers around llama-cpp-python's low-level API; the engine
(:mod:`ggmux.instance.engine`) owns when they run. Defaults are
llama-server's (``common/common.h``: temperature 0.8, top_k 40, top_p 0.95,
min_p 0.05, repeat penalty 1.0 over the last 64 tokens), and the chain's
order is llama-server's default sampler sequence (penalties, top_k,
typical_p, top_p, min_p, temperature, then a seeded draw), after the
logit bias; the grammar is checked apart from the chain, as llama.cpp's
common sampler does (:class:`SlotSampler`).
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass, field

import numpy as np

log = logging.getLogger(__name__)

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed per chain


DRY_BREAKERS = ("\n", ":", "\"", "*")
"""llama.cpp's default DRY sequence breakers (``common/common.h``)."""


@dataclass(slots=True)
class Sampling:
    """Sampling settings of one request (OpenAI's names; llama-server's
    ``repeat_last_n``). ``temperature <= 0`` is greedy. ``seed`` None draws a
    random seed; choice ``i`` of an ``n > 1`` request uses ``seed + i`` so
    that its choices differ yet repeat. ``logit_bias`` maps token id to an
    additive bias (OpenAI: -100 bans, +100 forces). ``grammar`` is GBNF text
    (llama.cpp's ``grammars/README.md``) whose start rule is ``grammar_root``;
    ``grammar_lazy`` holds it back until the text generated so far matches
    one of ``grammar_patterns`` (regexes; the grammar starts at the first
    capture group) or one of ``grammar_tokens`` is drawn (llama.cpp's lazy
    grammars, armed at a tool call's trigger).
    ``mirostat`` 1 or 2 replaces top-k/p and the draw by Mirostat (v1, v2)
    with target ``mirostat_tau`` and rate ``mirostat_eta``, as llama-server.
    ``dry_multiplier`` > 0 turns on llama.cpp's DRY sampler (a penalty
    ``multiplier * base ** (n - allowed_length)`` on a token that would
    extend a repetition of ``n`` tokens within the last
    ``dry_penalty_last_n``, sequences cut at ``dry_sequence_breakers``),
    after the penalties and before the rest, greedy draws included, as
    llama.cpp's ``common_sampler_init`` orders them.
    """

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = 1.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: str | None = None
    grammar_root: str = "root"
    grammar_lazy: bool = False
    grammar_patterns: list[str] = field(default_factory=list)
    grammar_tokens: list[int] = field(default_factory=list)
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DRY_BREAKERS))


class SamplerError(ValueError):
    """A sampler chain could not be built (an unparsable grammar); the
    request is at fault (answered with 400)."""


class SlotSampler:
    """The samplers of one choice: a ``llama_sampler`` chain and, kept apart
    from it, the grammar, sampled as llama.cpp's ``common_sampler_sample``
    does: the chain draws from all the logits; only when the grammar refuses
    that token is the draw redone with the grammar applied first. A grammar
    applied to the whole vocabulary costs tens to hundreds of ms per token
    (measured on smollm2's 49k tokens inside a JSON string); checking one
    token costs microseconds, and a constrained model mostly draws allowed
    tokens. :meth:`free` releases both.

    ``greedy``: a :class:`Greedy` when the chain is a logit bias and a
    greedy pick and nothing else (``temperature <= 0``, no penalties, no
    grammar): stateless, so the engine draws every such slot of a step in
    one numpy ``argmax`` over the logits (:func:`greedy_tokens`) instead of
    one ``llama_sampler_sample`` each (issue 21: 136 us a call on smollm2's
    49,152 tokens against 5-13 us), the same token to the bit."""

    __slots__ = ("L", "_buf", "_ids", "_one", "_ptr", "chain", "grammar", "greedy", "n_vocab",
                 "post", "probs")

    def __init__(self, llama_cpp, chain, grammar, n_vocab: int,
                 greedy: Greedy | None = None, probs: int = 0) -> None:
        self.L = llama_cpp
        self.chain = chain
        self.grammar = grammar
        self.n_vocab = n_vocab
        self.greedy = greedy
        self.probs = probs
        self.post: tuple[float, list[tuple[int, float]]] | None = None
        if grammar is not None or probs:
            self._buf = np.zeros(n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
            self._ids = np.arange(n_vocab, dtype=np.int32)
            self._ptr = self._buf.ctypes.data_as(ctypes.POINTER(llama_cpp.llama_token_data))
            self._one = (llama_cpp.llama_token_data * 1)()

    def sample(self, ctx, idx: int) -> int:
        """Draw the next token from batch output ``idx`` and accept it."""
        if self.grammar is None and not self.probs:
            return self.L.llama_sampler_sample(self.chain, ctx, idx)
        return self.sample_row(logits_row(self.L, ctx, idx, self.n_vocab))

    def sample_row(self, logits: np.ndarray) -> int:
        """Draw the next token from ``logits`` (shape ``[n_vocab]``; a copy
        the caller owns, so that this may run on a worker thread while the
        context decodes: :mod:`ggmux.instance.engine.sample_steps`) and accept it.
        With ``probs`` (llama-server's ``post_sampling_probs``) ``post``
        becomes the drawn token's probability after the chain and the
        ``probs`` best candidates left by it (:func:`post_sampling`).
        Raises :class:`SamplerError` when the chain selected none."""
        L = self.L
        if self.grammar is None and not self.probs:
            return sample_logits(L, self.chain, logits)
        arr = self._candidates(logits)
        if self.grammar is None:
            L.llama_sampler_apply(self.chain, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise SamplerError("the sampler chain selected no token")
            tok = int(arr.data[arr.selected].id)
            self.post = post_sampling(arr, tok, self.probs)
            L.llama_sampler_accept(self.chain, tok)
            return tok
        L.llama_sampler_apply(self.chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise SamplerError("the sampler chain selected no token")
        tok = arr.data[arr.selected].id
        one = self._one
        one[0].id, one[0].logit, one[0].p = tok, 1.0, 0.0
        single = L.llama_token_data_array(data=one, size=1, selected=-1, sorted=False)
        L.llama_sampler_apply(self.grammar, ctypes.byref(single))
        if one[0].logit == float("-inf"):  # refused: draw again under the grammar
            arr = self._candidates(logits)
            L.llama_sampler_apply(self.grammar, ctypes.byref(arr))
            L.llama_sampler_apply(self.chain, ctypes.byref(arr))
            if not 0 <= arr.selected < arr.size:
                raise SamplerError("the grammar allows no token here")
            tok = arr.data[arr.selected].id
        if self.probs:  # of the chain's last pass (with the grammar when it redrew)
            self.post = post_sampling(arr, int(tok), self.probs)
        L.llama_sampler_accept(self.grammar, tok)
        L.llama_sampler_accept(self.chain, tok)
        return int(tok)

    def _candidates(self, logits: np.ndarray):
        buf = self._buf
        buf["id"] = self._ids
        buf["logit"] = logits
        buf["p"] = 0.0
        return self.L.llama_token_data_array(data=self._ptr, size=self.n_vocab, selected=-1,
                                             sorted=False)

    def free(self) -> None:
        if self.chain is not None:
            self.L.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar is not None:
            self.L.llama_sampler_free(self.grammar)
            self.grammar = None


def post_sampling(arr, tok: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """llama-server's ``post_sampling_probs`` (``tools/server/server-context.cpp``,
    ``populate_token_probs``): the candidates the chain left in ``arr`` (a
    ``llama_token_data_array`` after ``llama_sampler_apply``; their ``p``
    set by the final draw), best first. Returns the probability of ``tok``
    and up to ``k`` ``(id, p)`` pairs, zero probabilities left out."""
    n = int(arr.size)
    cur = np.ctypeslib.as_array(ctypes.cast(arr.data, ctypes.POINTER(ctypes.c_uint8)),
                                (n * TOKEN_DATA.itemsize,)).view(TOKEN_DATA)
    own = cur["p"][cur["id"] == tok]
    keep = cur[cur["p"] > 0]
    best = keep[np.argsort(-keep["p"], kind="stable")[:k]]
    return (float(own[0]) if own.size else 0.0,
            [(int(i), float(p)) for i, p in zip(best["id"], best["p"], strict=True)])


def sampler_chain(llama_cpp, vocab, n_vocab: int, s: Sampling, seed: int,
                  probs: int = 0) -> SlotSampler:
    """The samplers for ``s`` (:class:`SlotSampler`; the caller frees them
    with ``free()``). ``seed`` is the seed of the final draw; ``probs``: how
    many post-sampling candidates each draw keeps (``SlotSampler.post``).

    Raises :class:`SamplerError` when the grammar does not parse (llama.cpp
    logs the parser's reason)."""
    L = llama_cpp
    grammar = None
    if s.grammar:
        grammar = _grammar(L, vocab, s)
        if not grammar:
            raise SamplerError("'grammar' could not be parsed as GBNF")
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    _fill_chain(L, chain, vocab, n_vocab, s, seed)
    greedy = None
    if grammar is None and s.temperature <= 0 and not _penalised(s) and not _dry(s):
        greedy = Greedy(s.logit_bias)
    return SlotSampler(L, chain, grammar, n_vocab, greedy, probs)


class Greedy:
    """A stateless greedy draw: llama.cpp's logit bias then greedy sampler
    (``src/llama-sampler.cpp``: each bias added to its token's float32
    logit, then the first token of the highest logit). ``ids``/``values``:
    the biases as arrays; ``lowering``: every bias is <= 0, so the raw
    argmax stands unless it is a biased token itself."""

    __slots__ = ("biased", "ids", "lowering", "values")

    def __init__(self, logit_bias: dict[int, float]) -> None:
        self.ids = np.fromiter((int(t) for t in logit_bias), np.intp, len(logit_bias))
        self.values = np.fromiter((float(v) for v in logit_bias.values()), np.float32,
                                  len(logit_bias))
        self.biased = frozenset(int(t) for t in logit_bias)
        self.lowering = bool((self.values <= 0).all())

    def pick(self, logits: np.ndarray, raw_argmax: int) -> int:
        """The token for ``logits`` (shape ``[n_vocab]``, not changed) whose
        unbiased argmax is ``raw_argmax``."""
        if not self.ids.size or self.lowering and raw_argmax not in self.biased:
            return raw_argmax  # lowered tokens cannot overtake the first maximum
        row = logits.copy()
        row[self.ids] += self.values
        return int(row.argmax())


def greedy_tokens(llama_cpp, ctx, outputs: list[int], greedy: list[Greedy],
                  n_vocab: int) -> list[int]:
    """The greedy draws of batch outputs ``outputs`` (batch indices whose
    logits were asked for) under ``greedy`` (one each): one ``argmax``
    over the rows of the context's logits that hold them (a view, no copy;
    rows in one run, as a step's generating slots are, take one call)."""
    L = llama_cpp
    first = L.llama_get_logits_ith(ctx, outputs[0])
    base = ctypes.cast(first, ctypes.c_void_p).value
    step = 4 * n_vocab
    rows = [0]
    for i in outputs[1:]:
        rows.append((ctypes.cast(L.llama_get_logits_ith(ctx, i), ctypes.c_void_p).value - base)
                    // step)
    lo, hi = min(rows), max(rows)
    start = base + lo * step
    block = np.ctypeslib.as_array(ctypes.cast(start, ctypes.POINTER(ctypes.c_float)),
                                  shape=(hi - lo + 1, n_vocab))
    raw = block.argmax(axis=1)
    return [g.pick(block[r - lo], int(raw[r - lo])) for r, g in zip(rows, greedy, strict=True)]


def _penalised(s: Sampling) -> bool:
    """Whether ``s`` adds llama.cpp's penalties sampler (stateful: it
    counts the tokens accepted)."""
    return s.repeat_penalty != 1.0 or bool(s.presence_penalty) or bool(s.frequency_penalty)


def _dry(s: Sampling) -> bool:
    """Whether ``s`` adds llama.cpp's DRY sampler (stateful, as the penalties)."""
    return s.dry_multiplier != 0.0 and s.dry_base >= 1.0 and s.dry_penalty_last_n != 0


def _grammar(L, vocab, s: Sampling):
    """The grammar sampler of ``s`` (lazy when asked), or NULL."""
    if not s.grammar_lazy:
        return L.llama_sampler_init_grammar(vocab, s.grammar.encode(), s.grammar_root.encode())
    pats = (ctypes.c_char_p * max(1, len(s.grammar_patterns)))(
        *[p.encode() for p in s.grammar_patterns])
    toks = (L.llama_token * max(1, len(s.grammar_tokens)))(*s.grammar_tokens)
    return L.llama_sampler_init_grammar_lazy_patterns(
        vocab, s.grammar.encode(), s.grammar_root.encode(), pats, len(s.grammar_patterns),
        toks, len(s.grammar_tokens))


def _fill_chain(L, chain, vocab, n_vocab: int, s: Sampling, seed: int) -> None:

    def add(smpl) -> None:
        L.llama_sampler_chain_add(chain, smpl)

    if s.logit_bias:
        arr = (L.llama_logit_bias * len(s.logit_bias))()
        for i, (tok, bias) in enumerate(s.logit_bias.items()):
            arr[i].token = int(tok)
            arr[i].bias = float(bias)
        add(L.llama_sampler_init_logit_bias(n_vocab, len(s.logit_bias), arr))
    if _penalised(s):
        # this llama.cpp's signature starts with n_vocab (include/llama.h)
        add(L.llama_sampler_init_penalties(n_vocab, s.repeat_last_n, s.repeat_penalty,
                                           s.frequency_penalty, s.presence_penalty))
    if _dry(s):
        breakers = [b.encode() for b in s.dry_sequence_breakers if b]
        arr = (ctypes.c_char_p * max(1, len(breakers)))(*breakers)
        # the vocabulary pointer as llama.h takes it; the sampler copies the breakers
        add(L.llama_sampler_init_dry(vocab, s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                     s.dry_penalty_last_n, arr, len(breakers)))
    if s.temperature <= 0:
        add(L.llama_sampler_init_greedy())
        return
    if s.mirostat in (1, 2):
        add(L.llama_sampler_init_temp(s.temperature))
        if s.mirostat == 1:
            add(L.llama_sampler_init_mirostat(n_vocab, seed & 0xFFFFFFFF, s.mirostat_tau,
                                              s.mirostat_eta, 100))
        else:
            add(L.llama_sampler_init_mirostat_v2(seed & 0xFFFFFFFF, s.mirostat_tau,
                                                 s.mirostat_eta))
        return
    if s.top_k > 0:
        add(L.llama_sampler_init_top_k(s.top_k))
    if s.typical_p < 1.0:
        add(L.llama_sampler_init_typical(s.typical_p, 1))
    if s.top_p < 1.0:
        add(L.llama_sampler_init_top_p(s.top_p, 1))
    if s.min_p > 0.0:
        add(L.llama_sampler_init_min_p(s.min_p, 1))
    add(L.llama_sampler_init_temp(s.temperature))
    add(L.llama_sampler_init_dist(seed & 0xFFFFFFFF))


def token_logprobs(logits: np.ndarray, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    """Log-probability of ``token`` under the model's raw distribution
    (log-softmax of ``logits``, shape ``[n_vocab]``) and the ``top`` most
    likely tokens as ``(id, logprob)``, best first (OpenAI's
    ``top_logprobs``; raw model probabilities, as llama-cpp-python reports)."""
    m = float(logits.max())
    lse = m + float(np.log(np.exp(logits - m).sum()))
    best: list[tuple[int, float]] = []
    if top > 0:
        idx = np.argpartition(-logits, min(top, logits.size - 1))[:top]
        idx = idx[np.argsort(-logits[idx])]
        best = [(int(i), float(logits[i]) - lse) for i in idx]
    return float(logits[token]) - lse, best


def logprob_entry(piece, tok: int, own: float, top: list[tuple[int, float]],
                  key: str = "logprob") -> dict:
    """One token's OpenAI-style logprob record (``id``, ``token``, ``bytes``,
    ``logprob``, ``top_logprobs``); ``piece(id)`` gives a token's bytes.
    ``key`` ``"prob"``: llama-server's ``post_sampling_probs`` record
    (``completion_token_output::to_json``: ``prob`` and ``top_probs``)."""
    def one(t: int, v: float) -> dict:
        b = piece(t)
        return {"id": t, "token": b.decode("utf-8", "replace"), "bytes": list(b), key: v}

    return {**one(tok, own), f"top_{key}s": [one(t, v) for t, v in top]}


TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
"""llama.cpp's ``llama_token_data`` as a numpy record."""


def sample_logits(llama_cpp, chain, logits: np.ndarray) -> int:
    """What ``llama_sampler_sample`` does (llama.cpp ``src/llama-sampler.cpp``),
    on ``logits`` (shape ``[n_vocab]``, a copy the caller owns) instead of the
    context's: every token a candidate, the chain applied, the selected one
    accepted. Needs no context, so it may run on any thread while the
    context decodes (one thread per chain at a time). Returns the token;
    raises :class:`SamplerError` when the chain selected none."""
    L = llama_cpp
    n = int(logits.size)
    cur = np.empty(n, TOKEN_DATA)
    cur["id"] = np.arange(n, dtype=np.int32)
    cur["logit"] = logits
    cur["p"] = 0.0
    arr = L.llama_token_data_array(cur.ctypes.data_as(ctypes.POINTER(L.llama_token_data)), n,
                                   -1, False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    if not 0 <= arr.selected < arr.size:
        raise SamplerError("the sampler chain selected no token")
    tok = int(arr.data[arr.selected].id)
    L.llama_sampler_accept(chain, tok)
    return tok


def logits_row(llama_cpp, ctx, i: int, n_vocab: int) -> np.ndarray:
    """The logits of batch output ``i`` as a numpy view (valid until the
    next decode)."""
    ptr = llama_cpp.llama_get_logits_ith(ctx, i)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
