"""The KV cache's bytes before a load (instance/kv_size.py): sliding-window
layers count their window, not the context, as llama.cpp allocates them;
the memory ledger takes these figures for a model it has not loaded yet."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from ggmux.instance.kv_size import checkpoint_bytes, kv_cache_bytes, sliding_layers
from ggmux.supervisor.demo import demo_models

MIB = 1 << 20


def test_gemma3_270m_as_llama_cpp_allocates_it():
    """llama-server b11434 on gemma-3-270m, ``-c 16384 -np 4`` (not unified):
    "non-SWA KV cache ... 48.00 MiB (4096 cells, 3 layers, 4/4 seqs)" and
    "SWA KV cache ... 60.00 MiB (1024 cells, 15 layers, 4/4 seqs)"."""
    n_swa = sliding_layers("gemma3", 18, 512)
    assert n_swa == 15
    per_token = 1 * 256 * 2  # KV heads x head size x f16
    got = kv_cache_bytes(18, per_token, 16384, swa_layers=n_swa, n_swa=512, sequences=4,
                         unified=False)
    assert got == (48 + 60) * MIB
    full = kv_cache_bytes(18, per_token, 16384, sequences=4, unified=False)
    assert full == 2 * 18 * 16384 * per_token  # every layer at the context: 288 MiB
    # one unified cache of the same cells: the window of every sequence and a micro-batch
    assert kv_cache_bytes(18, per_token, 16384, swa_layers=15, n_swa=512, sequences=4) == \
        2 * per_token * (3 * 16384 + 15 * 2560)


def test_which_layers_slide():
    assert sliding_layers("gemma3", 62, 1024) == 52  # Gemma 3 27B: 52 of 62
    assert sliding_layers("gpt-oss", 24, 128) == 12
    assert sliding_layers("gemma3", 18, 0) == 0  # no window: nothing slides
    assert sliding_layers("some-new-arch", 30, 4096) == 0  # unknown: every layer whole
    assert sliding_layers("some-new-arch", 30, 4096, period=4) == 23  # the GGUF's key
    # a window longer than the cache: the cache's cells, no more
    assert kv_cache_bytes(4, 10, 100, swa_layers=2, n_swa=4096, sequences=1) == 2 * 10 * 400


def measure(model: str, *llama_args: str) -> dict:
    p = subprocess.Popen([sys.executable, "-m", "ggmux.instance", "--model", model, "--ctx-size",
                          "4096", "--llama-args", json.dumps(["--parallel", "4", *llama_args]),
                          "--measure"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()  # stdin stays open: EOF would end it at once
    finally:
        p.stdin.close()
        err = p.stderr.read()
        p.wait(60)
    assert line.startswith("state:"), (line, err[-2000:])
    return json.loads(line.removeprefix("state:"))


def test_measure_counts_gemma3s_window_and_swa_full_its_whole_cache():
    """The instance's ``--measure`` on the real GGUF: with llama-server's
    default the 15 sliding layers hold 4 x 1,024 cells of the 16,384 four
    slots of 4,096 tokens have; ``--swa-full`` keeps every position."""
    path = {e.name: e.path for e in demo_models()}.get("gemma3-270m")
    if path is None:
        pytest.skip("gemma3-270m is not installed")
    window, whole = measure(path), measure(path, "--swa-full")
    assert whole["min"]["host"] - window["min"]["host"] == 2 * 15 * 256 * 2 * (16384 - 4 * 1024)
    # max: every slot's 32 checkpoints (7.9 MB each, the window's cells) on top
    one = checkpoint_bytes(15, 512, 256 * 2)
    assert one == 7_864_320  # 7,870,848 measured with the state's headers (docs/kv-tiers.md)
    no_ckpt = measure(path, "--ctx-checkpoints", "0")
    assert window["max"]["host"] - no_ckpt["max"]["host"] == 4 * 32 * one
    # --swa-full keeps every position: it can be cut anywhere, no checkpoint is made
    assert whole["max"]["host"] == measure(path, "--swa-full", "--ctx-checkpoints", "0")[
        "max"]["host"]
