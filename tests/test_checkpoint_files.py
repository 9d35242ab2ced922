"""Context checkpoints in the KV tiers without a model (issue 35): the
checkpoints' blob and its checks, the entry file's optional section under
the entry's MAC (a forged or moved section refused; files of versions 1 and
2 refused, never read), which checkpoint a lookup offers for a prefix
before a sliding window or of a recurrent state, and the byte bound. The
real engine's restores are tests/test_checkpoints.py's."""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import numpy as np
import pytest
from ggmux.instance.cache.checkpoint import (
    Checkpoint,
    CheckpointError,
    newest_within,
    pack,
    unpack,
    within_bytes,
)
from ggmux.instance.cache.entry import Entry
from ggmux.instance.cache.entry_file import (
    EntryFileError,
    entry_key,
    read_checkpoints,
    read_header,
    read_payload,
    write_entry,
)
from ggmux.instance.cache.fingerprint import fingerprint
from ggmux.instance.cache.tiers import CacheSettings, KVTiers
from test_kv_files import KEY, disk, payload, toks

FP = fingerprint({"size": 1, "mtime_ns": 2, "head_sha256": "ab"}, {"kv_size": 1024}, "test")
OTHER_FP = fingerprint({"size": 1, "mtime_ns": 2, "head_sha256": "ab"}, {"kv_size": 512}, "test")
LIMIT = 1 << 20


@pytest.fixture
def folder(tmp_path):
    """A descriptor of ``tmp_path`` (the entry functions work from one)."""
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    yield fd
    os.close(fd)


def ck(n: int, nbytes: int = 1000) -> Checkpoint:
    return Checkpoint(n, max(0, n - 512), n - 1, bytes(payload(nbytes, n)))


def test_checkpoints_pack_and_unpack_verified_and_the_newest_within_a_prefix_is_chosen():
    cks = [ck(100), ck(400), ck(700)]
    back = unpack(pack(cks, FP.hex), FP.hex, LIMIT, 800)
    assert [(c.n_tokens, c.pos_min, c.pos_max, c.data) for c in back] == \
        [(c.n_tokens, c.pos_min, c.pos_max, c.data) for c in cks]
    assert newest_within(back, 699).n_tokens == 400
    assert newest_within(back, 700).n_tokens == 700
    assert newest_within(back, 99) is None
    assert unpack(b"", FP.hex, LIMIT, 800) == []


@pytest.mark.parametrize("damage", ["torn", "flipped", "foreign", "over_the_bound",
                                    "longer_than_the_entry", "garbage"])
def test_a_damaged_foreign_or_oversized_checkpoint_blob_never_unpacks(damage):
    blob = bytearray(pack([ck(100), ck(400)], FP.hex))
    fp, limit, n_tokens = FP.hex, LIMIT, 800
    if damage == "torn":
        blob = blob[:-10]
    elif damage == "flipped":
        blob[-10] ^= 0x01
    elif damage == "foreign":
        fp = OTHER_FP.hex
    elif damage == "over_the_bound":
        limit = 1500
    elif damage == "longer_than_the_entry":
        n_tokens = 300
    elif damage == "garbage":
        blob = bytearray(b"not checkpoints" * 7)
    with pytest.raises(CheckpointError):
        unpack(bytes(blob), fp, limit, n_tokens)


def test_an_entry_carries_the_newest_checkpoints_within_its_byte_bound():
    cks = [ck(100, 400), ck(400, 400), ck(700, 400), ck(900, 400)]
    assert [c.n_tokens for c in within_bytes(cks, 1000, 800, 4)] == [400, 700]
    assert [c.n_tokens for c in within_bytes(cks, 1000, 800, 1)] == [700]
    assert within_bytes(cks, 0, 800, 4) == [] == within_bytes(cks, 1000, 800, 0)


def test_an_entry_file_carries_its_checkpoints_in_a_verified_section(tmp_path, folder):
    tokens = toks(*range(1, 801))
    data = payload(5000)
    blob = pack([ck(400), ck(700)], FP.hex)
    name, size = write_entry(folder, FP.hex, "", tokens, 300, data, KEY,
                             checkpoints=blob, ckpt_tokens=(400, 700))
    path = tmp_path / name
    h = read_header(folder, name, FP.hex, KEY)
    assert size == path.stat().st_size and h.ckpt_tokens == (400, 700)
    assert read_payload(folder, name, h, KEY) == data  # the state alone, not the section
    assert read_checkpoints(folder, name, h, KEY) == blob
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x01  # a flipped checkpoint byte: the state still verifies, the section not
    path.write_bytes(raw)
    h = read_header(folder, name, FP.hex, KEY)
    assert read_payload(folder, name, h, KEY) == data
    with pytest.raises(EntryFileError) as x:
        read_checkpoints(folder, name, h, KEY)
    assert x.value.reason == "corrupt"


def test_a_checkpoint_section_forged_or_moved_from_another_entry_never_verifies(tmp_path,
                                                                               folder):
    """The section is under the server's key and bound to its entry: one
    written with another key, or a whole valid section of entry A put in
    the place of entry B's (same length, so every size check passes), is
    refused; the entries' states still verify."""
    data = payload(3000)
    a_toks, b_toks = toks(*range(1, 801)), toks(*range(2, 802))
    a, _ = write_entry(folder, FP.hex, "", a_toks, 0, data, KEY,
                       checkpoints=pack([ck(400)], FP.hex), ckpt_tokens=(400,))
    blob_b = pack([Checkpoint(400, 0, 399, bytes(payload(1000, 9)))], FP.hex)  # A's counts
    b, _ = write_entry(folder, FP.hex, "", b_toks, 0, data, KEY,
                       checkpoints=blob_b, ckpt_tokens=(400,))
    ha, hb = read_header(folder, a, FP.hex, KEY), read_header(folder, b, FP.hex, KEY)
    assert read_checkpoints(folder, b, hb, KEY) == blob_b and hb.ckpt_bytes == ha.ckpt_bytes
    raw_a, raw_b = (tmp_path / a).read_bytes(), bytearray((tmp_path / b).read_bytes())
    raw_b[-hb.ckpt_bytes:] = raw_a[-ha.ckpt_bytes:]  # A's own, verified section into B
    (tmp_path / b).write_bytes(raw_b)
    hb = read_header(folder, b, FP.hex, KEY)
    assert read_payload(folder, b, hb, KEY) == data
    with pytest.raises(EntryFileError) as x:
        read_checkpoints(folder, b, hb, KEY)
    assert x.value.reason == "corrupt"
    # written whole by whoever holds another key: the header does not verify
    os.unlink(tmp_path / b)
    b, _ = write_entry(folder, FP.hex, "", b_toks, 0, data, b"not the server's key, forged!!!",
                       checkpoints=blob_b, ckpt_tokens=(400,))
    with pytest.raises(EntryFileError) as x:
        read_header(folder, b, FP.hex, KEY)
    assert x.value.reason == "corrupt"


@pytest.mark.parametrize("version", [1, 2, 4])
def test_an_entry_file_of_another_format_version_is_refused_and_never_read(tmp_path, version):
    """Version 1 (no MAC: the forgery path the MAC closes), version 2 (two
    branches' layouts) and a later one: refused as foreign, left in place,
    never indexed nor loaded, and the tier goes on working."""
    d = disk(tmp_path)
    assert d.open()
    tokens = toks(*range(1, 101))
    d.write(Entry(entry_key("", tokens), "", tokens, 0, 2000, 0.0, data=payload(2000),
                  checkpoints=[ck(50)]))
    (e,) = d.candidates()
    raw = bytearray(Path(e.path).read_bytes())
    raw[8:12] = struct.pack("<I", version)
    Path(e.path).write_bytes(raw)
    with pytest.raises(EntryFileError) as x:
        read_header(d.dir_fd, os.path.basename(e.path), FP.hex, KEY)
    assert x.value.reason == "foreign"
    fresh = disk(tmp_path)
    assert fresh.open()
    assert fresh.candidates() == [] and fresh.rejected == 1
    assert os.path.exists(e.path)  # not ours to judge: left in place
    fresh.write(Entry(entry_key("", toks(7, 8, 9)), "", toks(7, 8, 9), 0, 100, 0.0,
                      data=payload(100)))
    assert [c.tokens.tolist() for c in fresh.candidates()] == [[7, 8, 9]]


def test_a_lookup_offers_the_newest_checkpoint_of_a_prefix_that_left_the_window():
    tiers = KVTiers(CacheSettings(ram_mib=64), 4096)
    entry = toks(*range(1, 1001))
    # a sliding-window state of 1000 tokens: positions 488.. (a 512 window)
    tiers.save("", entry, 488, payload(3000), [ck(500), ck(850)])
    edited = np.concatenate([entry[:900], toks(*range(5000, 5100))])
    hit = tiers.lookup(edited, "", 0, n_swa=512)
    assert hit.n == 850  # the prefix (900) lies before the window: its newest checkpoint
    assert len(tiers.checkpoints(hit)) == 2
    assert tiers.lookup(np.concatenate([entry, toks(7, 8)]), "", 0, n_swa=512).n == 1000
    assert tiers.lookup(edited[:840].copy(), "", 0, n_swa=512).n == 500
    # no better than what the request's slot keeps (600 tokens): not offered
    assert tiers.lookup(edited[:840].copy(), "", 600, n_swa=512) is None
    # a recurrent state serves all its tokens, or a checkpoint
    tiers.save("r", entry, 0, payload(3000), [ck(850)])
    assert tiers.lookup(edited, "r", 0, recurrent=True).n == 850


def test_checkpoints_spill_to_disk_with_their_entry_and_a_torn_section_is_refused(tmp_path):
    d = disk(tmp_path)
    d.open()
    settings = CacheSettings(ram_mib=0, disk_dir=str(tmp_path))
    tiers = KVTiers(settings, 1 << 20, d)
    entry = toks(*range(1, 1001))
    tiers.save("", entry, 488, payload(3000), [ck(500), ck(850)])
    tiers.flush(time.monotonic() + 30)  # RAM off: straight to the writer, then flushed
    (e,) = d.candidates()
    assert e.ckpt_tokens == (500, 850) and e.nbytes > 3000 + 2000
    fresh = KVTiers(settings, 1 << 20, disk(tmp_path))
    fresh.disk.open()
    edited = np.concatenate([entry[:900], toks(*range(5000, 5100))])
    hit = fresh.lookup(edited, "", 0, n_swa=512)
    assert hit.tier == "disk" and hit.n == 850
    got = fresh.checkpoints(hit)
    assert [c.n_tokens for c in got] == [500, 850] and got[1].data == ck(850).data
    raw = bytearray(Path(e.path).read_bytes())
    Path(e.path).write_bytes(raw[:-3] + bytes([raw[-3] ^ 1]) + raw[-2:])
    assert fresh.checkpoints(hit) == []  # never loaded
    assert fresh.report()["rejected_checkpoints"] == 1
    assert fresh.state(hit) is not None  # the state itself still verifies
    small = KVTiers(CacheSettings(ram_mib=0, disk_dir=str(tmp_path), checkpoint_mib=0),
                    1 << 20, disk(tmp_path))
    small.disk.open()
    Path(e.path).write_bytes(raw)
    assert small.checkpoints(small.lookup(edited, "", 0, n_swa=512)) == []  # over its bound
