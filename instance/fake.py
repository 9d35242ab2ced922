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
/ ``max_bytes`` memory reported by ``--measure``, after ``measure_s`` (0), with
``chat_template`` (true): whether the model has a chat template; ``measure_log``
(str) a file each ``--measure`` appends a line to (its pid and ``--ctx-size``:
a test counts the measures); ``fail_requests`` (bool)
answer requests with the replica's own fault, a 500 marked ``fault`` (so does
the existence of a file ``BEHAVIOUR.json.fail-<pid>``, which lets a test break
and mend one replica); ``bad_request_marker`` (str) a request whose JSON body
contains it fails with a plain 500, an error the request caused (llama.cpp
answers some bad grammars so); ``crash_marker`` (str) a request whose JSON
body contains it makes the process exit with ``crash_code`` at once, as
llama.cpp aborts on an out-of-vocabulary token id;
``tokenize_s`` (0) time ``/tokenize``, ``/detokenize`` and
``/apply-template`` each take, sleeping as llama.cpp's tokenizer runs
(without the GIL); ``parallel`` (1) slots: requests served at once, the rest queued round robin
by tenant (:mod:`ggmux.instance.engine.fairness`), as the built-in instance's
engine does (reported in the ``ready`` line, so the balancer counts
in-flight relative to it); ``kv_size`` (0: none) KV cells its ``/metrics``
reports, each busy slot reserving ``kv_size / parallel`` of them. The request limits ``--max-tokens-limit`` and
``--n-predict`` (in ``--llama-args``) apply as in the built-in instance.

A prompt cache (issue 20), with ``prefix_cache`` (bool): each slot keeps
the text of its last request (the prompt rendered as the tools, then
``<|role|>content`` per message, then ``<|assistant|>``, then the answer:
an appended turn extends it), and a request goes to the free slot whose
text shares the longest prefix with its prompt (else, or when that is
under a tenth of the prompt as llama-server's ``--slot-prompt-similarity``,
the one used longest ago), within ``--cache-scope`` (``global`` any slot,
``key`` only one its own tenant filled, ``none`` never), as the built-in
engine does. A prompt
is one token per 4 characters; the shared ones are ``cached_tokens``
(``usage.prompt_tokens_details``, at most all but one), and each token not
cached adds ``prefill_token_s`` (0.0002) to the TTFT. So a repeated prefix
answers faster, per slot, with at most ``parallel`` prompts held.

Tool calls and reasoning (issue 19), in OpenAI's chat-completion shapes as
llama-server's Jinja mode answers: a chat request with ``tools`` whose
``tool_choice`` is not ``"none"`` and whose last message is not a tool
result is answered with tool calls (``finish_reason: "tool_calls"``;
streamed as ``delta.tool_calls``: index, id and name first, then the
arguments in pieces): to the tool ``tool_choice`` names, else the first
tool named in ``tool`` (a name or a list) that the request offers, else the
first; the
arguments hold each required property of the tool's schema with a value
built from the schema alone (:func:`example_value`), or are
``tool_arguments[name]`` (an object) when given; ``tool_calls`` (1) calls
are made at once (the next tools in order) unless ``parallel_tool_calls``
is false. ``reasoning`` (str) is sent as ``reasoning_content`` before the
content or the calls (streamed word by word).

KV tiers (issue 29), with ``prefix_cache``: a slot's text about to be
overwritten goes to a host-RAM tier and a disk tier, as the built-in
instance's (``--cache-ram``, ``--cache-disk``, ``--cache-disk-max``,
``--cache-save-timeout`` in ``--llama-args``; the behaviour's
``cache_entry_bytes``, ``save_s``, ``save_ignores_timeout``), with ``GET
/cache``, ``POST /cache/clear``, the ``cache`` state line and the answers'
``timings.cache_tier``: :mod:`.fake_cache`.

Every answer's text starts ``[<name>:<pid>]`` so a test can tell which model
and which process served it.
"""

from __future__ import annotations

import json
import os
import os.path
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import orjson

from . import protocol
from .backend import Backend, ReplicaFault
from .cache.report import empty_report
from .engine.fairness import FairQueue
from .fake_cache import FakeTiers
from .validate import (
    BadRequest,
    function_parameters,
    generation_limit,
    request_limits_from_args,
)


def _check_shapes(body: dict) -> None:
    """Raise :class:`BadRequest` for ``tools``, ``tool_choice`` or
    ``stream_options`` of the wrong shape, as the built-in instance does: a
    client's mistake, never a replica fault nor an error mid-stream
    (tests/test_api_fuzz.py sends such bodies)."""
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools)):
        raise BadRequest("'tools' must be a list of {\"type\": \"function\", \"function\": "
                         "{\"name\": ...}}", "tools")
    for i, t in enumerate(tools or ()):
        function_parameters(t["function"].get("parameters"), f"tools[{i}].function.parameters")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, (str, dict)):
        raise BadRequest("'tool_choice' must be a string or an object", "tool_choice")


def example_value(schema, name: str = "value"):
    """A deterministic value that ``schema`` (a JSON schema) accepts, from
    the schema alone: its ``const``, first ``enum`` value or ``default``;
    an object of its required properties; ``minItems`` copies of an item;
    the property's name for a string (``minLength`` padded); ``minimum``
    (else 1) for a number; true for a boolean; the first branch of
    ``anyOf``/``oneOf``/``allOf``."""
    if not isinstance(schema, dict):
        return name
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return example_value(schema[key][0], name)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties") or {}
        return {k: example_value(props.get(k), k) for k in schema.get("required") or ()}
    if kind == "array":
        return [example_value(schema.get("items"), name)] * int(schema.get("minItems", 0))
    if kind in ("integer", "number"):
        v = schema.get("minimum", 1)
        return int(v) if kind == "integer" else float(v)
    if kind == "boolean":
        return True
    if kind == "null":
        return None
    return name.ljust(int(schema.get("minLength", 0)), "x")


@dataclass(slots=True, eq=False)
class _FakeJob:
    kind: str
    body: dict
    sink: object
    request_id: str
    tenant: str = ""
    limit: int | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    calls: list = field(default_factory=list)  # the tool calls it is answered with
    text: str = ""  # the prompt as the prompt cache sees it (prefix_cache)
    cache: int = -1  # the cache slot it holds, -1: none
    cached: int = 0  # prompt tokens it found there
    tier: str = ""  # where: slot, ram, disk (fake_cache), "" none


CHARS_PER_TOKEN = 4  # the prompt cache's tokens (prefix_cache)
SIMILARITY = 0.1  # a slot sharing less of a prompt is not reused (llama-server's
# --slot-prompt-similarity default; the built-in engine's slot_prompt_similarity)


def cache_text(kind: str, body: dict) -> str:
    """A request's prompt as the fake's prompt cache sees it: the tools (as
    JSON), then ``<|role|>content`` per message, then ``<|assistant|>``
    (chat); the ``prompt`` (completions)."""
    if kind != "chat":
        p = body.get("prompt")
        return p if isinstance(p, str) else json.dumps(p)
    parts = ["<|tools|>" + json.dumps(body["tools"])] if body.get("tools") else []
    for m in body.get("messages") or ():
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role')}|>{content or ''}")
    return "".join(parts) + "<|assistant|>"


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
        self.limits = request_limits_from_args(args)
        la = list(getattr(args, "llama_args", None) or [])
        self.n_predict = int(la[la.index("--n-predict") + 1]) if "--n-predict" in la else -1
        self._lock = threading.Condition()
        self._queue: FairQueue[_FakeJob] = FairQueue(lambda j: j.tenant)
        self._busy: list[_FakeJob | None] = [None] * self.slots
        self._closing: str | None = None
        self._calls = 0  # tool calls made, for their ids
        # the prompt cache (prefix_cache): per slot its text, owner, last use, holder
        self.prefix_cache = bool(self.cfg.get("prefix_cache"))
        self.scope = getattr(args, "cache_scope", "global") or "global"
        self._texts = [""] * self.slots
        self._owners = [""] * self.slots
        self._used = [0.0] * self.slots
        self._held = [False] * self.slots
        # the KV tiers (issue 29): host RAM and disk, as the built-in instance's
        self.tiers = FakeTiers(self.name, self.path, la, self.cfg, self.n_ctx)
        for i in range(self.slots):
            threading.Thread(target=self._worker, args=(i,), name=f"slot{i}", daemon=True).start()

    def measure(self) -> dict:
        c = self.cfg
        time.sleep(float(c.get("measure_s", 0)))
        if c.get("measure_log"):
            with open(c["measure_log"], "a") as f:
                f.write(f"{os.getpid()} {self.n_ctx}\n")
        return {"min": {"host": int(c.get("min_bytes", 0))},
                "max": {"host": int(c.get("max_bytes", 0))},
                "chat_template": bool(c.get("chat_template", True))}

    def load(self) -> dict:
        c = self.cfg
        load_s = float(c.get("load_s", 0.05))
        if c.get("hang_load"):
            while True:
                time.sleep(3600)
        if c.get("crash_load") is not None:
            time.sleep(load_s / 2)
            os._exit(int(c["crash_load"]))
        # progress as the built-in instance reports llama.cpp's: a line per
        # LOAD_PROGRESS_S (at least four), the last at 1.0
        steps = max(4, int(load_s / protocol.LOAD_PROGRESS_S))
        for i in range(steps):
            time.sleep(load_s / steps)
            protocol.emit("loading", progress=round((i + 1) / steps, 3))
        if c.get("fail_load"):
            raise RuntimeError(str(c["fail_load"]))
        if c.get("crash_after_s") is not None:
            delay, code = float(c["crash_after_s"]), int(c.get("crash_code", 3))
            threading.Timer(delay, lambda: os._exit(code)).start()
        self.tiers.line()  # what its disk tier holds from the start
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
    def _tokens(self, job: _FakeJob) -> list[str]:
        n = int(self.cfg.get("tokens", 8))
        if job.limit is not None:
            n = min(n, job.limit)
        first = f"[{self.name}:{os.getpid()}]"
        return [first] + [" tok"] * max(0, n - 1)

    def _tool_calls(self, body: dict) -> list[dict]:
        """The calls this request is answered with (module docstring); []
        for a text answer. Raises BadRequest for a named tool the request
        does not offer."""
        tools = body.get("tools")
        tools = [t.get("function") for t in tools if isinstance(t, dict) and isinstance(
            t.get("function"), dict)] if isinstance(tools, list) else []
        choice = body.get("tool_choice")
        msgs = body.get("messages") or [{}]
        if not tools or choice == "none" or msgs[-1].get("role") == "tool":
            return []
        names = [t.get("name") for t in tools]
        if isinstance(choice, dict):
            fn = choice.get("function")
            name = fn.get("name") if isinstance(fn, dict) else None
            if name not in names:
                raise BadRequest(f"tool_choice names {name!r}, which is not among the tools",
                                 "tool_choice")
            first = names.index(name)
        else:
            wanted = self.cfg.get("tool") or []
            wanted = [wanted] if isinstance(wanted, str) else wanted
            first = next((names.index(w) for w in wanted if w in names), 0)
        n = 1 if body.get("parallel_tool_calls") is False or isinstance(choice, dict) else max(
            1, int(self.cfg.get("tool_calls", 1)))
        given = self.cfg.get("tool_arguments") or {}
        calls = []
        for k in range(n):
            fn = tools[(first + k) % len(tools)]
            args = given.get(fn.get("name"))
            if args is None:
                try:
                    args = example_value(function_parameters(fn.get("parameters"), ""),
                                         fn.get("name"))
                except (TypeError, ValueError, AttributeError, KeyError, RecursionError):
                    args = {}  # a schema the fake cannot read (a fuzzed one): no arguments
                if not isinstance(args, dict):  # (an object schema's own "default": 5)
                    args = {}  # a grammar-constrained replica writes an object, always
            self._calls += 1
            calls.append({"id": f"call_{os.getpid()}_{self._calls}", "type": "function",
                          "function": {"name": fn.get("name"),
                                       "arguments": orjson.dumps(args).decode()}})
        return calls

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

    def start(self, kind: str, body: dict, sink, request_id: str = "", tenant: str = ""):
        """Queue one request for the next free slot (``parallel`` slots,
        round robin by tenant); raises at once for the markers,
        ``fail_requests`` (:class:`ReplicaFault`), bad chat bodies and a
        limit over ``--max-tokens-limit``."""
        self._check(body)
        if self.cfg.get("fail_requests") or os.path.exists(self.path + f".fail-{os.getpid()}"):
            raise ReplicaFault("fake failure")
        if kind == "chat" and not (isinstance(body.get("messages"), list) and all(
                isinstance(m, dict) for m in body["messages"])):
            # the built-in instance's validation refuses these too: a client's
            # mistake, never a replica fault (tests/test_api_fuzz.py sends them)
            raise BadRequest("'messages' must be a list of objects", "messages")
        _check_shapes(body)
        job = _FakeJob(kind, body, sink, request_id, tenant)
        if kind != "embedding":
            job.limit = generation_limit(body, self.limits, self.n_predict)
        if kind == "chat":
            job.calls = self._tool_calls(body)
        if self.prefix_cache and kind in ("chat", "completion"):
            job.text = cache_text(kind, body)
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
                held = Counter(j.tenant for j in self._busy if j is not None)
                job = self._queue.next(held)
                self._queue.take(job)
                if job.cancel.is_set():
                    continue
                self._busy[slot] = job
                if job.text:
                    self._take_cache(job)
            try:
                self._serve(job)
            except Exception as e:  # noqa: BLE001 - a fake's failure is its answer
                job.sink("error", f"{type(e).__name__}: {e}")
            finally:
                with self._lock:
                    self._busy[slot] = None
                    if job.cache >= 0:
                        self._held[job.cache] = False

    def _take_cache(self, job: _FakeJob) -> None:
        """Give ``job`` the free cache slot sharing the longest prefix with its
        prompt (within the cache scope), else the one used longest ago; it
        holds that slot's text from now on (lock held)."""
        free = [k for k in range(self.slots) if not self._held[k]]
        best, best_n = -1, 0
        if self.scope != "none":
            for k in free:
                if self.scope == "key" and self._owners[k] != job.tenant:
                    continue
                n = len(os.path.commonprefix([self._texts[k], job.text]))
                if n > best_n:
                    best, best_n = k, n
        if best < 0 or best_n < SIMILARITY * len(job.text):
            best = min(free, key=lambda k: self._used[k])
            best_n = 0
            # its text is overwritten: kept in the KV tiers, and the prompt's
            # longest prefix there restored (issue 29)
            self.tiers.keep(self._owners[best], self._texts[best])
            self._texts[best] = ""
            if self.scope != "none":
                best_n, job.tier = self.tiers.lookup(
                    job.tenant if self.scope == "key" else None, job.text,
                    max(1, int(SIMILARITY * len(job.text))))
        elif best_n:
            job.tier = "slot"
            self.tiers.slot_hit()
        self._held[best] = True
        self._owners[best] = job.tenant
        self._used[best] = time.monotonic()
        job.cache = best
        total = -(-len(job.text) // CHARS_PER_TOKEN)
        job.cached = min(best_n // CHARS_PER_TOKEN, total - 1)

    def _deltas(self, job: _FakeJob, toks: list[str]) -> list[dict]:
        """A chat answer as its stream's deltas: reasoning words, then the
        tool calls (id and name, then the arguments in up to ``tokens``
        pieces each) or the text tokens."""
        words = str(self.cfg.get("reasoning") or "").split(" ")
        out = [{"reasoning_content": w if i == 0 else " " + w}
               for i, w in enumerate(words) if w]
        for k, call in enumerate(job.calls):
            fn = call["function"]
            out.append({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                        "function": {"name": fn["name"], "arguments": ""}}]})
            args = fn["arguments"]
            step = max(1, -(-len(args) // max(1, len(toks))))
            out += [{"tool_calls": [{"index": k, "function": {"arguments": args[i:i + step]}}]}
                    for i in range(0, len(args), step)]
        if not job.calls:
            out += [{"content": t} for t in toks]
        out[0] = {"role": "assistant", **out[0]}
        return out

    def _serve(self, job: _FakeJob) -> None:
        body, chat, sink = job.body, job.kind == "chat", job.sink
        if job.kind == "embedding":
            sink("result", self._embedding(body))
            return
        toks = self._tokens(job)
        pieces = self._deltas(job, toks) if chat else [{"text": t} for t in toks]
        finish = "tool_calls" if job.calls else "stop"
        ttft, tok_s = float(self.cfg.get("ttft_s", 0.002)), float(self.cfg.get("token_s", 0.002))
        created, rid = int(time.time()), f"fake-{os.getpid()}-{time.monotonic_ns()}"
        timings = None
        model = body.get("model") or self.name
        n = len(pieces)
        usage = {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}
        if job.cache >= 0:
            prompt = -(-len(job.text) // CHARS_PER_TOKEN)
            usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n,
                     "prompt_tokens_details": {"cached_tokens": job.cached}}
            if job.tier:  # llama-server's timings, with the tier it came from
                timings = {"cache_n": job.cached, "cache_tier": job.tier}
            ttft += float(self.cfg.get("prefill_token_s", 0.0002)) * (prompt - job.cached)
            # the slot holds this prompt and its answer now
            self._texts[job.cache] = job.text + "".join(toks)
        if not body.get("stream"):
            if job.cancel.wait(ttft + tok_s * (n - 1)):
                sink("error", self._closing or "cancelled")
                return
            text = "".join(toks)
            if chat:
                msg: dict = {"role": "assistant", "content": None if job.calls else text}
                reasoning = "".join(p.get("reasoning_content", "") for p in pieces)
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if job.calls:
                    msg["tool_calls"] = job.calls
                choice = {"index": 0, "message": msg, "finish_reason": finish}
                out = {"id": rid, "object": "chat.completion", "created": created,
                       "model": model, "choices": [choice], "usage": usage}
            else:
                choice = {"index": 0, "text": text, "finish_reason": "stop", "logprobs": None}
                out = {"id": rid, "object": "text_completion", "created": created,
                       "model": model, "choices": [choice], "usage": usage}
            if timings:
                out["timings"] = timings
            sink("result", out)
            return
        obj = "chat.completion.chunk" if chat else "text_completion"
        for i, piece in enumerate(pieces):
            if job.cancel.wait(ttft if i == 0 else tok_s):
                sink("error", self._closing or "cancelled")
                return
            last = finish if i == n - 1 else None
            if chat:
                ch = {"index": 0, "delta": piece, "finish_reason": last}
            else:
                ch = {"index": 0, "text": piece["text"], "finish_reason": last, "logprobs": None}
            chunk = {"id": rid, "object": obj, "created": created, "model": model,
                     "choices": [ch]}
            if last and timings:
                chunk["timings"] = timings
            sink("chunk", chunk)
        if (body.get("stream_options") or {}).get("include_usage"):
            sink("chunk", {"id": rid, "object": obj, "created": created, "model": model,
                           "choices": [], "usage": usage})
        sink("end", usage)

    def close(self, reason: str) -> None:
        with self._lock:
            self._closing = reason
            queued, self._queue = list(self._queue), FairQueue(lambda j: j.tenant)
            running = [j for j in self._busy if j is not None]
        for j in queued:
            j.sink("error", reason)
        for j in running:
            j.cancel.set()
        # issue 29: the slots' caches go to the disk tier before the process exits
        with self._lock:
            slots = list(zip(self._owners, self._texts, strict=True))
        self.tiers.save(slots)

    def cache_report(self) -> dict:
        """``GET /cache`` (:mod:`.fake_cache`); zeros without tiers."""
        return self.tiers.info() if self.tiers.enabled else empty_report()

    def cache_clear(self) -> dict:
        """``POST /cache/clear``: the RAM and disk tiers emptied,
        ``{"ram": entries, "disk": entries}``."""
        return self.tiers.clear()["cleared"]

    def refuse_queued(self, reason: str) -> None:
        with self._lock:
            queued, self._queue = list(self._queue), FairQueue(lambda j: j.tenant)
        for j in queued:
            j.sink("error", reason)

    def slot_info(self) -> list[dict]:
        with self._lock:
            return [{"id": i, "is_processing": j is not None, "state": "generating" if j else "idle",
                     "request_id": j.request_id if j else "", "tenant": j.tenant if j else ""}
                    for i, j in enumerate(self._busy)]

    def metrics(self) -> dict:
        with self._lock:
            busy = sum(j is not None for j in self._busy)
            out = {"slots_busy": busy, "slots_total": self.slots, "queue_depth": len(self._queue)}
        kv = int(self.cfg.get("kv_size", 0))
        if kv > 0:  # each busy slot reserves its share of the cache, as ctx-size x parallel
            out.update(kv_size=kv, kv_busy=busy * kv // self.slots, kv_used=busy * kv // self.slots)
        return out

    def _tokenizer_time(self) -> None:
        time.sleep(float(self.cfg.get("tokenize_s", 0)))

    def tokenize(self, body: dict) -> dict:
        content = body.get("content")
        if not isinstance(content, str):
            raise BadRequest("'content' must be a string", "content")
        self._tokenizer_time()
        return {"tokens": [len(w) for w in content.split()]}

    def detokenize(self, body: dict) -> dict:
        self._check(body)
        self._tokenizer_time()
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
        self._tokenizer_time()
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
