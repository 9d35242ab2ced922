"""The engine's vocabulary calls for the HTTP side (any thread): tokenize,
count, detokenize, a token's text, the special tokens. Each takes the
model lock shared (a long text never holds a ``submit``, issue 37 item 1)
and raises EngineAsleep while the weights are freed. Mixed into
:class:`~ggmux.instance.engine.Engine`."""

from __future__ import annotations

import codecs

from .jobs import RAISE_CTX, ContextExceeded
from .tokenizing import TooManyTokens

DECODE_SLICE = 1 << 20  # bytes of /detokenize's text decoded per call (a few ms)


class TokenCalls:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses ``m`` (the
    model context), ``L``, ``n_ctx``, ``_model_lock`` and ``_check_loaded``."""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (``add_special``: the model's BOS/EOS rule;
        ``parse_special``: ``<|im_start|>`` and the like become their
        tokens). Any thread, beside any other reader (the lock is shared:
        a long text never holds a ``submit``). Raises EngineAsleep while
        asleep."""
        with self._model_lock.shared():
            self._check_loaded()
            return self.m.tokenize(text.encode("utf-8"), add_special, parse_special)

    def tokenize_prompt(self, text: str | bytes, add_special: bool = True,
                        parse_special: bool = True) -> list[int]:
        """:meth:`tokenize` for a prompt, which must be shorter than ``n_ctx``:
        a longer one raises ContextExceeded as soon as that is known (by its
        size, or a few pieces in: :mod:`.tokenizing`; issue 37, item 1)."""
        raw = text.encode("utf-8") if isinstance(text, str) else text
        with self._model_lock.shared():
            self._check_loaded()
            try:
                return self.m.tokenize(raw, add_special, parse_special, self.n_ctx - 1)
            except TooManyTokens as e:
                raise ContextExceeded(
                    f"the request exceeds the available context size: the prompt has at least "
                    f"{e.at_least} tokens; this model's context (ctx-size) is {self.n_ctx} "
                    f"tokens per request; {RAISE_CTX}", e.at_least, self.n_ctx) from None

    def count_tokens(self, text: str, add_special: bool = True,
                     parse_special: bool = True) -> int:
        """How many tokens ``text`` is (as :meth:`tokenize`, listing none).
        Any thread. Raises EngineAsleep while asleep."""
        with self._model_lock.shared():
            self._check_loaded()
            return self.m.count(text.encode("utf-8"), add_special, parse_special)

    def detokenize(self, tokens: list[int], special: bool = True) -> str:
        """Text of ``tokens``; InvalidRequest names an id outside the
        vocabulary. Megabytes of it are decoded a slice at a time (one
        ``decode`` of 10 MB holds the GIL 60 ms; issue 31, item 1)."""
        with self._model_lock.shared():
            self._check_loaded()
            self.m.check_tokens(tokens, "tokens")
            raw = self.m.pieces(tokens, special)
        if len(raw) <= DECODE_SLICE:
            return raw.decode("utf-8", "replace")
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        parts = []
        for i in range(0, len(raw), DECODE_SLICE):
            parts.append(dec.decode(raw[i:i + DECODE_SLICE]))
        parts.append(dec.decode(b"", final=True))
        return "".join(parts)

    def token_text(self, token: int) -> str:
        """The vocabulary's text of one token (``<|im_end|>``), '' for -1."""
        with self._model_lock.shared():
            self._check_loaded()
            return self.m.token_text(token)

    def special_tokens(self) -> dict[str, int]:
        """``{"bos", "eos"}`` token ids (-1 where the model has none)."""
        with self._model_lock.shared():
            self._check_loaded()
            return {"bos": self.L.llama_vocab_bos(self.m.vocab),
                    "eos": self.L.llama_vocab_eos(self.m.vocab)}

    @property
    def n_vocab(self) -> int:
        return self.m.n_vocab


__all__ = ["DECODE_SLICE", "TokenCalls"]
