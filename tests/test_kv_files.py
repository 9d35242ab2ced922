"""The KV tiers without a model (instance/cache/): the entry file format and
its checks, the RAM tier's LRU and limits (llama-server's --cache-ram
rules), the disk tier's limit and index, and the lookup's scope rules
(issue 29, done-when 2 and 3). Payloads are random bytes: a model's
restore is tests/test_kv_tiers.py's."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import wait_for
from ggmux.instance.cache.disk import DiskTier
from ggmux.instance.cache.entry import Entry
from ggmux.instance.cache.entry_file import (
    EntryFileError,
    SaveTimeout,
    entry_key,
    read_header,
    read_payload,
    write_entry,
)
from ggmux.instance.cache.fingerprint import fingerprint
from ggmux.instance.cache.ram import RamTier
from ggmux.instance.cache.tiers import CacheSettings, KVTiers

KEY = b"k" * 32  # the entries' MAC key (a server's: safe_files.mac_key)
FP = fingerprint({"size": 1, "mtime_ns": 2, "head_sha256": "ab"}, {"kv_size": 1024}, "test")
OTHER_FP = fingerprint({"size": 1, "mtime_ns": 2, "head_sha256": "ab"}, {"kv_size": 512}, "test")


def toks(*ids: int) -> np.ndarray:
    return np.asarray(ids, np.int32)


def payload(n: int, seed: int = 0) -> bytearray:
    return bytearray(np.random.default_rng(seed).integers(0, 256, n, np.uint8).tobytes())


def entry(tokens: np.ndarray, nbytes: int, scope: str = "", t: float = 0.0) -> Entry:
    return Entry(entry_key(scope, tokens), scope, tokens, 0, nbytes, t, data=payload(nbytes))


@pytest.fixture
def folder(tmp_path):
    """A descriptor of ``tmp_path`` (the entry functions work from one)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def disk(root, fp=FP, limit: int = 1 << 30, **kw) -> DiskTier:
    return DiskTier(str(root), fp, limit, key=KEY, **kw)


def test_an_entry_file_reads_back_verified_and_is_named_by_a_hash_mode_0600(tmp_path, folder):
    tokens = toks(*range(1, 300))
    data = payload(5000)
    name, size = write_entry(folder, FP.hex, "tenant-a", tokens, 3, data, KEY)
    path = os.path.join(tmp_path, name)
    assert name == entry_key("tenant-a", tokens) + ".kv" and len(name) == 64 + 3
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert size == os.path.getsize(path)
    h = read_header(folder, name, FP.hex, KEY)
    assert h.scope == "tenant-a" and h.pos_min == 3 and h.tokens.tolist() == tokens.tolist()
    assert read_payload(folder, name, h, KEY) == data
    assert [n for n in os.listdir(tmp_path)] == [name]  # no temporary file left


@pytest.mark.parametrize("damage", ["torn", "flipped_payload", "flipped_token", "foreign",
                                    "renamed", "garbage"])
def test_a_damaged_or_foreign_entry_file_never_verifies(tmp_path, folder, damage):
    tokens = toks(*range(5, 105))
    name, _ = write_entry(folder, FP.hex, "", tokens, 0, payload(4096), KEY)
    path = os.path.join(tmp_path, name)
    raw = bytearray(Path(path).read_bytes())
    fp = FP.hex
    if damage == "torn":
        raw = raw[: len(raw) - 100]
    elif damage == "flipped_payload":
        raw[-10] ^= 0x01
    elif damage == "flipped_token":
        raw[len(raw) - 4096 - 8] ^= 0x01
    elif damage == "foreign":
        fp = OTHER_FP.hex
    elif damage == "garbage":
        raw = bytearray(b"not a kv entry at all" * 10)
    Path(path).write_bytes(raw)
    if damage == "renamed":
        other = os.path.join(tmp_path, entry_key("", toks(1, 2, 3)) + ".kv")
        os.rename(path, other)
        name = os.path.basename(other)
    with pytest.raises(EntryFileError):
        read_payload(folder, name, read_header(folder, name, fp, KEY), KEY)


def test_a_write_past_its_deadline_leaves_no_file(tmp_path, folder):
    with pytest.raises(SaveTimeout):
        write_entry(folder, FP.hex, "", toks(1, 2), 0, payload(64 << 20), KEY, deadline=0.0)
    assert os.listdir(tmp_path) == []


def test_the_ram_tier_keeps_the_most_recent_entries_within_its_byte_limit():
    ram = RamTier(1, 0)  # 1 MiB
    out = []
    for i in range(5):
        out += ram.put(entry(toks(100 + i, 1, 2), 300_000))
    assert ram.bytes <= 1 << 20 and len(ram.entries) == 3
    assert [e.tokens[0] for e in out] == [100, 101]  # the oldest left first, for the disk
    assert not ram.admits(2 << 20)  # larger than the whole limit: not kept (llama-server)


def test_the_ram_tier_drops_prefixes_a_new_entry_contains_and_skips_contained_ones():
    ram = RamTier(64, 0)
    ram.put(entry(toks(1, 2, 3), 100))
    ram.put(entry(toks(9, 9), 100, scope="other"))
    assert ram.put(entry(toks(1, 2, 3, 4, 5), 100)) == []
    assert sorted(len(e.tokens) for e in ram.entries.values()) == [2, 5]
    assert ram.holds(entry(toks(1, 2, 3, 4), 10))  # already inside the longer one
    assert not ram.holds(entry(toks(1, 2, 3, 4), 10, scope="other"))


def test_cache_ram_minus_one_bounds_the_tokens_by_the_context_as_llama_server():
    ram = RamTier(-1, 10)  # no byte limit; the context's 10 cells
    for i in range(4):
        ram.put(entry(toks(50 + i, 1, 2, 3), 1 << 20))
    assert ram.tokens <= 10 and len(ram.entries) == 2
    assert not RamTier(0, 10).admits(1)  # 0: off


def test_the_disk_tier_never_grows_past_its_limit_and_evicts_the_least_recently_used(tmp_path):
    d = disk(tmp_path, limit=3 * 11_000)
    assert d.open()
    for i in range(6):
        assert d.write(entry(toks(200 + i, *range(50)), 10_000))
        files = [f for f in os.listdir(d.dir) if f.endswith(".kv")]
        assert sum(os.path.getsize(os.path.join(d.dir, f)) for f in files) <= d.limit_bytes
    kept = sorted(int(e.tokens[0]) for e in d.candidates())
    assert kept == [203, 204, 205]
    assert not d.write(entry(toks(7, 7), 40_000))  # larger than the whole limit


def test_a_second_process_indexes_entries_another_wrote_and_refuses_foreign_files(tmp_path):
    a = disk(tmp_path)
    a.open()
    a.write(entry(toks(1, 2, 3, 4), 2048))
    b = disk(tmp_path)
    b.open()
    assert [e.tokens.tolist() for e in b.candidates()] == [[1, 2, 3, 4]]
    # a file of another context size copied into this fingerprint's directory
    c = disk(tmp_path, OTHER_FP)
    c.open()
    src = b.candidates()[0].path
    os.link(src, os.path.join(c.dir, os.path.basename(src)))
    c.refresh(force=True)
    assert c.candidates() == [] and c.rejected == 1


def test_a_lookup_finds_only_its_own_scope_and_the_longest_prefix(tmp_path):
    tiers = KVTiers(CacheSettings(ram_mib=64), 4096)
    prompt = toks(*range(1, 101))
    tiers.save("alice", prompt[:80].copy(), 0, payload(100))
    tiers.save("", prompt[:60].copy(), 0, payload(100))
    tiers.save("", prompt[:90].copy(), 0, payload(100))
    hit = tiers.lookup(prompt, "alice", better_than=0)
    assert hit.n == 80 and hit.entry.scope == "alice"
    assert tiers.lookup(prompt, "bob", better_than=0) is None
    assert tiers.lookup(prompt, "", better_than=0).n == 90
    assert tiers.lookup(prompt, "", better_than=95) is None  # the slot keeps more
    # a prompt keeping under a quarter of an entry does not restore it (llama-server's f_keep)
    assert tiers.lookup(toks(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 99), "", better_than=0) is None


def test_ram_leavers_spill_to_disk_and_a_flush_writes_what_ram_holds(tmp_path):
    d = disk(tmp_path)
    d.open()
    tiers = KVTiers(CacheSettings(ram_mib=1, disk_dir=str(tmp_path)), 1 << 20, d)
    for i in range(3):
        tiers.save("", toks(300 + i, 1, 2), 0, payload(400_000, i))
    # the first left RAM for the writer thread
    wait_for(lambda: d.report()["entries"] == 1, 30, what="the spilled entry on disk")
    assert tiers.flush(time.monotonic() + 30) == 2
    assert sorted(int(e.tokens[0]) for e in d.candidates()) == [300, 301, 302]
    assert tiers.clear() == {"ram": 2, "disk": 3}
    assert [f for f in os.listdir(d.dir) if f.endswith(".kv")] == []
