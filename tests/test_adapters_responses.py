"""The OpenAI Responses adapter on bytes, without any process (issue 14)."""

from __future__ import annotations

import json

import pytest
from adapter_streams import chat_sse, events, run_stream
from ggmux.proxy.apis.adapters import responses as R
from ggmux.proxy.apis.adapters.common import BadRequest


def test_string_input_and_instructions_become_chat_messages():
    t = R.Responses().request({"model": "m", "input": "hi", "instructions": "be brief",
                               "max_output_tokens": 20, "temperature": 0.2, "top_p": 0.5,
                               "previous_response_id": "resp_1"})
    assert t.body["messages"] == [{"role": "system", "content": "be brief"},
                                  {"role": "user", "content": "hi"}]
    assert (t.body["max_tokens"], t.body["temperature"], t.body["top_p"]) == (20, 0.2, 0.5)
    assert t.session == "resp_1" and not t.stream


def test_message_items_with_parts_and_developer_role():
    t = R.to_chat({"model": "m", "input": [
        {"role": "developer", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}]})
    assert t.body["messages"] == [{"role": "system", "content": "sys"},
                                  {"role": "user", "content": "a"},
                                  {"role": "assistant", "content": "b"}]


@pytest.mark.parametrize("bad, words", [
    ({"background": True}, "stores no responses"),
    ({"conversation": "c1"}, "stores no responses"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "stores no responses"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
    ({"input": [{"type": "computer_call", "id": "x"}]}, "not supported"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}},
     "hosted tools"),
    ({"input": 3}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_bad_requests_are_refused_with_the_reason(bad, words):
    with pytest.raises(BadRequest, match=words):
        R.to_chat({"model": "m", "input": "x", **bad})


def test_whole_answer_is_a_response_object():
    t = R.Responses().request({"model": "m", "input": "hi", "instructions": "i"})
    obj = {"id": "c", "object": "chat.completion", "created": 1700000000, "model": "m",
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "Yo"},
                        "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}
    r = R.Responses().response(obj, t)
    assert r["object"] == "response" and r["status"] == "completed" and r["id"].startswith("resp_")
    assert r["created_at"] == 1700000000 and r["instructions"] == "i" and r["model"] == "m"
    assert r["output"][0]["content"][0] == {"type": "output_text", "text": "Yo",
                                            "annotations": [], "logprobs": []}
    assert r["usage"]["input_tokens"] == 4 and r["usage"]["output_tokens"] == 1
    assert r["usage"]["total_tokens"] == 5


def test_stream_events_in_order_with_sequence_numbers():
    t = R.Responses().request({"model": "m", "input": "hi", "stream": True})
    assert t.body["stream_options"] == {"include_usage": True}
    evs = events(run_stream(R.Responses().stream(t), chat_sse(["He", "y"])))
    names = [n for n, _ in evs]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert all(d["type"] == n for n, d in evs)
    assert evs[6][1]["text"] == "Hey"
    done = evs[-1][1]["response"]
    assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hey"
    assert done["usage"]["output_tokens"] == 2
    assert evs[0][1]["response"]["id"] == done["id"]


def test_stream_cut_by_max_output_tokens_ends_incomplete():
    t = R.Responses().request({"model": "m", "input": "hi", "stream": True})
    evs = events(run_stream(R.Responses().stream(t), chat_sse(["a"], finish="length")))
    assert evs[-1][0] == "response.incomplete"
    assert evs[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    # the message item is incomplete too, in the item event and the response
    item = next(d["item"] for n, d in evs if n == "response.output_item.done")
    assert item["status"] == "incomplete"
    assert evs[-1][1]["response"]["output"][0]["status"] == "incomplete"


def test_llama_telemetry_progress_events_and_timings_on_deltas():
    """llama-server's extensions (test_responses_stream_with_llama_telemetry):
    ``return_progress`` and ``timings_per_token`` reach the replica; each
    ``prompt_progress`` is a ``response.in_progress`` event carrying it, and
    the timings ride on the deltas and on ``response.completed``."""
    t = R.Responses().request({"model": "m", "input": "hi", "stream": True,
                               "return_progress": True, "timings_per_token": True})
    assert t.body["return_progress"] is True and t.body["timings_per_token"] is True
    assert "return_progress" not in R.to_chat({"model": "m", "input": "x",
                                               "return_progress": True}).body  # no stream
    timings = {"prompt_per_second": 100.0, "predicted_per_second": 10.0}
    st = R.Responses().stream(t)
    out = b""
    for progress in ({"total": 40, "cache": 0, "processed": 32},
                     {"total": 40, "cache": 0, "processed": 40}):
        out += st.event(json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}],
                                    "prompt_progress": progress}).encode())
    out += st.event(json.dumps({"choices": [{"index": 0, "delta": {"content": "Yo"}}],
                                "timings": timings}).encode())
    out += st.event(json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                                "timings": timings}).encode())
    out += st.end()
    evs = events(out)
    progress = [d for _, d in evs if "prompt_progress" in d]
    assert [d["type"] for d in progress] == ["response.in_progress"] * 2
    assert [d["prompt_progress"]["processed"] for d in progress] == [32, 40]
    assert [n for n, d in evs if "timings" in d] == ["response.output_text.delta",
                                                     "response.completed"]
    assert evs[-1][1]["timings"] == timings
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))


def test_error_mid_stream_is_an_error_event():
    t = R.Responses().request({"model": "m", "input": "hi", "stream": True})
    st = R.Responses().stream(t)
    out = st.event(b'{"choices":[{"index":0,"delta":{"content":"x"}}]}')
    out += st.event(b'{"error":{"message":"replica died","type":"server_error","code":502}}')
    name, data = events(out)[-1]
    assert st.failed and name == "error"
    assert data["message"] == "replica died" and data["code"] == "server_error"
    assert json.loads(R.Responses().error(404, "no")[1])["error"]["code"] == "not_found"


@pytest.mark.parametrize("bad, words", [
    ({"input": [{"type": "reasoning", "content": 5}]}, ["input.0.content", "list", "int"]),
    ({"input": [{"type": "reasoning", "summary": "x"}]}, ["input.0.summary", "list", "str"]),
    ({"text": 5}, ["'text'", "object"]),
    ({"text": {"format": {"type": "json_schema", "name": "n", "schema": 5}}},
     ["text.format.schema", "object"]),
    ({"reasoning": 5}, ["'reasoning'", "object"]),
])
def test_a_wrong_type_is_refused_naming_the_field_and_the_type_it_must_be(bad, words):
    # issue 31 item 5: a reasoning item's content of 5 raised a TypeError, which the
    # proxy's except for orjson's JSONEncodeError (a TypeError) answered "nests too deep
    # or holds an integer beyond 64 bits"
    with pytest.raises(BadRequest) as e:
        R.to_chat({"model": "m", "input": "x", **bad})
    assert all(w in str(e.value) for w in words), str(e.value)
    assert "64 bits" not in str(e.value)
