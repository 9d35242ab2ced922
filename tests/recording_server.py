"""A `cmd` replica for tests that speaks the Anthropic and Responses APIs
natively, like a llama-server, and records every request it receives.

``python tests/recording_server.py --port PORT --log FILE``: each request
is appended to FILE as one JSON line ``{"method", "path", "headers",
"body"}`` (the body parsed as JSON when it is JSON); ``GET /health`` is
200; ``POST /v1/messages``, ``/v1/responses`` and ``/v1/chat/completions``
answer a fixed text ``native:<path>`` in that API's own shape (streamed as
SSE when the body says ``stream``), or, when the body has ``tools`` and its
last message is not a tool result, a call of the first tool with ``{}``
(whole answers only); ``/v1/messages/count_tokens`` answers 42 tokens;
``/apply-template`` renders ``<tpl>`` + the body's messages and tools as
JSON (llama-server's route), ``/tokenize`` gives one token per
whitespace-separated word. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()


def _tool(body: dict) -> str | None:
    """The first tool's name when the request is to be answered with a call."""
    tools = body.get("tools") or []
    msgs = body.get("messages") or [{}]
    last = msgs[-1] if isinstance(msgs[-1], dict) else {}
    if not tools or last.get("role") == "tool" or (
            isinstance(last.get("content"), list)
            and any(b.get("type") == "tool_result" for b in last["content"])):
        return None
    t = tools[0]
    return t.get("name") or (t.get("function") or {}).get("name")


def answer(path: str, body: dict) -> dict:
    text = f"native:{path}"
    tool = _tool(body)
    if path == "/v1/messages/count_tokens":
        return {"input_tokens": 42}
    if path == "/apply-template":
        return {"prompt": "<tpl>" + json.dumps([body.get("messages"), body.get("tools")])}
    if path == "/tokenize":
        return {"tokens": list(range(len(str(body.get("content", "")).split())))}
    if path == "/v1/messages" and tool:
        return {"id": "msg_native", "type": "message", "role": "assistant",
                "model": body.get("model"), "stop_reason": "tool_use", "stop_sequence": None,
                "content": [{"type": "tool_use", "id": "toolu_native", "name": tool,
                             "input": {}}],
                "usage": {"input_tokens": 1, "output_tokens": 1}}
    if path == "/v1/chat/completions" and tool:
        return {"id": "c", "object": "chat.completion", "created": 1, "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                    "role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_native", "type": "function",
                         "function": {"name": tool, "arguments": "{}"}}]}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    if path == "/v1/messages":
        return {"id": "msg_native", "type": "message", "role": "assistant",
                "model": body.get("model"), "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn", "stop_sequence": None,
                "usage": {"input_tokens": 1, "output_tokens": 1}}
    if path == "/v1/responses":
        return {"id": "resp_native", "object": "response", "created_at": 1, "status": "completed",
                "model": body.get("model"), "output": [
                    {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
                     "content": [{"type": "output_text", "text": text, "annotations": []}]}],
                "usage": {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}}
    return {"id": "c", "object": "chat.completion", "created": 1, "model": body.get("model"),
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    log_path = ""

    def log_message(self, *args) -> None:  # quiet
        pass

    def _record(self, body: bytes):
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = body.decode("latin-1")
        with LOCK, open(self.log_path, "a") as f:
            f.write(json.dumps({"method": self.command, "path": self.path,
                                "headers": {k.lower(): v for k, v in self.headers.items()},
                                "body": parsed}) + "\n")
        return parsed

    def _send(self, status: int, data: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._record(b"")
        if self.path == "/health":
            self._send(200, b'{"status":"ok"}')
        else:
            self._send(404, b'{"error":{"message":"not found","type":"not_found_error"}}')

    def do_POST(self) -> None:
        n = int(self.headers.get("content-length") or 0)
        body = self._record(self.rfile.read(n)) or {}
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/messages", "/v1/responses", "/v1/chat/completions",
                        "/v1/messages/count_tokens", "/apply-template", "/tokenize"):
            self._send(404, b'{"error":{"message":"not found","type":"not_found_error"}}')
            return
        obj = answer(path, body)
        if not body.get("stream"):
            self._send(200, json.dumps(obj).encode())
            return
        if path == "/v1/messages":
            events = [("message_start", {"type": "message_start", "message": {
                          **obj, "content": [], "stop_reason": None}}),
                      ("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "text", "text": ""}}),
                      ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta",
                                                         "text": obj["content"][0]["text"]}}),
                      ("content_block_stop", {"type": "content_block_stop", "index": 0}),
                      ("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": "end_turn",
                                                   "stop_sequence": None},
                                         "usage": {"output_tokens": 1}}),
                      ("message_stop", {"type": "message_stop"})]
        else:
            events = [("response.completed", {"type": "response.completed", "response": obj,
                                              "sequence_number": 0})]
        data = b"".join(b"event: %s\ndata: %s\n\n" % (e.encode(), json.dumps(d).encode())
                        for e, d in events)
        self._send(200, data, "text/event-stream")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--log", required=True)
    args = ap.parse_args()
    Handler.log_path = args.log
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
