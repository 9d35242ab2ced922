"""A ``llama_batch`` whose arrays are numpy arrays owned by Python.

``llama_batch_init`` allocates one ``seq_id`` array per token; filling those
through ctypes costs a Python call per token. Here every token's ``seq_id``
pointer points into one fixed array of sequence ids, so a prompt chunk is
written with a handful of numpy slice assignments (llama.cpp only reads a
batch during ``llama_decode``; the struct is passed by value).
"""

from __future__ import annotations

import ctypes

import numpy as np


class Batch:
    """Room for ``capacity`` tokens over sequences ``0 .. n_seq - 1``.

    ``add`` and ``add_run`` return the batch index of the last token added
    (the index ``llama_sampler_sample`` / ``llama_get_logits_ith`` take for
    a token whose output was requested). ``clear`` empties it.
    """

    def __init__(self, llama_cpp, capacity: int, n_seq: int) -> None:
        L = llama_cpp
        self.capacity = capacity
        self.n = 0
        self.token = np.zeros(capacity, np.int32)
        self.pos = np.zeros(capacity, np.int32)
        self.n_seq_id = np.ones(capacity, np.int32)
        self.logits = np.zeros(capacity, np.int8)
        self.seq_ids = np.arange(n_seq, dtype=np.int32)
        self.seq_ptr = np.zeros(capacity, np.uintp)
        self._seq_base = self.seq_ids.ctypes.data
        b = L.llama_batch()
        b.token = self.token.ctypes.data_as(ctypes.POINTER(L.llama_token))
        b.embd = None
        b.pos = self.pos.ctypes.data_as(ctypes.POINTER(L.llama_pos))
        b.n_seq_id = self.n_seq_id.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = ctypes.cast(self.seq_ptr.ctypes.data,
                               ctypes.POINTER(ctypes.POINTER(L.llama_seq_id)))
        b.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.struct = b

    @property
    def room(self) -> int:
        return self.capacity - self.n

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, output: bool) -> int:
        i = self.n
        self.token[i] = token
        self.pos[i] = pos
        self.seq_ptr[i] = self._seq_base + 4 * seq
        self.logits[i] = output
        self.n = i + 1
        return i

    def add_run(self, tokens, pos0: int, seq: int, outputs: str = "last") -> int:
        """Tokens at positions ``pos0 ..`` of ``seq``; ``outputs`` is
        ``"last"`` (logits of the final token only) or ``"all"``."""
        a, k = self.n, len(tokens)
        b = a + k
        self.token[a:b] = tokens
        self.pos[a:b] = np.arange(pos0, pos0 + k, dtype=np.int32)
        self.seq_ptr[a:b] = self._seq_base + 4 * seq
        if outputs == "all":
            self.logits[a:b] = 1
        else:
            self.logits[a:b] = 0
            self.logits[b - 1] = 1
        self.n = b
        return b - 1

    def ready(self):
        """The ``llama_batch`` struct for ``llama_decode``."""
        self.struct.n_tokens = self.n
        return self.struct
