"""A `cmd` llama-server's slots saved before it stops and restored after
its next load (issue 29, done-when 4; DESIGN.md "KV tiers"): the order
(save, then SIGTERM; restore, then ready), the failure paths (logged, the
replica still stops or serves), the bound (cache-save-timeout), on a stub
that speaks llama-server's slot routes, then on the real llama-server that
bench/llama_server.py builds."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
from conftest import wait_for
from ggmux.shm import layout as L

ROOT = Path(__file__).resolve().parent
CHAT = "/v1/chat/completions"


def stub(serve, tmp_path, *extra: str, timeout: float = 2.0):
    log, control = tmp_path / "events.log", tmp_path / "control.json"
    slots = tmp_path / "slots"
    cmd = (f"{sys.executable} {ROOT / 'slot_server.py'} --port ${{PORT}} "
           f"--slot-save-path ${{SLOT_SAVE_PATH}} --log {log} --control {control}")
    ini = tmp_path / "slots.ini"
    ini.write_text(f"[s]\ncmd = {cmd}\nslot-save-path = {slots}\n"
                   f"cache-save-timeout = {timeout}\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", *extra)
    return s, log, control, slots


def events(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def chat(s, text: str) -> int:
    return s.request("POST", CHAT, {"model": "s", "messages": [
        {"role": "user", "content": text}]})[0]


def load(s) -> None:
    assert s.request("POST", "/models/load", {"model": "s"})[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_STATUS] == L.ModelStatus.LOADED, 30, what="loaded")


def unload(s) -> None:
    assert s.request("POST", "/models/unload", {"model": "s"})[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_STATUS] == L.ModelStatus.UNLOADED, 30,
             what="unloaded")


def test_a_cmd_replica_saves_its_slots_before_sigterm_and_restores_them_before_ready(
        serve, tmp_path):
    s, log, _, slots = stub(serve, tmp_path)
    assert chat(s, "one two three four") == 200
    unload(s)
    ev = events(log)
    assert ev[0] == "chat" and ev[-1] == "sigterm"
    saved = [e.split() for e in ev if e.startswith("save ")]
    assert [e[1] for e in saved] == ["0"]  # only the slot that held a prompt
    name = saved[0][2]
    assert re.fullmatch(r"ggmux-[0-9a-f]{12}-[0-9a-f]{12}-slot0\.bin", name)  # no prompt text
    assert (slots / name).read_text() == "one two three four"
    assert oct((slots).stat().st_mode & 0o777) == "0o700"
    wait_for(lambda: s.seg.models[0, L.M_CACHE_DISK_BYTES] == len("one two three four"), 10,
             what="the slot files' size")
    load(s)
    ev = events(log)
    assert ev[-1] == f"restore 0 {name} 4"  # before it was ready: no request came first
    assert chat(s, "five") == 200


def test_a_failed_save_or_restore_is_logged_and_the_replica_still_stops_and_serves(
        serve, tmp_path):
    s, log, control, _slots = stub(serve, tmp_path)
    assert chat(s, "one two") == 200
    unload(s)
    control.write_text(json.dumps({"fail": "restore"}))
    load(s)  # ready all the same
    assert events(log)[-1] == "fail restore"
    assert chat(s, "three") == 200  # served by prefill
    assert "slot not restored (the next request is served by prefill)" in s.logs()
    control.write_text(json.dumps({"fail": "save"}))
    unload(s)
    assert events(log)[-2:] == ["fail save", "sigterm"]
    assert "slot not saved" in s.logs()


def test_a_stuck_save_is_not_waited_for_past_cache_save_timeout(serve, tmp_path):
    s, log, control, _ = stub(serve, tmp_path, timeout=1.0)
    assert chat(s, "one two") == 200
    control.write_text(json.dumps({"delay": 120}))
    unload(s)
    assert events(log)[-1] == "sigterm" and not any(e.startswith("save") for e in events(log))
    # the save's own HTTP deadline ended it (else the supervisor stops waiting at once past it)
    assert "slot not saved (the next request is served by prefill): slot 0: timed out" in s.logs()


def _llama_server() -> Path | None:
    sys.path.insert(0, str(ROOT.parent / "bench"))
    try:
        import llama_server
    finally:
        sys.path.pop(0)
    return llama_server.find()


def test_a_real_llama_server_slot_saved_before_an_eviction_is_restored_after_the_reload(
        serve, tmp_path):
    from ggmux.supervisor.demo import demo_path

    binary = _llama_server()
    if binary is None:
        pytest.skip("no llama-server: build it with `python bench/llama_server.py` "
                    "(~/.cache/ggmux-bench/llama-server)")
    model = demo_path("GGMUX_DEMO_SMOLLM2")
    if model is None or not os.path.isfile(model):
        pytest.skip("demo model smollm2-135m not installed")
    slots = tmp_path / "slots"
    ini = tmp_path / "real.ini"
    ini.write_text(f"[s]\ncmd = {binary} -m {model} --port ${{PORT}} -c 1024 -np 1 -t 1 "
                   f"--slot-save-path ${{SLOT_SAVE_PATH}}\nslot-save-path = {slots}\n"
                   "cache-save-timeout = 20\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1")
    prompt = "Here is a list of fruits: " + ", ".join(f"fruit number {i}" for i in range(40))
    req = {"model": "s", "max_tokens": 2, "temperature": 0,
           "messages": [{"role": "user", "content": prompt}]}
    st, _, b = s.request("POST", CHAT, req, timeout=300)
    assert st == 200, b
    first = json.loads(b)["timings"]
    assert first["cache_n"] == 0 and first["prompt_n"] > 100
    unload(s)
    assert len(list(slots.iterdir())) == 1 and "saved 1 slot(s)" in s.logs()
    load(s)
    assert "restored 1 slot(s)" in s.logs()
    st, _, b = s.request("POST", CHAT, req, timeout=300)
    assert st == 200, b
    again = json.loads(b)["timings"]
    # the restored slot's prompt is reused: only what follows it is read
    assert again["cache_n"] >= first["prompt_n"] - 1 and again["prompt_n"] <= 2, again
