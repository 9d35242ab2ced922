"""A replica's answer that cannot be translated, end to end (issue 31 item 4):
an ``upstream`` (translated) that answers 200 with JSON of the wrong shape
gets each client a 502 in its own API's envelope, streamed or not (a
stream that began ends with the API's error event, never a clean end),
and the request ring records the status the client got, whatever the
answer held. The upstream is a small HTTP server in this process: the
request's last message names the answer it sends."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import free_port, wait_for

OK = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                   "finish_reason": "stop"}]}
WHOLE = {  # the replica's whole answer, by the name the request's last message gives
    "choices-int": {"choices": 5},
    "choices-empty": {"choices": []},
    "choice-int": {"choices": [5]},
    "message-int": {"choices": [{"index": 0, "message": 5, "finish_reason": "stop"}]},
    "bad-args": {"choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{never json"}}]}}]},
    # a usage the ring's 64-bit words cannot hold: the record must still be written
    "huge-usage": {**OK, "usage": {"prompt_tokens": 2 ** 64 - 1, "completion_tokens": 1,
                                   "total_tokens": 2 ** 64}},
}
STREAMED = {  # the replica's stream (chunks, then [DONE])
    "choices-int": [{"choices": [{"index": 0, "delta": {"content": "a"}}]}, {"choices": 5}],
    "delta-int": [{"choices": [{"index": 0, "delta": 5}]}],
    "bad-args": [
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "{never"}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": " json"}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}],
}
TOOL = {"type": "object", "properties": {"x": {"type": "string"}}}


class Replica(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def _send(self, data: bytes, ctype: str = "application/json") -> None:
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(b'{"object":"list","data":[]}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        which = body["messages"][-1]["content"]
        if body.get("stream") and which in STREAMED:
            self._send(b"".join(b"data: %s\n\n" % json.dumps(c).encode()
                                for c in STREAMED[which]) + b"data: [DONE]\n\n",
                       "text/event-stream")
            return
        self._send(json.dumps(WHOLE[which]).encode())


@pytest.fixture(scope="module")
def bad(tmp_path_factory):
    """``ggmux serve`` (request excerpts on) with ``bad``, a translated
    upstream answering as :class:`Replica` does."""
    from conftest import Server

    d = tmp_path_factory.mktemp("bad")
    up = ThreadingHTTPServer(("127.0.0.1", free_port()), Replica)
    threading.Thread(target=up.serve_forever, daemon=True).start()
    (d / "p.ini").write_text(f"[bad]\nupstream = http://127.0.0.1:{up.server_port}\n"
                             "translate = true\n")
    s = Server(["--models-preset", str(d / "p.ini"), "--no-hf-cache", "--proxies", "1",
                "--log-requests-bodies"], free_port(), d / "server.log")
    try:
        s.wait_ready()
        wait_for(lambda: s.models()["bad"]["status"]["value"] == "loaded", 20,
                 what="the upstream healthy")
        yield s
    finally:
        s.stop()
        up.shutdown()
        up.server_close()


def ask(api: str, which: str, stream: bool) -> tuple[str, dict]:
    """``(path, body)`` of a request in ``api`` whose answer is ``which``."""
    msgs = [{"role": "user", "content": which}]
    if api == "anthropic":
        return "/v1/messages", {"model": "bad", "max_tokens": 8, "messages": msgs,
                                "stream": stream,
                                "tools": [{"name": "f", "input_schema": TOOL}]}
    if api == "responses":
        return "/v1/responses", {"model": "bad", "input": msgs, "stream": stream,
                                 "tools": [{"type": "function", "name": "f",
                                            "parameters": TOOL}]}
    return "/api/chat", {"model": "bad", "messages": msgs, "stream": stream,
                         "tools": [{"type": "function", "function": {
                             "name": "f", "parameters": TOOL}}]}


def envelope_message(api: str, doc: dict) -> str:
    """The error message of ``api``'s error envelope (asserting its shape)."""
    if api == "anthropic":
        assert doc["type"] == "error" and doc["error"]["type"] == "api_error", doc
        return doc["error"]["message"]
    if api == "responses":
        assert doc["error"]["type"] == "server_error", doc
        return doc["error"]["message"]
    assert set(doc) == {"error"}, doc
    return doc["error"]


def ring_status(server, rid: str) -> int | None:
    st, doc = server.json("GET", "/requests?model=bad")
    assert st == 200
    for r in doc["data"]:
        if r["request_id"] == rid:
            return r["status"]
    return None


APIS = ["anthropic", "responses", "ollama"]


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", ["choices-int", "choices-empty", "choice-int", "message-int",
                                   "bad-args"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_whole_answer_is_a_502_in_the_apis_envelope_and_in_the_ring(
        bad, api, which, stream):
    if stream and which in STREAMED:
        pytest.skip("streamed by the replica: the next test")
    path, body = ask(api, which, stream)
    st, headers, data = bad.request("POST", path, body)
    assert st == 502, data
    assert "could not be translated" in envelope_message(api, json.loads(data))
    rid = headers["x-request-id"]
    wait_for(lambda: ring_status(bad, rid) is not None, 10, what="the request's record")
    assert ring_status(bad, rid) == 502  # the client's status, not the replica's 200


def raw_post(server, path: str, body: dict) -> tuple[int, dict, bytes, bool]:
    """POST and read until the server closes: ``(status, headers, body
    dechunked, whether the body ended cleanly with its last chunk)``; a
    stream cut after an error event is no clean end."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sk:
        sk.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"connection: close\r\ncontent-length: %d\r\n\r\n%s"
                   % (path.encode(), len(data), data))
        raw = b""
        while chunk := sk.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    out, clean = b"", False
    while rest:
        size, _, rest = rest.partition(b"\r\n")
        n = int(size, 16) if size.strip() else -1
        if n <= 0:
            clean = n == 0
            break
        out, rest = out + rest[:n], rest[n + 2:]
    return int(lines[0].split()[1]), headers, out, clean


def error_event(api: str, raw: bytes) -> dict:
    if api == "ollama":
        last = json.loads(raw.strip().split(b"\n")[-1])
        assert set(last) == {"error"}, raw
        return last
    blocks = [b for b in raw.split(b"\n\n") if b.strip()]
    name, data = blocks[-1].split(b"\n", 1)
    assert name == b"event: error", raw
    return json.loads(data[6:])


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("which", sorted(STREAMED))
def test_a_malformed_stream_ends_with_the_apis_error_event_and_the_ring_has_502(
        bad, api, which):
    path, body = ask(api, which, True)
    st, headers, data, clean = raw_post(bad, path, body)
    assert st == 200 and not clean  # the stream had begun; never a clean end
    ev = error_event(api, data)
    assert "could not be translated" in json.dumps(ev), data
    assert b"message_stop" not in data and b"response.completed" not in data
    assert b'"done":true' not in data
    rid = headers["x-request-id"]
    wait_for(lambda: ring_status(bad, rid) is not None, 10, what="the request's record")
    assert ring_status(bad, rid) == 502


def test_a_usage_beyond_64_bits_still_leaves_the_request_in_the_ring(bad):
    path, body = ask("anthropic", "huge-usage", False)
    st, headers, data = bad.request("POST", path, body)
    assert st == 200, data
    rid = headers["x-request-id"]
    wait_for(lambda: ring_status(bad, rid) is not None, 10, what="the request's record")
    assert ring_status(bad, rid) == 200
