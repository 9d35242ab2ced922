"""Engine events to OpenAI answers: ``chat.completion`` and its chunks,
``text_completion`` (streamed or whole), tool calls and reasoning parsed
by a template family's format (:mod:`ggmux.instance.tools.stream`), a
forced tool call of a model without a Jinja template, log probabilities,
and the ``stream_options.include_usage`` usage chunk.

:class:`Answer` is the one object that holds a request's streaming state
(the shape of LiteLLM's streaming iterators); it runs where the engine
hands its events (the instance server's loop, or the decode thread) and
hands finished objects to a ``sink(kind, payload)``:
``("chunk", dict)`` for each streamed chunk, ``("result", dict)`` for a
whole answer, ``("end", usage)`` after the last chunk (its usage object),
``("error", str)``.
"""

from __future__ import annotations

import base64
import os
import time
from collections.abc import Callable

import numpy as np

from .tools.base import ChatMsg
from .tools.stream import ChatStream

Sink = Callable[[str, object], None]


def request_id(prefix: str) -> str:
    """A fresh OpenAI-style id (``chatcmpl-...``, ``cmpl-...``)."""
    return f"{prefix}-{os.urandom(12).hex()}"


class Answer:
    """One chat or completion request's answer being built.

    ``kind``: ``"chat"`` or ``"completion"``; ``n`` choices; ``stream``;
    ``include_usage``: a last chunk with ``usage`` and no choices (OpenAI's
    ``stream_options``); ``logprobs``: None, or how the per-token records
    are written (``"chat"``: ``{"content": [...]}``, ``"completion"``:
    OpenAI's legacy ``tokens``/``token_logprobs``/``top_logprobs``);
    ``tool``: the forced tool's name (the text is its arguments);
    ``echo``: prompt text that a completion's text starts with;
    ``parser``: makes one choice's :class:`~ggmux.instance.tools.stream.ChatStream`
    (a chat whose text is parsed into content, ``reasoning_content`` and
    ``tool_calls``; ``finish_reason`` ``tool_calls`` when it called one)."""

    def __init__(self, sink: Sink, kind: str, model: str, n: int = 1, stream: bool = False,
                 include_usage: bool = False, logprobs: str | None = None,
                 tool: str | None = None, echo: str | None = None,
                 parser: Callable[[], ChatStream] | None = None) -> None:
        self.sink = sink
        self.kind = kind
        self.model = model
        self.n = n
        self.stream = stream
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.tool = tool
        self.echo = echo
        self.id = request_id("chatcmpl" if kind == "chat" else "cmpl")
        self.created = int(time.time())
        self.texts: list[list[str]] = [[] for _ in range(n)]
        self.records: list[list[dict]] = [[] for _ in range(n)]
        self.reasons: list[str | None] = [None] * n
        self.started = [False] * n
        self.call_ids = [f"call_{os.urandom(8).hex()}" for _ in range(n)] if tool else []
        self.parsers = [parser() for _ in range(n)] if parser is not None else None
        self.messages: list[ChatMsg | None] = [None] * n

    # ---- events (one thread: the server's loop or the decode thread) ------
    def on_event(self, ev: tuple) -> None:
        kind = ev[0]
        if kind == "text":
            _, i, text, lp = ev
            if self.parsers is not None:
                self._parsed(i, text, lp)
            elif self.stream:
                if text or lp:
                    self._chunk(i, text, lp)
            else:
                self.texts[i].append(text)
                if lp:
                    self.records[i].extend(lp)
        elif kind == "end":
            i, reason = ev[1], ev[2]
            if self.tool and reason == "stop":
                reason = "tool_calls"
            if self.parsers is not None:
                reason = self._finish(i, reason)
            self.reasons[i] = reason
            if self.stream:
                self._chunk(i, None, None, reason)
        elif kind == "done":
            usage = ev[1]
            if not self.stream:
                self.sink("result", self._whole(usage))
                return
            if self.include_usage:
                self.sink("chunk", self._head(choices=[], usage=usage))
            self.sink("end", usage)  # (the server's usage trailer)
        elif kind == "error":
            self.sink("error", ev[1])

    # ---- parsed chat choices ----------------------------------------------
    def _parsed(self, i: int, text: str, lp: list[dict] | None) -> None:
        if not self.stream:
            self.parsers[i].text += text
            if lp:
                self.records[i].extend(lp)
            return
        deltas = self.parsers[i].feed(text)
        if not deltas and lp:
            deltas = [{}]
        for k, d in enumerate(deltas):
            self._delta(i, d, lp if k == 0 else None)

    def _finish(self, i: int, reason: str) -> str:
        """The choice ended: parse it as final; stream what is left."""
        msg, deltas = self.parsers[i].finish()
        self.messages[i] = msg
        if self.stream:
            for d in deltas:
                self._delta(i, d, None)
        return "tool_calls" if msg.tool_calls and reason == "stop" else reason

    def _delta(self, i: int, delta: dict, lp: list[dict] | None,
               reason: str | None = None) -> None:
        if not self.started[i]:
            self.started[i] = True
            delta = {"role": "assistant", "content": None if "tool_calls" in delta else "",
                     **delta}
        choice = {"index": i, "delta": delta, "logprobs": self._lp(lp) if lp else None,
                  "finish_reason": reason}
        self.sink("chunk", self._head(choices=[choice]))

    # ---- streamed chunks ---------------------------------------------------
    def _head(self, **rest) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                **rest}

    def _chunk(self, i: int, text: str | None, lp: list[dict] | None,
               reason: str | None = None) -> None:
        if self.kind == "completion":
            if not self.started[i]:
                self.started[i] = True
                if self.echo:
                    text = self.echo + (text or "")
            choice = {"index": i, "text": text or "", "logprobs": self._lp(lp) if lp else None,
                      "finish_reason": reason}
            self.sink("chunk", self._head(choices=[choice]))
            return
        if self.parsers is not None:
            self._delta(i, {}, lp, reason)
            return
        delta: dict = {}
        if not self.started[i]:
            self.started[i] = True
            delta["role"] = "assistant"
            if self.tool:
                delta["content"] = None
                delta["tool_calls"] = [{"index": 0, "id": self.call_ids[i], "type": "function",
                                        "function": {"name": self.tool, "arguments": ""}}]
            else:
                delta["content"] = ""
        if text:
            if self.tool:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            else:
                delta["content"] = text
        choice = {"index": i, "delta": delta, "logprobs": self._lp(lp) if lp else None,
                  "finish_reason": reason}
        self.sink("chunk", self._head(choices=[choice]))

    # ---- whole answers -----------------------------------------------------
    def _whole(self, usage: dict) -> dict:
        choices = []
        for i in range(self.n):
            text = "".join(self.texts[i])
            lp = self._lp(self.records[i]) if self.logprobs else None
            if self.kind == "completion":
                choices.append({"index": i, "text": (self.echo or "") + text, "logprobs": lp,
                                "finish_reason": self.reasons[i]})
                continue
            if self.parsers is not None:
                msg = self._message(self.messages[i])
            elif self.tool:
                msg = {"role": "assistant", "content": None, "tool_calls": [
                    {"id": self.call_ids[i], "type": "function",
                     "function": {"name": self.tool, "arguments": text}}]}
            else:
                msg = {"role": "assistant", "content": text}
            choices.append({"index": i, "message": msg, "logprobs": lp,
                            "finish_reason": self.reasons[i]})
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage}

    @staticmethod
    def _message(m: ChatMsg | None) -> dict:
        """OpenAI's assistant ``message`` for a parsed choice."""
        if m is None:
            return {"role": "assistant", "content": ""}
        out: dict = {"role": "assistant",
                     "content": m.content if m.content or not m.tool_calls else None}
        if m.reasoning_content:
            out["reasoning_content"] = m.reasoning_content
        if m.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in m.tool_calls]
        return out

    def _lp(self, records: list[dict]) -> dict:
        """Per-token records (engine: ``id``, ``token``, ``bytes``,
        ``logprob``, ``top_logprobs``) in OpenAI's chat or legacy form."""
        if self.logprobs == "chat":
            return {"content": [
                {"token": r["token"], "logprob": r["logprob"], "bytes": r["bytes"],
                 "top_logprobs": [{"token": t["token"], "logprob": t["logprob"],
                                   "bytes": t["bytes"]} for t in r["top_logprobs"]]}
                for r in records]}
        offsets, at = [], 0
        for r in records:
            offsets.append(at)
            at += len(r["token"])
        return {"tokens": [r["token"] for r in records],
                "token_logprobs": [r["logprob"] for r in records],
                "top_logprobs": [{t["token"]: t["logprob"] for t in r["top_logprobs"]}
                                 for r in records],
                "text_offset": offsets}


def embedding_answer(model: str, vectors: list[list[float]], usage: dict,
                     encoding: str | None) -> dict:
    """OpenAI's embeddings list; ``encoding`` ``"base64"`` packs each
    vector as little-endian float32 (what the OpenAI SDK asks for)."""
    if encoding == "base64":
        data = [base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() for v in vectors]
    else:
        data = vectors
    return {"object": "list", "model": model, "usage": usage,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(data)]}
