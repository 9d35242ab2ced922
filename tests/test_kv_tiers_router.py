"""The router's side of the KV tiers (issue 29; DESIGN.md "KV tiers"), end to
end through the real supervisor and proxies on fake instances whose tiers
(instance/fake_cache.py) keep the built-in instance's contract: the
``cache`` state line in the models table, the disk size known with no
replica running, the stop that leaves the save its time (and no more),
the ledger counting a saving instance, and ``POST /cache/clear``."""

from __future__ import annotations

import json
import os

from conftest import alive, served_by, wait_for
from ggmux.shm import layout as L
from ggmux.shm.seqlock import read_table

CHAT = "/v1/chat/completions"
MiB = 1 << 20


def body(i: int, turn: str = "go on", model: str = "m") -> dict:
    system = f"You are agent number {i}. " + " ".join(f"rule {i}.{k}: be brief." for k in range(60))
    return {"model": model, "max_tokens": 2,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": turn}]}


def usage(b: bytes) -> dict:
    return json.loads(b)["usage"]


def preset(tmp_path, sections: dict[str, dict]) -> str:
    ini = tmp_path / "tiers.ini"
    ini.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                           for name, keys in sections.items()))
    return str(ini)


def row(s, m: int = 0):
    return s.seg.models[m]


def entry_files(disk) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs if f.endswith(".entry")]


def test_the_cache_line_and_the_disk_tier_show_in_the_models_table_with_or_without_a_replica(
        serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2, parallel=1, cache_entry_bytes=4096)
    disk = tmp_path / "kv"
    ini = preset(tmp_path, {"m": {"model": f, "cache-ram": 1, "cache-disk": disk}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1")
    assert s.request("POST", CHAT, body(0))[0] == 200
    assert s.request("POST", CHAT, body(1))[0] == 200  # its one slot's text goes to RAM
    wait_for(lambda: row(s)[L.M_CACHE_RAM_BYTES] == 4096, 10, what="the cache line")
    assert row(s)[L.M_CACHE_FLAGS] & L.CACHE_DISK and row(s)[L.M_CACHE_DISK_BYTES] == 0
    # back from RAM: the answer says where its cached tokens came from
    st, _, b = s.request("POST", CHAT, body(0, turn="again"))
    assert st == 200 and usage(b)["prompt_tokens_details"]["cached_tokens"] > 100
    assert json.loads(b)["timings"]["cache_tier"] == "ram"
    assert s.json("POST", "/models/unload", {"model": "m"})[0] == 200
    # it saved its slot and its RAM tier to disk on `exit`; with no replica left, the
    # supervisor knows the disk tier's size from the files
    wait_for(lambda: row(s)[L.M_STATUS] == L.ModelStatus.UNLOADED, 20, what="unloaded")
    files = entry_files(disk)
    assert len(files) == 3  # its slot, and the two prompts its RAM tier held
    size = sum(os.path.getsize(p) for p in files)
    wait_for(lambda: row(s)[L.M_CACHE_DISK_BYTES] == size, 10, what="the scan")
    assert row(s)[L.M_CACHE_RAM_BYTES] == 0
    s.stop()
    # a new server knows it before any load, and a new replica restores from it
    s2 = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1")
    wait_for(lambda: row(s2)[L.M_CACHE_DISK_BYTES] == size, 10, what="the scan at start")
    st, _, b = s2.request("POST", CHAT, body(1, turn="after a restart"))
    assert st == 200 and json.loads(b)["timings"]["cache_tier"] == "disk"
    assert usage(b)["prompt_tokens_details"]["cached_tokens"] > 100


def test_a_stopping_instance_gets_its_save_time_and_is_counted_until_it_exits(
        serve, fakes, tmp_path):
    # stop-timeout 1 s alone would SIGTERM it mid-save (a 2 s save); exit -> SIGTERM is
    # stop-timeout + cache-save-timeout, so the save completes
    f = fakes.add("m", prefix_cache=True, tokens=2, save_s=2.0, mem_bytes=300 * MiB,
                  min_bytes=300 * MiB)
    disk = tmp_path / "kv"
    ini = preset(tmp_path, {"m": {"model": f, "cache-disk": disk, "stop-timeout": 1,
                                  "cache-save-timeout": 4}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1", "--host-memory", "1024")
    st, _, b = s.request("POST", CHAT, body(0))
    assert st == 200
    pid = served_by(b)[1]
    wait_for(lambda: read_table(s.seg.devices)[0, L.D_HELD] == 300 * MiB, 10, what="held")
    assert s.json("POST", "/models/unload", {"model": "m"})[0] == 200
    wait_for(lambda: row(s)[L.M_STATUS] == L.ModelStatus.STOPPING, 10, what="stopping")
    # saving: still a process, still in the ledger
    assert alive(pid) and read_table(s.seg.devices)[0, L.D_HELD] == 300 * MiB
    wait_for(lambda: not alive(pid), 20, what="the instance to exit")
    wait_for(lambda: read_table(s.seg.devices)[0, L.D_HELD] == 0, 10, what="memory released")
    assert len(entry_files(disk)) == 1  # the save was not cut
    assert "SIGTERM" not in s.logs()


def test_a_stuck_save_is_cut_at_stop_timeout_plus_save_timeout(serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2, save_s=600, save_ignores_timeout=True)
    ini = preset(tmp_path, {"m": {"model": f, "cache-disk": tmp_path / "kv", "stop-timeout": 1,
                                  "cache-save-timeout": 1}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1")
    st, _, b = s.request("POST", CHAT, body(0))
    pid = served_by(b)[1]
    assert s.json("POST", "/models/unload", {"model": "m"})[0] == 200
    wait_for(lambda: not alive(pid), 30, what="SIGTERM of the stuck save")
    assert "did not exit within 2.0 s of 'exit': SIGTERM" in s.logs()
    wait_for(lambda: row(s)[L.M_STATUS] == L.ModelStatus.UNLOADED, 10, what="unloaded")
