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
    return [os.path.join(d, f) for d, _, fs in os.walk(disk) for f in fs if f.endswith(".kv")]


def test_the_cache_line_and_the_disk_tier_show_in_the_models_table_with_or_without_a_replica(
        serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2, parallel=1, cache_entry_bytes=4096)
    disk = tmp_path / "kv"
    ini = preset(tmp_path, {"m": {"model": f, "cache-ram": 1, "cache-disk": disk}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1")
    assert s.request("POST", CHAT, body(0))[0] == 200
    held = int(s.seg.devices[0][L.D_HELD])  # the host: what the replica reported at ready
    assert s.request("POST", CHAT, body(1))[0] == 200  # its one slot's text goes to RAM
    wait_for(lambda: row(s)[L.M_CACHE_RAM_BYTES] == 4096, 10, what="the cache line")
    # the ledger counts the RAM tier as the replica's memory
    wait_for(lambda: int(s.seg.devices[0][L.D_HELD]) == held + 4096, 10, what="the ledger")
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
    _st, _, b = s.request("POST", CHAT, body(0))
    pid = served_by(b)[1]
    assert s.json("POST", "/models/unload", {"model": "m"})[0] == 200
    wait_for(lambda: not alive(pid), 30, what="SIGTERM of the stuck save")
    assert "did not exit within 2.0 s of 'exit': SIGTERM" in s.logs()
    wait_for(lambda: row(s)[L.M_STATUS] == L.ModelStatus.UNLOADED, 10, what="unloaded")


def warm_two_models(serve, fakes, tmp_path, *args):
    """Models ``m`` (RAM and disk tiers) and ``n`` (disk only), each served
    once; ``n`` unloaded again, so its disk tier is all it has."""
    fm = fakes.add("m", prefix_cache=True, tokens=2, parallel=1, cache_entry_bytes=2048)
    fn = fakes.add("n", prefix_cache=True, tokens=2)
    disk = tmp_path / "kv"
    ini = preset(tmp_path, {"m": {"model": fm, "cache-ram": 1, "cache-disk": disk},
                            "n": {"model": fn, "cache-disk": disk}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1", "--models-max", "2",
              *args)
    key = {"authorization": "Bearer admin"} if "--admin-key" in args else {}
    api = {"authorization": "Bearer api"} if "--api-key" in args else {}
    for b in (body(0), body(1), body(2, model="n")):
        assert s.request("POST", CHAT, b, headers=api)[0] == 200
    assert s.json("POST", "/models/unload", {"model": "n"}, headers=key)[0] == 200
    wait_for(lambda: row(s, 0)[L.M_CACHE_RAM_BYTES] == 2048, 10, what="m's cache line")
    wait_for(lambda: row(s, 1)[L.M_STATUS] == L.ModelStatus.UNLOADED
             and row(s, 1)[L.M_CACHE_DISK_BYTES] > 0, 20, what="n's disk tier")
    return s, disk, key, api


def test_models_ps_and_metrics_show_each_models_cache_ram_and_disk_bytes(
        serve, fakes, tmp_path, capsys):
    from ggmux.supervisor.cli import main as cli

    s, _, _, _ = warm_two_models(serve, fakes, tmp_path)
    disk_n = int(row(s, 1)[L.M_CACHE_DISK_BYTES])
    models = s.models()
    assert models["m"]["status"]["cache"] == {"ram_bytes": 2048, "disk_bytes": 0}
    assert models["n"]["status"] == {**models["n"]["status"], "value": "unloaded",
                                     "cache": {"ram_bytes": 0, "disk_bytes": disk_n}}
    st, doc = s.json("GET", "/models")
    assert {m["id"]: m["status"]["cache"] for m in doc["data"]} == {
        "m": {"ram_bytes": 2048, "disk_bytes": 0}, "n": {"ram_bytes": 0, "disk_bytes": disk_n}}
    ps = {m["id"]: m for m in s.json("GET", "/ps")[1]["models"]}
    assert ps["m"]["cache"] == {"ram": 2048, "disk": 0}
    assert ps["n"]["cache"] == {"ram": 0, "disk": disk_n}
    assert cli(["ps", "--all", "--url", s.base]) == 0
    out = capsys.readouterr().out
    head, *lines = out.splitlines()
    assert "CACHE" in head.split()
    line_m = next(x for x in lines if x.startswith("m "))
    line_n = next(x for x in lines if x.startswith("n "))
    assert "2.0 KiB/0" in line_m and f"0/{disk_n / 1024:.1f} KiB" in line_n
    text = s.request("GET", "/metrics")[2].decode()
    assert 'ggmux_model_cache_bytes{model="m",tier="ram"} 2048' in text
    assert f'ggmux_model_cache_bytes{{model="n",tier="disk"}} {disk_n}' in text
    # the running replica's own counters, from its GET /cache: two prompts, neither cached
    assert 'ggmux_model_cache_misses_total{model="m"} 2' in text
    assert 'ggmux_model_cache_hits_total{model="m",tier="ram"} 0' in text
    st, _, b = s.request("POST", CHAT, body(0, turn="again"))  # back from RAM
    assert st == 200 and json.loads(b)["timings"]["cache_tier"] == "ram"
    text = s.request("GET", "/metrics")[2].decode()
    assert 'ggmux_model_cache_hits_total{model="m",tier="ram"} 1' in text
    restored = usage(b)["prompt_tokens_details"]["cached_tokens"]
    assert f'ggmux_model_cache_restored_tokens_total{{model="m"}} {restored}' in text


def test_cache_clear_empties_running_replicas_and_the_disk_of_stopped_models(
        serve, fakes, tmp_path, capsys):
    from ggmux.supervisor.cli import main as cli

    s, disk, _, _ = warm_two_models(serve, fakes, tmp_path)
    assert len(entry_files(disk)) == 1  # n's, saved when it stopped
    st, doc = s.json("POST", "/cache/clear", {"model": "m"})
    assert st == 200, doc
    assert doc["cleared"] == {"m": {"ram": 1, "disk": 0, "replicas": 1}}
    wait_for(lambda: row(s, 0)[L.M_CACHE_RAM_BYTES] == 0, 10, what="m's RAM tier emptied")
    assert len(entry_files(disk)) == 1 and row(s, 1)[L.M_CACHE_DISK_BYTES] > 0  # n's kept
    # the prompt that was in RAM is a miss now
    st, _, b = s.request("POST", CHAT, body(0, turn="again"))
    assert st == 200 and usage(b)["prompt_tokens_details"]["cached_tokens"] == 0
    assert cli(["cache", "clear", "n", "--url", s.base]) == 0
    assert "n: 0 RAM and 1 disk entries removed" in capsys.readouterr().out
    assert entry_files(disk) == []
    wait_for(lambda: row(s, 1)[L.M_CACHE_DISK_BYTES] == 0, 10, what="n's disk figure")
    assert all(os.path.exists(os.path.join(d, "model.json")) for d, _, fs in os.walk(disk)
               if fs and d != str(disk))  # the folders stay named (the root holds tenant.key)
    st, doc = s.json("POST", "/cache/clear", {})  # every model
    assert st == 200 and set(doc["cleared"]) == {"m", "n"}
    assert s.json("POST", "/cache/clear", {"model": "nope"})[0] == 404
    assert s.request("POST", "/cache/clear", b'{"model": "m"}',
                     headers={"content-type": "text/plain"})[0] == 415
    assert s.request("GET", "/cache/clear")[0] == 405


def test_cache_clear_needs_the_admin_key(serve, fakes, tmp_path, capsys, monkeypatch):
    from ggmux.supervisor.cli import main as cli

    s, disk, admin, api = warm_two_models(serve, fakes, tmp_path, "--api-key", "api",
                                          "--admin-key", "admin")
    assert s.request("POST", "/cache/clear", {}, headers=api)[0] == 401
    assert s.request("POST", "/cache/clear", {})[0] == 401
    # a page of another origin, even with the admin key
    assert s.request("POST", "/cache/clear", {}, headers={
        **admin, "origin": "https://evil.example"})[0] == 403
    assert len(entry_files(disk)) == 1
    monkeypatch.setenv("GGMUX_API_KEY", "api")
    assert cli(["cache", "clear", "--url", s.base]) == 1
    assert "needs the admin key" in capsys.readouterr().err
    assert len(entry_files(disk)) == 1
    st, doc = s.json("POST", "/cache/clear", {}, headers=admin)
    assert st == 200 and doc["cleared"]["n"]["disk"] == 1 and entry_files(disk) == []


E1 = "e1" * 32 + ".kv"  # an entry's name: <sha256 hex>.kv


def test_tier_settings_stop_budget_and_the_disk_layout_by_model_json(tmp_path):
    from ggmux.supervisor.kvtiers import files as T
    from ggmux.supervisor.registry import ModelEntry

    disk = tmp_path / "kv"
    e = ModelEntry("org/m:q4", str(tmp_path / "m.gguf"), stop_timeout=3.0,
                   instance_args=["--cache-disk", "/elsewhere"],
                   extra_args=["--cache-disk", str(disk), "--cache-save-timeout", "1.5"])
    t = T.tiers_of(e)  # the preset's value wins over serve's
    assert (t.disk_dir, t.save_timeout, t.slot_dir, t.on_disk) == (str(disk), 1.5, "", True)
    assert T.stop_budget(e) == 4.5
    assert T.stop_budget(ModelEntry("n", "n.gguf", stop_timeout=3.0)) == 3.0  # no disk tier
    assert T.tiers_of(ModelEntry("n", "n.gguf")).save_timeout == T.DEFAULT_SAVE_TIMEOUT_S
    for name, model in (("aa", "org/m:q4"), ("bb", "org/m:q4"), ("cc", "other")):
        (disk / name).mkdir(parents=True)
        (disk / name / "model.json").write_text(json.dumps({"model": model, "path": "x"}))
        (disk / name / E1).write_bytes(b"x" * 100)
        (disk / name / "notes.txt").write_text("an operator's: not an entry, never removed")
    (disk / "dd").mkdir()  # no model.json: not a model's
    (disk / "dd" / E1).write_bytes(b"x" * 7)
    (disk / "ee").mkdir()
    (disk / "ee" / "model.json").write_text("{torn")
    use = T.disk_use(str(disk), "org/m:q4")
    assert (use.entries, use.bytes) == (2, 200)
    assert T.clear_disk(str(disk), "org/m:q4") == 2
    assert T.disk_use(str(disk), "org/m:q4").bytes == 0
    assert (disk / "aa" / "model.json").exists() and (disk / "cc" / E1).exists()
    assert (disk / "aa" / "notes.txt").exists()
    assert T.disk_use(str(tmp_path / "missing"), "m").entries == 0


def test_a_cmd_models_slot_path_goes_to_its_command_and_slot_files_name_no_prompt(tmp_path):
    from ggmux.supervisor.kvtiers import files as T
    from ggmux.supervisor.registry import ModelEntry

    gguf = tmp_path / "secret-model-name.gguf"
    gguf.write_bytes(b"GGUF")
    slots = tmp_path / "slots"
    e = ModelEntry("secret-model-name", "", kind="cmd", cmd=f"llama-server -m {gguf}",
                   extra_args=["--slot-save-path", str(slots)])
    assert T.tiers_of(e).slot_dir == str(slots) and T.tiers_of(e).disk_dir == ""
    assert T.cmd_line(e, e.cmd) == f"llama-server -m {gguf} --slot-save-path {slots}"
    assert slots.is_dir() and slots.stat().st_mode & 0o777 == 0o700
    e.cmd = "srv --slot-save-path ${SLOT_SAVE_PATH} --port 1"
    assert T.cmd_line(e, e.cmd) == f"srv --slot-save-path {slots} --port 1"
    e2 = ModelEntry("x", "", kind="cmd", cmd=f"srv --slot-save-path {tmp_path}")
    assert T.tiers_of(e2).slot_dir == str(tmp_path)  # from its command line alone
    e.cmd = f"llama-server -m {gguf}"
    name = T.slot_file(e, 3)
    assert name.endswith("-slot3.bin") and "secret" not in name and "/" not in name
    assert name.startswith(T.slot_prefix(e))
    os.utime(gguf, ns=(1, 1))  # another GGUF (its time): another config, never restored
    assert T.slot_file(e, 3) != name and T.slot_file(e, 3).startswith(T.slot_prefix(e))


def test_an_eviction_waits_for_the_save_because_the_ledger_counts_the_saving_instance(
        serve, fakes, tmp_path):
    # room for one of the two: b's load must wait until a, evicted, has saved and exited
    fa = fakes.add("a", prefix_cache=True, tokens=2, save_s=1.5, mem_bytes=600 * MiB,
                   min_bytes=600 * MiB)
    fb = fakes.add("b", mem_bytes=600 * MiB, min_bytes=600 * MiB)
    disk = tmp_path / "kv"
    ini = preset(tmp_path, {"a": {"model": fa, "cache-disk": disk, "stop-timeout": 1},
                            "b": {"model": fb}})
    s = serve("--models-preset", ini, "--no-hf-cache", "--proxies", "1", "--host-memory", "1024",
              "--models-max", "2")
    st, _, b = s.request("POST", CHAT, body(0, model="a"))
    assert st == 200
    pid = served_by(b)[1]
    st, _, b = s.request("POST", CHAT, body(1, model="b"))
    assert st == 200 and served_by(b)[0] == "b"
    assert not alive(pid) and len(entry_files(disk)) == 1  # a saved, then exited
    log = s.logs()
    assert log.index("a (slot 0) stopped") < log.index("loading b")


def test_the_tenant_key_is_kept_beside_the_disk_tier_so_tenants_survive_a_restart(tmp_path):
    from ggmux.supervisor.kvtiers import files as T
    from ggmux.supervisor.registry import ModelEntry

    disk = tmp_path / "kv"
    e = ModelEntry("m", "m.gguf", extra_args=["--cache-disk", str(disk)])
    key = T.tenant_secret([ModelEntry("n", "n.gguf"), e])
    assert len(key) == 32 and T.tenant_secret([e]) == key  # the same on the next start
    path = disk / T.TENANT_KEY_FILE
    assert path.stat().st_mode & 0o777 == 0o600 and path.read_text().strip() == key
    assert T.tenant_secret([ModelEntry("n", "n.gguf")]) != key  # no disk tier: random
    path.write_text("not a key\n")
    assert T.tenant_secret([e]) != "not a key"


def test_a_keys_prefix_saved_to_disk_is_restored_for_that_key_alone_after_a_restart(
        serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2)
    ini = preset(tmp_path, {"m": {"model": f, "cache-disk": tmp_path / "kv"}})
    args = ("--models-preset", ini, "--no-hf-cache", "--proxies", "1", "--api-key", "ka,kb")
    alice, bob = {"authorization": "Bearer ka"}, {"authorization": "Bearer kb"}
    s = serve(*args)  # with API keys, the cache scope is per key
    assert s.request("POST", CHAT, body(0), headers=alice)[0] == 200
    assert s.json("POST", "/models/unload", {"model": "m"}, headers=alice)[0] == 200
    wait_for(lambda: row(s)[L.M_STATUS] == L.ModelStatus.UNLOADED, 20, what="saved, unloaded")
    s.stop()
    s2 = serve(*args)
    st, _, b = s2.request("POST", CHAT, body(0, turn="bob"), headers=bob)
    assert st == 200 and usage(b)["prompt_tokens_details"]["cached_tokens"] == 0
    st, _, b = s2.request("POST", CHAT, body(0, turn="alice again"), headers=alice)
    assert st == 200 and json.loads(b)["timings"]["cache_tier"] == "disk"
    assert usage(b)["prompt_tokens_details"]["cached_tokens"] > 100
