"""What a new user meets on a first run (issue 15): process titles that say
what each process is, a reload that answers with the new list,
``--watch-config``, ``unload *``, a quiet stop, and the example preset
starting as shipped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import chat_body, children_of, open_stream, served_by, wait_for
from ggmux.supervisor.demo import demo_models

ROOT = Path(__file__).resolve().parent.parent


def title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode()


def titles(pid: int) -> list[str]:
    out = []
    for c in children_of(pid):
        try:
            out.append(title(c))
        except OSError:
            pass
    return sorted(out)


@pytest.mark.slow
def test_every_process_title_names_its_role_and_model(serve, fakes):
    fakes.add("alpha")
    fakes.add("beta", measure_s=60)  # its measure child stays while we look
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "1")
    assert title(s.proc.pid) == f"ggmux: supervisor 127.0.0.1:{s.port}"
    wait_for(lambda: "ggmux: spare" in titles(s.proc.pid), 15, what="a spare")
    # the measure child sets its title once its imports are done
    wait_for(lambda: "ggmux: measure beta" in titles(s.proc.pid), 15, what="beta's measure child")
    # /health answered by one proxy: the other may still be starting up
    proxies = [f"ggmux: proxy 0 :{s.port}", f"ggmux: proxy 1 :{s.port}"]
    wait_for(lambda: [t for t in titles(s.proc.pid) if t.startswith("ggmux: proxy")] == proxies,
             15, what="both proxies' titles")
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("alpha"))
    assert st == 200
    pid = served_by(body)[1]
    # the spare took the model: it no longer looks like a spare
    assert title(pid) == "ggmux: instance alpha #0"


def test_an_instance_started_for_its_model_has_the_title_too(serve, fakes):
    fakes.add("alpha")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("alpha"))
    assert st == 200 and title(served_by(body)[1]) == "ggmux: instance alpha #0"


def test_reload_answers_with_the_new_list(serve, fakes):
    fakes.add("alpha")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    fakes.add("beta")
    for _ in range(3):  # each proxy, each time: the list after the rescan
        st, doc = s.json("GET", "/models?reload=1")
        assert st == 200 and [m["id"] for m in doc["data"]] == ["alpha", "beta"]
    (fakes.dir / "beta.json").unlink()
    st, doc = s.json("GET", "/v1/models?reload=1")
    assert [m["id"] for m in doc["data"]] == ["alpha"]


def test_watch_config_picks_up_an_edited_preset(serve, fakes, tmp_path):
    alpha = fakes.add("alpha")
    preset = tmp_path / "presets.ini"
    preset.write_text(f"[alpha]\nmodel = {alpha}\nalias = a1\n")
    s = serve("--models-preset", str(preset), "--proxies", "1", "--spares", "0",
              "--watch-config")
    assert s.models()["alpha"]["aliases"] == ["a1"]
    preset.write_text(f"[alpha]\nmodel = {alpha}\nalias = a2\n")
    # deadlines that hold at 4x slower than an idle machine (issue 37, item 15)
    wait_for(lambda: s.models()["alpha"]["aliases"] == ["a2"], 10.0, 0.02,
             what="the edited alias")
    assert "changed (--watch-config)" in s.logs()
    beta = fakes.add("beta")
    preset.write_text(preset.read_text() + f"[beta]\nmodel = {beta}\n")
    wait_for(lambda: "beta" in s.models(), 10.0, 0.02, what="a new section")


def test_watch_config_sees_a_new_file_in_a_models_dir(serve, fakes):
    fakes.add("alpha")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--watch-config")
    fakes.add("beta")
    wait_for(lambda: "beta" in s.models(), 10.0, 0.02, what="a new model file")


def test_unload_star_unloads_every_idle_model_and_no_busy_one(serve, fakes):
    fakes.add("idle")
    fakes.add("busy", ttft_s=0.01, token_s=0.05, tokens=400)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert s.request("POST", "/v1/chat/completions", chat_body("idle"))[0] == 200
    sock = open_stream(s.port, chat_body("busy", stream=True))
    try:
        got = b""
        while b"data: " not in got:  # the stream is being served
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        st, doc = s.json("POST", "/models/unload", {"model": "*"})
        assert st == 200 and doc == {"success": True, "model": "*", "op": "unload"}
        wait_for(lambda: s.models()["idle"]["status"]["value"] == "unloaded", 10,
                 what="the idle model unloaded")
        assert s.models()["busy"]["status"]["value"] == "loaded"  # it is serving
    finally:
        sock.close()


def test_a_stop_while_a_model_is_measured_logs_no_warning(serve, fakes):
    fakes.add("alpha", measure_s=60)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    wait_for(lambda: "ggmux: measure alpha" in titles(s.proc.pid), 10, what="the measure child")
    s.stop()
    text = s.log_path.read_text()
    assert "could not measure" not in text and " WARNING " not in text, text


@pytest.mark.slow
def test_the_example_preset_starts_as_shipped(serve, monkeypatch):
    if len(demo_models()) < 2:
        import pytest

        pytest.skip("the demo models are not installed")
    for var in list(os.environ):
        if var.startswith("GGMUX_DEMO_"):
            monkeypatch.delenv(var)
    s = serve("--models-preset", str(ROOT / "presets.example.ini"), "--proxies", "1")
    assert sorted(s.models()) == ["gemma3-270m", "gemma3-270m-llama-server", "remote-gemma3",
                                  "smollm2-135m"]


@pytest.mark.slow
def test_measuring_a_real_model_prints_no_warning():
    """The measure child read the GGUF metadata through a vocab-only
    context, and llama.cpp warned "n_ctx_seq (512) > n_ctx_train (0)" at
    every start; it reads the model alone now."""
    import subprocess
    import sys

    demos = {e.name: e.path for e in demo_models()}
    if "smollm2-135m" not in demos:
        import pytest

        pytest.skip("the demo models are not installed")
    p = subprocess.Popen([sys.executable, "-m", "ggmux.instance", "--model",
                          demos["smollm2-135m"], "--measure"], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # stdin stays open: EOF would end it at once
    finally:
        p.stdin.close()
        err = p.stderr.read()
        p.wait(60)
    assert line.startswith('state:{"state":"measured"'), (line, err)
    assert "n_ctx_train" not in err and "warn" not in err.lower(), err
