"""A fake instance backend for tests: the real instance process and protocol,
with behaviour read from a JSON file instead of a GGUF model.

Run as ``python -m ggmux.instance --fake --model BEHAVIOUR.json``. Keys
(all optional; seconds and bytes):

``load_s`` (0.05) time to load; ``fail_load`` (str) fail the load with this
error after ``load_s``; ``crash_load`` (int) exit with this code during the
load; ``hang_load`` (bool) never finish loading; ``crash_after_s`` exit
with ``crash_code`` (3) this long after ready; ``ttft_s`` (0.002) delay before
the first token; ``token_s`` (0.002) delay between tokens; ``tokens`` (8)
tokens per answer unless the request's ``max_tokens`` is smaller;
``mem_bytes`` (0) effective host memory reported when ready; ``min_bytes``
/ ``max_bytes`` memory reported by ``--measure``, after ``measure_s`` (0); ``fail_requests`` (bool)
answer requests with the replica's own fault, a 500 marked ``fault`` (so does
the existence of a file ``BEHAVIOUR.json.fail-<pid>``, which lets a test break
and mend one replica); ``bad_request_marker`` (str) a request whose JSON body
contains it fails with a plain 500, an error the request caused (llama.cpp
answers some bad grammars so); ``crash_marker`` (str) a request whose JSON
body contains it makes the process exit with ``crash_code`` at once, as
llama.cpp aborts on an out-of-vocabulary token id;
``parallel`` (1) slots: requests served at once, the rest queued in arrival
order, as the built-in instance's engine does (reported in the ``ready``
line, so the balancer counts in-flight relative to it).

Every answer's text starts ``[<name>:<pid>]`` so a test can tell which model
and which process served it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import orjson

from . import protocol
from .backend import Backend, ReplicaFault
from .validate import BadRequest


@dataclass(slots=True, eq=False)
class _FakeJob:
    kind: str
    body: dict
    sink: object
    request_id: str
    cancel: threading.Event = field(default_factory=threading.Event)


class FakeBackend(Backend):
    def __init__(self, args) -> None:
        self.path = args.model
        self.name = args.name or os.path.basename(args.model).rsplit(".", 1)[0]
        self.n_ctx = args.ctx_size
        try:
            with open(self.path, "rb") as f:
                self.cfg = orjson.loads(f.read() or b"{}")
        except (OSError, orjson.JSONDecodeError):
            self.cfg = {}
        self.slots = max(1, int(self.cfg.get("parallel", 1)))
        self._lock = threading.Condition()
        self._queue: deque[_FakeJob] = deque()
        self._busy: list[_FakeJob | None] = [None] * self.slots
        self._closing: str | None = None
        for i in range(self.slots):
            threading.Thread(target=self._worker, args=(i,), name=f"slot{i}", daemon=True).start()

    def measure(self) -> dict:
        c = self.cfg
        time.sleep(float(c.get("measure_s", 0)))
        return {"min": {"host": int(c.get("min_bytes", 0))}, "max": {"host": int(c.get("max_bytes", 0))}}

    def load(self) -> dict:
        c = self.cfg
        load_s = float(c.get("load_s", 0.05))
        if c.get("hang_load"):
            while True:
                time.sleep(3600)
        if c.get("crash_load") is not None:
            time.sleep(load_s / 2)
            os._exit(int(c["crash_load"]))
        steps = 4
        for i in range(steps):
            time.sleep(load_s / steps)
            protocol.emit("loading", progress=round((i + 1) / steps, 3))
        if c.get("fail_load"):
            raise RuntimeError(str(c["fail_load"]))
        if c.get("crash_after_s") is not None:
            delay, code = float(c["crash_after_s"]), int(c.get("crash_code", 3))
            threading.Timer(delay, lambda: os._exit(code)).start()
        return {"n_ctx": self.n_ctx, "effective": {"host": int(c.get("mem_bytes", 0))},
                "slots": self.slots}

    def sleep(self) -> None:
        self.asleep = True

    def wake(self) -> dict:
        time.sleep(float(self.cfg.get("wake_s", self.cfg.get("load_s", 0.05))))
        self.asleep = False
        return {"n_ctx": self.n_ctx, "effective": {"host": int(self.cfg.get("mem_bytes", 0))},
                "slots": self.slots}

    # ---- generation ---------------------------------------------------------
    def _tokens(self, body: dict) -> list[str]:
        n = int(self.cfg.get("tokens", 8))
        mt = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(mt, int) and mt > 0:
            n = min(n, mt)
        first = f"[{self.name}:{os.getpid()}]"
        return [first] + [" tok"] * max(0, n - 1)

    def _check(self, body: dict) -> None:
        """The request-triggered behaviours: ``crash_marker``, ``bad_request_marker``."""
        c = self.cfg
        text = None
        for key, act in (("crash_marker", "crash"), ("bad_request_marker", "fail")):
            marker = c.get(key)
            if not marker:
                continue
            if text is None:
                text = orjson.dumps(body).decode()
            if marker in text:
                if act == "crash":
                    os._exit(int(c.get("crash_code", 3)))
                raise RuntimeError(f"request failed on {marker!r}")

    def start(self, kind: str, body: dict, sink, request_id: str = ""):
        """Queue one request for the next free slot (FIFO, ``parallel``
        slots); raises at once for the markers, ``fail_requests``
        (:class:`ReplicaFault`) and bad chat bodies."""
        self._check(body)
        if self.cfg.get("fail_requests") or os.path.exists(self.path + f".fail-{os.getpid()}"):
            raise ReplicaFault("fake failure")
        if kind == "chat" and not isinstance(body.get("messages"), list):
            raise BadRequest("'messages' must be a list", "messages")
        job = _FakeJob(kind, body, sink, request_id)
        with self._lock:
            if self._closing is not None:
                raise RuntimeError(self._closing)
            self._queue.append(job)
            self._lock.notify()
        return job.cancel.set

    def _worker(self, slot: int) -> None:
        while True:
            with self._lock:
                while not self._queue:
                    self._lock.wait()
                job = self._queue.popleft()
                if job.cancel.is_set():
                    continue
                self._busy[slot] = job
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - a fake's failure is its answer
                job.sink("error", f"{type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._busy[slot] = None

    def _serve(self, job: _FakeJob) -> None:
        body, chat, sink = job.body, job.kind == "chat", job.sink
        if job.kind == "embedding":
            sink("result", self._embedding(body))
            return
        toks = self._tokens(body)
        ttft, tok_s = float(self.cfg.get("ttft_s", 0.002)), float(self.cfg.get("token_s", 0.002))
        created, rid = int(time.time()), f"fake-{os.getpid()}-{time.monotonic_ns()}"
        model = body.get("model") or self.name
        usage = {"prompt_tokens": 1, "completion_tokens": len(toks), "total_tokens": len(toks) + 1}
        if not body.get("stream"):
            if job.cancel.wait(ttft + tok_s * (len(toks) - 1)):
                sink("error", self._closing or "cancelled")
                return
            text = "".join(toks)
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "finish_reason": "stop"}
                sink("result", {"id": rid, "object": "chat.completion", "created": created,
                                "model": model, "choices": [choice], "usage": usage})
            else:
                choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                sink("result", {"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": [choice], "usage": usage})
            return
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, t in enumerate(toks):
            if job.cancel.wait(ttft if i == 0 else tok_s):
                sink("error", self._closing or "cancelled")
                return
            last = i == len(toks) - 1
            if chat:
                delta = {"content": t} if i else {"role": "assistant", "content": t}
                ch = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
            else:
                ch = {"index": 0, "text": t, "finish_reason": "stop" if last else None,
                      "logprobs": None}
            sink("chunk", {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [ch]})
        if (body.get("stream_options") or {}).get("include_usage"):
            sink("chunk", {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [], "usage": usage})
        sink("end", None)

    def close(self, reason: str) -> None:
        with self._lock:
            self._closing = reason
            queued, self._queue = list(self._queue), deque()
            running = [j for j in self._busy if j is not None]
        for j in queued:
            j.sink("error", reason)
        for j in running:
            j.cancel.set()

    def refuse_queued(self, reason: str) -> None:
        with self._lock:
            queued, self._queue = list(self._queue), deque()
        for j in queued:
            j.sink("error", reason)

    def slot_info(self) -> list[dict]:
        with self._lock:
            return [{"id": i, "is_processing": j is not None, "state": "generating" if j else "idle",
                     "request_id": j.request_id if j else ""} for i, j in enumerate(self._busy)]

    def metrics(self) -> dict:
        with self._lock:
            busy = sum(j is not None for j in self._busy)
            return {"slots_busy": busy, "slots_total": self.slots, "queue_depth": len(self._queue)}

    def tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        return {"tokens": [len(w) for w in content.split()]}

    def detokenize(self, body: dict) -> dict:
        self._check(body)
        return {"content": " ".join("x" * int(t) for t in body.get("tokens", []))}

    def apply_template(self, body: dict) -> dict:
        """A stand-in chat template: ``<|role|>content`` per message, then the
        tools as JSON, then ``<|assistant|>`` (so a count of the prompt
        grows with the messages and the tools, as a real template's)."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list", "messages")
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
            calls = json.dumps(m.get("tool_calls")) if isinstance(m, dict) and m.get(
                "tool_calls") else ""
            role = m.get("role") if isinstance(m, dict) else "?"
            parts.append(f"<|{role}|>{content or ''}{calls}")
        if body.get("tools"):
            parts.append("<|tools|>" + json.dumps(body["tools"]))
        return {"prompt": "".join(parts) + "<|assistant|>"}

    def props(self) -> dict:
        return {"model_alias": self.name, "model_path": self.path, "n_ctx": self.n_ctx,
                "total_slots": self.slots}

    def _embedding(self, body: dict) -> dict:
        inp = body.get("input")
        items = inp if isinstance(inp, list) else [inp]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(str(x))), 0.5, -0.5]}
            for i, x in enumerate(items)
        ]
        return {"object": "list", "data": data, "model": body.get("model") or self.name,
                "usage": {"prompt_tokens": len(items), "total_tokens": len(items)}}
