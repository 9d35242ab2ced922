"""The prompt forms of llama.cpp's ``/completion``.

As llama-server's ``tokenize_input_prompts`` (``tools/server/server-common.cpp``):
``prompt`` is a string; a list of token ids; a list mixing token ids and
strings (one prompt: the strings tokenized in place, special tokens added
only when the first item is a string); an object ``{"prompt_string": ...}``
(with ``multimodal_data``, base64 media for the markers in its text:
:class:`MediaPrompt`, tokenized by the projector); or a list of those,
several prompts answered as a list of answers.
"""

from __future__ import annotations

from collections.abc import Callable

from .validate import BadRequest, is_int, shown, token_ids

Tokenize = Callable[[str, bool], list[int]]
"""``tokenize(text, add_special)`` with special tokens parsed (the engine's)."""
MediaTokenize = Callable[[dict, str], "MediaPrompt"]
"""``media(prompt_object, field)``: a ``{"prompt_string", "multimodal_data"}``
object as a :class:`MediaPrompt` (the backend's projector)."""


class MediaPrompt(list):
    """A prompt's ids (a list) with ``media``: its media spans
    (:class:`~ggmux.instance.media.spans.MediaSpan`)."""

    media: tuple = ()


def _mixed(items: list, tokenize: Tokenize, n_vocab: int, field: str) -> list[int]:
    out: list[int] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out += tokenize(p, i == 0)
        else:
            out += token_ids([p], n_vocab, f"{field}[{i}]")
    return out


def _one(p, tokenize: Tokenize, n_vocab: int, field: str,
         media: MediaTokenize | None = None) -> list[int]:
    if isinstance(p, str):
        return tokenize(p, True)
    if isinstance(p, list) and p and all(is_int(t) or isinstance(t, str) for t in p):
        if all(is_int(t) for t in p):
            return token_ids(p, n_vocab, field)
        return _mixed(p, tokenize, n_vocab, field)
    if isinstance(p, dict) and "prompt_string" in p:
        if "multimodal_data" in p:
            if media is None:
                raise BadRequest("Multimodal data provided, but model does not support "
                                 "multimodal requests.", f"{field}.multimodal_data")
            return media(p, field)
        s = p["prompt_string"]
        if isinstance(s, str):
            return tokenize(s, True)
        if isinstance(s, list) and s and all(is_int(t) or isinstance(t, str) for t in s):
            return _mixed(s, tokenize, n_vocab, f"{field}.prompt_string")
        raise BadRequest(f"'{field}.prompt_string' must be a string or a list of token ids and "
                         f"strings, not {shown(s)}", f"{field}.prompt_string")
    raise BadRequest(f"'{field}' elements must be a string, a list of tokens, a JSON object "
                     "containing a prompt string, or a list of mixed strings & tokens, not "
                     f"{shown(p)}", field)


def native_prompts(prompt, tokenize: Tokenize, n_vocab: int,
                   media: MediaTokenize | None = None) -> list[list[int]]:
    """The prompts (token ids) of a ``/completion`` ``prompt`` (see the
    module docstring); ``media``: the projector's tokenizer, None for a
    model without one. Raises :class:`BadRequest`."""
    if isinstance(prompt, list) and prompt and not any(is_int(t) for t in prompt):
        return [_one(p, tokenize, n_vocab, f"prompt[{i}]", media) for i, p in enumerate(prompt)]
    if isinstance(prompt, list) and not prompt:
        raise BadRequest("\"prompt\" must not be empty", "prompt")
    return [_one(prompt, tokenize, n_vocab, "prompt", media)]


class Batch:
    """Several prompts of one ``/completion``, each a job of its own
    (``start(prompt, sink)`` submits one and returns it); their answers go
    to ``sink`` as one ``("result", [answer, ...])`` in prompt order (each
    ``index`` its place), or the first ``("error", ...)``, the other jobs
    then cancelled. :meth:`cancel` ends them all (the client left)."""

    def __init__(self, prompts: list[list[int]], sink, start) -> None:
        import threading

        self._lock = threading.Lock()
        self._sink = sink
        self._results: list[dict | None] = [None] * len(prompts)
        self._left = len(prompts)
        self._failed = False
        self.jobs: list = []
        try:
            for i, p in enumerate(prompts):
                self.jobs.append(start(p, self._one(i)))
        except BaseException:
            self.cancel()
            raise

    def _one(self, i: int):
        def sink(kind: str, payload) -> None:
            with self._lock:
                if self._failed:
                    return
                if kind == "result":
                    payload["index"] = i
                    self._results[i] = payload
                    self._left -= 1
                    if self._left:
                        return
                elif kind == "error":
                    self._failed = True
                else:
                    return
            if kind == "error":
                self.cancel()
                self._sink("error", payload)
            else:
                self._sink("result", self._results)
        return sink

    def cancel(self) -> None:
        for job in self.jobs:
            job.cancel()


def _embedding_one(x, tokenize: Tokenize, n_vocab: int, field: str):
    if isinstance(x, dict):
        if "prompt_string" in x:
            return _one(x, tokenize, n_vocab, field)
        parts = x.get("content")
        if not isinstance(parts, list) or not parts:
            raise BadRequest(f"'{field}.content' must be a non-empty list of text parts, not "
                             f"{shown(parts)}", f"{field}.content")
        texts = []
        for j, p in enumerate(parts):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(
                    p.get("text"), str):
                kind = p.get("type") if isinstance(p, dict) else None
                raise BadRequest(f"'{field}.content[{j}]': this model takes text parts only, "
                                 f"not {shown(kind if kind is not None else p)}",
                                 f"{field}.content[{j}]")
            texts.append(p["text"])
        return "".join(texts)
    if isinstance(x, list) and x and any(isinstance(t, str) for t in x) and any(
            is_int(t) for t in x) and all(is_int(t) or isinstance(t, str) for t in x):
        return _mixed(x, tokenize, n_vocab, field)
    return x


def embedding_forms(inp, tokenize: Tokenize, n_vocab: int):
    """An embeddings ``input`` with llama-server's forms beside OpenAI's
    (``tokenize_input_prompts``, and ``{"content": [text parts]}`` whose
    texts are joined): objects become strings, mixed lists token ids; what
    is left is checked by :func:`~ggmux.instance.validate.embedding_inputs`.
    Raises :class:`BadRequest`."""
    if isinstance(inp, dict):
        return _embedding_one(inp, tokenize, n_vocab, "input")
    if isinstance(inp, list) and inp and any(is_int(t) for t in inp):
        return _embedding_one(inp, tokenize, n_vocab, "input")
    if isinstance(inp, list):
        return [_embedding_one(x, tokenize, n_vocab, f"input[{i}]") for i, x in enumerate(inp)]
    return inp
