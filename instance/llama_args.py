"""llama-server's command-line options for the built-in instance: a preset's
keys (and ``ggmux serve -- OPTIONS``) arrive as llama-server options
(``--batch-size 256``, ``--no-mmap``, ``--chat-template llama3``, ...) and
become :class:`~ggmux.instance.engine.model.EngineConfig` fields or the backend's
own settings (:func:`llama_kwargs`)."""

from __future__ import annotations

import logging

from .engine.spec_options import OPTIONS as SPEC_OPTIONS
from .engine.spec_options import SpecConfig, set_option, spec_default
from .settings import SAMPLING_OPTIONS, sampling_default

log = logging.getLogger(__name__)


def _on_off_auto(v) -> bool | None:
    """llama.cpp's ``on``/``off``/``auto`` (None: llama.cpp decides)."""
    t = str(v).lower()
    return None if t == "auto" else t in ("on", "1", "true", "enabled")


# llama.cpp option -> (EngineConfig field, or chat_format, converter); preset
# keys arrive as llama-server options ("--batch-size 256", "--no-mmap", ...)
_LLAMA_OPTIONS = {
    "--batch-size": ("n_batch", int), "-b": ("n_batch", int),
    "--ubatch-size": ("n_ubatch", int), "-ub": ("n_ubatch", int),
    "--threads-batch": ("n_threads_batch", int), "-tb": ("n_threads_batch", int),
    "--seed": ("seed", int), "-s": ("seed", int),
    "--rope-freq-base": ("rope_freq_base", float),
    "--rope-freq-scale": ("rope_freq_scale", float),
    "--main-gpu": ("main_gpu", int), "-mg": ("main_gpu", int),
    "--cache-type-k": ("type_k", str), "-ctk": ("type_k", str),
    "--cache-type-v": ("type_v", str), "-ctv": ("type_v", str),
    "--flash-attn": ("flash_attn", lambda v: _on_off_auto(v)),
    "-fa": ("flash_attn", lambda v: _on_off_auto(v)),
    "--chat-template": ("chat_format", str),
    "--chat-template-file": ("chat_template_file", str),
    "--pooling": ("pooling", str),
    "--n-predict": ("n_predict", int), "--predict": ("n_predict", int), "-n": ("n_predict", int),
    "--reasoning-format": ("reasoning_format", str),
    "--parallel": ("parallel", int), "-np": ("parallel", int),
    "--prefill-wait-ms": ("prefill_wait_ms", float),  # ggmux's (EngineConfig)
    # the KV tiers (EngineConfig.cache): llama-server's --cache-ram, ggmux's disk tier
    "--cache-ram": ("cache_ram", int), "-cram": ("cache_ram", int),
    "--cache-disk": ("cache_disk", str),
    "--cache-disk-max": ("cache_disk_max", float),
    "--cache-save-timeout": ("cache_save_timeout", float),
    "--cache-checkpoints": ("cache_checkpoints", int),
    "--cache-checkpoint-max": ("cache_checkpoint_max", int),
    # context checkpoints (issue 35): llama-server's names, aliases and defaults
    "--ctx-checkpoints": ("ctx_checkpoints", int), "-ctxcp": ("ctx_checkpoints", int),
    "--swa-checkpoints": ("ctx_checkpoints", int),
    "--checkpoint-min-step": ("checkpoint_min_step", int),
    "-cms": ("checkpoint_min_step", int),
    # the multimodal projector's (llama-server's names): dynamic-resolution token bounds
    "--image-min-tokens": ("image_min_tokens", int),
    "--image-max-tokens": ("image_max_tokens", int),
}
_LLAMA_FLAGS = {"--no-mmap": ("use_mmap", False), "--mmap": ("use_mmap", True),
                "--kv-unified": ("kv_unified", True), "-kvu": ("kv_unified", True),
                "--no-kv-unified": ("kv_unified", False),
                "--swa-full": ("swa_full", True),
                "--mmproj-offload": ("mmproj_offload", True),
                "--no-mmproj-offload": ("mmproj_offload", False),
                "--mlock": ("use_mlock", True), "--no-mlock": ("use_mlock", False),
                "--embedding": ("embedding", True), "--embeddings": ("embedding", True),
                "--jinja": ("jinja", True), "--no-jinja": ("jinja", False),
                "--verbose": ("verbose", True), "-v": ("verbose", True),
                "--log-verbose": ("verbose", True)}
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
               "bf16": 30}


def llama_kwargs(argv: list[str]) -> dict:
    """Engine settings (:class:`~ggmux.instance.engine.model.EngineConfig` fields)
    and the backend's own (``chat_format``, ``chat_template_file``,
    ``jinja``, ``n_predict``, ``pooling``, ``verbose``, ``reasoning_format``,
    ``sampling``: the requests' sampling defaults, field -> value;
    ``spec``: the ``--spec-*`` options as a
    :class:`~ggmux.instance.engine.spec_options.SpecConfig`) for
    llama-server options a preset gave (``extra_args``); options the engine
    has no equivalent for are logged and ignored, as llama.cpp ignores
    unknown environment."""
    kw: dict = {}
    i = 0
    while i < len(argv):
        opt = argv[i]
        if opt == "--spec-default":
            spec_default(kw.setdefault("spec", SpecConfig()))
            i += 1
            continue
        if opt in _LLAMA_FLAGS:
            k, v = _LLAMA_FLAGS[opt]
            kw[k] = v
            i += 1
            continue
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if opt == "--dry-sequence-breaker" and has_value:
            # llama-server: the first one replaces the defaults; "none": no breaker
            sampling = kw.setdefault("sampling", {})
            breakers = sampling.setdefault("dry_sequence_breakers", [])
            if argv[i + 1] != "none":
                breakers.append(argv[i + 1])
        elif opt in SPEC_OPTIONS and has_value:  # speculative decoding (issue 30)
            set_option(kw.setdefault("spec", SpecConfig()), opt, argv[i + 1])
        elif opt in SAMPLING_OPTIONS and has_value:
            try:
                k, v = sampling_default(opt, argv[i + 1])
                kw.setdefault("sampling", {})[k] = v
            except ValueError:
                log.warning("ignoring %s %s: not a number", opt, argv[i + 1])
        elif opt in _LLAMA_OPTIONS and has_value:
            k, conv = _LLAMA_OPTIONS[opt]
            val = conv(argv[i + 1])
            if k in ("type_k", "type_v"):
                val = _GGML_TYPES.get(str(val).lower())
                if val is None:
                    log.warning("ignoring %s %s: unknown cache type", opt, argv[i + 1])
                    i += 2
                    continue
            kw[k] = val
        else:
            log.warning("ignoring llama.cpp option %s: llama-cpp-python has no equivalent", opt)
        i += 2 if has_value else 1
    return kw
