"""A Hugging Face tokenizer folder made from a GGUF file's vocabulary, for
benchmark clients that count tokens with ``transformers`` (aiperf's
``--tokenizer``); nothing is downloaded.

``python bench/gguf_tokenizer.py MODEL.gguf OUT_DIR`` (needs the ``gguf``
and ``tokenizers`` packages: ``pip install gguf tokenizers``, aiperf brings
both) writes ``tokenizer.json`` and ``tokenizer_config.json``.

Only byte-level BPE vocabularies (``tokenizer.ggml.model`` ``gpt2``: SmolLM,
Qwen, Llama 3, ...) are made: the tokens and merges as the GGUF holds them,
control tokens (type 3) as special tokens, and the pre-tokenizer llama.cpp
uses for ``tokenizer.ggml.pre`` (``src/llama-vocab.cpp``): ``smollm``
splits digits one by one before GPT-2's regex; the rest get GPT-2's. The
result is checked against llama.cpp's own tokenizer by
``bench/aiperf_check.py`` before a run (the ids of a sample text must
match).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def build(gguf_path: str | Path, out: str | Path) -> Path:
    """Write the tokenizer folder ``out`` for ``gguf_path``; returns ``out``.
    Raises ValueError for a vocabulary that is not byte-level BPE."""
    import gguf
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    r = gguf.GGUFReader(str(gguf_path))
    kind = _field(r, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{gguf_path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE "
                         "('gpt2') is made here")
    tokens = _field(r, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
    types = _field(r, "tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                               fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if _field(r, "tokenizer.ggml.pre") == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types, strict=True) if ty == CONTROL])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))

    def name(key: str) -> str | None:
        i = _field(r, key)
        return tokens[i] if isinstance(i, int) and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(_field(r, f"{_field(r, 'general.architecture')}"
                                             ".context_length") or 8192),
              "bos_token": name("tokenizer.ggml.bos_token_id"),
              "eos_token": name("tokenizer.ggml.eos_token_id"),
              "unk_token": name("tokenizer.ggml.unknown_token_id"),
              "pad_token": name("tokenizer.ggml.padding_token_id")}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.split("\n\n")[1])
    print(build(sys.argv[1], sys.argv[2]))
