"""Preset values are checked at start (issue 11, finding 12): ``upstream``
is one or more ``http://`` URLs with a host, each one remote replica of
the model; every other value is type-checked, and each error reads
``FILE:LINE: reason``. Pure unit tests, no server started (the end-to-end
cases are in tests/test_upstreams.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from ggmux.supervisor.presets import PresetError, load_preset, resolve


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def no_hub(tmp_path, monkeypatch):
    monkeypatch.delenv("LLAMA_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))


def entries(tmp_path: Path, text: str):
    return {e.name: e for e in resolve([], load_preset(str(write(tmp_path / "p.ini", text))))}


def test_upstream_is_a_comma_separated_list_each_url_one_replica(tmp_path, no_hub):
    es = entries(tmp_path, "[m]\nupstream = http://gpu1:8080, http://10.0.0.2:9000/v1x/ ,"
                           "http://[::1]:7000,http://user:pw@gpu3\n"
                           "[one]\nupstream = http://gpu1:8080\n")
    m = es["m"]
    assert m.kind == "upstream"
    assert m.upstream == ["http://gpu1:8080", "http://10.0.0.2:9000/v1x", "http://[::1]:7000",
                          "http://user:pw@gpu3"]
    assert m.public()["upstream"][3] == "http://gpu3"  # no password in the registry blob
    assert es["one"].upstream == ["http://gpu1:8080"]


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("https://gpu1:8443", ["https:// is not supported yet"]),
        ("http://gpu1, https://gpu2", ["'https://gpu2'", "not supported yet"]),
        ("ftp://gpu1", ["expected http://HOST[:PORT][/PATH]"]),
        ("gpu1:8080", ["expected http://HOST[:PORT][/PATH]"]),
        ("http://", ["no valid host"]),
        ("http://:8080", ["no valid host"]),
        ("http://bad_host!:80", ["no valid host"]),
        ("http://gpu1:99999", ["Port out of range"]),
        ("http://gpu1:x", ["bad upstream"]),
        ("http://gpu1:0", ["port 0"]),
        ("http://gpu1/v1?key=x", ["query or fragment"]),
        ("http://gpu1, , http://gpu2", ["empty URL"]),
        ("http://gpu1, http://gpu1/", ["listed twice"]),
        (",", ["empty value"]),
    ],
)
def test_a_bad_upstream_is_an_error_at_its_line(tmp_path, no_hub, value, words):
    p = write(tmp_path / "p.ini", f"[*]\nc = 1\n\n[m]\nupstream = {value}\n")
    with pytest.raises(PresetError) as e:
        resolve([], load_preset(str(p)))
    assert (e.value.file, e.value.line) == (str(p), 5)
    assert str(e.value).startswith(f"{p}:5: 'upstream': ")
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("batch-size = many", ["'batch-size'", "expected an integer"]),
        ("b = 1.5", ["'b'", "expected an integer"]),
        ("n-predict = lots", ["'n-predict'", "expected an integer"]),
        ("parallel = two", ["'parallel'", "expected an integer"]),
        ("seed = random", ["'seed'", "expected an integer"]),
        ("temp = hot", ["'temp'", "expected a number"]),
        ("top-p = nan", ["'top-p'", "finite"]),
        ("LLAMA_ARG_TEMPERATURE = warm", ["'LLAMA_ARG_TEMPERATURE'", "expected a number"]),
        ("flash-attn = maybe", ["'flash-attn'", "one of on, off, auto"]),
        ("cache-type-k = q9_9", ["'cache-type-k'", "f16", "q8_0"]),
        ("ctv = f64", ["'ctv'", "q4_0"]),
        ("numa = all", ["'numa'", "distribute, isolate, numactl"]),
        ("ngld = most", ["'ngld'", "expected an integer"]),
        ("ctx-checkpoints = -1", ["'ctx-checkpoints'", "expected 0 or more"]),
        ("checkpoint-min-step = -5", ["'checkpoint-min-step'", "expected 0 or more"]),
        ("swa-checkpoints = some", ["'swa-checkpoints'", "expected an integer"]),
    ],
)
def test_llama_cpp_values_of_the_wrong_type_are_errors_at_their_line(
    tmp_path, no_hub, line, words
):
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF" + b"\0" * 12)
    p = write(tmp_path / "p.ini", f"[m]\nmodel = {m}\n{line}\n")
    with pytest.raises(PresetError) as e:
        resolve([], load_preset(str(p)))
    assert str(e.value).startswith(f"{p}:3: ")
    for w in words:
        assert w in str(e.value), str(e.value)


def test_llama_cpp_values_of_the_right_type_pass_through_unchanged(tmp_path, no_hub):
    m = tmp_path / "m.gguf"
    m.write_bytes(b"GGUF" + b"\0" * 12)
    es = entries(tmp_path, f"[m]\nmodel = {m}\nbatch-size = 256\ntemp = 0.7\nflash-attn = auto\n"
                           "cache-type-k = q8_0\nseed = -1\nngld = all\nchat-template = chatml\n")
    assert es["m"].extra_args == [
        "--batch-size", "256", "--temperature", "0.7", "--flash-attn", "auto",
        "--cache-type-k", "q8_0", "--seed", "-1", "--n-gpu-layers-draft", "all",
        "--chat-template", "chatml",
    ]
