"""llama-server's options, as preset keys: their names and spellings
(:data:`LLAMA_OPTIONS`) and the types of the values ggmux can check before
passing them on (:data:`LLAMA_VALUES`).

A preset value for a llama.cpp option is passed through to the instance as
text; one llama.cpp would reject (``batch-size = many``) is a
``FILE:LINE: reason`` error at start instead of a crash of every load
(issue 11, finding 12). Each parser returns the value as it is passed on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LlamaOption:
    """One llama-server option: ``forms`` its names with dashes (``-c``,
    ``--ctx-size``), ``neg`` its negated names, ``kind`` ``"value"``,
    ``"flag"`` (present or not) or ``"bool"`` (positive/negative pair),
    ``env`` its environment variable (``""``: none). ``key`` is the
    canonical preset key: the last form without dashes, the one llama.cpp
    renders (``common_preset::to_args`` uses ``args.back()``)."""

    forms: tuple[str, ...]
    neg: tuple[str, ...]
    kind: str
    env: str

    @property
    def key(self) -> str:
        return self.forms[-1].lstrip("-")


def _parse_table(table: str) -> dict[str, tuple[LlamaOption, bool]]:
    """Preset key (any form without dashes, or env name) -> (option, negated)."""
    out: dict[str, tuple[LlamaOption, bool]] = {}
    for row in table.strip().splitlines():
        forms, neg, kind, env = row.split("|")
        opt = LlamaOption(tuple(forms.split(",")), tuple(n for n in neg.split(",") if n), kind, env)
        for f in opt.forms:
            out.setdefault(f.lstrip("-"), (opt, False))
        for f in opt.neg:
            out.setdefault(f.lstrip("-"), (opt, True))
        if env:
            out.setdefault(env, (opt, False))
    return out


# llama-server options for presets, generated from llama.cpp common/arg.cpp
# (build b11434, options of the server example; --help, --version,
# --cache-list, --completion-bash, --list-devices and two-value options left
# out), then options of earlier builds that existing preset files use
# (--mmap/--no-mmap, --mlock, --draft-max, ...). Columns:
# forms | negated forms | value, flag or bool | environment variable.
_LLAMA_TABLE = """
-t,--threads||value|LLAMA_ARG_THREADS
-tb,--threads-batch||value|
-C,--cpu-mask||value|
-Cr,--cpu-range||value|
--cpu-strict||value|
--prio||value|
--poll||value|
-Cb,--cpu-mask-batch||value|
-Crb,--cpu-range-batch||value|
--cpu-strict-batch||value|
--prio-batch||value|
--poll-batch||value|
-lcs,--lookup-cache-static||value|
-lcd,--lookup-cache-dynamic||value|
-c,--ctx-size||value|LLAMA_ARG_CTX_SIZE
--kv-unified-per-slot||value|LLAMA_ARG_KV_UNIFIED_PER_SLOT
-n,--predict,--n-predict||value|LLAMA_ARG_N_PREDICT
-b,--batch-size||value|LLAMA_ARG_BATCH
-ub,--ubatch-size||value|LLAMA_ARG_UBATCH
--keep||value|
--swa-full||flag|LLAMA_ARG_SWA_FULL
-ctxcp,--ctx-checkpoints,--swa-checkpoints||value|LLAMA_ARG_CTX_CHECKPOINTS
-cms,--checkpoint-min-step||value|LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT
-cram,--cache-ram||value|LLAMA_ARG_CACHE_RAM
-kvu,--kv-unified|-no-kvu,--no-kv-unified|bool|LLAMA_ARG_KV_UNIFIED
--cache-idle-slots|--no-cache-idle-slots|bool|LLAMA_ARG_CACHE_IDLE_SLOTS
--context-shift|--no-context-shift|bool|LLAMA_ARG_CONTEXT_SHIFT
-fa,--flash-attn||value|LLAMA_ARG_FLASH_ATTN
--perf|--no-perf|bool|LLAMA_ARG_PERF
-e,--escape|--no-escape|bool|
-r,--reverse-prompt||value|
-sp,--special||flag|
--warmup|--no-warmup|bool|
--spm-infill||flag|
--samplers||value|
-s,--seed||value|
--sampler-seq,--sampling-seq||value|
--ignore-eos||flag|
--temp,--temperature||value|LLAMA_ARG_TEMPERATURE
--top-k||value|LLAMA_ARG_TOP_K
--top-p||value|LLAMA_ARG_TOP_P
--min-p||value|LLAMA_ARG_MIN_P
--top-nsigma,--top-n-sigma||value|
--xtc-probability||value|
--xtc-threshold||value|
--typical,--typical-p||value|
--repeat-last-n||value|
--repeat-penalty||value|LLAMA_ARG_REPEAT_PENALTY
--presence-penalty||value|LLAMA_ARG_PRESENCE_PENALTY
--frequency-penalty||value|LLAMA_ARG_FREQUENCY_PENALTY
--dry-multiplier||value|
--dry-base||value|
--dry-allowed-length||value|
--dry-penalty-last-n||value|
--dry-sequence-breaker||value|
--adaptive-target||value|
--adaptive-decay||value|
--dynatemp-range||value|
--dynatemp-exp||value|
--mirostat||value|
--mirostat-lr||value|
--mirostat-ent||value|
-l,--logit-bias||value|
--grammar||value|
--grammar-file||value|
-j,--json-schema||value|
-jf,--json-schema-file||value|
-bs,--backend-sampling||flag|LLAMA_ARG_BACKEND_SAMPLING
--pooling||value|LLAMA_ARG_POOLING
--rope-scaling||value|LLAMA_ARG_ROPE_SCALING_TYPE
--rope-scale||value|LLAMA_ARG_ROPE_SCALE
--rope-freq-base||value|LLAMA_ARG_ROPE_FREQ_BASE
--rope-freq-scale||value|LLAMA_ARG_ROPE_FREQ_SCALE
--yarn-orig-ctx||value|LLAMA_ARG_YARN_ORIG_CTX
--yarn-ext-factor||value|LLAMA_ARG_YARN_EXT_FACTOR
--yarn-attn-factor||value|LLAMA_ARG_YARN_ATTN_FACTOR
--yarn-beta-slow||value|LLAMA_ARG_YARN_BETA_SLOW
--yarn-beta-fast||value|LLAMA_ARG_YARN_BETA_FAST
-kvo,--kv-offload|-nkvo,--no-kv-offload|bool|LLAMA_ARG_KV_OFFLOAD
--repack|-nr,--no-repack|bool|LLAMA_ARG_REPACK
--no-host||flag|LLAMA_ARG_NO_HOST
-ctk,--cache-type-k||value|LLAMA_ARG_CACHE_TYPE_K
-ctv,--cache-type-v||value|LLAMA_ARG_CACHE_TYPE_V
-dt,--defrag-thold||value|LLAMA_ARG_DEFRAG_THOLD
-np,--parallel||value|LLAMA_ARG_N_PARALLEL
-cb,--cont-batching|-nocb,--no-cont-batching|bool|LLAMA_ARG_CONT_BATCHING
-mm,--mmproj||value|LLAMA_ARG_MMPROJ
-mmu,--mmproj-url||value|LLAMA_ARG_MMPROJ_URL
--mmproj-auto|--no-mmproj,--no-mmproj-auto|bool|LLAMA_ARG_MMPROJ_AUTO
--mmproj-offload|--no-mmproj-offload|bool|LLAMA_ARG_MMPROJ_OFFLOAD
-mmdev,--mmproj-device||value|MTMD_BACKEND_DEVICE
--image-min-tokens||value|LLAMA_ARG_IMAGE_MIN_TOKENS
--image-max-tokens||value|LLAMA_ARG_IMAGE_MAX_TOKENS
--mtmd-batch-max-tokens||value|LLAMA_ARG_MTMD_BATCH_MAX_TOKENS
--video-fps||value|LLAMA_ARG_VIDEO_FPS
--video-timestamp-interval||value|LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL
--video-ffmpeg-dir||value|LLAMA_ARG_VIDEO_FFMPEG_DIR
--rpc||value|LLAMA_ARG_RPC
-lm,--load-mode||value|LLAMA_ARG_LOAD_MODE
-lzm,--lazy-mode||value|LLAMA_ARG_LAZY_MODE
--numa||value|LLAMA_ARG_NUMA
-dev,--device||value|LLAMA_ARG_DEVICE
-ot,--override-tensor||value|LLAMA_ARG_OVERRIDE_TENSOR
-cmoe,--cpu-moe||flag|LLAMA_ARG_CPU_MOE
-ncmoe,--n-cpu-moe||value|LLAMA_ARG_N_CPU_MOE
-ncffn,--n-cpu-ffn||value|LLAMA_ARG_N_CPU_FFN
-ngl,--gpu-layers,--n-gpu-layers||value|LLAMA_ARG_N_GPU_LAYERS
-sm,--split-mode||value|LLAMA_ARG_SPLIT_MODE
-ts,--tensor-split||value|LLAMA_ARG_TENSOR_SPLIT
-mg,--main-gpu||value|LLAMA_ARG_MAIN_GPU
-fit,--fit||value|LLAMA_ARG_FIT
-fitt,--fit-target||value|LLAMA_ARG_FIT_TARGET
-fitc,--fit-ctx||value|LLAMA_ARG_FIT_CTX
--check-tensors||flag|
--override-kv||value|
--op-offload|--no-op-offload|bool|
--lora||value|
--lora-scaled||value|
--control-vector||value|
--control-vector-scaled||value|
-a,--alias||value|LLAMA_ARG_ALIAS
--tags||value|LLAMA_ARG_TAGS
-m,--model||value|LLAMA_ARG_MODEL
-mu,--model-url||value|LLAMA_ARG_MODEL_URL
-dr,--docker-repo||value|LLAMA_ARG_DOCKER_REPO
-hf,-hfr,--hf-repo||value|LLAMA_ARG_HF_REPO
-hff,--hf-file||value|LLAMA_ARG_HF_FILE
-hft,--hf-token||value|HF_TOKEN
--embd-normalize||value|
--host||value|LLAMA_ARG_HOST
--port||value|LLAMA_ARG_PORT
--reuse-port||flag|LLAMA_ARG_REUSE_PORT
--path||value|LLAMA_ARG_STATIC_PATH
--cors-origins||value|LLAMA_ARG_CORS_ORIGINS
--cors-methods||value|LLAMA_ARG_CORS_METHODS
--cors-headers||value|LLAMA_ARG_CORS_HEADERS
--cors-credentials|--no-cors-credentials|bool|LLAMA_ARG_CORS_CREDENTIALS
--api-prefix||value|LLAMA_ARG_API_PREFIX
--ui-config,--webui-config||value|LLAMA_ARG_UI_CONFIG
--ui-config-file,--webui-config-file||value|LLAMA_ARG_UI_CONFIG_FILE
--ui-mcp-proxy,--webui-mcp-proxy|--no-ui-mcp-proxy,--no-webui-mcp-proxy|bool|LLAMA_ARG_UI_MCP_PROXY
--tools||value|LLAMA_ARG_TOOLS
--tools-runtime||value|LLAMA_ARG_TOOLS_RUNTIME
--mcp-servers-config||value|LLAMA_ARG_MCP_SERVERS_CONFIG
--mcp-servers-json||value|LLAMA_ARG_MCP_SERVERS_JSON
-ag,--agent|-no-ag,--no-agent|bool|LLAMA_ARG_AGENT
--ui,--webui|--no-ui,--no-webui|bool|LLAMA_ARG_UI
--embedding,--embeddings||flag|LLAMA_ARG_EMBEDDINGS
--rerank,--reranking||flag|LLAMA_ARG_RERANKING
--api-key||value|LLAMA_API_KEY
--api-key-file||value|LLAMA_ARG_API_KEY_FILE
--ssl-key-file||value|LLAMA_ARG_SSL_KEY_FILE
--ssl-cert-file||value|LLAMA_ARG_SSL_CERT_FILE
--chat-template-kwargs||value|LLAMA_ARG_CHAT_TEMPLATE_KWARGS
-to,--timeout||value|LLAMA_ARG_TIMEOUT
--sse-ping-interval||value|LLAMA_ARG_SSE_PING_INTERVAL
--threads-http||value|LLAMA_ARG_THREADS_HTTP
--cache-prompt|--no-cache-prompt|bool|LLAMA_ARG_CACHE_PROMPT
--cache-reuse||value|LLAMA_ARG_CACHE_REUSE
--metrics||flag|LLAMA_ARG_ENDPOINT_METRICS
--props||flag|LLAMA_ARG_ENDPOINT_PROPS
--slots|--no-slots|bool|LLAMA_ARG_ENDPOINT_SLOTS
--slot-save-path||value|
--media-path||value|
--models-dir||value|LLAMA_ARG_MODELS_DIR
--models-preset||value|LLAMA_ARG_MODELS_PRESET
--models-max||value|LLAMA_ARG_MODELS_MAX
--models-autoload|--no-models-autoload|bool|LLAMA_ARG_MODELS_AUTOLOAD
--jinja|--no-jinja|bool|LLAMA_ARG_JINJA
--reasoning-format||value|LLAMA_ARG_THINK
-rea,--reasoning||value|LLAMA_ARG_REASONING
--reasoning-effort||value|LLAMA_ARG_REASONING_EFFORT
--reasoning-budget||value|LLAMA_ARG_THINK_BUDGET
--reasoning-budget-message||value|LLAMA_ARG_THINK_BUDGET_MESSAGE
--reasoning-preserve|--no-reasoning-preserve|bool|LLAMA_ARG_REASONING_PRESERVE
--chat-template||value|LLAMA_ARG_CHAT_TEMPLATE
--chat-template-file||value|LLAMA_ARG_CHAT_TEMPLATE_FILE
--skip-chat-parsing|--no-skip-chat-parsing|bool|LLAMA_ARG_SKIP_CHAT_PARSING
--prefill-assistant|--no-prefill-assistant|bool|LLAMA_ARG_PREFILL_ASSISTANT
-sps,--slot-prompt-similarity||value|
--lora-init-without-apply||flag|
--sleep-idle-seconds||value|
--log-disable||flag|
--log-file||value|LLAMA_ARG_LOG_FILE
--log-jsonl|--no-log-jsonl|bool|LLAMA_ARG_LOG_JSONL
--log-prompts-dir||value|
--log-colors||value|LLAMA_ARG_LOG_COLORS
-v,--verbose,--log-verbose||flag|
--offline||flag|LLAMA_ARG_OFFLINE
-lv,--verbosity,--log-verbosity||value|LLAMA_ARG_LOG_VERBOSITY
--log-prefix|--no-log-prefix|bool|LLAMA_ARG_LOG_PREFIX
--log-timestamps|--no-log-timestamps|bool|LLAMA_ARG_LOG_TIMESTAMPS
--spec-draft-hf,-hfd,-hfrd,--hf-repo-draft||value|LLAMA_ARG_SPEC_DRAFT_HF_REPO
--spec-draft-threads,-td,--threads-draft||value|
--spec-draft-threads-batch,-tbd,--threads-batch-draft||value|
--spec-draft-cpu-mask,-Cd,--cpu-mask-draft||value|
--spec-draft-cpu-range,-Crd,--cpu-range-draft||value|
--spec-draft-cpu-strict,--cpu-strict-draft||value|
--spec-draft-prio,--prio-draft||value|
--spec-draft-poll,--poll-draft||value|
--spec-draft-cpu-mask-batch,-Cbd,--cpu-mask-batch-draft||value|
--spec-draft-cpu-strict-batch,--cpu-strict-batch-draft||value|
--spec-draft-prio-batch,--prio-batch-draft||value|
--spec-draft-poll-batch,--poll-batch-draft||value|
--spec-draft-type-k,-ctkd,--cache-type-k-draft||value|LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K
--spec-draft-type-v,-ctvd,--cache-type-v-draft||value|LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V
--spec-draft-override-tensor,-otd,--override-tensor-draft||value|
--spec-draft-cpu-moe,-cmoed,--cpu-moe-draft||flag|LLAMA_ARG_SPEC_DRAFT_CPU_MOE
--spec-draft-n-cpu-moe,--spec-draft-ncmoe,-ncmoed,--n-cpu-moe-draft||value|LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE
--spec-draft-n-max||value|LLAMA_ARG_SPEC_DRAFT_N_MAX
--spec-draft-n-min||value|LLAMA_ARG_SPEC_DRAFT_N_MIN
--spec-synth-len||value|LLAMA_ARG_SPEC_SYNTH_LEN
--spec-synth-rates||value|LLAMA_ARG_SPEC_SYNTH_RATES
--spec-draft-p-split,--draft-p-split||value|LLAMA_ARG_SPEC_DRAFT_P_SPLIT
--spec-draft-p-min,--draft-p-min||value|LLAMA_ARG_SPEC_DRAFT_P_MIN
--spec-draft-backend-sampling|--no-spec-draft-backend-sampling|bool|LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING
--spec-draft-sampling||value|LLAMA_ARG_SPEC_DRAFT_SAMPLING
--spec-draft-device,-devd,--device-draft||value|
--spec-draft-ngl,-ngld,--gpu-layers-draft,--n-gpu-layers-draft||value|LLAMA_ARG_N_GPU_LAYERS_DRAFT
--spec-draft-model,-md,--model-draft||value|LLAMA_ARG_SPEC_DRAFT_MODEL
--spec-type||value|LLAMA_ARG_SPEC_TYPE
--spec-ngram-mod-n-min||value|
--spec-ngram-mod-n-max||value|
--spec-ngram-mod-n-match||value|
--spec-ngram-simple-size-n||value|
--spec-ngram-simple-size-m||value|
--spec-ngram-simple-min-hits||value|
--spec-ngram-map-k-size-n||value|
--spec-ngram-map-k-size-m||value|
--spec-ngram-map-k-min-hits||value|
--spec-ngram-map-k4v-size-n||value|
--spec-ngram-map-k4v-size-m||value|
--spec-ngram-map-k4v-min-hits||value|
--embd-gemma-default||flag|
--fim-qwen-1.5b-default||flag|
--fim-qwen-3b-default||flag|
--fim-qwen-7b-default||flag|
--fim-qwen-7b-spec||flag|
--fim-qwen-14b-spec||flag|
--fim-qwen-30b-default||flag|
--gpt-oss-20b-default||flag|
--gpt-oss-120b-default||flag|
--vision-gemma-4b-default||flag|
--vision-gemma-12b-default||flag|
--spec-default||flag|
--mmap|--no-mmap|bool|LLAMA_ARG_MMAP
--mlock||flag|LLAMA_ARG_MLOCK
-dio,--direct-io|-ndio,--no-direct-io|bool|LLAMA_ARG_DIO
--draft,--draft-n,--draft-max||value|LLAMA_ARG_DRAFT_MAX
--draft-min,--draft-n-min||value|LLAMA_ARG_DRAFT_MIN
-cd,--ctx-size-draft||value|LLAMA_ARG_CTX_SIZE_DRAFT
-mv,--model-vocoder||value|
--tts-use-guide-tokens||flag|
-hfv,-hfrv,--hf-repo-v||value|LLAMA_ARG_HF_REPO_V
-hffv,--hf-file-v||value|LLAMA_ARG_HF_FILE_V
--allowed-local-media-path||value|LLAMA_ARG_ALLOWED_LOCAL_MEDIA_PATH
--local-media-max-size-mb||value|LLAMA_ARG_LOCAL_MEDIA_MAX_SIZE_MB
--embd-bge-small-en-default||flag|
--embd-e5-small-en-default||flag|
--embd-gte-small-default||flag|
--spec-ngram-size-n||value|
--spec-ngram-size-m||value|
--spec-ngram-min-hits||value|
"""

LLAMA_OPTIONS: dict[str, tuple[LlamaOption, bool]] = _parse_table(_LLAMA_TABLE)


# ---- value types -------------------------------------------------------------------


def _integer(v: str) -> str:
    try:
        int(v.strip())
    except ValueError:
        raise ValueError(f"bad number {v!r} (expected an integer)") from None
    return v.strip()


def _count(v: str) -> str:
    """An integer of 0 or more (a number of checkpoints, a token spacing:
    llama.cpp takes a negative one without a word and does nothing useful)."""
    if int(_integer(v)) < 0:
        raise ValueError(f"bad number {v!r} (expected 0 or more)")
    return v.strip()


def _decimal(v: str) -> str:
    try:
        x = float(v.strip())
    except ValueError:
        raise ValueError(f"bad number {v!r} (expected a number)") from None
    if not math.isfinite(x):
        raise ValueError(f"bad number {v!r} (must be finite)")
    return v.strip()


def _one_of(*words: str) -> Callable[[str], str]:
    def parse(v: str) -> str:
        if v.strip() not in words:
            raise ValueError(f"bad value {v!r} (expected one of {', '.join(words)})")
        return v.strip()

    return parse


SPEC_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
              "draft-dspark", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
              "ngram-cache")
"""llama.cpp b11434's ``--spec-type`` names (``common/speculative.cpp``); the
built-in engine drafts with some of them and refuses the rest at load
(``instance/engine/spec_options.py``)."""


def _spec_types(v: str) -> str:
    """``--spec-type``: a comma-separated list of llama.cpp's type names."""
    names = [t.strip() for t in v.split(",") if t.strip()]
    bad = [t for t in names if t not in SPEC_TYPES]
    if not names or bad:
        raise ValueError(f"bad value {v!r} (expected a comma-separated list of "
                         f"{', '.join(SPEC_TYPES)})")
    return ",".join(names)


def _layers(v: str) -> str:
    return v.strip() if v.strip() in ("auto", "all") else _integer(v)


# llama.cpp common/arg.cpp: options read with an int handler (std::stoi),
# with std::stof, or from a fixed list of words (kv_cache_types,
# --flash-attn's is_truthy/is_falsey/is_autoy, --numa)
_INTEGERS = (
    "threads-batch", "n-predict", "batch-size", "ubatch-size", "keep", "top-k", "repeat-last-n",
    "mirostat", "dry-allowed-length", "dry-penalty-last-n", "parallel", "main-gpu",
    "cache-reuse", "timeout", "threads-http", "cache-ram", "n-cpu-moe",
    "yarn-orig-ctx", "reasoning-budget", "draft-max", "draft-min", "ctx-size-draft",
    "image-min-tokens", "image-max-tokens", "sleep-idle-seconds", "seed", "prio", "poll",
    "prio-batch", "poll-batch", "spec-draft-n-max", "spec-draft-n-min",
    "spec-ngram-mod-n-min", "spec-ngram-mod-n-max", "spec-ngram-mod-n-match",
    "spec-ngram-simple-size-n", "spec-ngram-simple-size-m", "spec-ngram-simple-min-hits",
    "spec-ngram-map-k-size-n", "spec-ngram-map-k-size-m", "spec-ngram-map-k-min-hits",
    "spec-ngram-map-k4v-size-n", "spec-ngram-map-k4v-size-m", "spec-ngram-map-k4v-min-hits",
)
_DECIMALS = (
    "temp", "top-p", "min-p", "typical", "repeat-penalty", "presence-penalty",
    "frequency-penalty", "dry-multiplier", "dry-base", "dynatemp-range", "dynatemp-exp",
    "mirostat-lr", "mirostat-ent", "xtc-probability", "xtc-threshold", "top-nsigma",
    "rope-scale", "rope-freq-base", "rope-freq-scale", "yarn-ext-factor", "yarn-attn-factor",
    "yarn-beta-slow", "yarn-beta-fast", "defrag-thold", "slot-prompt-similarity",
    "draft-p-min",
)
_CACHE_TYPES = _one_of("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
_WORDS: dict[str, Callable[[str], str]] = {
    "flash-attn": _one_of("on", "off", "auto", "enabled", "disabled", "true", "false", "1", "0",
                          "-1"),
    "cache-type-k": _CACHE_TYPES,
    "cache-type-v": _CACHE_TYPES,
    "cache-type-k-draft": _CACHE_TYPES,
    "cache-type-v-draft": _CACHE_TYPES,
    "numa": _one_of("distribute", "isolate", "numactl"),
    "n-gpu-layers-draft": _layers,
    "spec-type": _spec_types,
    "ctx-checkpoints": _count,
    "checkpoint-min-step": _count,
}


def _by_canonical_key() -> dict[str, Callable[[str], str]]:
    out: dict[str, Callable[[str], str]] = {}
    for names, parse in ((_INTEGERS, _integer), (_DECIMALS, _decimal)):
        for name in names:
            out[LLAMA_OPTIONS[name][0].key] = parse
    for name, parse in _WORDS.items():
        out[LLAMA_OPTIONS[name][0].key] = parse
    return out


LLAMA_VALUES: dict[str, Callable[[str], str]] = _by_canonical_key()
"""Canonical key of a llama.cpp value option -> parser of its preset value:
returns the text passed on, raises ``ValueError`` with the reason."""
