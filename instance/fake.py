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
llama.cpp aborts on an out-of-vocabulary token id.

Every answer's text starts ``[<name>:<pid>]`` so a test can tell which model
and which process served it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator

import orjson

from . import protocol
from .server import Backend, ReplicaFault
from .validate import BadRequest


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
        return {"n_ctx": self.n_ctx, "effective": {"host": int(c.get("mem_bytes", 0))}}

    def sleep(self) -> None:
        self.asleep = True

    def wake(self) -> dict:
        time.sleep(float(self.cfg.get("wake_s", self.cfg.get("load_s", 0.05))))
        self.asleep = False
        return {"n_ctx": self.n_ctx, "effective": {"host": int(self.cfg.get("mem_bytes", 0))}}

    # ---- generation ---------------------------------------------------------
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

    def _tokens(self, body: dict) -> list[str]:
        n = int(self.cfg.get("tokens", 8))
        mt = body.get("max_tokens") or body.get("max_completion_tokens")
        if isinstance(mt, int) and mt > 0:
            n = min(n, mt)
        first = f"[{self.name}:{os.getpid()}]"
        return [first] + [" tok"] * max(0, n - 1)

    def _gen(self, body: dict, cancel: threading.Event, chat: bool) -> dict | Iterator[dict]:
        self._check(body)
        if self.cfg.get("fail_requests") or os.path.exists(self.path + f".fail-{os.getpid()}"):
            raise ReplicaFault("fake failure")
        if chat and not isinstance(body.get("messages"), list):
            raise ValueError("'messages' must be a list")
        toks = self._tokens(body)
        ttft, tok_s = float(self.cfg.get("ttft_s", 0.002)), float(self.cfg.get("token_s", 0.002))
        created, rid = int(time.time()), f"fake-{os.getpid()}-{time.monotonic_ns()}"
        model = body.get("model") or self.name
        if not body.get("stream"):
            time.sleep(ttft + tok_s * (len(toks) - 1))
            text = "".join(toks)
            usage = {"prompt_tokens": 1, "completion_tokens": len(toks), "total_tokens": len(toks) + 1}
            if chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                return {"id": rid, "object": "chat.completion", "created": created, "model": model,
                        "choices": [choice], "usage": usage}
            choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
            return {"id": rid, "object": "text_completion", "created": created, "model": model,
                    "choices": [choice], "usage": usage}

        def stream() -> Iterator[dict]:
            for i, t in enumerate(toks):
                if cancel.wait(ttft if i == 0 else tok_s):
                    return
                last = i == len(toks) - 1
                if chat:
                    delta = {"content": t} if i else {"role": "assistant", "content": t}
                    ch = {"index": 0, "delta": delta, "finish_reason": "stop" if last else None}
                    yield {"id": rid, "object": "chat.completion.chunk", "created": created,
                           "model": model, "choices": [ch]}
                else:
                    ch = {"index": 0, "text": t, "finish_reason": "stop" if last else None,
                          "logprobs": None}
                    yield {"id": rid, "object": "text_completion", "created": created,
                           "model": model, "choices": [ch]}

        return stream()

    def chat(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        return self._gen(body, cancel, chat=True)

    def completion(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        return self._gen(body, cancel, chat=False)

    def tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        return {"tokens": [len(w) for w in content.split()]}

    def detokenize(self, body: dict) -> dict:
        self._check(body)
        return {"content": " ".join("x" * int(t) for t in body.get("tokens", []))}

    def props(self) -> dict:
        return {"model_alias": self.name, "model_path": self.path, "n_ctx": self.n_ctx,
                "total_slots": 1}

    def embedding(self, body: dict, cancel: threading.Event) -> dict:
        inp = body.get("input")
        items = inp if isinstance(inp, list) else [inp]
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(str(x))), 0.5, -0.5]}
            for i, x in enumerate(items)
        ]
        return {"object": "list", "data": data, "model": body.get("model") or self.name,
                "usage": {"prompt_tokens": len(items), "total_tokens": len(items)}}
