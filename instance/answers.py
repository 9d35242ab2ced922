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
from dataclasses import dataclass, field

import numpy as np

from .. import __version__
from .tools.base import ChatMsg
from .tools.stream import ChatStream

Sink = Callable[[str, object], None]


def _fingerprint() -> str:
    try:
        from importlib.metadata import version

        llama = version("llama_cpp_python")
    except Exception:  # noqa: BLE001 - no distribution metadata
        llama = "0"
    return f"b{llama}-ggmux{__version__}"


FINGERPRINT = _fingerprint()
"""``system_fingerprint`` of every answer: llama-server's is its build
(``b11434-abc1234``, always starting with ``b``); ours names the
llama-cpp-python and ggmux versions."""

STOP_TYPES = {"stop": "eos", "length": "limit", "tool_calls": "eos"}
"""finish_reason -> llama.cpp's ``stop_type`` (a stop string: ``word``)."""


def llama_timings(t: dict) -> dict:
    """The engine's timings (:meth:`~ggmux.instance.engine.jobs.Job.timings`,
    milliseconds) as llama-server's ``timings`` (``server_slot_stats``:
    ``cache_n``, ``prompt_n``/``_ms``/``_per_token_ms``/``_per_second``, the
    same for ``predicted``). The generation's rates are per decode step,
    ``predicted_n - 1`` of them: the first token comes from the prompt's
    last batch (``server-common.h``, ``n_gen_steps``)."""
    out = dict(t)
    for k in ("prompt", "predicted"):
        n, ms = int(t.get(f"{k}_n", 0) or 0), float(t.get(f"{k}_ms", 0.0) or 0.0)
        out[f"{k}_n"], out[f"{k}_ms"] = n, ms
        steps = n if k == "prompt" else max(n - 1, 0)
        out[f"{k}_per_token_ms"] = ms / steps if steps else 0.0
        out[f"{k}_per_second"] = 1e3 * steps / ms if ms > 0 else 0.0
    out.setdefault("cache_n", 0)
    return out


@dataclass(slots=True)
class Extras:
    """llama-server's fields of an answer: ``native``: llama.cpp's own
    ``/completion`` shape (``content``, ``stop``, ``timings``,
    ``generation_settings``, ``completion_probabilities``); ``verbose``: the
    request's ``verbose`` (or ``--verbose``): ``__verbose`` holds that
    native object; ``timings_per_token``: ``timings`` on every chunk;
    ``settings``: ``generation_settings``; ``prompt``: gives the prompt's
    text (detokenized with special tokens, as llama-server's ``prompt``)."""

    native: bool = False
    verbose: bool = False
    timings_per_token: bool = False
    settings: dict = field(default_factory=dict)
    prompt: Callable[[], str] | None = None

    def prompt_text(self) -> str:
        return self.prompt() if self.prompt is not None else ""


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
    ``tool_calls``; ``finish_reason`` ``tool_calls`` when it called one);
    ``extras``: llama-server's own fields (:class:`Extras`).

    As llama-server's (``tools/server/server-task.cpp``): every answer has
    ``system_fingerprint`` and ``timings``; a streamed chat starts with a
    chunk of its own holding ``role`` and ``content: null`` and ends each
    choice with an empty ``delta`` and its ``finish_reason`` (sent when the
    request is done, the last chunk carrying ``timings``)."""

    def __init__(self, sink: Sink, kind: str, model: str, n: int = 1, stream: bool = False,
                 include_usage: bool = False, logprobs: str | None = None,
                 tool: str | None = None, echo: str | None = None,
                 parser: Callable[[], ChatStream] | None = None,
                 extras: Extras | None = None) -> None:
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
        self.x = extras or Extras()
        self.job = None  # the engine's job (its live timings), set after submit

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
        elif kind == "done":
            usage, timings = ev[1], llama_timings(ev[2] if len(ev) > 2 else {})
            if not self.stream:
                self.sink("result", self._native(0, usage, timings, True) if self.x.native
                          else self._whole(usage, timings))
                return
            self._ends(usage, timings)
            self.sink("end", usage)  # (the server's usage trailer)
        elif kind == "progress":
            if self.stream:
                self._progress(ev[1], ev[2] if len(ev) > 2 else None)
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
        self._role(i)
        choice = {"index": i, "delta": delta, "logprobs": self._lp(lp) if lp else None,
                  "finish_reason": reason}
        self.sink("chunk", self._timed(self._head(choices=[choice])))

    def _role(self, i: int) -> None:
        """llama-server's first chunk of a chat choice: the role alone."""
        if not self.started[i]:
            self.started[i] = True
            choice = {"index": i, "delta": {"role": "assistant", "content": None},
                      "logprobs": None, "finish_reason": None}
            self.sink("chunk", self._head(choices=[choice]))

    def _progress(self, progress: dict, timings: dict | None) -> None:
        """llama-server's ``prompt_progress`` chunk (``return_progress``): a
        chat's carries the role delta, as its first chunk would; with
        ``timings_per_token`` the ``timings`` as of the progress (the step's
        events are handed on together, after it)."""
        def timed(chunk: dict) -> dict:
            if self.x.timings_per_token and timings is not None:
                chunk["timings"] = llama_timings(timings)
            return chunk

        if self.x.native:
            self.sink("chunk", timed({"index": 0, "content": "", "tokens": [], "stop": False,
                                      "id_slot": -1, "model": self.model,
                                      "prompt_progress": progress}))
            return
        if self.kind == "chat":
            self.started[0] = True
            choice = {"index": 0, "delta": {"role": "assistant", "content": None},
                      "logprobs": None, "finish_reason": None}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": None}
        self.sink("chunk", timed({**self._head(choices=[choice]), "prompt_progress": progress}))

    def _ends(self, usage: dict, timings: dict) -> None:
        """The stream's end: each choice's finish chunk, the usage chunk,
        ``timings`` on the last of them."""
        out = []
        for i in range(self.n):
            if self.x.native:
                out.append(self._native(i, usage, timings, False))
                continue
            if self.kind == "chat":
                self._role(i)
                choice = {"index": i, "delta": {}, "logprobs": None,
                          "finish_reason": self.reasons[i]}
            else:
                choice = {"index": i, "text": "", "logprobs": None,
                          "finish_reason": self.reasons[i]}
            out.append(self._head(choices=[choice]))
        if self.include_usage and not self.x.native:
            out.append(self._head(choices=[], usage=usage))
        if out and not self.x.native:
            out[-1]["timings"] = timings
            if self.x.verbose:
                out[0]["__verbose"] = self._native(0, usage, timings, False)
        for c in out:
            self.sink("chunk", c)

    def _timed(self, chunk: dict) -> dict:
        """``timings`` so far on a chunk (the request's ``timings_per_token``)."""
        if self.x.timings_per_token and self.job is not None:
            chunk["timings"] = llama_timings(self.job.timings(time.monotonic()))
        return chunk

    # ---- streamed chunks ---------------------------------------------------
    def _head(self, **rest) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": FINGERPRINT, **rest}

    def _chunk(self, i: int, text: str | None, lp: list[dict] | None,
               reason: str | None = None) -> None:
        if self.kind == "completion":
            if not self.started[i]:
                self.started[i] = True
                if self.echo:
                    text = self.echo + (text or "")
            if self.x.native:
                out = {"index": i, "content": text or "", "tokens": [], "stop": False,
                       "id_slot": -1, "model": self.model,
                       "tokens_predicted": self.job.n_decoded if self.job is not None else 0}
                if lp:
                    out["completion_probabilities"] = lp
                self.sink("chunk", self._timed(out))
                return
            choice = {"index": i, "text": text or "", "logprobs": self._lp(lp) if lp else None,
                      "finish_reason": reason}
            self.sink("chunk", self._timed(self._head(choices=[choice])))
            return
        if self.parsers is not None:
            self._delta(i, {}, lp, reason)
            return
        delta: dict = {}
        if not self.started[i]:
            self._role(i)
            if self.tool:
                delta["tool_calls"] = [{"index": 0, "id": self.call_ids[i], "type": "function",
                                        "function": {"name": self.tool, "arguments": ""}}]
        if text:
            if self.tool:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
            else:
                delta["content"] = text
        if not delta and not lp and reason is None:
            return
        choice = {"index": i, "delta": delta, "logprobs": self._lp(lp) if lp else None,
                  "finish_reason": reason}
        self.sink("chunk", self._timed(self._head(choices=[choice])))

    # ---- whole answers -----------------------------------------------------
    def _whole(self, usage: dict, timings: dict) -> dict:
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
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
               "system_fingerprint": FINGERPRINT, "choices": choices, "usage": usage,
               "timings": timings}
        if self.x.verbose:
            out["__verbose"] = self._native(0, usage, timings, True)
        return out

    def _native(self, i: int, usage: dict, timings: dict, whole: bool) -> dict:
        """llama.cpp's own final answer of choice ``i`` (``/completion``,
        and ``__verbose``: ``server_task_result_cmpl_final::to_json_non_oaicompat``)."""
        done = self.parsers[i].text if self.parsers is not None else "".join(self.texts[i])
        text = (self.echo or "") + done if whole else ""
        reason = self.reasons[i]
        out = {"index": i, "content": text, "tokens": [], "id_slot": -1, "stop": True,
               "model": self.model, "tokens_predicted": usage.get("completion_tokens", 0),
               "tokens_evaluated": usage.get("prompt_tokens", 0),
               "generation_settings": self.x.settings, "prompt": self.x.prompt_text(),
               "has_new_line": "\n" in text, "truncated": False,
               "stop_type": STOP_TYPES.get(reason or "", "none"), "stopping_word": "",
               "tokens_cached": usage.get("prompt_tokens", 0) + usage.get("completion_tokens", 0),
               "timings": timings}
        if whole and self.records[i]:
            out["completion_probabilities"] = self.records[i]
        return out

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
