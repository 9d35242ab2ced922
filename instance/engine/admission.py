"""The engine's admission step (:class:`~ggmux.instance.engine.Engine`'s
step 2): queued requests take free slots, round robin by tenant
(:mod:`.fairness`), each in the free slot whose cached tokens share the
longest prefix with its prompt (llama-server's ``cache_prompt`` and
``slot_prompt_similarity``) or, when a KV tier holds a longer prefix, the
least recently used slot with that prefix restored into it
(:mod:`.cache_steps`); a request starts only when every running slot's
reservation and its own fit the KV cache (a full cache makes new requests
wait, never aborts running ones: llama.cpp #23652)."""

from __future__ import annotations

import codecs
import time
from collections import Counter

import numpy as np

from ..media.spans import floor_outside
from .cache_steps import SAVE_KEEP_SHARE
from .jobs import Embedding, Generation, Job
from .slots import EMBED, IDLE, PROMPT, WAIT, Slot, common_prefix
from .stops import StopText


def tenant_of(job: Job) -> str:
    """The tenant a request is counted and cached under."""
    return job.request.tenant


class AdmissionSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses its slots,
    ``_waiting`` queue, ``cfg``, ``m``, ``L``, ``stats``, ``kv_size``,
    ``_clear``, the tier steps (``_tier_lookup``, ``_tier_save``,
    ``_tier_restore``, ``_tier_count``) and the checkpoint steps
    (``_ckpt_usable``, ``_ckpt_rollback``: :mod:`.checkpoints`)."""

    def _admit(self) -> None:
        while self._waiting:
            idle = [s for s in self.slots if s.state == IDLE]
            if not idle:
                return
            held = Counter(tenant_of(s.job) for s in self.slots
                           if s.state != IDLE and s.job is not None)
            job = self._waiting.next(held)
            r = job.request
            k = r.n if isinstance(r, Generation) else 1
            if len(idle) < k:
                return
            chosen = self._choose(job, idle, k)
            if job.restore is not None and not self.cache.fetch(job.restore, self._kick):
                return  # its entry is being read off this thread; the reader kicks
            busy_kv = sum(s.reserved for s in self.slots if s.state != IDLE)
            need = busy_kv + k * job.footprint
            if need > self.kv_size:
                return  # wait for running requests to end; never cut them
            others = sorted((s for s in idle if s not in chosen), key=lambda s: s.t_used)
            cached = sum(len(s.tokens) for s in others)
            for s in others:  # make room by dropping the oldest idle caches
                if need + cached <= self.kv_size:
                    break
                cached -= len(s.tokens)
                self._clear(s)
            self._waiting.take(job)
            self._start(job, chosen)

    def _choose(self, job: Job, idle: list[Slot], k: int) -> list[Slot]:
        r = job.request
        lru = sorted(idle, key=lambda s: s.t_used)
        job.restore = None
        if not isinstance(r, Generation) or not r.cache_prompt:
            return lru[:k]
        best, best_n = None, 0
        for s in idle:
            if s.tokens and self._may_reuse(s, r):
                n = common_prefix(r.prompt, np.asarray(s.tokens, np.int32))
                n = floor_outside(r.media, min(n, len(r.prompt) - 1))  # no part of an image
                n = self._ckpt_usable(s, n)  # what it can serve
                if n > best_n:
                    best, best_n = s, n
        job.restore = self._tier_lookup(job, best_n)  # a longer prefix in RAM or on disk
        if job.restore is not None:
            return lru[:k]
        if best is None or best_n < self.cfg.slot_prompt_similarity * len(r.prompt):
            return lru[:k]
        return [best] + [s for s in lru if s is not best][: k - 1]

    def _uncached(self, r: Generation) -> int:
        """Tokens of ``r``'s prompt that no slot's cache holds as a prefix
        (at least 1: the last prompt token is always read): the estimate of
        its prefill that the engine's gather wait is sized by. A sliding-window
        slot may have to read more, a KV tier may hold more; the estimate
        needs no checkpoint or tier lookup, which cost more than the wait."""
        prompt = r.prompt
        best = 0
        if r.cache_prompt:
            for s in self.slots:
                if s.tokens and self._may_reuse(s, r):
                    best = max(best, common_prefix(prompt, np.asarray(s.tokens, np.int32)))
        return max(1, len(prompt) - best)

    def _may_reuse(self, s: Slot, r: Generation) -> bool:
        """Whether ``r`` may reuse the prompt cache of slot ``s``
        (``cache_scope``: ``global`` any, ``key`` one its own tenant made,
        ``none`` never)."""
        scope = self.cfg.cache_scope
        return scope == "global" or scope == "key" and s.owner == r.tenant

    def _start(self, job: Job, chosen: list[Slot]) -> None:
        job.t_start = time.monotonic()
        job.slots = chosen
        self.stats["requests_total"] += 1
        for i, s in enumerate(chosen):
            s.job, s.choice, s.reserved, s.n_decoded = job, i, job.footprint, 0
            s.children, s.pending, s.i_batch = [], -1, -1
        first = chosen[0]
        if isinstance(job.request, Embedding):
            self._clear(first)
            first.state, first.embed_i, first.embed_pos, first.embed_sum = EMBED, 0, 0, None
            first.n_cached = 0
            return
        prompt = job.request.prompt
        keep = 0
        restored = None
        if job.restore is not None:  # the slot's cache goes whole: saved, then replaced
            self._tier_save(first)
            restored = self._tier_restore(first, job.restore, job.request.tenant)
        if job.request.cache_prompt and first.tokens and self._may_reuse(first, job.request):
            keep = min(common_prefix(prompt, np.asarray(first.tokens, np.int32)), len(prompt) - 1)
            keep = floor_outside(job.request.media, keep)  # an image is kept whole or not at all
        # what a sliding-window or recurrent memory can serve of it (issue 35)
        usable = self._ckpt_usable(first, keep)
        if first.tokens and usable < SAVE_KEEP_SHARE * len(first.tokens):
            self._tier_save(first)  # most of the slot's cache goes (llama-server's f_keep)
        # a sliding-window or recurrent memory cut back to `keep` tokens: what it
        # still holds, or its newest context checkpoint within them (issue 35)
        keep, from_checkpoint = self._ckpt_rollback(first, keep)
        self._tier_count(job, keep, restored)
        if not self.L.llama_memory_seq_rm(self.m.mem, first.id, keep, -1):
            self._clear(first)
            keep = from_checkpoint = 0
        del first.tokens[keep:]
        first.checkpoints = [c for c in first.checkpoints if c.n_tokens <= keep]
        job.n_cached = first.n_cached = keep
        job.n_checkpoint = from_checkpoint
        if job.request.media or keep and min(first.tokens[:keep]) < 0:
            job.no_drafts = True  # media placeholders are no tokens a drafter may propose
        for i, s in enumerate(chosen):
            s.owner = job.request.tenant  # the KV it holds from now on is this tenant's
            s.sampler = job.samplers[i]
            s.decoder = codecs.getincrementaldecoder("utf-8")("replace")
            s.stop = StopText(job.stops)
            if s is not first:
                self._clear(s)
                s.state, s.n_cached = WAIT, keep
        first.children = chosen[1:]
        first.state = PROMPT
        if job.request.media:
            self._prefetch(job, keep)  # the encoder starts on its images and audio now
        job.progress(keep)
