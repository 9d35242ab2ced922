"""The disk tier against a hostile local user (issue 37, items 4 and 12),
each attack as the issue describes it: a planted symlink at a save's name,
a symlinked fingerprint folder, a forged entry, a FIFO named like an entry
or ``tenant.key``, a foreign-owned or world-writable ``DIR``, a 0644 or
linked ``tenant.key``, an entry claiming more tokens than the context; and
the decode thread never indexing the folder. No model: payloads are random
bytes (a restore through llama.cpp is tests/test_kv_tiers.py's)."""

from __future__ import annotations

import logging
import os
import stat
import threading
import time

import numpy as np
import orjson
import pytest
from conftest import wait_for
from ggmux.instance.cache import disk as disk_mod
from ggmux.instance.cache import entry_file as ef
from ggmux.instance.cache.disk import DiskTier
from ggmux.instance.cache.entry import Entry
from ggmux.instance.cache.entry_file import EntryFileError, entry_key, read_header, write_entry
from ggmux.instance.cache.fingerprint import fingerprint
from ggmux.instance.cache.safe_files import UnsafeFile, mac_key
from ggmux.instance.cache.tiers import CacheSettings, KVTiers
from ggmux.supervisor.kvtiers import files as T
from ggmux.supervisor.registry import ModelEntry

KEY = b"k" * 32
FP = fingerprint({"size": 1, "mtime_ns": 2, "head_sha256": "ab"}, {"kv_size": 1024}, "test")


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, np.int32)


def entry(tokens: np.ndarray, nbytes: int = 2048, scope: str = "") -> Entry:
    data = bytearray(np.random.default_rng(len(tokens)).integers(0, 256, nbytes, np.uint8))
    return Entry(entry_key(scope, tokens), scope, tokens, 0, nbytes, 0.0, data=data)


def opened(root, key: bytes = KEY, **kw) -> DiskTier:
    d = DiskTier(str(root), FP, 1 << 30, key=key, **kw)
    assert d.open()
    return d


def in_thread(fn, timeout: float = 20.0):
    """Run ``fn`` on a thread; fail (instead of hanging the suite) when it
    does not return within ``timeout`` s, as a blocking open would not."""
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"{fn} blocked"
    return out[0] if out else None


def test_a_planted_symlink_at_a_save_name_never_writes_or_chmods_outside_the_folder(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.chmod(victim, 0o644)
    d = opened(tmp_path / "kv")
    e = entry(toks(*range(1, 40)))
    # links where the save writes: its temporary name and its final name
    os.symlink(victim, os.path.join(d.dir, f".{e.key}.{os.getpid()}.tmp"))
    os.symlink(victim, os.path.join(d.dir, e.key + ".kv"))
    assert d.write(e)
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    final = os.path.join(d.dir, e.key + ".kv")
    assert stat.S_ISREG(os.lstat(final).st_mode)  # the link itself was replaced
    assert d.load(d.candidates()[0]) == e.data


def test_a_symlinked_fingerprint_folder_turns_the_tier_off_and_touches_nothing_behind_it(
        tmp_path, caplog):
    elsewhere = tmp_path / "home"
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("mine")
    (elsewhere / ("0" * 64 + ".kv")).write_text("a user's file named like an entry")
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.symlink(elsewhere, root / FP.hex)
    d = DiskTier(str(root), FP, 1 << 30, key=KEY)
    with caplog.at_level(logging.ERROR):
        assert not d.open()
    assert "symbolic link" in caplog.text
    assert sorted(os.listdir(elsewhere)) == ["0" * 64 + ".kv", "notes.txt"]
    # the supervisor's clear of a stopped model does not walk through it either
    (root / FP.hex).unlink()
    real = opened(root, model="m")
    real.write(entry(toks(1, 2, 3)))
    os.rename(real.dir, tmp_path / "moved")
    os.symlink(tmp_path / "moved", root / FP.hex)  # model.json reachable only through the link
    (tmp_path / "moved" / "backup.db").write_text("keep")
    assert T.clear_disk(str(root), "m") == 0
    assert "backup.db" in os.listdir(tmp_path / "moved")


def test_a_forged_entry_is_never_loaded(tmp_path):
    """Whoever can write DIR but does not hold the server's key: a whole,
    well-formed entry for a prompt of theirs with a state of theirs (the
    issue's "capital of Italy" answered "Paris") is refused and removed."""
    d = opened(tmp_path / "kv")
    write_entry(d.dir_fd, FP.hex, "", toks(*range(7, 70)), 0, bytearray(b"P" * 4096),
                b"attacker's own key, not ours!!!!")
    d.refresh(force=True)
    assert d.candidates() == [] and d.rejected == 1
    assert [n for n in os.listdir(d.dir) if n.endswith(".kv")] == []


def test_a_fifo_named_like_an_entry_is_refused_without_blocking(tmp_path):
    d = opened(tmp_path / "kv")
    os.mkfifo(os.path.join(d.dir, "x.kv"))
    os.mkfifo(os.path.join(d.dir, entry_key("", toks(1, 2)) + ".kv"))
    in_thread(lambda: d.refresh(force=True))
    assert d.candidates() == [] and d.rejected == 2
    d.write(entry(toks(5, 6, 7)))  # the tier goes on working
    assert len(d.candidates()) == 1


def test_a_fifo_tenant_key_never_blocks_the_start(tmp_path):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    os.mkfifo(root / T.TENANT_KEY_FILE)
    e = ModelEntry("m", "m.gguf", extra_args=["--cache-disk", str(root)])
    key = in_thread(lambda: T.tenant_secret([e]))
    assert len(key) == 32


@pytest.mark.parametrize("how", ["world_writable", "foreign_owned"])
def test_a_dir_another_user_owns_or_anyone_may_write_is_refused(tmp_path, how, caplog):
    root = tmp_path / "kv"
    root.mkdir()
    if how == "world_writable":
        os.chmod(root, 0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(root, 12345, 12345)
        os.chmod(root, 0o777)
    d = DiskTier(str(root), FP, 1 << 30, key=KEY)
    with caplog.at_level(logging.ERROR):
        assert not d.open()
    assert ("writable by others" if how == "world_writable" else "owned by uid 12345") \
        in caplog.text
    assert os.listdir(root) == []  # nothing made in it
    # nor is the tenant key kept there
    e = ModelEntry("m", "m.gguf", extra_args=["--cache-disk", str(root)])
    T.tenant_secret([e])
    assert os.listdir(root) == []


@pytest.mark.parametrize("how", ["mode_0644", "symlink"])
def test_a_tenant_key_others_may_read_or_a_link_is_not_used(tmp_path, how):
    root = tmp_path / "kv"
    root.mkdir(mode=0o700)
    e = ModelEntry("m", "m.gguf", extra_args=["--cache-disk", str(root)])
    planted = "ab" * 16
    if how == "mode_0644":
        (root / T.TENANT_KEY_FILE).write_text(planted + "\n")
        os.chmod(root / T.TENANT_KEY_FILE, 0o644)
    else:
        target = tmp_path / "elsewhere.key"
        target.write_text(planted + "\n")
        os.chmod(target, 0o600)
        os.symlink(target, root / T.TENANT_KEY_FILE)
    assert T.tenant_secret([e]) != planted


def test_a_tenant_key_kept_right_is_the_same_on_the_next_start(tmp_path):
    e = ModelEntry("m", "m.gguf", extra_args=["--cache-disk", str(tmp_path / "kv")])
    key = T.tenant_secret([e])
    assert T.tenant_secret([e]) == key
    assert stat.S_IMODE(os.stat(tmp_path / "kv" / T.TENANT_KEY_FILE).st_mode) == 0o600


def test_the_mac_key_is_made_once_0600_outside_dir_and_a_readable_one_is_refused(tmp_path):
    state = tmp_path / "state"
    key = mac_key(str(state))
    assert len(key) == 32 and mac_key(str(state)) == key
    assert stat.S_IMODE(os.stat(state / "kv.key").st_mode) == 0o600
    os.chmod(state / "kv.key", 0o644)
    with pytest.raises(UnsafeFile):
        mac_key(str(state))
    os.chmod(state / "kv.key", 0o600)
    os.chmod(state, 0o777)  # a key folder others may write: they could swap the key
    with pytest.raises(UnsafeFile):
        mac_key(str(state))


def test_an_entry_claiming_more_tokens_than_the_context_is_refused_before_it_is_read(
        tmp_path, monkeypatch):
    d = opened(tmp_path / "kv", max_tokens=1000)
    tokens = toks(*range(2000))
    name, _ = write_entry(d.dir_fd, FP.hex, "", tokens, 0, bytearray(64), KEY)
    reads = []
    real = np.frombuffer
    monkeypatch.setattr(ef.np, "frombuffer", lambda *a, **k: reads.append(a) or real(*a, **k))
    with pytest.raises(EntryFileError, match="more than the context's 1000"):
        read_header(d.dir_fd, name, FP.hex, KEY, max_tokens=1000)
    assert reads == []
    # a header claiming 100 M tokens on a small file: refused by the count, nothing allocated
    h = orjson.dumps({"fingerprint": FP.hex, "scope": "", "n_tokens": 100_000_000, "pos_min": 0,
                      "payload_bytes": 1, "payload_mac": ""})
    with open(os.path.join(d.dir, "huge.kv"), "wb") as f:
        f.write(ef._FIXED.pack(ef.MAGIC, ef.VERSION, len(h)) + b"\0" * 32 + h + b"\0" * 64)
    with pytest.raises(EntryFileError, match="more than the context's"):
        read_header(d.dir_fd, "huge.kv", FP.hex, KEY, max_tokens=1000)
    d.refresh(force=True)
    assert d.rejected == 2 and d.candidates() == []


def test_the_decode_threads_lookup_never_indexes_the_folder(tmp_path, monkeypatch):
    """The writer thread finds what another process wrote; a lookup (the
    decode thread's call) only reads the index."""
    monkeypatch.setattr(disk_mod, "REFRESH_S", 0.05)
    d = opened(tmp_path / "kv")
    tiers = KVTiers(CacheSettings(ram_mib=0, disk_dir=str(tmp_path / "kv")), 4096, d)
    other = opened(tmp_path / "kv")  # another process's writes
    callers = []
    real = DiskTier.refresh
    monkeypatch.setattr(DiskTier, "refresh",
                        lambda self, force=False: callers.append(
                            threading.current_thread().name) or real(self, force))
    prompt = toks(*range(1, 200))
    other.write(entry(prompt[:150].copy()))
    wait_for(lambda: tiers.lookup(prompt, "", 0) is not None, 30,
             what="the writer thread indexing the other's entry")
    for _ in range(20):
        tiers.lookup(prompt, "", 0)
    assert callers and threading.current_thread().name not in callers
    assert set(callers) == {"kv-disk"}
    tiers.flush(time.monotonic() + 5)
