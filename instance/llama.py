"""The built-in instance backend: llama-cpp-python on one GGUF file."""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Iterator

from .server import Backend, BadRequest

log = logging.getLogger(__name__)


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
        size = os.path.getsize(self.path)
        return {"min": {"host": size}, "max": {"host": size}}

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
        self.llm = Llama(**kw)
        self._chat_keys = _accepted(self.llm.create_chat_completion) - {"self"}
        self._comp_keys = _accepted(self.llm.create_completion) - {"self"}
        return {"n_ctx": self.llm.n_ctx()}

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
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            raise BadRequest("'messages' must be a non-empty list")
        return self.llm.create_chat_completion(**self._kwargs(body, self._chat_keys, cancel))

    def completion(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required")
        return self.llm.create_completion(**self._kwargs(body, self._comp_keys, cancel))

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
