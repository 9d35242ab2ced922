"""The weights, the llama context and the vocabulary the engine runs on.

:class:`ModelContext` loads a GGUF file with llama-cpp-python's low-level
API into a context made for parallel slots (``n_seq_max`` = slots, one
KV cache of ``kv_size`` cells, shared or a stream per slot), and answers the vocabulary's
questions (tokens, pieces, metadata). It is not thread-safe by itself: the
engine serialises ``load``/``free`` against the other calls.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cache.tiers import CacheSettings
from .jobs import InvalidRequest
from .sampling import DEFAULT_SEED
from .spec_options import SpecConfig
from .tokenizing import Tokenizer

ID_SLICE = 1 << 16
"""Ids listed or checked per GIL-holding call (:meth:`ModelContext.tokenize`,
:meth:`ModelContext.check_tokens`): well under a millisecond each."""

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineConfig:
    """How the engine loads its model. Names are llama.cpp's (``n_batch``
    ...) or llama-server's options (``ctx_size`` = ``--ctx-size``: the most
    tokens one request may hold, prompt and answer; ``parallel`` =
    ``--parallel``; ``kv_size``: KV cache tokens for all slots together, 0
    for ``ctx_size x parallel``). ``ctx_size`` 0 takes the model's trained
    context. ``n_threads`` 0 is every CPU; ``n_threads_batch`` 0 is
    ``n_threads``. ``embedding`` makes the context an embedding one (pooling
    from the model: an embedding model). ``seed`` is the draw's seed for
    requests that give none (default: random). ``slot_prompt_similarity``:
    the share of a prompt a slot's cache must match to be chosen for it
    (llama-server's ``--slot-prompt-similarity``, 0.1). ``flash_attn``
    None is llama.cpp's ``auto`` (on where the backend has it, the CPU
    included), as llama-server; llama-cpp-python's ``Llama`` turns it off.
    ``kv_unified``
    (llama-server's ``--kv-unified``): one cache whose cells any slot may
    use, or one stream of ``kv_size / parallel`` cells per slot; None
    chooses: a stream per slot when each gets a whole ``ctx_size`` (the
    default ``kv_size``), else one shared cache. Streams make a slot's
    attention independent of the others' (batched greedy answers equal
    the same prompt's alone; measured on this CPU, where a shared cache
    parted them after 8 to 48 tokens) and cheaper (each token attends over
    its own cells only); a shared cache lets a smaller ``kv_size`` serve
    long requests, the rest waiting for room. ``cache_scope``
    (``--cache-scope``, issue 18 finding 6): whose prompt cache a request
    may reuse: ``global`` any slot's (llama-server), ``key`` only one made
    by a request of its own tenant, ``none`` nobody's. ``prefill_wait_ms``
    (preset ``prefill-wait-ms``, ggmux's): the most an idle engine's first
    request waits for others sent with it, so that they are read in one
    batch and start generating together, as llama-server's HTTP threads
    hand them over; each wait lasts 5% of the expected prefill of what has
    arrived (``engine.PREFILL_WAIT_SHARE``) and ends when nothing more
    comes; 0 starts at once (bench/RESULTS.md section 17: without it the
    first of 4 requests sent together was read alone, then stalled ~4 s
    while the other three were read). ``cache``: the KV tiers' options
    (``--cache-ram``, ``--cache-disk``, ``--cache-disk-max``,
    ``--cache-save-timeout``; :class:`~ggmux.instance.cache.CacheSettings`;
    llama-server's default: 8192 MiB of host RAM, no disk). ``spec``: speculative decoding's
    options (:class:`~ggmux.instance.engine.spec_options.SpecConfig`,
    llama-server's ``--spec-*``), None for none. ``ctx_checkpoints`` and
    ``checkpoint_min_step`` (llama-server's ``--ctx-checkpoints``, 32 per
    slot, 0 off, and ``--checkpoint-min-step``, 8192 tokens): context
    checkpoints of a sliding-window or recurrent model
    (:mod:`~ggmux.instance.engine.checkpoints`). ``swa_full``
    (llama-server's ``--swa-full``, off): the sliding-window layers keep
    every position, as the full-attention ones do; off, they keep the
    window and a micro-batch (``n_swa + n_ubatch`` cells a sequence:
    Gemma 3's KV shrinks about 5/6 at long contexts), as llama-server's
    default (llama.cpp's C API default, which llama-cpp-python's
    ``Llama`` takes, is on). ``mmproj``: a multimodal projector loaded
    beside the model (:class:`~ggmux.instance.media.projector.Projector`),
    with llama-server's ``mmproj_offload``, ``image_min_tokens`` and
    ``image_max_tokens``."""

    model_path: str
    ctx_size: int = 2048
    parallel: int = 4
    kv_size: int = 0
    n_batch: int = 512
    n_ubatch: int = 512
    n_threads: int = 0
    n_threads_batch: int = 0
    n_gpu_layers: int = 0
    main_gpu: int = 0
    use_mmap: bool = True
    use_mlock: bool = False
    type_k: int | None = None
    type_v: int | None = None
    flash_attn: bool | None = None
    rope_freq_base: float = 0.0
    rope_freq_scale: float = 0.0
    embedding: bool = False
    pooling: int | None = None  # llama.cpp's LLAMA_POOLING_TYPE_* (--pooling); None: the model's
    seed: int = DEFAULT_SEED
    slot_prompt_similarity: float = 0.1
    kv_unified: bool | None = None
    cache_scope: str = "global"
    prefill_wait_ms: float = 50.0
    cache: CacheSettings = field(default_factory=CacheSettings)
    spec: SpecConfig | None = None  # speculative decoding (issue 30); None: off
    ctx_checkpoints: int = 32  # llama-server's --ctx-checkpoints (issue 35): per slot, 0 off
    swa_full: bool = False  # llama-server's --swa-full: a sliding-window cache of every position
    checkpoint_min_step: int = 8192  # llama-server's --checkpoint-min-step (tokens)
    mmproj: str | None = None  # a multimodal projector (llama-server's --mmproj)
    mmproj_offload: bool = True  # llama-server's --mmproj-offload (the encoder on the GPU)
    image_min_tokens: int = 0  # llama-server's --image-min-tokens (0: the projector's own)
    image_max_tokens: int = 0  # llama-server's --image-max-tokens (0: the projector's own)


class ModelContext:
    """One loaded model and its context. After :meth:`load`: ``ctx``,
    ``vocab``, ``mem`` (llama pointers), ``n_vocab``, ``n_embd``, ``n_ctx``
    (tokens per request: ``min(ctx_size, kv_size)``), ``kv_size`` (cells
    llama.cpp gave the cache), ``n_batch``, ``n_swa`` (sliding window, 0 for
    none), ``recurrent`` (a recurrent or hybrid model: its state cannot be
    cut back), ``pooled`` (an embedding model's pooling is on), ``metadata``
    (GGUF key -> string)."""

    def __init__(self, llama_cpp, config: EngineConfig, n_seq: int,
                 on_progress: Callable[[float], None] | None = None) -> None:
        self.L = llama_cpp
        self.cfg = config
        self.n_seq = n_seq
        self.on_progress = on_progress  # the weights' load, 0.0 .. 1.0 (llama.cpp's callback)
        self.model = self.ctx = self.vocab = self.mem = None
        self.n_vocab = self.n_embd = self.n_ctx = self.kv_size = self.n_batch = self.n_swa = 0
        self.pooled = self.recurrent = False
        self.unified = True
        self.metadata: dict[str, str] = {}
        self._pieces: dict[int, bytes] = {}
        self._eog: dict[int, bool] = {}
        self.tokenizer: Tokenizer | None = None
        self.projector = None  # media.projector.Projector of cfg.mmproj, once loaded

    @property
    def loaded(self) -> bool:
        return self.ctx is not None

    def load(self) -> None:
        """Load the weights and make the context. Raises RuntimeError when
        llama.cpp cannot (missing file, bad GGUF, no memory for the KV)."""
        L, cfg = self.L, self.cfg
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0x7FFFFFFF if cfg.n_gpu_layers < 0 else cfg.n_gpu_layers
        mp.main_gpu = cfg.main_gpu
        if cfg.use_mmap and cfg.use_mlock:
            mp.load_mode = L.LLAMA_LOAD_MODE_MMAP_MLOCK
        elif cfg.use_mlock:
            mp.load_mode = L.LLAMA_LOAD_MODE_MLOCK
        else:
            mp.load_mode = L.LLAMA_LOAD_MODE_MMAP if cfg.use_mmap else L.LLAMA_LOAD_MODE_NONE
        if not os.path.exists(cfg.model_path):
            raise RuntimeError(f"model file not found: {cfg.model_path}")
        report = self.on_progress
        if report is not None:
            def progress(value: float, _data) -> bool:
                try:
                    report(float(value))
                except Exception:  # a report never stops the load
                    log.exception("load progress report failed")
                return True

            # kept referenced until the load returns (llama.cpp calls it meanwhile)
            mp.progress_callback = callback = L.llama_progress_callback(progress)
        model = L.llama_model_load_from_file(cfg.model_path.encode(), mp)
        if report is not None:
            del callback
        if not model:
            raise RuntimeError(f"llama.cpp could not load {cfg.model_path}")
        n_ctx = cfg.ctx_size or L.llama_model_n_ctx_train(model)
        kv = cfg.kv_size or n_ctx * self.n_seq
        cp = L.llama_context_default_params()
        cp.n_ctx = kv
        cp.n_batch = max(self.n_seq, min(cfg.n_batch, kv))
        cp.n_ubatch = max(1, min(cfg.n_ubatch, cp.n_batch))
        cp.n_seq_max = self.n_seq
        unified = cfg.kv_unified if cfg.kv_unified is not None else kv < n_ctx * self.n_seq
        cp.kv_unified = unified
        cp.n_outputs_max_per_seq = 0  # embeddings want every token of a sequence
        threads = cfg.n_threads or os.cpu_count() or 1
        cp.n_threads = threads
        cp.n_threads_batch = cfg.n_threads_batch or threads
        cp.flash_attn_type = (L.LLAMA_FLASH_ATTN_TYPE_AUTO if cfg.flash_attn is None
                              else L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn
                              else L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if cfg.type_k is not None:
            cp.type_k = cfg.type_k
        if cfg.type_v is not None:
            cp.type_v = cfg.type_v
        cp.rope_freq_base = cfg.rope_freq_base
        cp.rope_freq_scale = cfg.rope_freq_scale
        cp.embeddings = cfg.embedding
        if cfg.pooling is not None:
            cp.pooling_type = cfg.pooling
        cp.swa_full = cfg.swa_full
        cp.no_perf = True
        ctx = L.llama_init_from_model(model, cp)
        if not ctx:
            L.llama_model_free(model)
            raise RuntimeError(f"llama.cpp could not create a context of {kv} tokens")
        self.model, self.ctx = model, ctx
        self.vocab = L.llama_model_get_vocab(model)
        self.mem = L.llama_get_memory(ctx)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_embd = L.llama_model_n_embd(model)
        self.kv_size = L.llama_n_ctx(ctx)
        self.unified = unified
        self.n_ctx = min(n_ctx, self.kv_size if unified else L.llama_n_ctx_seq(ctx))
        self.n_batch = cp.n_batch
        self.n_swa = L.llama_model_n_swa(model)
        self.recurrent = bool(L.llama_model_is_recurrent(model) or L.llama_model_is_hybrid(model))
        self.pooled = L.llama_pooling_type(ctx) != L.LLAMA_POOLING_TYPE_NONE
        self.tokenizer = Tokenizer(L, self.vocab, self.n_vocab, self._tokenize_once,
                                   self._count_once)
        self.metadata = self._read_metadata()
        self._pieces = {}
        self._eog = {}
        if cfg.mmproj:
            self._load_projector()
        log.info("loaded %s: %d slots, %d tokens per request, KV cache %d tokens (%s)",
                 os.path.basename(cfg.model_path), self.n_seq, self.n_ctx, self.kv_size,
                 "shared" if unified else "a stream per slot")

    def _load_projector(self) -> None:
        """The projector of ``cfg.mmproj`` for the loaded model; a projector
        that does not load ends the load (its message names the file)."""
        from ..media.projector import Projector, ProjectorConfig

        cfg = self.cfg
        pc = ProjectorConfig(cfg.mmproj, n_threads=cfg.n_threads or os.cpu_count() or 1,
                             use_gpu=cfg.mmproj_offload,
                             image_min_tokens=cfg.image_min_tokens,
                             image_max_tokens=cfg.image_max_tokens, flash_attn=cfg.flash_attn)
        proj = Projector(self.L, pc)
        try:
            proj.load(self.model)
        except Exception:
            self.free()
            raise
        self.projector = proj

    def free(self) -> None:
        """Free the projector, the context and the weights (idempotent)."""
        if self.projector is not None:
            self.projector.free()
            self.projector = None
        if self.ctx is not None:
            self.L.llama_free(self.ctx)
            self.ctx = None
        if self.model is not None:
            self.L.llama_model_free(self.model)
            self.model = None
        self.vocab = self.mem = None
        self.tokenizer = None

    def _read_metadata(self) -> dict[str, str]:
        L, out = self.L, {}
        buf = ctypes.create_string_buffer(1 << 16)
        for i in range(L.llama_model_meta_count(self.model)):
            if L.llama_model_meta_key_by_index(self.model, i, buf, len(buf)) < 0:
                continue
            key = buf.value.decode("utf-8", "replace")
            n = L.llama_model_meta_val_str_by_index(self.model, i, buf, len(buf))
            if n >= len(buf):  # a long value (a chat template, a token list)
                big = ctypes.create_string_buffer(n + 1)
                L.llama_model_meta_val_str_by_index(self.model, i, big, len(big))
                out[key] = big.value.decode("utf-8", "replace")
            elif n >= 0:
                out[key] = buf.value.decode("utf-8", "replace")
        return out

    # ---- outputs ------------------------------------------------------------
    def output_embeddings(self, n_outputs: int) -> np.ndarray:
        """The last decode's per-token embeddings, ``[n_outputs, n_embd]``
        float32 (a view, valid until the next decode)."""
        ptr = self.L.llama_get_embeddings(self.ctx)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(n_outputs, self.n_embd))

    def sequence_embedding(self, seq: int) -> np.ndarray:
        """The pooled embedding of sequence ``seq`` after the last decode
        (an embedding model's pooling), ``[n_embd]`` float64."""
        ptr = self.L.llama_get_embeddings_seq(self.ctx, seq)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                     shape=(self.n_embd,)).astype(np.float64)

    # ---- vocabulary ---------------------------------------------------------
    def tokenize(self, raw: bytes, add_special: bool, parse_special: bool,
                 limit: int | None = None) -> list[int]:
        """Token ids of UTF-8 ``raw``, with bounded work
        (:class:`~ggmux.instance.engine.tokenizing.Tokenizer`: a long text
        in pieces; with ``limit``, :class:`~.tokenizing.TooManyTokens` as
        soon as it is known to be longer, issue 37 item 1)."""
        return self.tokenizer.tokenize(raw, add_special, parse_special, limit)

    def _tokenize_once(self, raw: bytes, add_special: bool, parse_special: bool) -> list[int]:
        """Token ids of UTF-8 ``raw`` in one ``llama_tokenize``, which runs
        without the GIL (ctypes); the list is built a slice of
        :data:`ID_SLICE` at a time, so a thread doing this for megabytes of
        text leaves the GIL to the event loop between slices (issue 31,
        item 1)."""
        L = self.L
        cap = len(raw) + 8
        buf = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, raw, len(raw), buf, cap, add_special, parse_special)
        out: list[int] = []
        for i in range(0, max(0, n), ID_SLICE):
            out += buf[i:min(n, i + ID_SLICE)]
        return out

    def count(self, raw: bytes, add_special: bool, parse_special: bool) -> int:
        """How many tokens UTF-8 ``raw`` is, without listing them, with
        bounded work (:meth:`~.tokenizing.Tokenizer.count`)."""
        return self.tokenizer.count(raw, add_special, parse_special)

    def _count_once(self, raw: bytes, add_special: bool, parse_special: bool) -> int:
        """:meth:`count` in one ``llama_tokenize`` (into no room: it answers
        minus the count)."""
        L = self.L
        buf = (L.llama_token * 1)()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, 0, add_special, parse_special)
        return -n if n < 0 else n

    def pieces(self, tokens, special: bool = False) -> bytes:
        """The bytes of ``tokens`` (:meth:`piece` of each), joined a slice
        of :data:`ID_SLICE` at a time: ``b"".join`` of a generator holds
        the GIL to its end (1.3 s for 1.45 M ids), a comprehension lets it
        go between steps (issue 31, item 1)."""
        piece = self.piece
        parts = []
        for i in range(0, len(tokens), ID_SLICE):
            parts.append(b"".join([piece(t, special) for t in tokens[i:i + ID_SLICE]]))
        return b"".join(parts)

    def piece(self, token: int, special: bool = False) -> bytes:
        """The bytes ``token`` stands for (``special``: control tokens as
        their text, else as nothing, llama-server's output rule). Cached. A
        media placeholder (a negative id, :mod:`~ggmux.instance.media.spans`)
        or an id past the vocabulary stands for no text: ``b""`` (llama.cpp
        aborts the process on one)."""
        if not 0 <= token < self.n_vocab:
            return b""
        key = token if not special else -2 - token
        p = self._pieces.get(key)
        if p is None:
            L = self.L
            buf = ctypes.create_string_buffer(64)
            n = L.llama_token_to_piece(self.vocab, token, buf, 64, 0, special)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = L.llama_token_to_piece(self.vocab, token, buf, -n, 0, special)
            p = buf.raw[:max(0, n)]
            self._pieces[key] = p
        return p

    def token_text(self, token: int) -> str:
        """The vocabulary's text of one token (``<|im_end|>``), '' for -1."""
        if token < 0:
            return ""
        return self.L.llama_vocab_get_text(self.vocab, token).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        """Whether ``token`` ends a generation (``llama_vocab_is_eog``; cached:
        the decode thread asks once per token)."""
        e = self._eog.get(token)
        if e is None:
            e = self._eog[token] = bool(self.L.llama_vocab_is_eog(self.vocab, token))
        return e

    def check_tokens(self, tokens, what: str) -> None:
        """Raise InvalidRequest naming the first id outside the vocabulary
        (llama.cpp aborts the process on one: the hardening issue)."""
        # a slice at a time: np.asarray of 3 M ints holds the GIL 60 ms
        for start in range(0, len(tokens), ID_SLICE):
            a = np.asarray(tokens[start:start + ID_SLICE])
            if a.dtype.kind not in "iu":
                raise InvalidRequest(f"{what} must be token ids (integers)")
            bad = np.flatnonzero((a < 0) | (a >= self.n_vocab))
            if bad.size:
                i = start + int(bad[0])
                raise InvalidRequest(f"{what}[{i}]: {tokens[i]} is not a token id of this "
                                     f"model (vocabulary size {self.n_vocab})")
