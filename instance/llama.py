"""The built-in instance backend: llama-cpp-python on one GGUF file."""

from __future__ import annotations

import inspect
import logging
import os
import re
import threading
from collections.abc import Iterator

from .server import Backend, BadRequest

log = logging.getLogger(__name__)


_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
            "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
            "repeat_penalty": (0.0, 10.0), "typical_p": (0.0, 1.0)}
_INTEGERS = {"max_tokens": 0, "max_completion_tokens": 0, "top_k": 0, "seed": None,
             "top_logprobs": 0, "n": 1}


def check_sampling(body: dict) -> None:
    """Types and ranges of OpenAI sampling fields, as OpenAI checks them, so
    that a client mistake is a 400 naming the field (llama-cpp-python would
    fail inside ctypes with a 500). ``n`` must be 1: one generation at a
    time per instance. Raises :class:`BadRequest`."""
    for k, (lo, hi) in _NUMBERS.items():
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
            raise BadRequest(f"'{k}' must be a number from {lo:g} to {hi:g}")
    for k, lo in _INTEGERS.items():
        v = body.get(k)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            raise BadRequest(f"'{k}' must be an integer" + (f" >= {lo}" if lo else ""))
    if body.get("n", 1) != 1:
        raise BadRequest("'n' > 1 is not supported (one generation per request)")
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(x, str) for x in stop)
    ):
        raise BadRequest("'stop' must be a string or a list of strings")


def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages as llama-cpp-python's templates take them:
    content parts (``[{"type": "text", "text": ...}]``, what many clients
    send) are joined into one string. Raises :class:`BadRequest` for a
    malformed list, naming the message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                    raise BadRequest(f"messages[{i}].content: only text parts are supported")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content: a text part needs 'text'")
                texts.append(part["text"])
            msg = {**msg, "content": "".join(texts)}
        elif content is not None and not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts")
        out.append(msg)
    return out


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
        self.llm = None

    def measure(self) -> dict:
        """Memory a load needs, from GGUF metadata read by llama.cpp itself
        (a ``vocab_only`` load: metadata and vocabulary, no weights, ~0.1 s;
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
        from llama_cpp import Llama

        weights = sum(os.path.getsize(p) for p in model_parts(self.path))
        llm = Llama(model_path=self.path, vocab_only=True, verbose=False)
        md = llm.metadata
        del llm
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

    def _kwargs(self, body: dict, keys: frozenset[str], cancel: threading.Event) -> dict:
        kw = {k: v for k, v in body.items() if k in keys}
        if "max_tokens" not in kw and isinstance(body.get("max_completion_tokens"), int):
            kw["max_tokens"] = body["max_completion_tokens"]
        kw["model"] = body.get("model") or self.name
        from llama_cpp import LogitsProcessorList

        eos = self.llm.token_eos()

        def stop_if_cancelled(_ids, scores):
            # runs before every token: once the client went away, only
            # end-of-sequence can be sampled, so the generation ends at once
            # (create_chat_completion takes no stopping_criteria)
            if cancel.is_set():
                scores[:] = -float("inf")
                scores[eos] = 0.0
            return scores

        kw["logits_processor"] = LogitsProcessorList([stop_if_cancelled])
        return kw

    def chat(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        body = {**body, "messages": chat_messages(body.get("messages"))}
        check_sampling(body)
        return self.llm.create_chat_completion(**self._kwargs(body, self._chat_keys, cancel))

    def completion(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        prompt = body.get("prompt")
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)
        ):
            raise BadRequest("'prompt' must be a string (or a list of token ids)")
        check_sampling(body)
        return self.llm.create_completion(**self._kwargs(body, self._comp_keys, cancel))

    def tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string")
        add_special = bool(body.get("add_special", False))
        return {"tokens": self.llm.tokenize(content.encode(), add_bos=add_special, special=True)}

    def detokenize(self, body: dict) -> dict:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise BadRequest("'tokens' must be a list of integers")
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

    def embedding(self, body: dict) -> dict:
        import llama_cpp

        inp = body.get("input")
        if not isinstance(inp, (str, list)) or not inp:
            raise BadRequest("'input' must be a string or a non-empty list")
        llm = self.llm
        # A generation context can embed too: switch the context to embedding
        # output for this call (llama_set_embeddings) instead of holding a
        # second copy of the model loaded with embedding=True.
        ctx = llm._ctx.ctx
        llm.context_params.embeddings = True
        llama_cpp.llama_set_embeddings(ctx, True)
        try:
            out = llm.create_embedding(inp, model=body.get("model") or self.name)
        finally:
            llm.context_params.embeddings = False
            llama_cpp.llama_set_embeddings(ctx, False)
        # a generation context has no pooling: llama-cpp-python then returns one
        # vector per token; pool them (mean, then L2-normalise) into one
        for item in out["data"]:
            emb = item["embedding"]
            if emb and isinstance(emb[0], list):
                n = len(emb)
                mean = [sum(col) / n for col in zip(*emb)]
                norm = sum(x * x for x in mean) ** 0.5 or 1.0
                item["embedding"] = [x / norm for x in mean]
        return out
