"""Helpers for the adapter unit tests: a replica's chat-completion SSE body
as bytes, and the SSE events an adapter wrote, parsed back."""

from __future__ import annotations

import json

from ggmux.proxy.apis.adapters.common import SseEvents, StreamState


def chat_sse(texts: list[str], finish: str = "stop", usage: dict | None = None,
             model: str = "m") -> bytes:
    """A chat-completion stream as llama.cpp-style servers send it."""
    out = []
    for i, t in enumerate(texts):
        delta = {"content": t} if i else {"role": "assistant", "content": t}
        last = i == len(texts) - 1
        out.append({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                    "choices": [{"index": 0, "delta": delta,
                                 "finish_reason": finish if last else None}]})
    if usage is not None:
        out.append({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                    "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in out) + b"data: [DONE]\n\n"


def run_stream(state: StreamState, body: bytes, pieces: int = 7) -> bytes:
    """Feed ``body`` to ``state`` in ``pieces`` uneven slices, as reads from
    a socket arrive, and return everything it wrote."""
    sse = SseEvents()
    out = b""
    step = max(1, len(body) // pieces)
    for i in range(0, len(body), step):
        for data in sse.feed(body[i:i + step]):
            if data == b"[DONE]":
                return out + state.end()
            out += state.event(data)
    return out + state.end()


def events(raw: bytes) -> list[tuple[str | None, dict]]:
    """``(event name, data)`` of every SSE event in ``raw``."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        out.append((name, json.loads("\n".join(data))))
    return out
