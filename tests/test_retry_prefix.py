"""A client that gives up during a long prefill and sends the same prompt
again (Claude Code does, after its own timeout) finds the part of the
prompt already read in the slot, as llama-server's slot keeps it: only the
rest is read. The demo model end to end, one slot, one thread, 128-token
batches (a prompt of five batches is read in a few seconds)."""

from __future__ import annotations

import json

import pytest
from conftest import open_stream, wait_for
from ggmux.shm import layout as L
from ggmux.supervisor.demo import demo_models

SMOL = "smollm2-135m"
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not any(e.name == SMOL for e in demo_models()),
                                 reason="the demo models are not installed")]


def long_prompt() -> list[dict]:
    """About 650 tokens: five batches of 128 (the preset's ``batch-size``)."""
    text = " ".join(f"Line {i}: the router keeps what it read, and the client comes back."
                    for i in range(45))
    return [{"role": "user", "content": text + "\nSummarise the lines in one sentence."}]


@pytest.mark.timeout(600)
def test_a_retry_after_the_client_left_mid_prefill_reads_only_the_rest(serve, tmp_path):
    path = next(e.path for e in demo_models() if e.name == SMOL)
    ini = tmp_path / "presets.ini"
    ini.write_text(f"[{SMOL}]\nmodel = {path}\nbatch-size = 128\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", "--threads", "1",
              "--ctx-size", "4096", "--parallel", "1", "--spares", "0")
    body = {"model": SMOL, "messages": long_prompt(), "max_tokens": 1, "temperature": 0}
    sock = open_stream(s.port, {**body, "stream": True, "return_progress": True})
    got, read = b"", 0
    while read == 0:  # until a batch of the prompt was read, then the client leaves
        chunk = sock.recv(65536)
        assert chunk, got[-2000:]
        got += chunk
        for line in got.split(b"\n"):
            if line.startswith(b"data: {") and b"prompt_progress" in line:
                p = json.loads(line[6:])["prompt_progress"]
                if p["processed"] > p["cache"]:
                    read, total = p["processed"], p["total"]
    sock.close()
    assert read < total, "the whole prompt was read before the client could leave"
    inflight = s.seg.counters[:, :, L.C_IN_FLIGHT]
    wait_for(lambda: inflight.sum() == 0, 30.0, what="the request ended when its client left")
    st, doc = s.json("POST", "/v1/chat/completions", body, timeout=300)
    assert st == 200, doc
    usage = doc["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    # what was read before the client left is not read again
    assert cached >= read, (cached, read, usage)
    assert usage["prompt_tokens"] == total
    assert doc["timings"]["cache_n"] == cached and doc["timings"]["prompt_n"] == total - cached
