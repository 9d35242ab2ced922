"""Context checkpoints in the slots (issue 35; the record and its blob:
:mod:`ggmux.instance.cache.checkpoint`), as llama-server makes and uses
them (tools/server/server-context.cpp, b11434):

* **Which models.** A sliding-window model (``n_swa`` > 0; ggmux never
  asks for ``swa_full``) or a recurrent or hybrid one: their memory cannot
  be cut back to an arbitrary prefix (``COMMON_CONTEXT_SEQ_RM_TYPE_FULL`` /
  ``_RS``, or ``n_swa > 0``). ``--ctx-checkpoints 0`` turns them off.
* **Where they are made.** Just before the prompt batch that starts at
  ``n - min(n_batch, 4 + n_ubatch)`` and at ``n - min(n_batch, 4)`` of an
  ``n``-token prompt (the prompt is cut there so a batch starts there:
  llama-server's ``checkpoint_offsets``, PR 20288), and where the request
  says a user message starts (:attr:`Generation.checkpoint_at`: the last
  user message of a chat, llama-server's ``message_spans``, and earlier
  ones :mod:`~ggmux.instance.checkpoint_hints` picks), spaced by
  ``--checkpoint-min-step`` tokens except near the prompt's end and at the
  last user message. At most ``--ctx-checkpoints`` per slot: when full,
  first those within min-step of an earlier one made by another request
  go, then the oldest (``create_checkpoint``).
* **How they are used.** A prompt whose common prefix with the slot ends
  where the memory no longer holds what that prefix needs (positions that
  left the window, or any cut of a recurrent state) restores the newest
  checkpoint of at most that many tokens and reads from there; none: the
  whole prompt is read ("forcing full prompt re-processing"). Checkpoints
  past the kept prefix go.

A draft model (speculative decoding) keeps its own tokens and catches up
by common prefix (:mod:`.draft`); a draft model that cannot be cut back
starts its sequence over instead, so it never drafts from a state that
does not match the target's (drafts are verified by the target anyway).
Every llama.cpp call here runs on the decode thread.
"""

from __future__ import annotations

import ctypes
import logging

from ..cache.checkpoint import Checkpoint, newest_within
from .slots import Slot

log = logging.getLogger(__name__)

END_OFFSET = 4
"""llama-server's ``checkpoint_offsets`` are ``{4 + n_ubatch, 4}``: tokens
before a prompt's end where a batch starts with a checkpoint."""


class CheckpointSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses ``L``, ``m``
    (``ctx``, ``mem``, ``n_swa``, ``recurrent``, ``n_batch``), ``cfg``
    (``ctx_checkpoints``, ``checkpoint_min_step``, ``n_ubatch``) and
    ``stats``."""

    @property
    def _ckpt_limited(self) -> bool:
        """Whether the model's memory cannot be cut back to any prefix (a
        sliding window keeps every position with ``swa_full``, as
        llama-server's ``--swa-full``: no checkpoint is needed then)."""
        return self.m.n_swa > 0 and not self.cfg.swa_full or self.m.recurrent

    @property
    def _ckpt_on(self) -> bool:
        return self.cfg.ctx_checkpoints > 0 and self._ckpt_limited and not self.m.pooled

    @property
    def checkpoints_wanted(self) -> bool:
        """Whether this model makes context checkpoints (any thread): the
        HTTP side then says where a chat's last user message starts
        (:attr:`~ggmux.instance.engine.jobs.Generation.checkpoint_at`)."""
        return self.m.loaded and self._ckpt_on

    # ---- making -----------------------------------------------------------------
    def _ckpt_points(self, s: Slot) -> tuple[list[int], set[int]]:
        """Token counts of ``s``'s prompt where a batch starts with a
        checkpoint (ascending), and those of them that are near the end or
        at the last user message (never skipped for the min step)."""
        r = s.job.request
        n = len(r.prompt)
        ub = max(1, min(self.cfg.n_ubatch, self.m.n_batch))
        near = {n - min(self.m.n_batch, off) for off in (END_OFFSET + ub, END_OFFSET)}
        hints = [p for p in getattr(r, "checkpoint_at", ()) if 0 < p < n]
        if hints:
            near.add(max(hints))  # the last user message
        points = sorted({p for p in (*near, *hints) if 0 < p < n})
        return points, near

    def _ckpt_cut(self, s: Slot, start: int, k: int) -> int:
        """Before ``k`` prompt tokens of slot ``s`` from ``start`` go into the
        batch: make a checkpoint when ``start`` is one of its points, and
        return ``k`` cut at the next point (so a batch starts there)."""
        points, keep_always = self._ckpt_points(s)
        cks = s.checkpoints

        def due(p: int) -> bool:  # a checkpoint is made at p (min-step spacing)
            return (p in keep_always or not cks
                    or p > cks[-1].n_tokens + self.cfg.checkpoint_min_step)

        if start in points and start > 0 and due(start):
            self._ckpt_make(s, start)
        for p in points:  # a batch is cut only where a checkpoint will be made
            if start < p < start + k and due(p):
                return p - start
        return k

    def _ckpt_make(self, s: Slot, n_tokens: int) -> None:
        """Save slot ``s``'s partial state now (its first ``n_tokens``
        tokens are in its memory), under llama-server's caps."""
        cks = s.checkpoints
        if any(c.n_tokens == n_tokens for c in cks):
            return  # made already (a batch planned again after a decode without room)
        new = self._ckpt_take(s, n_tokens)
        if new is None:
            return
        cap = self.cfg.ctx_checkpoints
        job_id = new.job
        if len(cks) + 1 >= cap:  # full: those too close to an earlier one go first
            last, kept = -1, []
            for c in cks:
                if c.job != job_id and last >= 0 and \
                        c.n_tokens <= last + self.cfg.checkpoint_min_step:
                    continue
                last = c.n_tokens
                kept.append(c)
            cks[:] = kept
        while len(cks) >= cap:
            cks.pop(0)
        cks.append(new)
        log.debug("slot %d: checkpoint %d of %d at %d tokens (%.2f MiB)", s.id, len(cks), cap,
                  n_tokens, new.nbytes / (1 << 20))

    def _ckpt_take(self, s: Slot, n_tokens: int, most: int = -1) -> SlotCheckpoint | None:
        """Slot ``s``'s partial state now, as a checkpoint of ``n_tokens``
        tokens (its memory must hold exactly those); None when it is empty,
        over ``most`` bytes (-1: no bound) or does not read whole. Counted
        in the engine's checkpoint figures."""
        L, m = self.L, self.m
        flag = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
        size = L.llama_state_seq_get_size_ext(m.ctx, s.id, flag)
        if size <= 0 or 0 <= most < size:
            return None
        data = bytearray(size)
        got = L.llama_state_seq_get_data_ext(
            m.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, s.id, flag)
        if got != size:
            log.warning("slot %d: a checkpoint gave %d of %d bytes; not kept", s.id, got, size)
            return None
        st = self.stats
        st["checkpoints_made_total"] += 1
        st["checkpoint_bytes_made_total"] += size
        c = SlotCheckpoint(n_tokens, L.llama_memory_seq_pos_min(m.mem, s.id),
                           L.llama_memory_seq_pos_max(m.mem, s.id), bytes(data))
        c.job = s.job.id if s.job is not None else -1
        return c

    # ---- using --------------------------------------------------------------------
    def _ckpt_whole(self, s: Slot, keep: int) -> bool:
        """Whether slot ``s``'s memory, cut to ``keep`` tokens, is what a
        prefill of them makes (no checkpoint needed)."""
        L, m = self.L, self.m
        if keep >= len(s.tokens):
            return True  # nothing is cut: the prompt extends the cache
        if m.recurrent:
            return False  # a recurrent state holds its last position only
        pos_min = L.llama_memory_seq_pos_min(m.mem, s.id)
        # llama-server's pos_min check: the window of the next position is there
        return pos_min <= max(0, keep - m.n_swa)

    def _ckpt_usable(self, s: Slot, keep: int) -> int:
        """Tokens of a ``keep``-token common prefix slot ``s`` can serve
        (a choice between slots; nothing is changed)."""
        if keep <= 0 or not self._ckpt_limited or self._ckpt_whole(s, keep):
            return keep
        c = newest_within(s.checkpoints, keep) if self._ckpt_on else None
        return c.n_tokens if c is not None else 0

    def _ckpt_rollback(self, s: Slot, keep: int) -> tuple[int, int]:
        """Make slot ``s`` serve a ``keep``-token common prefix: ``(tokens
        kept, of them from a checkpoint)``; the caller then cuts the memory
        at the tokens kept (``llama_memory_seq_rm``). 0 kept: prefill."""
        if keep <= 0 or not self._ckpt_limited or self._ckpt_whole(s, keep):
            return keep, 0
        c = newest_within(s.checkpoints, keep) if self._ckpt_on else None
        if c is None:
            return 0, 0
        L = self.L
        src = (ctypes.c_uint8 * c.nbytes).from_buffer_copy(c.data)
        got = L.llama_state_seq_set_data_ext(self.m.ctx, src, c.nbytes, s.id,
                                             L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if got != c.nbytes:
            log.warning("slot %d: restoring a checkpoint of %d tokens failed; prefilling",
                        s.id, c.n_tokens)
            s.checkpoints = []
            return 0, 0
        st = self.stats
        st["checkpoints_restored_total"] += 1
        st["checkpoint_tokens_total"] += c.n_tokens
        return c.n_tokens, c.n_tokens

    def _ckpt_bytes(self) -> int:
        """Bytes the slots' checkpoints hold now."""
        return sum(c.nbytes for s in self.slots for c in s.checkpoints)


class SlotCheckpoint(Checkpoint):
    """A slot's checkpoint: ``job`` is the request that made it (the
    min-step eviction spares the current request's)."""

    __slots__ = ("job",)


__all__ = ["CheckpointSteps", "SlotCheckpoint"]
