"""The built-in instance backend: llama-cpp-python on one GGUF file."""

from __future__ import annotations

import base64
import inspect
import logging
import os
import re
import threading
from collections.abc import Iterator

from .server import Backend
from .structured import forced_tool, structured_output
from .validate import (
    BadRequest,
    chat_messages,
    check_sampling,
    completion_prompt,
    embedding_inputs,
    fit_embedding_input,
    logit_bias,
    request_limits_from_args,
    token_ids,
    tokenize_request,
)

__all__ = ["BadRequest", "LlamaBackend", "chat_messages", "check_sampling", "llama_kwargs",
           "model_parts"]

log = logging.getLogger(__name__)


def model_parts(path: str) -> list[str]:
    """All files of a split GGUF (``name-00001-of-00003.gguf``), else [path]."""
    m = re.match(r"^(.*)-(\d{5})-of-(\d{5})\.gguf$", path)
    if not m:
        return [path]
    n = int(m.group(3))
    parts = [f"{m.group(1)}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    return [p for p in parts if os.path.exists(p)]


# llama.cpp option -> (llama_cpp.Llama keyword, converter); preset keys arrive
# as llama-server options ("--batch-size 256", "--no-mmap", ...)
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
    "--flash-attn": ("flash_attn", lambda v: str(v).lower() in ("on", "1", "true", "auto")),
    "-fa": ("flash_attn", lambda v: str(v).lower() in ("on", "1", "true", "auto")),
    "--chat-template": ("chat_format", str),
}
_LLAMA_FLAGS = {"--no-mmap": ("use_mmap", False), "--mmap": ("use_mmap", True),
                "--mlock": ("use_mlock", True), "--no-mlock": ("use_mlock", False),
                "--embedding": ("embedding", True), "--embeddings": ("embedding", True)}
_GGML_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8,
               "bf16": 30}


def llama_kwargs(argv: list[str]) -> dict:
    """``llama_cpp.Llama`` keywords for llama-server options a preset gave
    (``extra_args``); options llama-cpp-python has no equivalent for are
    logged and ignored, as llama.cpp ignores unknown environment."""
    kw: dict = {}
    i = 0
    while i < len(argv):
        opt = argv[i]
        if opt in _LLAMA_FLAGS:
            k, v = _LLAMA_FLAGS[opt]
            kw[k] = v
            i += 1
            continue
        has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
        if opt in _LLAMA_OPTIONS and has_value:
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


def _gpu_count() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetCount())
    except Exception:  # noqa: BLE001 - no NVML means no GPU
        return 0


def _accepted(fn) -> frozenset[str]:
    return frozenset(inspect.signature(fn).parameters)


class LlamaBackend(Backend):
    """Serves chat, completions and embeddings with ``llama_cpp.Llama``.

    One context per process; calls come from the single generation thread.
    Request keys that the llama-cpp-python method does not accept are
    ignored, as OpenAI-compatible servers do with unknown sampling options.
    """

    def __init__(self, args) -> None:
        self.args = args
        self.path = args.model
        self.name = args.name or os.path.basename(args.model).rsplit(".", 1)[0]
        self.limits = request_limits_from_args(args)
        self.llm = None

    def measure(self) -> dict:
        """Memory a load needs, from GGUF metadata read by llama.cpp itself
        (a ``vocab_only`` model load without a context: metadata and
        vocabulary, no weights, ~0.1 s;
        the ``gguf`` package's reader takes seconds on a 49k-token vocab).

        ``min`` = weights + KV cache at the configured context + compute
        estimate; ``max`` = the same at the model's trained context. KV: K
        and V, f16, ``n_layer * n_head_kv * head_dim`` per token. Compute:
        ``4 * n_ubatch * (4 * n_embd + 2 * n_ff + n_head * n_ctx)`` bytes,
        llama.cpp's CPU graph buffers to within tens of MiB for small models;
        the ``effective`` figure a ready instance reports calibrates it.
        With ``--n-gpu-layers`` and a GPU, the offloaded share of weights and
        KV is put on ``gpu0``. Bytes per device key.
        """
        import llama_cpp
        from llama_cpp._internals import LlamaModel

        weights = sum(os.path.getsize(p) for p in model_parts(self.path))
        # the model alone, no context: a context on a vocab-only model warns
        # "n_ctx_seq (512) > n_ctx_train (0)" at every start (issue 15)
        params = llama_cpp.llama_model_default_params()
        params.vocab_only = True
        model = LlamaModel(path_model=self.path, params=params, verbose=False)
        try:
            md = model.metadata()
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
        n_ctx_train = int(num("context_length", self.args.ctx_size)) or self.args.ctx_size
        n_ubatch = 512

        def need(n_ctx: int) -> int:
            kv = 2 * n_layer * n_ctx * n_head_kv * head_dim * 2
            compute = 4 * n_ubatch * (4 * n_embd + 2 * n_ff + n_head * n_ctx)
            return weights + kv + compute

        ctx = self.args.ctx_size or n_ctx_train
        lo, hi = need(ctx), need(max(ctx, n_ctx_train))
        ngl = self.args.n_gpu_layers
        if ngl and _gpu_count() > 0:
            frac = 1.0 if ngl < 0 else min(1.0, ngl / max(1, n_layer))
            return {
                "min": {"host": int(lo * (1 - frac)) + 64 << 20, "gpu0": int(lo * frac)},
                "max": {"host": int(hi * (1 - frac)) + 64 << 20, "gpu0": int(hi * frac)},
                "n_ctx_train": n_ctx_train,
            }
        return {"min": {"host": lo}, "max": {"host": hi}, "n_ctx_train": n_ctx_train}

    def load(self) -> dict:
        from llama_cpp import Llama

        kw = {
            "model_path": self.path,
            "n_ctx": self.args.ctx_size,
            "n_gpu_layers": self.args.n_gpu_layers,
            "verbose": False,
        }
        if self.args.threads:
            kw["n_threads"] = self.args.threads
        kw.update(llama_kwargs(getattr(self.args, "llama_args", []) or []))
        self.llm = Llama(**kw)
        self._chat_keys = _accepted(self.llm.create_chat_completion) - {"self"}
        self._comp_keys = _accepted(self.llm.create_completion) - {"self"}
        return {"n_ctx": self.llm.n_ctx()}

    def sleep(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        import gc

        gc.collect()

    # request keys never passed through: they take Python objects there
    # (logits_processor, stopping_criteria, grammar), or the backend handles
    # them itself (the rest)
    _OWN_KEYS = frozenset(("logits_processor", "stopping_criteria", "grammar", "logit_bias",
                           "response_format", "tools", "tool_choice", "functions",
                           "function_call", "prompt", "messages", "model"))

    def _kwargs(self, body: dict, keys: frozenset[str], cancel: threading.Event,
                constrained: bool = False) -> dict:
        """llama-cpp-python keywords for a chat or completion ``body``,
        checked: its sampling fields, the request's grammar (parsed by
        llama.cpp itself too), its ``logit_bias`` and the cancellation hook
        as one logits processor (llama-cpp-python drops a processor list
        when it is also given ``logit_bias``: ``list.extend`` returns None).
        ``constrained``: llama-cpp-python adds a grammar of its own (a
        forced tool call)."""
        import numpy as np
        from llama_cpp import LlamaGrammar, LogitsProcessorList

        check_sampling(body)
        kw = {k: v for k, v in body.items() if k in keys and k not in self._OWN_KEYS
              and v is not None}
        if kw.get("logprobs"):
            # the context keeps only the last token's logits (logits_all=False):
            # llama-cpp-python refuses them for completions, ignores them for chat
            raise BadRequest("'logprobs' is not supported by the llama-cpp-python instance",
                             "logprobs")
        kw.pop("logprobs", None)
        if "max_tokens" not in kw and isinstance(body.get("max_completion_tokens"), int):
            kw["max_tokens"] = body["max_completion_tokens"]
        kw["model"] = body.get("model") if isinstance(body.get("model"), str) else self.name
        gbnf = structured_output(body, self.limits)
        if gbnf is not None:
            self._check_grammar(gbnf)
            kw["grammar"] = LlamaGrammar.from_string(gbnf, verbose=False)
        bias = logit_bias(body, self.llm.n_vocab())
        ids = np.fromiter(bias, dtype=np.intc) if bias else None
        add = np.fromiter(bias.values(), dtype=np.single) if bias else None
        eos = self.llm.token_eos()
        constrained = constrained or gbnf is not None

        def process(_ids, scores):
            # runs before every token, first in llama.cpp's sampler chain
            # (so index = token id)
            if ids is not None:
                scores[ids] += add
            if cancel.is_set():
                # the client went away: end the generation at once
                # (create_chat_completion takes no stopping_criteria). Under
                # a grammar only raise end-of-sequence: if every token the
                # grammar allows were -inf, llama.cpp would abort
                # ("Unexpected empty grammar stack")
                if constrained:
                    scores[eos] = scores.max() + 100.0
                else:
                    scores[:] = -float("inf")
                    scores[eos] = 0.0
            return scores

        kw["logits_processor"] = LogitsProcessorList([process])
        return kw

    def _check_grammar(self, gbnf: str) -> None:
        """Let llama.cpp parse ``gbnf`` once: what it refuses (left
        recursion, too many repeated rules) would otherwise reach the
        sampler as a NULL grammar."""
        import llama_cpp

        sampler = llama_cpp.llama_sampler_init_grammar(self.llm._model.vocab, gbnf.encode(),
                                                       b"root")
        if not sampler:
            raise BadRequest("the request's grammar was refused by llama.cpp (left recursion, "
                             "or too many repeated rules)", "grammar")
        llama_cpp.llama_sampler_free(sampler)

    def chat(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        from jinja2 import TemplateError

        messages = chat_messages(body.get("messages"))
        tool = forced_tool(body, self.limits)
        if tool is not None and structured_output(body, self.limits) is not None:
            raise BadRequest("a forced tool call cannot be combined with a grammar or JSON "
                             "schema", "tool_choice")
        kw = self._kwargs(body, self._chat_keys, cancel, constrained=tool is not None)
        if tool is not None:
            kw["tools"] = [{"type": "function", "function": tool}]
            kw["tool_choice"] = {"type": "function", "function": {"name": tool["name"]}}
        try:
            return self.llm.create_chat_completion(messages=messages, **kw)
        except TemplateError as e:
            raise BadRequest(f"messages: the model's chat template refused them: {e}",
                             "messages") from None

    def completion(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        prompt = completion_prompt(body, self.llm.n_vocab())
        kw = self._kwargs(body, self._comp_keys, cancel)
        return self.llm.create_completion(prompt=prompt, **kw)

    def tokenize(self, body: dict) -> dict:
        content, add_special, with_pieces = tokenize_request(body)
        tokens = self.llm.tokenize(content.encode(), add_bos=add_special, special=True)
        if not with_pieces:
            return {"tokens": tokens}
        out = []
        for t in tokens:
            raw = self.llm.detokenize([t])
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama.cpp: the bytes of a partial character
            out.append({"id": t, "piece": piece})
        return {"tokens": out}

    def detokenize(self, body: dict) -> dict:
        tokens = token_ids(body.get("tokens"), self.llm.n_vocab(), "tokens")
        return {"content": self.llm.detokenize(tokens).decode("utf-8", "replace")}

    def props(self) -> dict:
        llm = self.llm
        return {
            "model_alias": self.name,
            "model_path": self.path,
            "n_ctx": llm.n_ctx() if llm is not None else self.args.ctx_size,
            "total_slots": 1,
            "chat_template": (llm.metadata.get("tokenizer.chat_template", "") if llm else ""),
        }

    def embedding(self, body: dict, cancel: threading.Event | None = None) -> dict:
        """OpenAI embeddings: one vector per input (a string or token ids),
        the mean of the model's per-token output vectors, L2-normalised, for
        a generation model (no pooling), or the model's pooled vector.

        All inputs are checked (count, token ids, length: ``ctx-size``
        tokens, or one micro-batch for a pooling model, unless ``truncate``)
        before any is computed; between inputs the work stops once
        ``cancel`` is set (the client left), returning what was computed.
        """
        import llama_cpp
        import numpy as np

        llm = self.llm
        inputs = embedding_inputs(body, llm.n_vocab(), self.limits)
        truncate = bool(body.get("truncate"))
        pooled = llm.pooling_type() not in (llama_cpp.LLAMA_POOLING_TYPE_NONE,
                                            llama_cpp.LLAMA_POOLING_TYPE_UNSPECIFIED)
        # a pooling (non-causal) model must see an input in one micro-batch
        n_max = min(llm.n_ctx(), llm.context_params.n_ubatch) if pooled else llm.n_ctx()
        batch = []
        for i, x in enumerate(inputs):
            tokens = llm.tokenize(x.encode("utf-8")) if isinstance(x, str) else x
            field = "input" if len(inputs) == 1 else f"input[{i}]"
            batch.append(fit_embedding_input(tokens, n_max, truncate, field))
        n_embd, n_batch = llm.n_embd(), llm.n_batch
        ctx = llm._ctx
        # A generation context can embed too: switch it to embedding output
        # for this call (llama_set_embeddings) instead of holding a second
        # copy of the model loaded with embedding=True.
        llm.context_params.embeddings = True
        llama_cpp.llama_set_embeddings(ctx.ctx, True)
        vectors, used = [], 0
        try:
            for tokens in batch:
                if cancel is not None and cancel.is_set():
                    break
                ctx.kv_cache_clear()
                if pooled:
                    llm._batch.set_batch(tokens, n_past=0, logits_all=True)
                    ctx.decode(llm._batch)
                    vec = np.array(llama_cpp.llama_get_embeddings_seq(ctx.ctx, 0)[:n_embd],
                                   dtype=np.float64)
                else:
                    vec = np.zeros(n_embd, dtype=np.float64)
                    for off in range(0, len(tokens), n_batch):
                        chunk = tokens[off:off + n_batch]
                        llm._batch.set_batch(chunk, n_past=off, logits_all=True)
                        ctx.decode(llm._batch)
                        rows = np.ctypeslib.as_array(llama_cpp.llama_get_embeddings(ctx.ctx),
                                                     shape=(len(chunk), n_embd))
                        vec += rows.sum(axis=0)
                    vec /= len(tokens)
                norm = float(np.sqrt(vec @ vec)) or 1.0
                vectors.append(vec / norm)
                used += len(tokens)
        finally:
            llm.context_params.embeddings = False
            llama_cpp.llama_set_embeddings(ctx.ctx, False)
            ctx.kv_cache_clear()
            llm.reset()
        b64 = body.get("encoding_format") == "base64"
        data = [{"object": "embedding", "index": i,
                 "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode() if b64
                 else v.tolist()} for i, v in enumerate(vectors)]
        return {"object": "list", "data": data,
                "model": body.get("model") if isinstance(body.get("model"), str) else self.name,
                "usage": {"prompt_tokens": used, "total_tokens": used}}
