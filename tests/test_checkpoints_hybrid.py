"""Context checkpoints of a hybrid model (issue 35, done-when 2 and 3): a
tiny random-weight LFM2 (short-convolution layers, whose state is
recurrent, and one attention layer; tests/hybrid_model.py) written at test
time. A recurrent state cannot be cut back at all, so a prompt that
changes anything before the cached end rolls back to a checkpoint or is
read whole: in the slot, from RAM, from disk on a new engine, and through
``ggmux serve`` after an unload and a reload, the restored state's greedy
draws and their log-probabilities are the cold prefill's to the last bit;
a checkpoint blob torn, of another model or over the byte bound is never
loaded and the request is answered by a prefill. One token per ubatch, as
tests/test_kv_tiers.py explains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import wait_for
from ggmux.instance.cache.checkpoint import pack, unpack
from ggmux.instance.cache.tiers import CacheSettings
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
from hybrid_model import make_lfm2

GREEDY = Sampling(temperature=0)
HISTORY = "The city's record: " + " ".join(f"In year {1500 + i} a bridge." for i in range(6))
A = HISTORY + " Q: the old one, please, now."
B = HISTORY + " Q: the new one, please, now."


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory) -> str:
    return make_lfm2(str(tmp_path_factory.mktemp("lfm2") / "lfm2-tiny.gguf"))


def engine(path: str, disk: str | None = None, ram_mib: int = 64, ctx_checkpoints: int = 32,
           checkpoint_min_step: int = 8192, **cache) -> Engine:
    e = Engine(EngineConfig(path, ctx_size=512, parallel=1, n_threads=1, n_ubatch=1,
                            ctx_checkpoints=ctx_checkpoints,
                            checkpoint_min_step=checkpoint_min_step,
                            cache=CacheSettings(ram_mib=ram_mib, disk_dir=disk, **cache)))
    e.load()
    return e


def hint(e: Engine) -> tuple[int]:
    return (len(e.tokenize(HISTORY)) - 2,)  # the last message's start (checkpoint_hints.py)


def ask(e: Engine, text: str, **kw) -> dict:
    r = e.submit(Generation(e.tokenize(text), GREEDY, max_tokens=6, logprobs=0,
                            checkpoint_at=hint(e), **kw)).result(300)
    u = r["usage"]["prompt_tokens_details"]
    return {"draws": [(x["id"], x["logprob"]) for x in r["choices"][0]["logprobs"]],
            "cached": u["cached_tokens"], "checkpoint": u.get("checkpoint_tokens", 0),
            "tier": r["timings"].get("cache_tier")}


@pytest.fixture(scope="module")
def cold(lfm2) -> dict:
    """B's draws from a cold prefill, read with the same batch cuts."""
    e = engine(lfm2, ram_mib=0)
    try:
        assert e.m.recurrent and e.checkpoints_wanted
        return ask(e, B, cache_prompt=False)
    finally:
        e.close()


def test_without_checkpoints_a_changed_last_message_reads_the_whole_prompt(lfm2, cold):
    e = engine(lfm2, ctx_checkpoints=0)
    try:
        ask(e, A)
        again = ask(e, B)
        assert again["cached"] == 0 and again["draws"] == cold["draws"]
    finally:
        e.close()


def test_a_changed_last_message_rolls_back_to_its_checkpoint_in_the_slot_ram_and_disk(
        lfm2, cold, tmp_path):
    disk = str(tmp_path / "kv")
    e = engine(lfm2, disk)
    at = hint(e)[0]
    try:
        ask(e, A)
        from_slot = ask(e, B)
        assert from_slot == {**cold, "cached": at, "checkpoint": at, "tier": "slot"}
        ask(e, A)  # the slot holds A again (rolled back to the same checkpoint)
        ask(e, "Something else entirely.")  # A's state and checkpoints leave for RAM
        from_ram = ask(e, B)
        assert from_ram == {**cold, "cached": at, "checkpoint": at, "tier": "ram"}
        m = e.metrics()
        assert m["checkpoints_restored_total"] == 3 and m["checkpoint_tokens_total"] == 3 * at
        e.cache.flush(10**9)  # RAM's entries (A's among them) to disk
    finally:
        e.close()
    restarted = engine(lfm2, disk, ram_mib=0)
    try:
        from_disk = ask(restarted, B)
        assert from_disk == {**cold, "cached": at, "checkpoint": at, "tier": "disk"}
    finally:
        restarted.close()


TALK = " A: It stood for a long time, then it fell."
FIRST = HISTORY + " Q: the old one, please?" + TALK
EARLIER = (FIRST + " Q: and after that?" + TALK + " Q: which was last?",
           FIRST + " Q: and then, before?" + TALK + " Q: which was last?")


def starts(e: Engine, prompt: str) -> tuple[int, ...]:
    """The three user messages' starts of an :data:`EARLIER` prompt (checkpoint_hints.py)."""
    second = prompt.index(" Q:", len(FIRST))
    last = prompt.rindex(" Q:")
    return tuple(len(e.tokenize(prompt[:at])) - 2 for at in (len(HISTORY), second, last))


@pytest.mark.parametrize("min_step", [1, 8192])
def test_an_edited_earlier_user_message_rolls_back_to_the_checkpoint_min_step_left(
        lfm2, min_step):
    """Checkpoints at every user message's start, spaced by
    ``checkpoint_min_step`` (the first one always, the last one always):
    with the step small, an edit of the second of three user messages
    rolls back to that message's start; with llama-server's 8192 the second
    start is within the step of the first, gets no checkpoint (and no batch
    cut), and the edit rolls back to the first message's start. Either way
    the draws are a cold prefill's."""
    x, y = EARLIER

    def ask_at(e: Engine, text: str, **kw) -> dict:
        r = e.submit(Generation(e.tokenize(text), GREEDY, max_tokens=6, logprobs=0,
                                checkpoint_at=starts(e, text), **kw)).result(300)
        u = r["usage"]["prompt_tokens_details"]
        return {"draws": [(d["id"], d["logprob"]) for d in r["choices"][0]["logprobs"]],
                "cached": u["cached_tokens"], "checkpoint": u.get("checkpoint_tokens", 0)}

    cold = engine(lfm2, ram_mib=0, checkpoint_min_step=min_step)
    try:
        want = ask_at(cold, y, cache_prompt=False)["draws"]
    finally:
        cold.close()
    e = engine(lfm2, ram_mib=0, checkpoint_min_step=min_step)
    try:
        first, second, _ = starts(e, x)
        ask_at(e, x)
        made = e.metrics()["checkpoints_made_total"]
        again = ask_at(e, y)
        assert again["draws"] == want
        if min_step == 1:
            assert made == 5  # three user messages' starts and two near the end
            assert again["cached"] == again["checkpoint"] == second
        else:
            assert made == 4  # not the second message's start
            assert again["cached"] == again["checkpoint"] == first
    finally:
        e.close()


@pytest.mark.parametrize("fault", ["torn", "another_model", "over_the_bound"])
def test_a_checkpoint_torn_of_another_model_or_over_the_bound_is_never_loaded(
        lfm2, cold, tmp_path, fault):
    disk = str(tmp_path / "kv")
    e = engine(lfm2, disk, ram_mib=0)  # every save goes to disk
    try:
        ask(e, A)
        ask(e, "Something else entirely.")
        wait_for(lambda: e.cache_report()["disk"]["entries"] >= 1, 60, what="A on disk")
        fp, key = e.cache.disk.fp.hex, e.cache.disk.key
    finally:
        e.close()
    (f,) = [p for p in Path(disk).rglob("*.kv") if p.stat().st_size > 10_000]
    raw = bytearray(f.read_bytes())
    if fault == "torn":
        raw[-20] ^= 0x01  # inside the checkpoints section, the file's last bytes
    elif fault == "another_model":
        # a section whose blob names another fingerprint, in an entry written
        # whole under the server's key (its MACs all verify): unpack refuses it
        from ggmux.instance.cache.entry_file import read_header, write_entry

        fd = os.open(f.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            h = read_header(fd, f.name, fp, key)
            start = h.data_offset + h.payload_bytes
            cks = unpack(bytes(raw[start:]), fp, 1 << 30, h.tokens.size)
            f.unlink()
            write_entry(fd, fp, h.scope, h.tokens, h.pos_min, raw[h.data_offset:start], key,
                        checkpoints=pack(cks, "0" * len(fp)), ckpt_tokens=h.ckpt_tokens)
        finally:
            os.close(fd)
        raw = bytearray(f.read_bytes())
    f.write_bytes(raw)
    bound = {"checkpoint_mib": 0} if fault == "over_the_bound" else {}
    again = engine(lfm2, disk, ram_mib=0, **bound)
    try:
        got = ask(again, B)
        assert got["checkpoint"] == 0 and got["cached"] == 0 and got["draws"] == cold["draws"]
        if fault != "over_the_bound":
            assert again.cache_report()["rejected_checkpoints"] == 1
    finally:
        again.close()


def test_ggmux_serve_restores_a_changed_chat_after_an_unload_and_reload(lfm2, serve,
                                                                        tmp_path):
    """Through the router: the chat path says where the last user message
    starts, the unload's stop writes the slot and its checkpoints to disk,
    and the model loaded again rolls the edited chat back to the checkpoint."""
    preset = tmp_path / "p.ini"
    preset.write_text(f"[lfm2-tiny]\nmodel = {lfm2}\nparallel = 1\nubatch-size = 1\n"
                      "ctx-size = 512\n")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--cache-disk",
              str(tmp_path / "kv"))

    def chat(text: str) -> dict:
        body = {"model": "lfm2-tiny", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "system", "content": HISTORY},
                             {"role": "user", "content": text}]}
        st, doc = s.json("POST", "/v1/chat/completions", body, timeout=300)
        assert st == 200, doc
        return doc

    cold_b = chat("Q: the new one, please, now.")["choices"][0]["message"]
    chat("Q: the old one, please, now.")  # the slot: the old message
    assert s.json("POST", "/models/unload", {"model": "lfm2-tiny"})[0] == 200
    wait_for(lambda: s.models()["lfm2-tiny"]["status"]["value"] == "unloaded", 60,
             what="the model unloaded")
    again = chat("Q: the new one, please, now.")
    details = again["usage"]["prompt_tokens_details"]
    assert again["timings"]["cache_tier"] == "disk"
    assert details["checkpoint_tokens"] == details["cached_tokens"] > 40
    assert again["choices"][0]["message"] == cold_b
