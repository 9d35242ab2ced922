"""The engine's sampling step: every slot whose logits came out of a decode
draws its token and hands its text on (stop strings, end of generation,
log-probabilities), part of :class:`~ggmux.instance.engine.Engine`'s step 3.

Issue 18, finding 2: the decode thread serves every client, so no request
may make its work there grow with something the client chose. Each step of
a slot here is O(its new text) (stop strings: :mod:`.stops`) plus the
sampler chain's O(n_vocab), except a grammar's: llama.cpp checks every
candidate token against every parse stack of the grammar, so its cost per
token grows with the grammar (measured on smollm2: a grammar of 8,000
alternatives took 8 s a token where the model took 1). A slot whose chain
has a grammar therefore draws on a worker thread, from a copy of its logits
(``llama_sampler_sample``'s own steps, :func:`~.sampling.sample_logits`;
ctypes lets go of the GIL in llama.cpp): meanwhile it sits out of the
batches (state ``sampling``) and the other slots go on; its token is taken
at the start of the next step after it is ready (:meth:`SampleSteps._collect`),
which waits for the draws sent since the last step up to :data:`DRAW_WAIT`
of a decode's time, so that a cheap grammar (most JSON schemas) still
joins every batch while an expensive one delays the others by at most that
share, once per token of its own. A
request's samplers are freed only once no worker holds one, and the
weights only once no worker runs (:meth:`SampleSteps._drain_samples`).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .sampling import (
    greedy_tokens,
    logits_row,
    logprob_entry,
    token_logprobs,
)
from .slots import GENERATE, SAMPLE, Slot

log = logging.getLogger(__name__)

DRAW_WAIT = 0.25  # share of a decode's time a step waits for draws on workers
STEP_ALPHA = 0.2  # EWMA weight of the newest decode time


class SampleSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses its model
    (``m``), llama bindings (``L``), condition (``_cond``), slots and
    ``_end_job``; owns ``_results`` (worker results, under ``_cond``) and
    ``_pool`` (the worker threads, made at the first grammar)."""

    _pool: ThreadPoolExecutor | None = None
    _drawing = 0  # draws on workers not yet collected
    _fresh = 0  # of those, sent since the last step's collect
    _step_s = 0.0  # EWMA of a decode's seconds (:meth:`_timed`)

    def _timed(self, seconds: float) -> None:
        """One decode took ``seconds`` (the engine's ``_decode`` reports)."""
        old = self._step_s
        self._step_s = seconds if not old else old + STEP_ALPHA * (seconds - old)

    def _sample_all(self, slots: list[Slot]) -> None:
        """Every slot in ``slots`` (its logits just came out) draws: the
        stateless greedy ones together (:func:`~.sampling.greedy_tokens`),
        the others with their own chain; a slot whose request ended
        meanwhile (an earlier slot of the step ended it) is skipped."""
        greedy = [s for s in slots if s.sampler.greedy is not None]
        if greedy:
            toks = greedy_tokens(self.L, self.m.ctx, [s.i_batch for s in greedy],
                                 [s.sampler.greedy for s in greedy], self.m.n_vocab)
            for s, tok in zip(greedy, toks, strict=True):
                job = s.job
                if job is None or job.ended:
                    continue
                row = (logits_row(self.L, self.m.ctx, s.i_batch, self.m.n_vocab)
                       if job.request.logprobs is not None else None)
                self._took(s, tok, row)
            if len(greedy) == len(slots):
                return
        for s in slots:
            if s.sampler is not None and s.sampler.greedy is None and s.job is not None \
                    and not s.job.ended:
                self._sample(s)

    def _sample(self, s: Slot) -> None:
        job = s.job
        if job.request.sampling.grammar:
            self._sample_later(s)
            return
        tok = s.sampler.sample(self.m.ctx, s.i_batch)
        row = (logits_row(self.L, self.m.ctx, s.i_batch, self.m.n_vocab)
               if job.request.logprobs is not None else None)
        self._took(s, tok, row)

    def _sample_later(self, s: Slot) -> None:
        """Draw ``s``'s token on a worker thread, from a copy of its logits
        (valid only until the next decode)."""
        row = logits_row(self.L, self.m.ctx, s.i_batch, self.m.n_vocab).copy()
        s.state = SAMPLE
        job = s.job
        job.sampling += 1
        self._drawing += 1
        self._fresh += 1
        self._workers().submit(self._sample_off, s, job, s.sampler, row)

    def _workers(self) -> ThreadPoolExecutor:
        """The worker threads, made at the first grammar draw."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(len(self.slots), thread_name_prefix="sampler")
        return self._pool

    def _sample_off(self, s: Slot, job, sampler, row: np.ndarray) -> None:
        """A worker thread's draw; its result goes to the decode thread."""
        try:
            tok: int | BaseException = sampler.sample_row(row)
        except BaseException as e:  # noqa: BLE001 - handed to the decode thread
            tok = e
        with self._cond:
            self._results.append((s, job, tok, row))
            self._cond.notify()

    def _collect(self) -> None:
        """Take the tokens the workers drew (the start of a step), waiting
        for those sent since the last step up to :data:`DRAW_WAIT` of a
        decode's time (a draw still out after that is a slow one: the
        others do not wait for it again)."""
        if not self._drawing:
            return
        with self._cond:
            if not self._results and self._fresh:
                self._cond.wait_for(lambda: self._results, DRAW_WAIT * self._step_s)
            done, self._results = self._results, []
        self._fresh = 0
        self._drawing -= len(done)
        for s, job, tok, row in done:
            job.sampling -= 1
            if job.ended or s.job is not job or s.state != SAMPLE:
                if job.ended and job.sampling == 0:
                    self._free_samplers(job)  # deferred while a worker held them
                continue
            s.state = GENERATE
            if isinstance(tok, BaseException):
                log.error("sampling failed: %s", tok)
                self._fail(job, f"sampling failed: {tok}")
                continue
            if isinstance(tok, tuple):  # a draft verification's draws (verify_steps)
                self._accept_drawn(s, tok, row)
                continue
            self._took(s, tok, row)

    def _drain_samples(self) -> None:
        """Wait for the workers (before the weights are freed) and free what
        they held."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        with self._cond:
            done, self._results = self._results, []
        self._drawing = self._fresh = 0
        for _, job, _, _ in done:
            job.sampling -= 1
            if job.ended and job.sampling == 0:
                self._free_samplers(job)

    def _took(self, s: Slot, tok: int, row: np.ndarray | None) -> None:
        """Slot ``s`` drew ``tok`` (``row``: its logits, for log-probabilities):
        hand its text on, or end the choice."""
        job = s.job
        r = job.request
        s.n_decoded += 1
        job.n_decoded += 1
        lp = None
        if r.logprobs is not None and r.post_sampling_probs:
            own, top = s.sampler.post or (1.0, [(tok, 1.0)])  # greedy: the one candidate
            lp = [logprob_entry(self.m.piece, tok, own, top, "prob")]
        elif r.logprobs is not None:
            own, top = token_logprobs(row, tok, r.logprobs)
            lp = [logprob_entry(self.m.piece, tok, own, top)]
        if not r.ignore_eos and self.m.is_eog(tok):
            if lp:
                job.emit(("text", s.choice, "", lp))
            self._end_choice(s, "stop")
            return
        text = s.decoder.decode(self.m.piece(tok, tok in r.preserved))
        out, matched = s.stop.feed(text)
        if out or lp:
            job.emit(("text", s.choice, out, lp))
        if matched:
            self._end_choice(s, "stop", flush=False)
        elif s.n_decoded >= job.max_gen:
            self._end_choice(s, "length")
        else:
            s.pending = tok

    def _end_choice(self, s: Slot, reason: str, flush: bool = True) -> None:
        job = s.job
        if flush:
            tail = s.stop.flush() + s.decoder.decode(b"", True)
            if tail:
                job.emit(("text", s.choice, tail, None))
        job.emit(("end", s.choice, reason))
        s.release()
        job.left -= 1
        if job.left == 0:
            self._end_job(job)

    def _free_samplers(self, job) -> None:
        """Free ``job``'s sampler chains, or, while a worker draws with one,
        leave that to :meth:`_collect`."""
        if job.sampling:
            return
        for smpl in job.samplers:
            smpl.free()
        job.samplers = []


__all__ = ["SampleSteps"]
