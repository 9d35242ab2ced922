"""Supervisor stop paths end to end that other files leave out: a load past
``--load-timeout`` is killed and reported as a failed load; a ``cmd`` model
with ``cmd-stop`` is stopped by that command, not by a signal."""

from __future__ import annotations

import sys

import pytest
from conftest import alive, wait_for
from ggmux.shm import layout as L


@pytest.mark.slow
def test_a_hung_load_past_load_timeout_is_killed_and_reported(serve, fakes):
    fakes.add("hang", hang_load=True)
    s = serve("--fake-models-dir", str(fakes), "--load-timeout", "0.5", "--proxies", "1")
    assert s.json("POST", "/models/load", {"model": "hang"})[0] == 200
    pid = wait_for(lambda: int(s.seg.replicas[:, L.R_PID].max()), 10, what="pid")
    wait_for(lambda: not alive(pid), 10, what="the hung instance killed")
    m = wait_for(lambda: (st := s.models()["hang"]["status"]).get("failed") and st, 10,
                 what="failed load")
    assert "load did not finish within" in m["error"] and "(--load-timeout)" in m["error"]
    assert m["exit_code"] == -9


def test_cmd_stop_stops_a_cmd_model(serve, fakes, tmp_path):
    behaviour = fakes.add("behaviour", load_s=0.05)
    marker = tmp_path / "stopped"
    preset = tmp_path / "cmd.ini"
    preset.write_text(f"""[viacmd]
cmd = {sys.executable} -m ggmux.instance --fake --model {behaviour} --name viacmd --port ${{PORT}}
check-endpoint = /health
cmd-stop = sh -c "echo ${{PID}} ${{MODEL_ID}} > {marker}; kill ${{PID}}"
""")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--proxies", "1")
    assert s.json("POST", "/models/load", {"model": "viacmd"})[0] == 200
    wait_for(lambda: s.models()["viacmd"]["status"]["value"] == "loaded", 15, what="loaded")
    pid = int(s.seg.replicas[:, L.R_PID].max())
    assert s.json("POST", "/models/unload", {"model": "viacmd"})[0] == 200
    wait_for(lambda: not alive(pid), 10, what="cmd model stopped")
    assert marker.read_text().split() == [str(pid), "viacmd"]
    wait_for(lambda: s.models()["viacmd"]["status"]["value"] == "unloaded", 10, what="unloaded")
