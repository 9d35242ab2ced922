"""What a load of a GGUF model needs, for the memory ledger's ``measure``
child (:meth:`~ggmux.instance.llama.LlamaBackend.measure`): weights, KV
cache and compute per device, read from the GGUF's metadata by llama.cpp
itself, and what the model is (a chat template, a projector's modalities)."""

from __future__ import annotations

import os
import re

from .engine.model import EngineConfig
from .kv_size import checkpoint_bytes, kv_cache_bytes, sliding_layers


def model_parts(path: str) -> list[str]:
    """All files of a split GGUF (``name-00001-of-00003.gguf``), else [path]."""
    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", path)
    if not m:
        return [path]
    n = int(m.group(3))
    parts = [f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    return [p for p in parts if os.path.exists(p)]


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no NVML means no GPU
        return 0


def measure_model(path: str, args, cfg: EngineConfig) -> dict:
    """Memory a load needs, from GGUF metadata read by llama.cpp itself
    (a ``vocab_only`` model load without a context: metadata and
    vocabulary, no weights, ~0.1 s;
    the ``gguf`` package's reader takes seconds on a 49k-token vocab).

    ``min`` = weights + KV cache at ``kv-size`` (``ctx-size x parallel``
    unless given: the cache all slots share, issue 12) + compute
    estimate; ``max`` = the same with every slot at the model's trained
    context. KV: K and V, f16, ``n_layer * n_head_kv * head_dim`` per
    token, sliding-window layers at their window (:mod:`.kv_size`); ``max``
    also holds every slot's ``ctx-checkpoints`` context checkpoints. Compute: ``4 * n_ubatch * (4 * n_embd + 2 * n_ff +
    max(n_vocab, n_head * n_kv))`` bytes, where ``n_kv`` is the cells one
    token attends over (``kv-size`` in a shared cache, ``ctx-size`` in a
    slot's own stream): the graph holds either a micro-batch's logits or
    its attention scores at its peak; within 5% of llama.cpp's CPU
    compute buffer for smollm2 at 4 x 2048 tokens (99 MiB streams, 166
    MiB shared); the ``effective`` figure a ready instance reports
    calibrates it.
    With ``--n-gpu-layers`` and a GPU, the offloaded share of weights and
    KV is put on ``gpu0``. Bytes per device key. ``chat_template``:
    whether the GGUF metadata has ``tokenizer.chat_template``. A
    multimodal projector adds its weights and encoder
    (:func:`~ggmux.instance.media.measure.projector_need`) to both, and
    ``modalities`` (``{"vision", "audio"}``) says what it reads.
    """
    import llama_cpp
    from llama_cpp._internals import LlamaModel

    weights = sum(os.path.getsize(p) for p in model_parts(path))
    modalities = None
    mmproj = getattr(args, "mmproj", None)
    if mmproj and os.path.isfile(mmproj):  # a projector: its weights and encoder
        from .media.measure import projector_need

        extra, modalities = projector_need(mmproj)
        weights += extra
    spec = cfg.spec
    if spec is not None and spec.on and spec.draft_model and os.path.isfile(spec.draft_model):
        weights += os.path.getsize(spec.draft_model)  # a draft model (issue 30): its weights
    # the model alone, no context: a context on a vocab-only model warns
    # "n_ctx_seq (512) > n_ctx_train (0)" at every start (issue 15)
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = LlamaModel(path_model=path, params=params, verbose=False)
    try:
        md, n_vocab = model.metadata(), model.n_vocab()
    finally:
        model.close()
    arch = md.get("general.architecture", "llama")

    def num(key: str, default: float = 0) -> float:
        try:
            return float(md.get(f"{arch}.{key}", default))
        except ValueError:
            return default

    n_layer = int(num("block_count", 1))
    n_embd = int(num("embedding_length", 0))
    n_head = max(1, int(num("attention.head_count", 1)))
    n_head_kv = int(num("attention.head_count_kv", n_head))
    head_dim = int(num("attention.key_length", n_embd // n_head if n_embd else 0))
    n_ff = int(num("feed_forward_length", 4 * n_embd))
    n_ctx_train = int(num("context_length", args.ctx_size)) or args.ctx_size
    n_ubatch = cfg.n_ubatch or 512
    n_swa = int(num("attention.sliding_window", 0))
    pattern = md.get(f"{arch}.attention.sliding_window_pattern", "")
    if pattern.startswith("["):  # per layer: true where it slides
        swa_layers = sum(x.strip() in ("true", "1") for x in pattern.strip("[]").split(","))
    else:
        swa_layers = sliding_layers(arch, n_layer, n_swa,
                                    int(pattern) if pattern.isdigit() else None)
    if cfg.swa_full:
        swa_layers = 0

    ctx = args.ctx_size or n_ctx_train
    parallel = cfg.parallel
    kv = cfg.kv_size or ctx * parallel
    unified = cfg.kv_unified if cfg.kv_unified is not None else kv < ctx * parallel

    def need(cells: int, per_slot: int) -> int:
        kv_bytes = kv_cache_bytes(n_layer, n_head_kv * head_dim * 2, cells,
                                  swa_layers=swa_layers, n_swa=n_swa, sequences=parallel,
                                  unified=unified, n_ubatch=n_ubatch)
        attended = cells if unified else per_slot
        compute = 4 * n_ubatch * (4 * n_embd + 2 * n_ff + max(n_vocab, n_head * attended))
        return weights + kv_bytes + compute

    lo = need(kv, ctx)
    hi = need(max(kv, n_ctx_train * parallel), max(ctx, n_ctx_train))
    # every slot's context checkpoints at their cap: host memory the
    # minimum does not hold (made as prompts are read)
    hi += parallel * cfg.ctx_checkpoints * checkpoint_bytes(
        swa_layers, n_swa, n_head_kv * head_dim * 2)
    ngl = args.n_gpu_layers
    # whether the GGUF has a chat template (a base model has none: the
    # page and clients then use completions, issue 22)
    has_template = bool(md.get("tokenizer.chat_template"))
    if ngl and _gpu_count() > 0:
        frac = 1.0 if ngl < 0 else min(1.0, ngl / max(1, n_layer))
        out = {
            "min": {"host": int(lo * (1 - frac)) + 64 << 20, "gpu0": int(lo * frac)},
            "max": {"host": int(hi * (1 - frac)) + 64 << 20, "gpu0": int(hi * frac)},
            "n_ctx_train": n_ctx_train, "chat_template": has_template,
        }
    else:
        out = {"min": {"host": lo}, "max": {"host": hi}, "n_ctx_train": n_ctx_train,
               "chat_template": has_template}
    if modalities is not None:
        out["modalities"] = modalities
    return out
