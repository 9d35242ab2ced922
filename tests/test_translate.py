"""The relay of translated answers (proxy/apis/translate.py) on bytes: what the
forwarding code writes goes in, what the client would get comes out; no
process, no socket."""

from __future__ import annotations

import json

from adapter_streams import chat_sse, events
from ggmux.http1 import Request
from ggmux.proxy.apis.adapters import anthropic, ollama
from ggmux.proxy.apis.translate import TranslatedConnection

HI = [{"role": "user", "content": "hi"}]


class Conn:
    """Records what a TranslatedConnection writes to the client."""

    write_paused = False
    write_paused_cb = None

    def __init__(self) -> None:
        self.out: list = []
        self.closed = self.finished = self.ended = False

    def cork(self): pass
    def uncork(self): pass
    def write(self, data): self.out.append(("write", data))
    def start_stream(self, req, status=200, content_type=b"text/event-stream", headers=()):
        self.out.append(("stream", content_type))
    def send_chunk(self, data): self.out.append(("chunk", data))
    def end_stream(self, req): self.ended = self.finished = True
    def finish(self, req): self.finished = True
    def close(self): self.closed = True
    def send_response(self, req, status, body, content_type=b"application/json", headers=()):
        self.out.append(("response", status, content_type, body))
        self.finished = True

    def body(self) -> bytes:
        return b"".join(x[1] for x in self.out if x[0] == "chunk")


def relay(adapter, body: dict):
    conn, req = Conn(), Request()
    t = adapter.request(body)
    return conn, req, TranslatedConnection(conn, req, adapter, t)


SSE = [(b"content-type", b"text/event-stream")]
JSON = [(b"content-type", b"application/json")]


def test_a_streamed_answer_is_rewritten_as_it_arrives_in_any_pieces():
    conn, req, tc = relay(anthropic.Messages(), {"model": "m", "max_tokens": 4,
                                                 "messages": HI, "stream": True})
    assert tc.head(req, 200, SSE, b"") == b""
    assert conn.out == [("stream", b"text/event-stream")]  # the head goes out at once
    raw = chat_sse(["a", "b"])
    for i in range(0, len(raw), 5):
        tc.send_chunk(raw[i:i + 5])
    tc.end_stream(req)
    names = [n for n, _ in events(conn.body())]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names.count("content_block_delta") == 2 and conn.ended and not conn.closed


def test_a_replica_error_event_ends_the_stream_with_the_apis_error_and_no_clean_end():
    conn, req, tc = relay(ollama.Chat(), {"model": "m", "messages": HI})
    tc.head(req, 200, SSE, b"")
    tc.send_chunk(b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n')
    tc.send_chunk(b'data: {"error":{"message":"boom","type":"server_error"}}\n\n')
    tc.send_chunk(b'data: {"choices":[{"index":0,"delta":{"content":"late"}}]}\n\n')
    tc.end_stream(req)
    lines = [json.loads(x) for x in conn.body().splitlines()]
    assert lines[-1] == {"error": "boom"} and len(lines) == 2  # nothing after the error
    assert conn.closed and not conn.ended


def test_an_error_answer_gets_the_apis_envelope_and_the_replicas_status():
    conn, req, tc = relay(anthropic.Messages(), {"model": "m", "max_tokens": 4,
                                                 "messages": HI, "stream": True})
    tc.head(req, 400, JSON, b"")
    tc.send_chunk(b'{"error":{"message":"bad temperature","type":"invalid_request_error",')
    tc.send_chunk(b'"code":400}}')
    tc.end_stream(req)
    (_, status, _, body), = conn.out
    assert status == 400 and json.loads(body) == {
        "type": "error", "error": {"type": "invalid_request_error", "message": "bad temperature"}}


def test_a_replica_that_dies_before_a_whole_answer_ends_gets_a_502_not_a_cut():
    conn, req, tc = relay(anthropic.Messages(), {"model": "m", "max_tokens": 4, "messages": HI})
    tc.head(req, 200, JSON, b"")
    tc.send_chunk(b'{"choices": [')
    tc.close()  # what the relay does when the replica's connection drops
    (_, status, _, body), = conn.out
    assert status == 502 and json.loads(body)["error"]["type"] == "api_error"
    assert not conn.closed  # the error answer is whole: the connection can stay


def test_a_stream_the_replica_answered_whole_is_played_through_the_stream():
    conn, req, tc = relay(ollama.Chat(), {"model": "m", "messages": HI})
    tc.head(req, 200, JSON, b"")
    tc.send_chunk(json.dumps({"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "whole"}}]}).encode())
    tc.end_stream(req)
    lines = [json.loads(x) for x in conn.body().splitlines()]
    assert [ln["message"]["content"] for ln in lines] == ["whole", ""] and lines[-1]["done"]


def test_keepalive_comments_pass_on_sse_streams_and_not_on_ndjson():
    conn, req, tc = relay(anthropic.Messages(), {"model": "m", "max_tokens": 4,
                                                 "messages": HI, "stream": True})
    tc.start_stream(req)  # the proxy's head while the model loads
    tc.send_chunk(b": waiting for m to load (10%)\n\n")
    assert conn.body() == b": waiting for m to load (10%)\n\n"
    conn, req, tc = relay(ollama.Chat(), {"model": "m", "messages": HI})
    tc.start_stream(req)
    tc.send_chunk(b": waiting for m to load (10%)\n\n")
    assert conn.out == [("stream", b"application/x-ndjson")]
