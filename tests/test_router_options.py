"""llama-server router options that ggmux serve takes as llama-server does
(issue 23): ``--no-models-autoload``, and llama-server options after
``--`` for every model."""

from __future__ import annotations

from conftest import chat_body, served_by, wait_for
from ggmux.supervisor.cli import build_parser, build_registry, split_llama_args

CHAT = "/v1/chat/completions"


def test_no_models_autoload_loads_only_on_an_explicit_load(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--no-models-autoload",
              "--load-wait", "1")
    _, doc = s.seg.read_registry()
    assert doc["router"] == {"models_max": 4, "models_autoload": False, "model_fallback": None,
                             "metrics": True, "metrics_compat": "vllm",
                             "kv_block_size": 16}  # for GET /props and /metrics
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    assert st == 400 and b"model is not loaded" in body, body  # llama-server's answer
    assert s.models()["a"]["status"]["value"] == "unloaded"
    assert "load of a" not in s.logs() and "loading a" not in s.logs()
    st, _, _ = s.request("POST", "/models/load", {"model": "a"})
    assert st == 200
    wait_for(lambda: s.models()["a"]["status"]["value"] == "loaded", 20, what="explicit load")
    st, _, body = s.request("POST", CHAT, chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"


def test_models_autoload_is_the_default(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    _, doc = s.seg.read_registry()
    assert doc["router"]["models_autoload"] is True
    assert s.request("POST", CHAT, chat_body("a"))[0] == 200


def test_llama_server_options_after_dashes_apply_to_every_model_over_its_preset(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    preset = tmp_path / "p.ini"
    preset.write_text(f"[*]\nseed = 1\n\n[m]\nmodel = {f}\ntemp = 0.2\n\n[n]\nmodel = {f}\n")
    argv, llama = split_llama_args(["serve", "--models-preset", str(preset), "--no-hf-cache",
                                    "--", "--temp", "0.8", "--no-mmap"])
    assert llama == ["--temp", "0.8", "--no-mmap"] and "--" not in argv
    args = build_parser().parse_args(argv)
    args.llama_args = llama
    reg = build_registry(args)
    for name in ("m", "n"):
        extra = reg.get(name).extra_args
        assert extra[extra.index("--temperature") + 1] == "0.8", extra  # over the section's
        assert "--no-mmap" in extra and extra[extra.index("--seed") + 1] == "1"
    assert split_llama_args(["ps", "--", "x"]) == (["ps", "--", "x"], [])


def test_a_bad_llama_option_after_dashes_stops_the_start(serve, fakes, tmp_path):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--", "--temp", "hot", ready=False)
    wait_for(lambda: s.proc.poll() is not None, 30, what="the start to fail")
    assert s.proc.returncode == 2
    assert "'temp': bad number 'hot'" in s.logs()
