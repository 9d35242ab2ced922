"""The engine's side of the KV tiers (:mod:`ggmux.instance.cache`): a
slot's sequence state saved before its cached tokens are overwritten or
dropped, and a tier's entry restored into the slot a request gets
(llama-server's ``prompt_save`` / ``prompt_load``,
tools/server/server-context.cpp). Every llama.cpp call here runs on the
decode thread, between decodes.

Saves happen where llama-server saves: a slot chosen for a request that
keeps less than half its cached tokens (or none: another prompt, another
scope, the least recently used slot), an idle slot whose cells are freed
for room (admission, a decode without room), an embedding or an ``n > 1``
choice taking a slot, the engine going to sleep, and the instance stopping
(:meth:`CacheSteps.persist`). With ``cache_scope`` ``none`` nothing is
saved or restored; with ``key`` an entry serves its own tenant only.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time

import numpy as np

from ..cache.checkpoint import within_bytes
from ..cache.fingerprint import fingerprint, gguf_identity, llama_build
from ..cache.report import empty_report
from ..cache.tiers import CacheSettings, KVTiers, open_tiers
from .checkpoints import END_OFFSET
from .slots import IDLE, Slot

log = logging.getLogger(__name__)

SAVE_KEEP_SHARE = 0.5
"""A slot whose next request keeps less than this share of its cached
tokens is saved first (llama-server: ``f_keep < 0.5``)."""
EDIT_POINTS = 3
"""Line starts inside a sliding-window entry's window that get a checkpoint
when it is saved (:meth:`CacheSteps._edit_checkpoints`): an edit of one of
the prompt's last lines restores its entry and reads from that line."""
CLEAR_WAIT_S = 5.0
"""Most seconds ``POST /cache/clear`` waits for the decode thread to drop
the slots' caches (it does so between two steps)."""


class CacheSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses ``L``, ``m``
    (its ``ctx``, ``mem``, ``n_swa``), ``cfg`` (``cache_scope``, the
    :class:`~ggmux.instance.cache.CacheSettings` in ``cfg.cache``),
    ``slots``, ``_cond`` and ``_model_lock``."""

    cache: KVTiers | None = None
    kv_events = None  # the Engine's KVEvents hook (--kv-events), or None
    _persist_done: threading.Event | None = None
    _clear_done: threading.Event | None = None
    _cleared_slots = 0

    def _open_cache(self) -> None:
        """Make the tiers after the first load (they outlive sleep and wake:
        host RAM and disk, not the weights)."""
        settings: CacheSettings = self.cfg.cache
        if self.cache is not None or self.m.pooled or settings is None:
            return
        self.cache = open_tiers(settings, self.m.kv_size, self._fingerprint,
                                settings.model_name or os.path.basename(self.cfg.model_path),
                                self.cfg.model_path, max_tokens=self.m.n_ctx)

    def _fingerprint(self):
        m, cfg, L = self.m, self.cfg, self.L
        ctx = {"kv_size": m.kv_size, "n_ctx": m.n_ctx, "n_seq": m.n_seq, "unified": m.unified,
               "type_k": cfg.type_k, "type_v": cfg.type_v, "flash_attn": cfg.flash_attn,
               "rope_freq_base": cfg.rope_freq_base, "rope_freq_scale": cfg.rope_freq_scale,
               "n_swa": m.n_swa, "swa_full": cfg.swa_full,
               "lora": []}
        return fingerprint(gguf_identity(cfg.model_path), ctx, llama_build(L))

    def _cache_scope(self, tenant: str) -> str | None:
        """The scope an entry of ``tenant`` is saved and found under; None
        when nothing may be (``cache_scope`` ``none``)."""
        scope = self.cfg.cache_scope
        return None if scope == "none" else tenant if scope == "key" else ""

    # ---- save ---------------------------------------------------------------
    def _tier_save(self, s: Slot) -> None:
        """Keep slot ``s``'s cached tokens in the tiers before they go."""
        tiers = self.cache
        if tiers is None or not s.tokens or s.state != IDLE or s.forget:
            return
        scope = self._cache_scope(s.owner)
        if scope is None:
            return
        L, ctx = self.L, self.m.ctx
        tokens = np.asarray(s.tokens, np.int32)
        n = L.llama_state_seq_get_size(ctx, s.id)
        if n <= 0 or not tiers.wants(scope, tokens, n):
            return
        data = bytearray(n)
        got = L.llama_state_seq_get_data(ctx, (ctypes.c_uint8 * n).from_buffer(data), n, s.id)
        if got != n:
            log.warning("slot %d: saving its state gave %d of %d bytes; not kept", s.id, got, n)
            return
        st = tiers.settings
        limit = st.checkpoint_mib << 20
        cks = within_bytes(s.checkpoints, limit, len(s.tokens), st.checkpoints)
        pos_min = self._saved_pos_min(s)
        if st.checkpoints > 0:
            cks = sorted([*cks, *self._edit_checkpoints(s, cks, limit - sum(c.nbytes for c in cks))],
                         key=lambda c: c.n_tokens)
        tiers.save(scope, tokens, pos_min, data, cks)

    def _edit_checkpoints(self, s: Slot, have: list, budget: int) -> list:
        """Checkpoints of slot ``s`` at the starts of its prompt's last
        :data:`EDIT_POINTS` lines inside its sliding window, made as its
        state goes to the tiers (every caller drops or cuts the slot's
        cells right after: the slot is left holding the tokens before the
        first of them).

        Why: a sliding-window slot keeps ``n_swa + n_ubatch`` cells, so it
        serves a prompt that diverges anywhere inside its window (an edited
        last line) without a checkpoint; its saved state holds only the
        window of its last position (llama.cpp writes no masked cell), so a
        restored entry could not, and fell back to the checkpoint before the
        prompt's last micro-batch (512 tokens read again for gemma3). The
        cells the slot still holds past the window are read here instead:
        cut back to a line start, its partial state there is that line's
        checkpoint. Sizes: one partial state each (gemma3-270m: 7.9 MB),
        within ``budget`` bytes; none for a recurrent model (no cells to
        cut back to) or a full-attention one (its entry serves any cut)."""
        m, L = self.m, self.L
        if not self._ckpt_on or m.recurrent or m.n_swa <= 0 or budget <= 0:
            return []
        n = len(s.tokens)
        first = L.llama_memory_seq_pos_min(m.mem, s.id)
        lo = first + m.n_swa if first > 0 else 1  # the least cut its cells serve
        # the prompt's end less the near-end checkpoint's offset (that one serves past it)
        hi = n - max(0, s.n_decoded - 1) - END_OFFSET
        if hi < lo:
            return []
        piece = m.piece
        points = []
        for p in range(hi, lo - 1, -1):  # (a media placeholder's piece is b"": no line end)
            if b"\n" in piece(s.tokens[p - 1]) and not any(0 <= p - c.n_tokens <= END_OFFSET
                                                          for c in have):
                points.append(p)
                if len(points) >= EDIT_POINTS:
                    break
        out = []
        for p in points:  # newest first: each cut keeps the cells the next one needs
            if not L.llama_memory_seq_rm(m.mem, s.id, p, -1):
                break
            del s.tokens[p:]
            c = self._ckpt_take(s, p, budget)
            if c is None:
                break
            budget -= c.nbytes
            out.append(c)
        s.checkpoints = [c for c in s.checkpoints if c.n_tokens <= len(s.tokens)]
        return out

    def _saved_pos_min(self, s: Slot) -> int:
        """The first position a restore of slot ``s``'s state holds. A
        sliding-window cache saves only the cells inside the window of the
        sequence's last position (``state_write_meta`` skips the masked
        ones), so a restore serves only a prompt that keeps all of it, and
        the lookup skips the others."""
        L, mem = self.L, self.m.mem
        pos_min = max(0, L.llama_memory_seq_pos_min(mem, s.id))
        if self.m.n_swa > 0:
            pos_min = max(pos_min, L.llama_memory_seq_pos_max(mem, s.id) - self.m.n_swa + 1)
        return pos_min

    def _save_idle(self) -> None:
        for s in self.slots:
            self._tier_save(s)

    # ---- restore ------------------------------------------------------------
    def _tier_lookup(self, job, better_than: int):
        """A tier hit for ``job``'s prompt that beats ``better_than`` tokens
        of a slot's own cache, or None."""
        r = job.request
        scope = self._cache_scope(r.tenant)
        if self.cache is None or scope is None or not r.cache_prompt:
            return None
        return self.cache.lookup(np.asarray(r.prompt, np.int32), scope, better_than,
                                 self.m.n_swa, self.m.recurrent)

    def _tier_restore(self, s: Slot, hit, tenant: str) -> float | None:
        """Put ``hit``'s state into slot ``s`` (its cells replaced); on
        success ``s.tokens`` are the entry's tokens and the seconds it took
        are returned. A state that does not read back or does not fit
        leaves the slot empty (None): the prompt is prefilled."""
        t0 = time.perf_counter()
        data = self.cache.state(hit)
        L = self.L
        ok = False
        if data is not None:
            src = np.frombuffer(data, np.uint8)  # a RAM entry's bytes, or a file's mapping
            n = src.size
            ok = L.llama_state_seq_set_data(
                self.m.ctx, src.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), n, s.id) == n
            del src
            if not ok:
                log.warning("slot %d: restoring %d bytes failed (no room?); prefilling", s.id, n)
        if not ok:
            L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
            s.tokens = []
            s.checkpoints = []
            return None
        s.tokens = hit.entry.tokens.tolist()
        # its context checkpoints (issue 35): the rollback to the prompt's prefix picks one
        s.checkpoints = self.cache.checkpoints(hit) if self._ckpt_on else []
        s.owner = tenant
        return time.perf_counter() - t0

    def _tier_count(self, job, keep: int, restored: float | None) -> None:
        """Count where ``job``'s ``keep`` cached prompt tokens came from (a
        restore that took ``restored`` seconds, or its slot) and say so in
        its timings (``cache_tier``)."""
        if self.cache is None or not getattr(job.request, "cache_prompt", False):
            return
        if restored is not None and keep > 0:
            job.cache_tier = job.restore.tier
            self.cache.restored(job.cache_tier, keep, restored)
        else:
            self.cache.used_slot(keep)
            job.cache_tier = "slot" if keep else ""

    # ---- stop ---------------------------------------------------------------
    def persist(self, timeout: float | None = None) -> int:
        """Write the slots' caches and the RAM entries disk lacks to the disk
        tier within ``timeout`` seconds (default ``--cache-save-timeout``),
        for an instance about to exit. The slots' states are taken on the
        decode thread at its next step (idle slots only: running requests
        should have ended). Returns the entries written; never waits past
        the timeout."""
        tiers = self.cache
        if tiers is None or tiers.disk is None:
            return 0
        t = tiers.settings.save_timeout if timeout is None else timeout
        deadline = time.monotonic() + max(0.0, t)
        done = threading.Event()
        with self._cond:
            running = self._thread is not None and self._close_reason is None
            if running:
                self._persist_done = done
                self._interrupt.set()  # a prompt step in progress ends now (item 17)
                self._cond.notify()
        if running:
            done.wait(max(0.0, deadline - time.monotonic()))
        n = tiers.flush(deadline)
        log.info("KV tiers: %d entries written to %s in %.2f s", n, tiers.disk.dir,
                 t - max(0.0, deadline - time.monotonic()))
        return n

    def _do_persist(self) -> None:
        """On the decode thread: the idle slots' states into the tiers."""
        done, self._persist_done = self._persist_done, None
        self._resume()
        try:
            if not self._asleep:
                self._save_idle()
        finally:
            done.set()

    def cache_report(self) -> dict:
        """``GET /cache`` (:meth:`~ggmux.instance.cache.KVTiers.report`)."""
        return self.cache.report() if self.cache is not None else empty_report()

    def cache_clear(self, timeout: float = CLEAR_WAIT_S) -> dict:
        """``POST /cache/clear``: every tier emptied, the slots' own caches
        included, so that no later request, save or stop brings back what
        was cleared (issue 37, item 5): idle slots' KV is dropped by the
        decode thread at its next step (waited for, at most ``timeout`` s),
        a running request's slot when it ends; then RAM and disk. Returns
        ``{"ram": n, "disk": n, "slots": n}`` (entries, and slots holding a
        cache)."""
        done = threading.Event()
        with self._cond:
            running = self._thread is not None and self._close_reason is None
            if running:
                self._clear_done = done
                self._interrupt.set()
                self._cond.notify()
        if running and not done.wait(timeout):
            log.warning("cache clear: the decode thread did not drop the slots' caches within "
                        "%.0f s; it will at its next step", timeout)
        out = self.cache.clear() if self.cache is not None else {"ram": 0, "disk": 0}
        out["slots"] = self._cleared_slots
        if self.kv_events is not None:
            self.kv_events.cleared()
        return out

    def _do_clear(self) -> None:
        """On the decode thread: drop every idle slot's KV; mark the busy
        ones (:attr:`Slot.forget`: never saved, dropped when they end)."""
        done, self._clear_done = self._clear_done, None
        self._resume()
        n = 0
        try:
            for s in self.slots:
                if s.state != IDLE:
                    s.forget = True
                    n += 1
                elif s.tokens:
                    if not self._asleep:
                        self.L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
                    s.tokens = []
                    s.t_used = 0.0
                    n += 1
        finally:
            self._cleared_slots = n
            done.set()

    def _resume(self) -> None:
        """Let decodes run again after an interrupted step (unless closing)."""
        with self._cond:
            if self._close_reason is None:
                self._interrupt.clear()

    def _drop_forgotten(self) -> None:
        """Drop the KV of slots that were busy at a cache clear and are idle now."""
        for s in self.slots:
            if s.forget and s.state == IDLE:
                s.forget = False
                self.L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
                s.tokens = []
                s.t_used = 0.0


__all__ = ["CacheSteps"]
