"""The engine's generation step: one batch of every generating slot's
pending token and then prompt chunks, one ``llama_decode``, then the
draws (:class:`~ggmux.instance.engine.Engine`'s step 3; the draws and
their text: :mod:`ggmux.instance.engine.sample_steps`)."""

from __future__ import annotations

import logging
import time

from ..backend import ReplicaFault
from ..media.spans import next_start
from .slots import GENERATE, IDLE, PROMPT, Slot

log = logging.getLogger(__name__)

KV_FULL = "Context size has been exceeded."
"""What every request being served gets when the shared KV cache has no cell
left for the next generated tokens: llama-server's message and status (500,
``tools/server/server-context.cpp``); not the replica's fault."""


class GenerateSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses its model
    (``m``), llama bindings (``L``), batch (``_batch``), slots, ``stats``,
    ``_timed``, ``_sample_all``, ``_clear``, ``_fail`` and the speculative
    steps (``drafter``, ``_propose``, ``_verify``: :mod:`.verify_steps`)."""

    def _plan(self, prompt_budget: int, drafts: bool = True) -> list[tuple[Slot, int]]:
        """Fill the batch: every generating slot's pending token and its
        draft (``drafts``: speculation, :mod:`.verify_steps`; logits at
        each), then prompt chunks (oldest request first) up to
        ``prompt_budget`` tokens. Returns ``(slot, tokens added)``; nothing
        is committed yet."""
        b = self._batch
        b.clear()
        plan = []
        gen = [s for s in self.slots if s.state == GENERATE]
        if drafts and self.drafter is not None:
            self._propose(gen, b.capacity - len(gen))
        else:
            for s in gen:
                s.draft = []
        for s in gen:
            s.i_batch = b.add(s.pending, len(s.tokens), s.id, True)
            if s.draft:
                b.add_run(s.draft, len(s.tokens) + 1, s.id, "all")
            plan.append((s, 1 + len(s.draft)))
        budget = min(prompt_budget, b.room)
        for s in sorted((s for s in self.slots if s.state == PROMPT), key=lambda s: s.job.id):
            if budget <= 0:
                break
            r = s.job.request
            prompt = r.prompt
            start = len(s.tokens)
            k = min(len(prompt) - start, budget)
            if r.media:  # text up to the next media span (read by the media step)
                nxt = next_start(r.media, start)
                if nxt is not None:
                    k = min(k, nxt - start)
                if k <= 0:
                    continue
            if self._ckpt_on:  # context checkpoints (issue 35): a batch starts at each
                k = self._ckpt_cut(s, start, k)
            last = b.add_run(prompt[start:start + k], start, s.id, "last")
            s.i_batch = last if start + k == len(prompt) else -1
            plan.append((s, k))
            budget -= k
        return plan

    def _decode(self) -> tuple[int, float]:
        t0 = time.perf_counter()
        ret = self.L.llama_decode(self.m.ctx, self._batch.ready())
        dt = time.perf_counter() - t0
        self._timed(dt)
        st = self.stats
        st["decode_calls_total"] += 1
        st["decode_seconds_total"] += dt
        st["batch_tokens_total"] += self._batch.n
        return ret, dt

    def _generate(self) -> None:
        budget = self._batch.capacity
        drafts = True
        while True:
            plan = self._plan(budget, drafts)
            if not plan:
                return
            ret, _ = self._decode()
            if ret == 0:
                self.stats["busy_slots_total"] += len(plan)  # slots served by this decode
                break
            if ret == 2:  # interrupted (a save, a clear, a close): undone, planned again later
                for s, _ in plan:
                    self.L.llama_memory_seq_rm(self.m.mem, s.id, len(s.tokens), -1)
                    s.draft = []
                return
            if ret == 1 and drafts and any(s.draft for s, _ in plan):
                drafts = False  # no room for the drafts' cells: this step goes without
                for s, _ in plan:
                    self.L.llama_memory_seq_rm(self.m.mem, s.id, len(s.tokens), -1)
                continue
            if ret == 1 and self._clear_idle_cells():
                continue  # idle slots' prompt caches gave their cells (llama-server's order)
            if ret == 1 and budget > 0 and any(s.state == PROMPT for s, _ in plan):
                budget //= 2  # no room for this many cells: llama-server halves the batch
                log.warning("KV cache had no room for the batch; retrying with %d prompt tokens",
                            budget)
                continue
            if ret == 1:
                self._fail_kv_full()
                return
            log.error("llama_decode failed (%d) on a batch of %d tokens", ret, self._batch.n)
            for s, _ in plan:
                self.L.llama_memory_seq_rm(self.m.mem, s.id, len(s.tokens), -1)
                if s.job is not None and not s.job.ended:
                    self._fail(s.job, ReplicaFault(f"decode failed ({ret})"))
            return
        ready = []
        verify = []
        for s, k in plan:
            if s.state == GENERATE:
                s.tokens.append(s.pending)
                s.pending = -1
                (verify if s.draft else ready).append(s)
            else:
                start = len(s.tokens)
                s.tokens.extend(s.job.request.prompt[start:start + k])
                s.job.progress(len(s.tokens))
                if s.i_batch >= 0:
                    ready.append(s)
        draw = []
        for s in ready:
            if s.job is None or s.job.ended:
                continue
            if s.state == PROMPT:
                s.job.t_first = time.monotonic()
                for c in s.children:  # n > 1: the other choices share the prompt's cells
                    self.L.llama_memory_seq_cp(self.m.mem, s.id, c.id, -1, -1)
                    c.tokens = list(s.tokens)
                    c.checkpoints = list(s.checkpoints)  # the same states up to each
                    c.i_batch = s.i_batch
                for c in [s, *s.children]:
                    c.state = GENERATE
                    draw.append(c)
            else:
                draw.append(s)
        if draw:
            self._sample_all(draw)
        for s in verify:
            if s.job is not None and not s.job.ended:
                self._verify(s)
            else:  # ended meanwhile: its draft's cells go
                s.draft = []
                self.L.llama_memory_seq_rm(self.m.mem, s.id, len(s.tokens), -1)

    def _clear_idle_cells(self) -> bool:
        """Free the cells idle slots keep as prompt caches (a shared cache
        only: a stream per slot holds no one else's cells). Returns whether
        any were freed."""
        if not self.m.unified:
            return False
        freed = False
        for s in self.slots:
            if s.state == IDLE and s.tokens:
                self._clear(s)
                freed = True
        if freed:
            log.warning("KV cache had no room for the batch; idle slots' prompt caches freed")
        return freed

    def _fail_kv_full(self) -> None:
        """No cell left even for one token a slot: every request being
        served ends with :data:`KV_FULL` and its cells are freed, as
        llama-server aborts the whole pool (it cannot tell which sequence
        to drop without undoing the batch)."""
        log.error("KV cache full (%d cells): every request being served ends", self.m.kv_size)
        serving = [s for s in self.slots if s.job is not None and s.state != IDLE]
        for s in serving:
            self._clear(s)
        for job in {id(s.job): s.job for s in serving}.values():
            if not job.ended:
                self._fail(job, KV_FULL)


__all__ = ["GenerateSteps"]
