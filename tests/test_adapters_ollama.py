"""The Ollama adapter on bytes, without any process (issue 14)."""

from __future__ import annotations

import json
import math

import pytest
from adapter_streams import chat_sse, run_stream
from ggmux.proxy.apis.adapters import ollama as O
from ggmux.proxy.apis.adapters.common import BadRequest
from ggmux.proxy.apis.adapters.openai import UsageStream


def test_chat_streams_by_default_and_maps_option_names():
    t = O.Chat().request({"model": "m:latest", "messages": [{"role": "user", "content": "hi"}],
                          "options": {"num_predict": 5, "temperature": 0.1, "top_k": 3,
                                      "top_p": 0.8, "stop": ["x"], "seed": 7, "num_ctx": 4096},
                          "format": "json"})
    b = t.body
    assert t.stream and b["stream"] and b["stream_options"] == {"include_usage": True}
    assert (b["max_tokens"], b["temperature"], b["top_k"], b["top_p"], b["stop"], b["seed"]) == \
        (5, 0.1, 3, 0.8, ["x"], 7)
    assert "num_ctx" not in b and b["response_format"] == {"type": "json_object"}


def test_generate_is_a_chat_with_system_or_a_raw_completion():
    t = O.Generate().request({"model": "m", "prompt": "p", "system": "s", "stream": False})
    assert t.target == b"/v1/chat/completions" and not t.stream
    assert t.body["messages"] == [{"role": "system", "content": "s"},
                                  {"role": "user", "content": "p"}]
    t = O.Generate().request({"model": "m", "prompt": "p", "raw": True})
    assert t.target == b"/v1/completions" and t.body["prompt"] == "p"


@pytest.mark.parametrize("value, seconds", [
    (0, 0.0), ("0", 0.0), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("300ms", 0.3),
    (-1, math.inf), ("-1m", math.inf), (None, None),
])
def test_keep_alive_reads_numbers_and_go_durations(value, seconds):
    assert O.keep_alive_seconds(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5", True, "", "5x"])
def test_keep_alive_garbage_is_refused(value):
    if value == "5":
        assert O.keep_alive_seconds(value) == 5.0
        return
    with pytest.raises(BadRequest):
        O.keep_alive_seconds(value)


def test_ndjson_stream_lines_and_the_done_line():
    t = O.Chat().request({"model": "smol:latest", "messages": [{"role": "user", "content": "x"}]})
    raw = run_stream(O.Chat().stream(t), chat_sse(["A", "B"], usage={
        "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}))
    lines = [json.loads(x) for x in raw.decode().splitlines()]
    assert [ln["message"]["content"] for ln in lines] == ["A", "B", ""]
    assert [ln["done"] for ln in lines] == [False, False, True]
    assert all(ln["model"] == "smol:latest" and ln["created_at"].endswith("Z") for ln in lines)
    last = lines[-1]
    assert last["done_reason"] == "stop" and last["eval_count"] == 2
    assert last["prompt_eval_count"] == 3 and last["total_duration"] >= last["eval_duration"]


def test_generate_stream_uses_response_and_errors_are_an_error_line():
    t = O.Generate().request({"model": "m", "prompt": "x"})
    st = O.Generate().stream(t)
    out = st.event(b'{"choices":[{"index":0,"delta":{"content":"q"}}]}')
    assert json.loads(out)["response"] == "q"
    out = st.event(b'{"error":{"message":"gone","type":"server_error","code":500}}')
    assert st.failed and json.loads(out) == {"error": "gone"}


def test_whole_answers_and_embeddings():
    t = O.Chat().request({"model": "m", "messages": [], "stream": False})
    obj = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                        "finish_reason": "length"}],
           "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
    r = O.Chat().response(obj, t)
    assert r["message"] == {"role": "assistant", "content": "hey"} and r["done"]
    assert r["done_reason"] == "length" and r["eval_count"] == 1
    t = O.Embed().request({"model": "m", "input": ["a", "b"]})
    assert t.target == b"/v1/embeddings" and t.body["input"] == ["a", "b"]
    emb = {"data": [{"index": 1, "embedding": [2.0]}, {"index": 0, "embedding": [1.0]}],
           "usage": {"prompt_tokens": 2}}
    r = O.Embed().response(emb, t)
    assert r["embeddings"] == [[1.0], [2.0]] and r["prompt_eval_count"] == 2
    t = O.Embeddings().request({"model": "m", "prompt": "a"})
    assert O.Embeddings().response(emb, t) == {"embedding": [1.0]}
    assert json.loads(O.Chat().error(404, "model 'x' not found")[1]) == {
        "error": "model 'x' not found"}


def test_durations_are_the_replicas_timings_and_count_from_the_request():
    """``prompt_eval_duration`` and ``eval_duration`` are the replica's own
    ``timings`` (llama.cpp's ``prompt_ms``, ``predicted_ms``) when it sent
    them, whole and streamed (a whole answer had ``eval_duration`` 0:
    clients' tokens per second divided by zero); a stream's
    ``total_duration`` counts from the request, not from its first chunk
    (the prefill was missing from it)."""
    timings = {"prompt_n": 1542, "prompt_ms": 5650.5, "predicted_n": 2, "predicted_ms": 80.25}
    t = O.Chat().request({"model": "m", "messages": [], "stream": False})
    t.echo["t0"] -= 6_000_000_000  # the request came 6 s ago
    obj = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hey"},
                        "finish_reason": "stop"}], "timings": timings,
           "usage": {"prompt_tokens": 1542, "completion_tokens": 2, "total_tokens": 1544}}
    r = O.Chat().response(obj, t)
    assert (r["prompt_eval_duration"], r["eval_duration"]) == (5_650_500_000, 80_250_000)
    assert r["total_duration"] >= 6_000_000_000
    body = chat_sse(["A", "B"], usage=obj["usage"]).replace(
        b'"usage":', b'"timings": ' + json.dumps(timings).encode() + b', "usage":')
    raw = run_stream(O.Chat().stream(t), body)
    last = json.loads(raw.decode().splitlines()[-1])
    assert (last["prompt_eval_duration"], last["eval_duration"]) == (5_650_500_000, 80_250_000)
    assert last["total_duration"] >= 6_000_000_000
    bare = O.Chat().response({**obj, "timings": None}, t)  # no timings: the proxy's times
    assert bare["prompt_eval_duration"] + bare["eval_duration"] == bare["total_duration"]


def test_router_level_answers():
    m = {"name": "smol", "args": [], "size_bytes": 10, "created": 1700000000}
    info = {"family": "llama", "parameter_size": "135M", "quantization_level": "Q4_1"}
    tag = O.tags([(m, info)])["models"][0]
    assert tag["name"] == tag["model"] == "smol:latest" and tag["size"] == 10
    assert tag["modified_at"].startswith("2023-11-14T") and len(tag["digest"]) == 64
    assert tag["details"]["quantization_level"] == "Q4_1"
    assert O.tag_name("org/repo:Q4_K_M") == "org/repo:Q4_K_M"
    p = O.ps([(m, info, 123, None, 2048)])["models"][0]
    assert p["size"] == 123 and p["expires_at"].startswith("9999") and p["context_length"] == 2048
    s = O.show(m, info)
    assert s["details"]["family"] == "llama" and "model_info" in s


def test_openai_usage_stream_adds_the_usage_chunk_only_when_missing():
    raw = run_stream(UsageStream(), chat_sse(["a", "b", "c"]))
    datas = [x[6:] for x in raw.decode().split("\n\n") if x]
    assert datas[-1] == "[DONE]"
    usage = json.loads(datas[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 3
    assert usage["id"] == "c1" and usage["object"] == "chat.completion.chunk"
    raw = run_stream(UsageStream(), chat_sse(["a"], usage={"prompt_tokens": 1,
                                                           "completion_tokens": 1,
                                                           "total_tokens": 2}))
    assert raw.count(b'"usage"') == 1 and raw.endswith(b"data: [DONE]\n\n")
