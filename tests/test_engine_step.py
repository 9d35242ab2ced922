"""The engine's decode step without per-token Python (issue 21, item 4), on
the real smollm2-135m GGUF: a step hands every request's events on in one
batch, and the batched greedy draw picks what ``llama_sampler_sample`` picks.
"""

from __future__ import annotations

import numpy as np
import pytest
from ggmux.instance.engine import Engine, EngineConfig, Generation, Sampling
from ggmux.instance.engine.batch import Batch
from ggmux.instance.engine.jobs import deliver
from ggmux.instance.engine.sampling import greedy_tokens, sampler_chain
from test_engine import QUESTIONS, chat, smollm2_path


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(smollm2_path(), ctx_size=256, parallel=4, n_threads=1))
    e.load()
    yield e
    e.close()


def test_a_step_hands_every_requests_events_on_in_one_batch(engine):
    """Four greedy streams of 8 tokens: the deliver hook gets at most one
    batch per decode, one batch holds a token of every stream, and every
    request's events arrive in order through it (text..., end, done)."""
    batches: list[list] = []

    def hand_off(batch):
        batches.append(batch)
        deliver(batch)

    engine.deliver = hand_off
    try:
        decodes = engine.metrics()["decode_calls_total"]
        jobs = [engine.submit(Generation(engine.tokenize(chat(q)), Sampling(temperature=0),
                                         max_tokens=8, ignore_eos=True)) for q in QUESTIONS]
        results = [j.result(120) for j in jobs]
    finally:
        engine.deliver = None
    decodes = engine.metrics()["decode_calls_total"] - decodes
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)
    assert len(batches) <= decodes
    assert any(len({j.id for j, ev in b if ev[0] == "text"}) == 4 for b in batches)
    for job in jobs:
        kinds = [ev[0] for b in batches for j, ev in b if j is job]
        assert kinds[-2:] == ["end", "done"] and set(kinds[:-2]) == {"text"}


def test_the_batched_greedy_draw_picks_what_llama_sampler_sample_picks(engine):
    """sampling.greedy_tokens against llama.cpp's own greedy chain on real
    logits of four sequences, with no bias, biases that lower tokens (the
    raw argmax among them), and one that raises a token; also with the
    outputs in another order than the batch's."""
    e = Engine(EngineConfig(smollm2_path(), ctx_size=64, parallel=4, n_threads=1))
    e.m.load()
    try:
        L, m = e.L, e.m
        b = Batch(L, 64, 4)
        rng = np.random.default_rng(7)
        for _ in range(3):
            b.clear()
            outs = []
            for seq in range(4):
                L.llama_memory_seq_rm(m.mem, seq, -1, -1)
                outs.append(b.add_run([int(t) for t in rng.integers(100, 20000, 10)], 0, seq))
            assert L.llama_decode(m.ctx, b.ready()) == 0
            first = greedy_tokens(L, m.ctx, outs[:1], [sampler_chain(
                L, m.vocab, m.n_vocab, Sampling(temperature=0), 1).greedy], m.n_vocab)[0]
            for bias in ({}, {0: -100.0, 2: -100.0}, {first: -3.0}, {5: 100.0}):
                chains = [sampler_chain(L, m.vocab, m.n_vocab,
                                        Sampling(temperature=0, logit_bias=bias), 1)
                          for _ in outs]
                assert all(c.greedy is not None for c in chains)
                fast = greedy_tokens(L, m.ctx, outs, [c.greedy for c in chains], m.n_vocab)
                backwards = greedy_tokens(L, m.ctx, outs[::-1],
                                          [c.greedy for c in chains[::-1]], m.n_vocab)
                slow = [c.sample(m.ctx, i) for c, i in zip(chains, outs, strict=True)]
                assert fast == slow == backwards[::-1], bias
                for c in chains:
                    c.free()
    finally:
        e.m.free()


def test_a_chain_with_state_or_chance_is_not_drawn_greedily(engine):
    """Penalties count accepted tokens and a temperature draws at random:
    those chains keep llama_sampler_sample."""
    L, m = engine.L, engine.m
    for s in (Sampling(temperature=0, repeat_penalty=1.1), Sampling(temperature=0.8),
              Sampling(temperature=0, presence_penalty=0.5)):
        c = sampler_chain(L, m.vocab, m.n_vocab, s, 1)
        try:
            assert c.greedy is None
        finally:
            c.free()


def test_a_request_with_penalties_is_served(engine):
    """OpenAI's presence and frequency penalties and llama-server's
    repeat_penalty build llama.cpp's penalties sampler (its signature takes
    n_vocab first: with it missing every such request failed with a
    TypeError, a 500)."""
    r = engine.submit(Generation(engine.tokenize(chat("List three fruits.")),
                                 Sampling(temperature=0, repeat_penalty=1.3,
                                          presence_penalty=0.5, frequency_penalty=0.5),
                                 max_tokens=6)).result(120)
    assert r["choices"][0]["text"]
