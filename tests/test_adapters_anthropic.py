"""The Anthropic Messages adapter on bytes, without any process (issue 14)."""

from __future__ import annotations

import json

import pytest
from adapter_streams import chat_sse, events, run_stream
from ggmux.proxy.apis.adapters import anthropic as A
from ggmux.proxy.apis.adapters.common import BadRequest


def req(**kw):
    return {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


def test_request_maps_system_blocks_sampling_stop_and_session_key():
    t = A.to_chat(req(system=[{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                      messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]},
                                {"role": "assistant", "content": "c"}],
                      stop_sequences=["END"], temperature=0.5, top_p=0.9, top_k=40,
                      metadata={"user_id": "u-1"}, stream=True))
    assert t.target == b"/v1/chat/completions" and t.stream and t.session == "u-1"
    assert t.body["messages"] == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "ab"},
                                  {"role": "assistant", "content": "c"}]
    assert t.body["max_tokens"] == 16 and t.body["stop"] == ["END"]
    assert (t.body["temperature"], t.body["top_p"], t.body["top_k"]) == (0.5, 0.9, 40)
    assert t.body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("bad, words", [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ({"temperature": 3}, "temperature"),
    ({"stop_sequences": "END"}, None),  # a string is taken as one sequence
    ({"tools": [{"name": "f"}]}, "tools"),
])
def test_bad_requests_are_refused_with_the_reason(bad, words):
    body = {**req(), **bad}
    body = {k: v for k, v in body.items() if v is not None}
    if words is None:
        assert A.to_chat(body).body["stop"] == ["END"]
        return
    with pytest.raises(BadRequest, match=words):
        A.to_chat(body)


def test_whole_answer_is_a_message_with_stop_reason_and_usage():
    obj = {"id": "x", "object": "chat.completion", "created": 1, "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                        "finish_reason": "length"}],
           "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    msg = A.from_chat(obj, "smol")
    assert msg["type"] == "message" and msg["role"] == "assistant" and msg["model"] == "smol"
    assert msg["content"] == [{"type": "text", "text": "Hello"}]
    assert msg["stop_reason"] == "max_tokens" and msg["usage"] == {
        "cache_read_input_tokens": 0, "input_tokens": 5, "output_tokens": 2}


def test_stream_is_anthropics_event_sequence_whatever_the_read_boundaries():
    body = chat_sse(["Hel", "lo", "!"], usage={"prompt_tokens": 9, "completion_tokens": 3,
                                               "total_tokens": 12})
    for pieces in (1, 3, 50):
        evs = events(run_stream(A.MessagesStream("smol"), body, pieces))
        names = [n for n, _ in evs]
        assert names == ["message_start", "content_block_start", "ping",
                         "content_block_delta", "content_block_delta", "content_block_delta",
                         "content_block_stop", "message_delta", "message_stop"]
        assert all(d["type"] == n for n, d in evs)
        assert evs[0][1]["message"]["model"] == "smol"
        assert "".join(d["delta"]["text"] for n, d in evs if n == "content_block_delta") == \
            "Hello!"
        delta = evs[-2][1]
        assert delta["delta"]["stop_reason"] == "end_turn"
        assert delta["usage"] == {"cache_read_input_tokens": 0, "input_tokens": 9,
                                  "output_tokens": 3}


def test_usage_is_llama_servers_cache_reads_apart_and_the_prompt_size_starts_the_stream():
    progress = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}],
                "prompt_progress": {"total": 11, "cache": 4, "processed": 11, "time_ms": 1}}
    body = (b"data: " + json.dumps(progress).encode() + b"\n\n"
            + chat_sse(["Hi"], usage={"prompt_tokens": 11, "completion_tokens": 1,
                                      "total_tokens": 12,
                                      "prompt_tokens_details": {"cached_tokens": 4}}))
    evs = events(run_stream(A.MessagesStream("m"), body, 1))
    assert evs[0][1]["message"]["usage"] == {"cache_read_input_tokens": 4, "input_tokens": 7,
                                             "output_tokens": 0}
    assert evs[-2][1]["usage"] == {"cache_read_input_tokens": 4, "input_tokens": 7,
                                   "output_tokens": 1}


def test_stream_without_replica_usage_counts_text_chunks():
    evs = events(run_stream(A.MessagesStream("m"), chat_sse(["a", "b"], finish="length")))
    assert evs[-2][1]["usage"]["output_tokens"] == 2
    assert evs[-2][1]["delta"]["stop_reason"] == "max_tokens"


def test_replica_error_mid_stream_becomes_an_error_event():
    st = A.MessagesStream("m")
    out = st.event(json.dumps({"choices": [{"index": 0, "delta": {"content": "x"}}]}).encode())
    out += st.event(b'{"error": {"message": "boom", "type": "server_error", "code": 500}}')
    assert st.failed
    name, data = events(out)[-1]
    assert name == "error" and data == {"type": "error",
                                        "error": {"type": "api_error", "message": "boom"}}


def test_error_envelope_types_follow_the_status():
    for status, etype in ((400, "invalid_request_error"), (401, "authentication_error"),
                          (404, "not_found_error"), (429, "rate_limit_error"),
                          (500, "api_error"), (503, "overloaded_error")):
        assert json.loads(A.error_body(status, "m")) == {
            "type": "error", "error": {"type": etype, "message": "m"}}


def test_count_tokens_asks_the_replica_tokenizer_for_the_message_text():
    t = A.CountTokens().request(req(system="sys"))
    assert t.target == b"/tokenize" and t.body["content"] == "sys\nhi"
    assert A.CountTokens().response({"tokens": [1, 2, 3]}, t) == {"input_tokens": 3}
