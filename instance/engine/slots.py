"""The engine's slots: one llama sequence each, with the request choice it
serves and the tokens its KV cache holds (llama-server's ``server_slot``)."""

from __future__ import annotations

import time

import numpy as np

from .jobs import Job
from .stops import StopText

# slot states
IDLE, PROMPT, WAIT, GENERATE, EMBED, SAMPLE, ENCODE = range(7)
# SAMPLE: generating, its next token drawn on a worker thread (a grammar's)
# ENCODE: reading its prompt, waiting for a media span's encoder (media_steps)
STATE_NAMES = ("idle", "prompt", "waiting for prompt", "generating", "embedding", "sampling",
               "encoding media")


class Slot:
    """One slot; ``tokens`` are the tokens whose KV sits in sequence ``id``
    at positions ``0 ..``, kept after a request as its prompt cache."""


    __slots__ = (
        "checkpoints",
        "children",
        "choice",
        "decoder",
        "draft",
        "embed_i",
        "embed_pos",
        "embed_sum",
        "forget",
        "i_batch",
        "id",
        "job",
        "n_cached",
        "n_decoded",
        "owner",
        "pending",
        "reserved",
        "sampler",
        "spec",
        "state",
        "stop",
        "t_used",
        "tokens",
    )

    def __init__(self, sid: int) -> None:
        self.id = sid
        self.state = IDLE
        self.tokens: list[int] = []  # tokens whose KV is in sequence `id`, positions 0..
        self.job: Job | None = None
        self.choice = 0
        self.sampler = None
        self.pending = -1  # sampled, not yet decoded
        self.i_batch = -1
        self.n_decoded = 0
        self.reserved = 0
        self.decoder = None
        self.stop: StopText | None = None
        self.t_used = 0.0
        self.children: list[Slot] = []
        self.embed_i = 0
        self.embed_pos = 0
        self.embed_sum = None
        self.n_cached = 0
        self.owner = ""  # the tenant whose request made the cached tokens
        self.draft: list[int] = []  # tokens proposed after `pending` this step (issue 30)
        self.spec = None  # its drafting state (draft.SlotSpec), made at its first draft
        self.forget = False  # a cache clear came while it ran: its KV goes when it ends
        self.checkpoints: list = []  # context checkpoints of `tokens`, oldest first (issue 35)

    def release(self) -> None:
        """Back to idle; the KV (``tokens``) stays as a prompt cache."""
        self.state = IDLE
        self.job = None
        self.sampler = None
        self.reserved = 0
        self.pending = -1
        self.i_batch = -1
        self.children = []
        self.t_used = time.monotonic()


def common_prefix(a: list[int], b: np.ndarray) -> int:
    """Length of the common prefix of token lists ``a`` and ``b``."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int32) != b[:n])
    return int(diff[0]) if diff.size else n


