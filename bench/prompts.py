"""Synthetic prompts of the serving benchmark, by words or by tokens.

A prompt is a random number, a fixed instruction and words drawn from a
small fixed vocabulary, all from the run's seed: equal seeds give equal
prompts, so every target of a comparison gets the same input. The leading
number makes every prompt of a run different, so a server's prompt cache
(llama.cpp's ``--cache-ram``, a slot's cached prompt) cannot answer a
repeated prompt, while the chat template's fixed prefix can still be
reused, as in real traffic.

By tokens (:func:`sized_prompt`): the prompt text holds exactly the number
of tokens asked for, as a tokenizer counts them, so ``prompt_tokens = 100``
means the same 100-token input for every target serving one model. The
count is of the text alone, without the chat template's tokens (the
``usage.prompt_tokens`` a server reports adds those). Tokenizers
(:func:`make_counter`):

* ``server``: the target's own ``POST /tokenize`` (llama.cpp's shape,
  ``{"content": text, "add_special": false}`` -> ``{"tokens": [...]}``;
  ``llama-server``, ggmux and its built-in instance answer it);
* a GGUF file: llama-cpp-python's tokenizer of that file, loaded with
  ``vocab_only=True`` (no weights), for targets without ``/tokenize``.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

WORDS = (
    "river", "mountain", "lantern", "copper", "garden", "whisper", "harbor", "meadow", "signal",
    "orbit", "candle", "forest", "marble", "thunder", "velvet", "compass", "island", "ember",
    "glacier", "puzzle", "falcon", "quartz", "harvest", "beacon", "canyon", "silver", "meadow",
    "rocket", "shadow", "willow", "anchor", "bridge", "cobalt", "desert", "engine", "feather",
    "galaxy", "hollow", "ivory", "jungle", "kettle", "ladder", "mirror", "nickel", "oyster",
    "pepper", "quiver", "ribbon", "saddle", "timber",
)
"""The vocabulary; words tokenize to about 1.3 tokens each on common tokenizers."""

INSTRUCTION = "Write a long story that uses these words:"

TokenCounter = Callable[[str, str], int]
"""``counter(model, text)``: the number of tokens of ``text`` for ``model``."""


def make_prompt(rng: random.Random, words: int) -> str:
    """A prompt of ``words`` vocabulary words after the number and the instruction."""
    body = " ".join(rng.choice(WORDS) for _ in range(words))
    return f"{rng.randrange(10**6)}. {INSTRUCTION} {body}"


def sized_prompt(
    rng: random.Random, tokens: int, model: str, counter: TokenCounter
) -> tuple[str, int]:
    """A prompt of exactly ``tokens`` tokens of ``model`` (by ``counter``), and that count.

    Draws the same values from ``rng`` whatever the tokenizer (a number,
    ``tokens`` words, an offset), so the prompts of a plan depend only on
    the seed. The words go in while the count stays within ``tokens``
    (binary search over how many, on the assumption that a word more never
    makes fewer tokens); the remaining gap, if any, is filled by trying
    vocabulary words one by one. When no word fits (the number and the
    instruction alone are over ``tokens``, or every word is longer than the
    gap) the count returned is below or above ``tokens``: callers report it.

    Raises ``ValueError`` when ``tokens`` < 1; the counter's own errors
    (``OSError`` from a server) pass through.
    """
    if tokens < 1:
        raise ValueError(f"prompt tokens must be at least 1, not {tokens}")
    head = f"{rng.randrange(10**6)}. {INSTRUCTION}"
    words = [rng.choice(WORDS) for _ in range(tokens)]  # each word is >= 1 token
    offset = rng.randrange(len(WORDS))

    def text(k: int) -> str:
        return " ".join([head, *words[:k]])

    low, high = 0, len(words)  # count(text(low)) <= tokens is assumed, then checked
    while low < high:
        mid = (low + high + 1) // 2
        if counter(model, text(mid)) <= tokens:
            low = mid
        else:
            high = mid - 1
    prompt = text(low)
    count = counter(model, prompt)
    candidates = WORDS[offset:] + WORDS[:offset]
    while count < tokens:
        for word in candidates:
            longer = f"{prompt} {word}"
            n = counter(model, longer)
            if n <= tokens:
                prompt, count = longer, n
                break
        else:
            break  # no word fits the gap
    return prompt, count


def server_counter(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> TokenCounter:
    """A counter asking ``POST base_url/tokenize`` (llama.cpp's shape, ``model`` in the body).

    Raises ``OSError`` when the server cannot be reached and ``ValueError``
    when it answers other than 200 with a ``tokens`` list (a target without
    ``/tokenize``: give a GGUF tokenizer instead).
    """
    url = urlsplit(base_url)
    prefix = url.path.rstrip("/").removesuffix("/v1")
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    conn: list[http.client.HTTPConnection] = []

    def count(model: str, text: str) -> int:
        if not conn:
            conn.append(http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout))
        body = json.dumps({"model": model, "content": text, "add_special": False})
        try:
            conn[0].request("POST", prefix + "/tokenize", body=body, headers=headers)
            resp = conn[0].getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException):
            conn.clear()  # a fresh connection next time
            raise
        n = _token_count(raw) if resp.status == 200 else None
        if n is None:
            raise ValueError(
                f"POST {prefix}/tokenize answered {resp.status}: {raw[:200]!r} "
                "(give a GGUF file as the tokenizer)"
            )
        return n

    return count


def _token_count(raw: bytes) -> int | None:
    """Length of the ``tokens`` list of a ``/tokenize`` answer, None if it has none."""
    try:
        tokens = json.loads(raw).get("tokens")
    except (ValueError, AttributeError):
        return None
    return len(tokens) if isinstance(tokens, list) else None


@functools.lru_cache(maxsize=4)
def gguf_vocabulary(path: str) -> Any:
    """llama-cpp-python's ``Llama`` of the GGUF file ``path`` with its vocabulary only.

    Cached (a run per concurrency level and target would load it again
    each time). Raises ``ImportError`` without llama-cpp-python and
    ``ValueError`` when the file does not load.
    """
    from llama_cpp import Llama

    return Llama(model_path=path, vocab_only=True, verbose=False)


def gguf_counter(path: str | Path) -> TokenCounter:
    """A counter with llama-cpp-python's tokenizer of the GGUF file ``path`` (vocabulary only).

    The model name is ignored: one file, one tokenizer. Text is tokenized
    without BOS and with special tokens read as text, as ``/tokenize`` with
    ``add_special: false`` does. Raises ``ImportError`` without
    llama-cpp-python and ``ValueError`` when the file does not load.
    """
    llm = gguf_vocabulary(str(path))

    def count(_model: str, text: str) -> int:
        return len(llm.tokenize(text.encode(), add_bos=False, special=False))

    return count


def make_counter(tokenizer: str, base_url: str, api_key: str | None = None) -> TokenCounter:
    """The counter a ``tokenizer`` option names: ``server`` or the path of a GGUF file."""
    if tokenizer == "server":
        return server_counter(base_url, api_key)
    return gguf_counter(tokenizer)
