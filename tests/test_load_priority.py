"""Loads yield the CPU to serving replicas (issue 31, item 11): a loading
replica's threads run at a nice value raised by ``--load-nice`` until it is
ready, then at the supervisor's again, read from ``/proc/PID/task/*/stat``.
The speed it buys is measured in bench/load_isolation.py, not here."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest
from conftest import chat_body, wait_for
from ggmux.supervisor import priority

CHAT = "/v1/chat/completions"


def _stat(path: str) -> list[str] | None:
    """The fields of a ``stat`` file after the command name (field 3 on)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2:].decode().split()


def thread_nices(pid: int) -> list[int]:
    """The nice value (field 19) of every thread of ``pid``."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        fields = _stat(f"/proc/{pid}/task/{tid}/stat")
        if fields is not None:
            out.append(int(fields[16]))
    return out


def child_titled(server_pid: int, title_: str) -> int | None:
    """The pid of a child of the supervisor ``server_pid`` whose process
    title starts with ``title`` (``ggmux: instance NAME``, ``ggmux: spare``: ``title_``)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read()
        except OSError:
            continue
        fields = _stat(f"/proc/{entry}/stat")
        if (fields is not None and int(fields[1]) == server_pid
                and title.startswith(title_.encode())):
            return int(entry)
    return None


@pytest.mark.skipif(not priority.can_give_back(os.getpriority(os.PRIO_PROCESS, 0)),
                    reason="no CAP_SYS_NICE nor RLIMIT_NICE here: --load-nice is off")
@pytest.mark.parametrize("spares", ["0", "1"])
def test_a_loading_replica_runs_at_a_raised_nice_value_until_ready(serve, fakes, spares):
    fakes.add("m", load_s=2.0, tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--spares", spares)
    base = os.getpriority(os.PRIO_PROCESS, 0)  # the supervisor's: ours, inherited
    low = min(19, base + priority.LOAD_NICE)
    if spares == "1":  # a spare's start is load work done ahead: lowered too
        spare = wait_for(lambda: child_titled(s.proc.pid, "ggmux: spare"), 30, what="a spare")
        assert set(thread_nices(spare)) == {low}
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=s.request("POST", CHAT, chat_body("m"))))
    t.start()
    try:
        pid = wait_for(lambda: child_titled(s.proc.pid, "ggmux: instance m"), 20,
                       what="the instance of m")
        during = thread_nices(pid)
        assert during and set(during) == {low}, during
    finally:
        t.join(60)
    assert answer["r"][0] == 200, answer
    after = thread_nices(pid)  # ready: its threads serve at the supervisor's value
    assert after and set(after) == {base}, after


def test_load_nice_is_off_where_a_priority_could_not_be_given_back(monkeypatch):
    monkeypatch.setattr(priority, "can_give_back", lambda nice: False)
    assert priority.usable_nice(10) == 0
    monkeypatch.setattr(priority, "can_give_back", lambda nice: True)
    assert priority.usable_nice(10) == 10
    assert priority.usable_nice(0) == 0


@pytest.mark.skipif(not priority.can_give_back(os.getpriority(os.PRIO_PROCESS, 0)),
                    reason="no CAP_SYS_NICE nor RLIMIT_NICE here: --load-nice is off")
def test_a_cmd_replica_and_the_server_its_wrapper_started_get_their_priority_back(
        serve, tmp_path):
    # a cmd line whose server is a child of a shell: children inherit the
    # lowered value, so it is given back to the whole family once ready
    log = tmp_path / "cmd.jsonl"
    log.touch()
    recorder = Path(__file__).with_name("recorder.py")
    cmd = f"sh -c '{sys.executable} {recorder} --port ${{PORT}} --log {log}; true'"
    ini = tmp_path / "preset.ini"
    ini.write_text(f"[c]\ncmd = {cmd}\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", "--spares", "0")
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert s.request("POST", CHAT, chat_body("c"), timeout=30)[0] == 200
    server = wait_for(lambda: next((int(p) for p in os.listdir("/proc") if p.isdigit()
                                    and str(log).encode() in _cmdline(p)
                                    and _cmdline(p).startswith(sys.executable.encode())),
                                   None),
                      10, what="the recorder process (not its shell)")
    nices = thread_nices(server)
    assert nices and set(nices) == {base}, nices


def _cmdline(pid: str) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def test_the_server_a_cmd_wrapper_shell_started_stops_with_the_model(serve, tmp_path):
    """A cmd replica leads its own process group: the stop reaches the
    server that its wrapper shell started, which the shell's death left
    running before (issue 37: a tests/recorder.py outlived the suite)."""
    log = tmp_path / "cmd.jsonl"
    log.touch()
    recorder = Path(__file__).with_name("recorder.py")
    ini = tmp_path / "preset.ini"
    ini.write_text(f"[c]\ncmd = sh -c '{sys.executable} {recorder} --port ${{PORT}} --log {log}; "
                   "true'\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", "--spares", "0")
    assert s.request("POST", CHAT, chat_body("c"), timeout=30)[0] == 200
    server = wait_for(lambda: next((int(p) for p in os.listdir("/proc") if p.isdigit()
                                    and str(log).encode() in _cmdline(p)
                                    and _cmdline(p).startswith(sys.executable.encode())),
                                   None),
                      10, what="the recorder process (not its shell)")
    assert s.json("POST", "/models/unload", {"model": "c"})[0] == 200
    wait_for(lambda: not _cmdline(str(server)), 30, what="the wrapper's server gone")
