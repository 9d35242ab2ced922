"""The engine's speculative steps (issue 30): before a generation batch is
built, each generating slot may propose a draft (:mod:`.draft`); the batch
carries its pending token and then the draft, with logits at every one of
them, so the one ``llama_decode`` of the step verifies every slot's drafts
together; after it, each drafting slot draws at its positions in order and
keeps the longest accepted prefix.

The acceptance rule is llama.cpp's ``common_sampler_sample_and_accept_n``
(``common/sampling.cpp``, used by llama-server's ``update_slots``): at
position ``i`` the slot's own sampler draws a token from the logits there
and accepts it (penalties, DRY, mirostat state advance exactly as without a
draft); when it equals draft token ``i`` the next position's logits are the
ones the model gives after that token, so the draw goes on; at the first
difference (or the end of the draft, one more draw) it stops. Each drawn
token is handed on as any token is (stop strings, end of generation,
``max_tokens``, log-probabilities, streaming in order), and a choice that
ends stops the run. The KV cells past the slot's accepted tokens are
removed (``llama_memory_seq_rm``), so the cache holds exactly the tokens
it would hold without drafts. Greedy output is therefore the same token
for token with speculation on or off (up to the floating-point sums of a
bigger batch, measured equal on this CPU); with sampling, each drawn token
has the distribution it would have without drafts (a draw, not llama.cpp's
``--spec-draft-sampling probabilistic`` rejection sampling, which needs
the draft's probabilities).

A slot whose sampler has a grammar (``json_schema``, a tool call's) drafts
too: the draft is verified by its own sampler, grammar included, so a
drafted token the grammar refuses is simply not accepted; its draws run on
a worker thread (as every grammar draw, :mod:`.sample_steps`) from a copy
of its rows, at most :data:`MOST_GRAMMAR_DRAFT` of them.

Sliding-window models (gemma3): drafts are at most a quarter of a
micro-batch (see :meth:`VerifySteps._propose`). Their answers are the same
with speculation on or off while the sequence fits the window (measured on
gemma3-270m: 260-token prompt, 160 tokens); past it, llama.cpp does not
compute a token's logits in a many-token batch to the bit as in a one-token
one (gemma3-270m after a 718-token prompt: the same token's log-probability
1e-3 apart by the 10th token, with drafts and without), so a near tie may
go the other way, as in llama-server.
"""

from __future__ import annotations

import logging

import numpy as np

from .sampling import greedy_tokens, logits_row
from .slots import GENERATE, SAMPLE, Slot

log = logging.getLogger(__name__)

MOST_DRAFT = 1024
"""The longest draft a slot is asked for (llama.cpp's n-gram sizes are at
most 1024); the proposers' own sizes and the adaptive length cut it."""

MOST_GRAMMAR_DRAFT = 16
"""The longest draft of a slot with a grammar: its rows are copied for the
worker (16 x smollm2's 49,152 logits: 3 MiB a step)."""


class VerifySteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses its model
    (``m``), llama bindings (``L``), ``drafter`` (None: no speculation),
    ``stats``, ``_took`` and the worker threads of
    :mod:`.sample_steps` (``_workers``, ``_cond``, ``_results``)."""

    drafter = None

    def _propose(self, gen: list[Slot], room: int) -> None:
        """Set the draft of every slot of ``gen`` (generating slots) that
        may draft: not paused, room left for the answer
        (llama-server's ``get_n_draft_max``: at most the tokens still to
        generate less one, and two short of the context). ``room``: batch
        tokens the drafts may take together."""
        for s in gen:
            s.draft = []
        d = self.drafter
        if d is None or room <= 0:
            return
        asks = []
        most = MOST_DRAFT
        if self.m.n_swa > 0:
            # a sliding-window cache reuses cells that left the window of the
            # newest position, drafts included; it keeps a micro-batch of
            # cells beyond the window, so drafts well within that never take
            # a cell the accepted positions still attend to
            most = max(1, min(self.m.cfg.n_ubatch, self.m.n_batch) // 4)
        for s in gen:
            job = s.job
            if job is None or s.sampler is None or job.no_drafts:
                continue
            st = d.state(s)
            if st.pause_left > 0:
                st.pause_left -= 1
                continue
            n = min(job.max_gen - s.n_decoded - 1, self.m.n_ctx - len(s.tokens) - 2, most)
            if s.sampler.grammar is not None:
                n = min(n, MOST_GRAMMAR_DRAFT)
            if n > 0:
                asks.append((s, st.limit(d.spec, n)))
        if not asks:
            return
        d.propose(asks)
        for s, _ in asks:  # the batch's room, first come first served
            if len(s.draft) > room:
                del s.draft[room:]
            room -= len(s.draft)

    def _verify(self, s: Slot) -> None:
        """Slot ``s`` decoded its pending token at batch index ``s.i_batch``
        and its draft after it (the pending token already moved into
        ``s.tokens``): draw, accept the longest matching prefix, hand the
        drawn tokens on, remove the rejected cells. A slot with a grammar
        draws on a worker thread (:meth:`_verify_later`)."""
        draft, s.draft = s.draft, []
        k = len(draft)
        base = s.i_batch
        sampler = s.sampler
        if sampler.grammar is not None:
            self._verify_later(s, draft)
            return
        ctx, n_vocab = self.m.ctx, self.m.n_vocab
        if sampler.greedy is not None:
            draw = greedy_tokens(self.L, ctx, list(range(base, base + k + 1)),
                                 [sampler.greedy] * (k + 1), n_vocab).__getitem__
        else:
            def draw(i: int) -> int:
                return sampler.sample(ctx, base + i)
        row = None
        if s.job.request.logprobs is not None:
            def row(i: int):
                return logits_row(self.L, ctx, base + i, n_vocab)
        self._accept(s, draft, draw, row)

    def _accept(self, s: Slot, draft: list[int], draw, row) -> None:
        """llama.cpp's sample-and-accept over ``draft``: ``draw(i)`` is the
        slot's draw at draft position ``i`` (0: after the pending token),
        ``row(i)`` its logits (None: no log-probabilities asked)."""
        job = s.job
        k = len(draft)
        end = len(s.tokens) + k  # the tokens' length with every draft token accepted
        st = self.stats
        job.n_drafted += k  # counted before the tokens: a choice may end the request
        st["draft_tokens_total"] += k
        st["draft_verifications_total"] += 1
        accepted = 0
        for i in range(k + 1):
            tok = draw(i)
            hit = i < k and tok == draft[i]
            if hit:  # llama-server counts a matching token even where a stop ends the choice
                accepted += 1
                job.n_draft_accepted += 1
                st["draft_accepted_total"] += 1
            self._took(s, tok, row(i) if row is not None else None)
            if s.job is not job or s.state != GENERATE or not hit:
                break  # the choice ended (stop string, end of generation, max_tokens) or a miss
            s.tokens.append(tok)  # the draft's cell holds it: decoded
            s.pending = -1
        if len(s.tokens) < end:
            self.L.llama_memory_seq_rm(self.m.mem, s.id, len(s.tokens), -1)
        self.drafter.verified(s, k, accepted)

    def _verify_later(self, s: Slot, draft: list[int]) -> None:
        """A grammar slot's verification: its draws (the grammar's cost)
        run on a worker thread from a copy of its ``len(draft) + 1`` logits
        rows, as :meth:`~.sample_steps.SampleSteps._sample_later`; the slot
        sits out of the batches meanwhile, its draft's cells kept, and
        :meth:`~.sample_steps.SampleSteps._collect` hands the draws to
        :meth:`_accept_drawn`."""
        base, n_vocab = s.i_batch, self.m.n_vocab
        rows = np.stack([logits_row(self.L, self.m.ctx, base + i, n_vocab)
                         for i in range(len(draft) + 1)])
        job = s.job
        s.state = SAMPLE
        job.sampling += 1
        self._drawing += 1
        self._fresh += 1
        self._workers().submit(self._verify_off, s, job, s.sampler, rows, draft)

    def _verify_off(self, s: Slot, job, sampler, rows: np.ndarray, draft: list[int]) -> None:
        """A worker thread's draws for :meth:`_verify_later`: at each
        position until the first miss; the result goes to the decode thread."""
        toks: list[int] = []
        posts: list = []
        try:
            for i in range(len(draft) + 1):
                toks.append(sampler.sample_row(rows[i]))
                posts.append(sampler.post)
                if i == len(draft) or toks[-1] != draft[i]:
                    break
            res: tuple | BaseException = (toks, posts, draft)
        except BaseException as e:  # noqa: BLE001 - handed to the decode thread
            res = e
        with self._cond:
            self._results.append((s, job, res, rows))
            self._cond.notify()

    def _accept_drawn(self, s: Slot, drawn: tuple, rows: np.ndarray) -> None:
        """The worker's draws of a grammar slot's verification, accepted
        as :meth:`_accept` does (each token's post-sampling probabilities
        restored before it is handed on)."""
        toks, posts, draft = drawn
        sampler = s.sampler

        def draw(i: int) -> int:
            sampler.post = posts[i]
            return toks[i]

        want = s.job.request.logprobs is not None
        self._accept(s, draft, draw, rows.__getitem__ if want else None)


__all__ = ["VerifySteps"]
