"""Model sources end to end (issue 4): presets, aliases, cmd models, reload."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import chat_body, served_by, wait_for
from ggmux.supervisor.demo import demo_models

CHAT = "/v1/chat/completions"



@pytest.mark.slow
def test_llama_cpp_preset_serves_both_demo_models_by_name_and_alias(serve, tmp_path):
    demos = {e.name: e.path for e in demo_models()}
    if len(demos) < 2:
        pytest.skip("demo models not installed")
    preset = tmp_path / "models.ini"
    preset.write_text(f"""version = 1

[*]
c = 1024
threads = 2

[small]
model = {demos["smollm2-135m"]}
alias = tiny, smol
load-on-startup = true

[gemma]
m = {demos["gemma3-270m"]}
ctx-size = 512
""")
    s = serve("--models-preset", str(preset), "--no-hf-cache", "--proxies", "1")
    wait_for(lambda: s.models()["small"]["status"]["value"] == "loaded", 30,
             what="load-on-startup")
    models = s.models()
    assert set(models) == {"small", "gemma"}  # each once, aliases beside them
    assert models["small"]["aliases"] == ["tiny", "smol"]
    assert "--ctx-size" in models["gemma"]["status"]["args"]
    for name in ("small", "tiny", "gemma"):
        st, _, body = s.request("POST", CHAT, chat_body(name, max_tokens=4))
        assert st == 200, body
    assert s.logs().count("loading small in slot") == 1  # the alias is the same model


def test_cmd_model_is_loaded_served_evicted_and_reloaded(serve, fakes, tmp_path):
    behaviour = fakes.add("behaviour", load_s=0.1)
    fakes.add("other")
    preset = tmp_path / "cmd.ini"
    preset.write_text(f"""[viacmd]
cmd = {sys.executable} -m ggmux.instance --fake --model {behaviour} --name viacmd --port ${{PORT}}
check-endpoint = /health
stop-timeout = 5
""")
    s = serve("--models-preset", str(preset), "--fake-models-dir", str(fakes), "--no-hf-cache",
              "--models-max", "1", "--proxies", "1")
    st, _, body = s.request("POST", CHAT, chat_body("viacmd"))
    assert st == 200 and served_by(body)[0] == "viacmd"
    first_pid = served_by(body)[1]
    assert s.request("POST", CHAT, chat_body("other"))[0] == 200  # evicts viacmd
    wait_for(lambda: s.models()["viacmd"]["status"]["value"] == "unloaded", 10,
             what="cmd model evicted")
    st, _, body = s.request("POST", CHAT, chat_body("viacmd"))
    assert st == 200 and served_by(body)[1] != first_pid  # a new process
    assert "failed" not in s.models()["viacmd"]["status"]


@pytest.mark.slow
def test_sighup_adds_new_models_and_reloads_an_edited_one_only_when_idle(serve, fakes, tmp_path):
    fakes.add("a", token_s=0.05, tokens=30)
    preset = tmp_path / "p.ini"
    preset.write_text("[a]\nctx-size = 1024\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(preset), "--no-hf-cache",
              "--proxies", "1")
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    pid = served_by(body)[1]
    with ThreadPoolExecutor(1) as ex:
        busy = ex.submit(s.request, "POST", CHAT, chat_body("a", stream=True))
        wait_for(lambda: s.seg.counters[:, :, 0].sum() == 1, 5, what="a busy")
        fakes.add("b")
        preset.write_text("[a]\nctx-size = 512\n")
        s.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "b" in s.models(), 5, what="b listed")
        st, _, streamed = busy.result()
    assert st == 200 and streamed.rstrip().endswith(b"[DONE]")  # not interrupted
    assert streamed.count(b"data: ") == 31
    wait_for(lambda: s.models()["a"]["status"]["value"] == "unloaded", 5,
             what="edited model unloaded once idle")
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    assert st == 200 and served_by(body)[1] != pid
    assert "--ctx-size" in (args := s.models()["a"]["status"]["args"])
    assert args[args.index("--ctx-size") + 1] == "512"
    assert s.request("POST", CHAT, chat_body("b"))[0] == 200
    # GET /models?reload=1 does the same; a removed file's model disappears
    (fakes.dir / "b.json").unlink()
    s.request("GET", "/models?reload=1")
    wait_for(lambda: "b" not in s.models(), 5, what="b gone")
    assert s.request("POST", CHAT, chat_body("b"))[0] == 404


@pytest.mark.parametrize(
    "text,fragment",
    [
        ("[m]\nmodel = {f}\nbogus-key = 1\n", ":3: unknown key 'bogus-key'"),
        ("[m]\nmodel = /nonexistent/x.gguf\n", ":2:"),
        ("[m]\nmodel = {f}\n[m]\nmodel = {f}\n", ":3:"),
        ("[m]\nmodel = {f}\nctx-size = lots\n", ":3:"),
    ],
)
def test_bad_preset_fails_at_start_with_file_line_and_reason(tmp_path, text, fragment):
    f = tmp_path / "x.gguf"
    f.write_bytes(b"GGUF")
    preset = tmp_path / "bad.ini"
    preset.write_text(text.format(f=f))
    r = subprocess.run(
        [sys.executable, "-m", "ggmux.supervisor", "serve", "--models-preset", str(preset),
         "--no-hf-cache", "--port", "1"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert r.returncode == 2
    assert str(preset) in r.stderr and fragment.split(" ", 1)[0] in r.stderr, r.stderr
    if "unknown key" in fragment:
        assert "bogus-key" in r.stderr


@pytest.mark.slow
def test_path_like_model_names_are_not_found(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
    for name in ("../a", "/etc/passwd", "..%2Fa", str(fakes.dir / "a.json"), "a.json"):
        st, _, body = s.request("POST", CHAT, json.dumps(chat_body(name)).encode())
        assert st == 404, name
        assert json.loads(body)["error"]["code"] == "model_not_found"


def test_health_is_503_loading_model_until_the_load_on_startup_models_first_load_ends(
        serve, fakes, tmp_path):
    """llama-server answers /health 503 "Loading model" until its model is
    loaded (readiness probes and its own test suite wait on it); ggmux does
    the same for load-on-startup models, and a first load that fails ends
    the wait (the failure is in /v1/models)."""
    fakes.add("slow", load_s=3)
    fakes.add("broken", load_s=0.2, fail_load="no weights")
    fakes.add("lazy")
    preset = tmp_path / "p.ini"
    preset.write_text("[slow]\nload-on-startup = true\n\n[broken]\nload-on-startup = true\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(preset), "--no-hf-cache",
              "--proxies", "1", ready=False)

    def answered():
        try:
            return s.request("GET", "/health")
        except OSError:
            return None

    first = wait_for(answered, 30, 0.05, "the proxy to answer")
    assert first[0] == 503, first
    # Kubernetes' readiness: the pod can serve (a request waits for the load)
    assert s.request("GET", "/readyz")[0] == 200
    assert json.loads(first[2]) == {"error": {"code": 503, "message": "Loading model",
                                              "type": "unavailable_error"}}
    wait_for(lambda: s.request("GET", "/health")[0] == 200, 30, 0.05, "the startup loads")
    models = s.models()
    assert models["slow"]["status"]["value"] == "loaded"
    assert models["broken"]["status"].get("failed"), models["broken"]
    assert models["lazy"]["status"]["value"] == "unloaded"
    # an unload afterwards does not make the server unready again
    assert s.request("POST", "/models/unload", {"model": "slow"})[0] == 200
    wait_for(lambda: s.models()["slow"]["status"]["value"] == "unloaded", 10, what="unload")
    assert s.request("GET", "/health")[0] == 200
