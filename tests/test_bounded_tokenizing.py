"""Tokenizing with bounded work (issue 37, item 1), on the real smollm2-135m
GGUF: llama.cpp's special-token partition is quadratic in the special
tokens of a text, and the engine tokenized under the lock every ``submit``
takes, so one tenant's 1 MB chat of 30,000 tiny messages held every
tenant's requests for two minutes. Now a long text is tokenized in pieces
to the same ids, a prompt over the context is refused once that is known
(by its size, or a few pieces in), and tokenizing shares the model lock
with ``submit``. Asserts count bytes and order events, never times."""

from __future__ import annotations

import threading

import pytest
from ggmux.instance.engine.jobs import ContextExceeded
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
from ggmux.instance.engine.tokenizing import PIECE_BYTES
from test_engine import smollm2_path

CTX = 2048


def chat_of(n: int) -> str:
    """``n`` tiny user turns in SmolLM2's ChatML, as its template renders them."""
    return "".join(f"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nok {i}<|im_end|>\n"
                   for i in range(n))


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(smollm2_path(), ctx_size=CTX, parallel=2, n_threads=1))
    e.load()
    yield e
    e.close()


@pytest.fixture
def calls(engine):
    """The bytes of every ``llama_tokenize`` call while a test runs."""
    tok = engine.m.tokenizer
    plain, seen = tok.call, []

    def call(raw, add_special, parse_special):
        seen.append(len(raw))
        return plain(raw, add_special, parse_special)

    tok.call = call
    yield seen
    tok.call = plain


def test_a_long_text_is_tokenized_in_pieces_to_the_same_ids(engine, calls):
    m = engine.m
    for text in (chat_of(2000), "<|im_end|>" * 20000, "x<|im_start|>  <|im_end|>\n" * 3000,
                 "plain words and no special token at all " * 2000):
        raw = text.encode()
        for parse_special in (True, False):
            for add_special in (True, False):
                calls.clear()
                assert m.tokenize(raw, add_special, parse_special) == m._tokenize_once(
                    raw, add_special, parse_special)
                if parse_special and "<|" in text:  # cut at special tokens: bounded calls
                    assert max(calls) <= PIECE_BYTES + 64, max(calls)
    assert m.count(("<|im_end|>" * 20000).encode(), True, True) == 20000


def test_a_chat_over_the_context_is_refused_after_reading_little_of_it(engine, calls):
    big = chat_of(30000)  # the 1 MB chat (124 s to its 400)
    with pytest.raises(ContextExceeded) as e:
        engine.tokenize_prompt(big)
    assert e.value.n_ctx == CTX and e.value.n_prompt_tokens >= CTX
    assert sum(calls) < 64 * 1024, sum(calls)  # of 1.2 MB
    calls.clear()
    with pytest.raises(ContextExceeded):  # far over: refused by its size, nothing tokenized
        engine.tokenize_prompt("no special tokens here " * 200000)
    assert calls == []
    ok = engine.tokenize_prompt(chat_of(20))
    assert ok == engine.tokenize(chat_of(20))


def test_tokenizing_never_holds_a_submit(engine):
    """A tokenization in progress (held open here) and another tenant's
    request: the request is served before the tokenization ends."""
    tok = engine.m.tokenizer
    plain = tok.call
    inside, release = threading.Event(), threading.Event()

    def slow(raw, add_special, parse_special):
        if len(raw) > 100:
            inside.set()
            assert release.wait(120)
        return plain(raw, add_special, parse_special)

    tok.call = slow
    order: list[str] = []
    t = threading.Thread(target=lambda: (engine.tokenize("<|im_end|>" * 200),
                                         order.append("tokenized")))
    t.start()
    try:
        assert inside.wait(60)
        served = []
        other = threading.Thread(target=lambda: served.append(engine.submit(Generation(
            engine.tokenize("<|im_start|>user\nhi"), Sampling(temperature=0), max_tokens=2,
            tenant="b")).result(120)))
        other.start()
        other.join(60)
        order.append("served" if served else "not served")
    finally:
        release.set()
        t.join(60)
        tok.call = plain
    assert order == ["served", "tokenized"], order
