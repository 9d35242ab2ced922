"""``draft-simple``'s draft model (speculative decoding, :mod:`.draft`): a
second model of the same vocabulary, loaded in this process with its own
context (a sequence per slot); its KV mirrors each slot's verified tokens,
then it decodes the pending token and drafts greedily, one batched
``llama_decode`` per draft position for all drafting slots, stopping a
slot's draft below ``p_min`` (the top token's probability among its 10
best, as llama.cpp's top-k 10 draft sampler) or at ``n_max``; drafts
shorter than ``n_min`` are dropped (llama.cpp ``common/speculative.cpp``,
build b11434).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

from .batch import Batch
from .model import EngineConfig, ModelContext
from .slots import Slot, common_prefix
from .spec_options import SpecConfig, SpecError

log = logging.getLogger(__name__)

VOCAB_MAX_SIZE_DIFFERENCE = 128  # llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE
VOCAB_CHECK_START = 5  # SPEC_VOCAB_CHECK_START_TOKEN_ID


class DraftModel:
    """``draft-simple``: a second model and context in this process (see
    the module docstring). ``dft`` holds, per slot, the tokens whose KV its
    sequence holds in the draft context."""

    def __init__(self, llama_cpp, spec: SpecConfig, target: EngineConfig, n_seq: int) -> None:
        self.L = llama_cpp
        self.spec = spec
        cfg = EngineConfig(spec.draft_model, ctx_size=target.ctx_size, parallel=n_seq,
                           kv_size=target.kv_size, n_batch=target.n_batch,
                           n_ubatch=target.n_ubatch, n_threads=target.n_threads,
                           n_threads_batch=target.n_threads_batch,
                           n_gpu_layers=target.n_gpu_layers if spec.draft_ngl is None
                           else spec.draft_ngl, main_gpu=target.main_gpu,
                           use_mmap=target.use_mmap, flash_attn=target.flash_attn,
                           kv_unified=target.kv_unified, swa_full=target.swa_full, spec=spec)
        self.m = ModelContext(llama_cpp, cfg, n_seq)
        self.batch: Batch | None = None
        self.dft: list[list[int]] = [[] for _ in range(n_seq)]
        self.owner: list = [None] * n_seq  # the request each slot's last draft was for
        self.base = [0] * n_seq  # its tokens then (known equal to the draft context's)

    def load(self, target: ModelContext) -> None:
        """Load the draft model; raise :class:`SpecError` when its
        vocabulary is not the target's (llama.cpp's
        ``common_speculative_are_compatible``), naming both files."""
        if not os.path.exists(self.spec.draft_model):
            raise SpecError(f"draft model file not found: {self.spec.draft_model}")
        c = self.m.cfg  # the target's context shape, its cells per slot
        c.ctx_size, c.kv_unified = target.n_ctx, target.unified
        c.kv_size = target.kv_size if target.unified else 0
        self.m.load()
        why = vocab_mismatch(self.L, target, self.m)
        if why:
            self.free()
            raise SpecError(f"the draft model {os.path.basename(self.spec.draft_model)} has "
                            f"another vocabulary than {os.path.basename(target.cfg.model_path)}"
                            f" ({why}): --spec-draft-model needs the same vocabulary")
        self.batch = Batch(self.L, self.m.n_batch, self.m.n_seq)
        self.dft = [[] for _ in range(self.m.n_seq)]
        self.owner = [None] * self.m.n_seq

    def free(self) -> None:
        self.m.free()
        self.batch = None

    def _can_cut(self, seq: int, keep: int) -> bool:
        """Whether the draft context's sequence ``seq`` cut to ``keep`` tokens
        is what reading them makes: a sliding-window draft model still holds
        the window of position ``keep``, a recurrent one is never cut (the
        target's checkpoints are not the draft's: it reads again instead)."""
        m = self.m
        if m.recurrent:
            return False
        if m.n_swa > 0:
            return self.L.llama_memory_seq_pos_min(m.mem, seq) <= max(0, keep - m.n_swa)
        return True

    def draft(self, asks: list[tuple[Slot, list[int], int, int]]) -> dict[int, list[int]]:
        """Drafts for ``(slot, tokens, pending, n_max)``: slot id -> draft."""
        L, m, b = self.L, self.m, self.batch
        spec = self.spec
        out: dict[int, list[int]] = {}
        b.clear()
        # 1. the draft context catches up with each slot's verified tokens and the pending one
        todo = []
        for s, hist, sampled, _ in asks:
            have = self.dft[s.id]
            # within a request the slot's tokens only grow: compare from where
            # they were last time (O(draft) a step), all of them at a new one
            base = self.base[s.id] if self.owner[s.id] is s.job else 0
            base = min(base, len(have), len(hist))
            keep = base + (common_prefix(have[base:], np.asarray(hist[base:], np.int32))
                           if len(have) > base else 0)
            self.owner[s.id], self.base[s.id] = s.job, len(hist)
            if keep < len(have):
                if not self._can_cut(s.id, keep):
                    keep = 0  # its window or recurrent state is gone: start over (issue 35)
                if not L.llama_memory_seq_rm(m.mem, s.id, keep, -1):
                    L.llama_memory_seq_rm(m.mem, s.id, -1, -1)
                    keep = 0
                del have[keep:]
            todo.append([s, [*hist[keep:], sampled], keep])
        # the tokens before each pending one first (no outputs), in as many
        # batches as they need; then every pending token in one batch
        # (logits hold only the last decode's rows)
        for t in todo:
            s, toks, pos = t
            head = toks[:-1]
            while head:
                if b.room <= 0 or b.n and len(head) > b.room:
                    if not self._decode():
                        return self._reset(asks)
                    b.clear()
                k = min(len(head), b.room)
                b.add_run(head[:k], pos, s.id, "last")
                b.logits[b.n - 1] = 0
                self.dft[s.id].extend(head[:k])
                head, pos = head[k:], pos + k
            t[1], t[2] = toks[-1:], pos
        if b.n and b.n + len(todo) > b.capacity:
            if not self._decode():
                return self._reset(asks)
            b.clear()
        last: dict[int, int] = {}
        for s, toks, pos in todo:
            last[s.id] = b.add(toks[0], pos, s.id, True)
            self.dft[s.id].append(toks[0])
        if not self._decode():
            return self._reset(asks)
        # 2. greedy drafting, one decode per position for every drafting slot
        active = {s.id: (s, n) for s, _, _, n in asks if n > 0}
        for sid in active:
            out[sid] = []
        while active:
            toks = self._best(last, active)
            b.clear()
            nxt: dict[int, int] = {}
            for sid, tok in toks.items():
                s, n = active[sid]
                if tok < 0:
                    del active[sid]
                    continue
                out[sid].append(tok)
                if len(out[sid]) >= n:
                    del active[sid]
                    continue
                nxt[sid] = b.add(tok, len(self.dft[sid]), sid, True)
                self.dft[sid].append(tok)
            if not nxt:
                break
            if L.llama_decode(m.ctx, b.ready()) != 0:
                log.warning("draft model decode failed: drafts cut")
                break
            last = nxt
        for sid, d in out.items():
            if len(d) < spec.draft_n_min:
                out[sid] = []
        return out

    def _decode(self) -> bool:
        if self.L.llama_decode(self.m.ctx, self.batch.ready()) != 0:
            log.warning("draft model decode failed: no drafts this step")
            return False
        return True

    def _reset(self, asks) -> dict[int, list[int]]:
        """After a failed decode: the draft context forgets those slots."""
        for s, *_ in asks:
            self.L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
            self.dft[s.id] = []
            self.owner[s.id] = None
        return {}

    def _best(self, rows: dict[int, int], active: dict) -> dict[int, int]:
        """The draft model's greedy token at each slot's output row, -1 where
        its probability among the 10 best is below ``p_min``."""
        L, m = self.L, self.m
        out = {}
        for sid in active:
            ptr = L.llama_get_logits_ith(m.ctx, rows[sid])
            row = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                        shape=(m.n_vocab,))
            tok = int(row.argmax())
            if self.spec.draft_p_min > 0:
                top = np.partition(row, -10)[-10:]
                p = 1.0 / float(np.exp(top - row[tok]).sum())
                if p < self.spec.draft_p_min:
                    tok = -1
            out[sid] = tok
        return out


def vocab_mismatch(L, a: ModelContext, b: ModelContext) -> str:
    """Why ``b``'s vocabulary cannot draft for ``a``'s ('' when it can):
    llama.cpp's ``common_speculative_are_compatible`` (type, BOS/EOS, size
    within 128, token texts from id 5 on)."""
    va, vb = a.vocab, b.vocab
    if L.llama_vocab_type(va) != L.llama_vocab_type(vb):
        return f"vocabulary types {L.llama_vocab_type(va)} and {L.llama_vocab_type(vb)}"
    for what, add, tok in (("BOS", L.llama_vocab_get_add_bos, L.llama_vocab_bos),
                           ("EOS", L.llama_vocab_get_add_eos, L.llama_vocab_eos)):
        if add(va) != add(vb) or add(va) and tok(va) != tok(vb):
            return f"{what} tokens {tok(va)} and {tok(vb)}"
    if abs(a.n_vocab - b.n_vocab) > VOCAB_MAX_SIZE_DIFFERENCE:
        return f"{a.n_vocab} and {b.n_vocab} tokens"
    for i in range(VOCAB_CHECK_START, min(a.n_vocab, b.n_vocab)):
        if L.llama_vocab_get_text(va, i) != L.llama_vocab_get_text(vb, i):
            return f"token {i} differs"
    return ""


__all__ = ["DraftModel", "vocab_mismatch"]
