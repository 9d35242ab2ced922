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


def delta_sse(deltas: list[dict], finish: str = "stop", usage: dict | None = None,
              model: str = "m") -> bytes:
    """A chat-completion stream of the given ``delta`` objects (tool-call
    and reasoning deltas as llama-server writes them), ``finish`` on the
    last one."""
    out = []
    for i, d in enumerate(deltas):
        out.append({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                    "choices": [{"index": 0, "delta": d,
                                 "finish_reason": finish if i == len(deltas) - 1 else None}]})
    if usage is not None:
        out.append({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": model,
                    "choices": [], "usage": usage})
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in out) + b"data: [DONE]\n\n"


def tool_deltas(reasoning: str = "", text: str = "",
                calls: tuple[tuple[str, str, str], ...] = ()) -> list[dict]:
    """Deltas of an answer: ``reasoning`` and ``text`` word by word (each
    word after the first with its space), then
    each ``(id, name, arguments)`` call: id and name first, then the
    arguments in pieces of 5 characters."""
    def words(s: str) -> list[str]:
        return [w if i == 0 else " " + w for i, w in enumerate(s.split(" ")) if s]

    out: list[dict] = [{"reasoning_content": w} for w in words(reasoning)]
    out += [{"content": w} for w in words(text)]
    for k, (cid, name, args) in enumerate(calls):
        out.append({"tool_calls": [{"index": k, "id": cid, "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        out += [{"tool_calls": [{"index": k, "function": {"arguments": args[i:i + 5]}}]}
                for i in range(0, len(args), 5)]
    out[0] = {"role": "assistant", **out[0]}
    return out
