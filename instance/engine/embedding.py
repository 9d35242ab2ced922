"""The engine's embedding steps (:class:`~ggmux.instance.engine.Engine`'s
step 4): an :class:`~ggmux.instance.engine.jobs.Embedding` request takes one slot
and its inputs go through it one after another, in chunks beside the other
slots' work; a pooled (embedding) model needs each input whole in one batch,
a generation model gives the mean of the tokens' last hidden states. Every
vector is L2-normalised. A client that leaves ends the batch at the next
step, like a generation."""

from __future__ import annotations

import numpy as np

from ..backend import ReplicaFault
from .jobs import Embedding, InvalidRequest, Job
from .slots import EMBED


class EmbeddingSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses its model
    (``m``), llama bindings (``L``), batch, slots and ``_decode`` /
    ``_fail`` / ``_end_job``."""

    def _prepare_embedding(self, job: Job, r: Embedding) -> None:
        if not r.inputs:
            raise InvalidRequest("'input' is empty")
        for i, inp in enumerate(r.inputs):
            if not inp:
                raise InvalidRequest(f"input[{i}] has no tokens")
            if len(inp) > self.n_ctx:
                raise InvalidRequest(f"input[{i}] has {len(inp)} tokens; the context (ctx-size) "
                                     f"is {self.n_ctx} tokens")
            if self.m.pooled and len(inp) > self.m.n_batch:
                raise InvalidRequest(f"input[{i}] has {len(inp)} tokens; this embedding model "
                                     f"takes at most {self.m.n_batch} (batch-size)")
            self.m.check_tokens(inp, f"input[{i}]")
        job.footprint = max(len(x) for x in r.inputs)
        job.left = 1

    def _embed(self) -> None:
        work = [s for s in self.slots if s.state == EMBED]
        if not work:
            return
        L, b = self.L, self._batch
        b.clear()
        plan = []
        for s in work:
            inp = s.job.request.inputs[s.embed_i]
            k = min(len(inp) - s.embed_pos, b.room)
            if k <= 0 or (self.m.pooled and k < len(inp) - s.embed_pos):
                continue  # a pooled model needs the whole input in one batch
            b.add_run(inp[s.embed_pos:s.embed_pos + k], s.embed_pos, s.id, "all")
            plan.append((s, b.n - k, k))
        if not plan:
            return
        L.llama_set_embeddings(self.m.ctx, True)
        try:
            ret, _ = self._decode()
        finally:
            if not self.cfg.embedding:
                L.llama_set_embeddings(self.m.ctx, False)
        if ret == 2:  # interrupted (engine.interrupt): read again at a later step
            for s, _, _ in plan:
                L.llama_memory_seq_rm(self.m.mem, s.id, s.embed_pos, -1)
            return
        if ret != 0:
            for s, _, _ in plan:
                self._fail(s.job, ReplicaFault(f"embedding decode failed ({ret})"))
            return
        for s, off, k in plan:
            job = s.job
            inputs = job.request.inputs
            s.embed_pos += k
            if self.m.pooled:
                vec = self.m.sequence_embedding(s.id)
            else:  # a generation model: mean of the tokens' last hidden states
                part = self.m.output_embeddings(b.n)[off:off + k].sum(axis=0, dtype=np.float64)
                s.embed_sum = part if s.embed_sum is None else s.embed_sum + part
                if s.embed_pos < len(inputs[s.embed_i]):
                    continue
                vec = s.embed_sum / len(inputs[s.embed_i])
            norm = float(np.linalg.norm(vec)) or 1.0
            job.emit(("embedding", s.embed_i, (vec / norm).tolist()))
            job.n_decoded += len(inputs[s.embed_i])
            self.L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
            s.embed_i, s.embed_pos, s.embed_sum = s.embed_i + 1, 0, None
            if s.embed_i == len(inputs):
                s.release()
                s.tokens = []
                s.checkpoints = []
                job.left = 0
                self._end_job(job)
