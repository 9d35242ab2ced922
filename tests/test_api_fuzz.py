"""No client API input gives a 500 (issue 18, finding 8): hypothesis fuzzes
the request fields of every adapter (Anthropic Messages and count_tokens,
Responses, Ollama chat, generate, embed and embeddings, and the OpenAI
chat body the proxy itself rewrites for ``stream_options.include_usage``)
with wrong types, out-of-range and big numbers, NaN and infinities, odd
strings, deep nesting and wrong containers, and asserts: no 5xx, no
exception out of the handler (the HTTP core would answer it with a 500),
and every error in the API's own envelope.

Most examples run :class:`~ggmux.proxy.apis.ClientApis` itself on bytes,
with no process: a stub proxy stands for the worker (its ``_forward``
records what would reach the replica, which must be a JSON object naming
the model). A smaller set goes through a real ``ggmux serve`` on a fake
model. The suite runs a fixed number of examples (seconds); the long run
is opt-in: ``python -m pytest tests/test_api_fuzz.py -m fuzz``
(``GGMUX_FUZZ_EXAMPLES`` examples per API, default 5000).
"""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import math
import os
import re
from collections import Counter
from dataclasses import dataclass, field

import orjson
import pytest
from ggmux.http1 import Request
from ggmux.proxy.apis import CHAT_WITH_USAGE, ClientApis
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

SUITE_EXAMPLES = 120  # per API on bytes, in the suite
SERVE_EXAMPLES = 25  # per API through a real server, in the suite
LONG_EXAMPLES = int(os.environ.get("GGMUX_FUZZ_EXAMPLES", "5000"))

# ---- values ------------------------------------------------------------------------
ODD_STRINGS = ["", " ", "\x00", "nan", "NaN", "inf", "-inf", "Infinity", "-1", "0", "1e999",
               ".s", "1..2s", "5m", "-5m", "1h30m", "300ms", "0s", "+", "-", "µs", "9" * 400 + "h",
               "a" * 2000, "\u202e", "💥", "<script>alert(1)</script>", "\\", "\"", "null",
               "latest", "m:latest", "data:image/png;base64,", "iVBORw0KGgo=", "/9j/4AAQ"]
ODD_NUMBERS = [0, -1, -2, 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70,
               -2**63 - 1, -2**70, 1e30, -1e30, 1e308, 1e-300, 0.5, -0.0, 3.7, float("nan"),
               float("inf"), float("-inf")]

text = st.one_of(st.text(max_size=24), st.sampled_from(ODD_STRINGS))
number = st.one_of(st.integers(-5, 5), st.integers(-2**80, 2**80),
                   st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(ODD_NUMBERS))
scalar = st.one_of(st.none(), st.booleans(), number, text)


def nested(depth: int, kind: int):
    """A value ``depth`` containers deep (beyond orjson's 254-level writer)."""
    v: object = "x"
    for _ in range(depth):
        v = [v] if kind == 0 else {"a": v}
    return v


deep = st.builds(nested, st.integers(240, 700), st.integers(0, 1))
junk = st.one_of(
    st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
                 max_leaves=8),
    deep)


def obj(required: dict, optional: dict | None = None):
    return st.fixed_dictionaries(required, optional=optional or {})


# ---- valid requests: each API's fields with values of their own shape -------------------
words = st.text("abcdefgh xyz.,?!é漢", max_size=16)
name = st.text("abcdefghij_", min_size=1, max_size=8)
model = st.sampled_from(["m"] * 6 + ["m:latest", "missing"])
schema = st.one_of(
    st.just({"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}),
    st.just({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}),
    st.just({"type": "string", "maxLength": 5}), st.just({}))
fn_tool = obj({"type": st.just("function"),
               "function": obj({"name": name}, {"description": words, "parameters": schema})})
stops = st.one_of(words, st.lists(words, max_size=3))
small = st.integers(1, 64)
temp = st.floats(0, 2)
unit = st.floats(0, 1)
png = st.just("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")

a_block = st.one_of(
    obj({"type": st.just("text"), "text": words}),
    obj({"type": st.just("image"), "source": obj({"type": st.just("base64"),
                                                  "media_type": st.just("image/png"),
                                                  "data": png})}),
    obj({"type": st.just("tool_use"), "id": name, "name": name, "input": st.just({"x": "1"})}),
    obj({"type": st.just("tool_result"), "tool_use_id": name},
        {"content": st.one_of(words, st.lists(obj({"type": st.just("text"), "text": words}),
                                              max_size=2)), "is_error": st.booleans()}),
    obj({"type": st.just("thinking"), "thinking": words, "signature": name}))
a_message = obj({"role": st.sampled_from(["user", "assistant"]),
                 "content": st.one_of(words, st.lists(a_block, min_size=1, max_size=3))})
anthropic = obj({"model": model, "max_tokens": small,
                 "messages": st.lists(a_message, min_size=1, max_size=3)},
                {"system": st.one_of(words, st.lists(obj({"type": st.just("text"),
                                                          "text": words}), max_size=2)),
                 "stream": st.booleans(), "temperature": temp, "top_p": unit,
                 "top_k": st.integers(0, 100), "stop_sequences": st.lists(words, max_size=3),
                 "tools": st.lists(obj({"name": name, "input_schema": schema},
                                       {"description": words}), max_size=2),
                 "tool_choice": obj({"type": st.sampled_from(["auto", "any", "tool", "none"])},
                                    {"name": name, "disable_parallel_tool_use": st.booleans()}),
                 "thinking": obj({"type": st.sampled_from(["enabled", "disabled"])},
                                 {"budget_tokens": st.integers(1024, 4096)}),
                 "metadata": obj({"user_id": name})})

r_part = st.one_of(obj({"type": st.sampled_from(["input_text", "output_text"]), "text": words}),
                   obj({"type": st.just("input_image"),
                        "image_url": png.map(lambda d: "data:image/png;base64," + d)}))
r_item = st.one_of(
    obj({"role": st.sampled_from(["user", "assistant", "system", "developer"]),
         "content": st.one_of(words, st.lists(r_part, min_size=1, max_size=2))},
        {"type": st.just("message")}),
    obj({"type": st.just("function_call"), "call_id": name, "name": name,
         "arguments": st.just('{"x": "1"}')}),
    obj({"type": st.just("function_call_output"), "call_id": name, "output": words}),
    obj({"type": st.just("reasoning"),
         "summary": st.lists(obj({"type": st.just("summary_text"), "text": words}), max_size=2)}))
responses = obj({"model": model, "input": st.one_of(words, st.lists(r_item, min_size=1,
                                                                    max_size=3))},
                {"instructions": words, "max_output_tokens": small, "temperature": temp,
                 "top_p": unit, "stream": st.booleans(),
                 "text": obj({"format": st.one_of(
                     obj({"type": st.sampled_from(["text", "json_object"])}),
                     obj({"type": st.just("json_schema"), "name": name, "schema": schema}))}),
                 "tools": st.lists(obj({"type": st.just("function"), "name": name},
                                       {"parameters": schema, "description": words}),
                                   max_size=2),
                 "tool_choice": st.sampled_from(["auto", "none", "required"]),
                 "parallel_tool_calls": st.booleans(), "previous_response_id": name,
                 "reasoning": obj({"effort": st.sampled_from(["low", "medium", "high"])})})

keep_alive = st.one_of(st.sampled_from(["5m", "1h30m", "300ms", "-1", "0", ".5s"]),
                       st.integers(-1, 600), st.floats(0, 600))
options = obj({}, {"num_predict": st.integers(-2, 64), "temperature": temp,
                   "top_k": st.integers(0, 100), "top_p": unit, "min_p": unit, "stop": stops,
                   "seed": st.integers(0, 2**31), "repeat_penalty": temp, "num_ctx": small})
o_common = {"stream": st.booleans(), "format": st.one_of(st.just("json"), schema),
            "options": options, "keep_alive": keep_alive,
            "think": st.one_of(st.booleans(), st.sampled_from(["low", "medium", "high"]))}
o_message = st.one_of(
    obj({"role": st.sampled_from(["user", "system"]), "content": words},
        {"images": st.lists(png, max_size=1)}),
    obj({"role": st.just("assistant"), "content": words},
        {"tool_calls": st.lists(obj({"function": obj({"name": name,
                                                       "arguments": st.just({"x": "1"})})}),
                                max_size=2), "thinking": words}),
    obj({"role": st.just("tool"), "content": words}, {"tool_name": name}))
ollama_chat = obj({"model": model}, {"messages": st.lists(o_message, max_size=3),
                                     "tools": st.lists(fn_tool, max_size=2), **o_common})
ollama_generate = obj({"model": model}, {"prompt": words, "system": words, "raw": st.booleans(),
                                         "images": st.lists(png, max_size=1), **o_common})
ollama_embed = obj({"model": model, "input": stops}, {"keep_alive": keep_alive,
                                                      "truncate": st.booleans()})
ollama_embeddings = obj({"model": model}, {"prompt": words, "keep_alive": keep_alive})

openai_usage = obj({"model": model, "messages": st.lists(obj({"role": st.sampled_from(
                        ["system", "user", "assistant"]), "content": words}), min_size=1,
                        max_size=2),
                    "stream": st.just(True), "stream_options": st.just({"include_usage": True})},
                   {"max_tokens": small, "tools": st.lists(fn_tool, max_size=1),
                    "user": name, "prompt_cache_key": name, "metadata": obj({"session_id": name})})


# ---- mutations: a valid request with a few of its values made anything at all ----------------
PLACE_DEPTH = 6  # a request's own fields; not inside a value a mutation made deep


def _places(v, path=()):
    """The places in a JSON value: the paths of its containers' members."""
    if len(path) >= PLACE_DEPTH:
        return
    if isinstance(v, dict):
        for k, x in v.items():
            yield (*path, k)
            yield from _places(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield (*path, i)
            yield from _places(x, (*path, i))


def _containers(v, path=()):
    if isinstance(v, (dict, list)) and len(path) < PLACE_DEPTH:
        yield path
        for k, x in (v.items() if isinstance(v, dict) else enumerate(v)):
            yield from _containers(x, (*path, k))


def _at(v, path):
    for k in path:
        v = v[k]
    return v


field_names = st.sampled_from(["model", "messages", "stream", "options", "keep_alive", "tools",
                               "tool_choice", "content", "role", "type", "input", "prompt",
                               "format", "max_tokens", "num_predict", "seed", "x", "images",
                               "stop", "system", "text", "function", "arguments", "name"])


@st.composite
def mutated(draw, valid):
    """``valid``'s body with 0 to 3 changes: a value replaced by anything
    (wrong types, big or non-finite numbers, odd strings, deep nesting),
    wrapped in the wrong container, removed, or a member added."""
    body = copy.deepcopy(draw(valid))  # st.just values are shared between examples
    for _ in range(draw(st.integers(0, 3))):
        act = draw(st.sampled_from(["replace", "replace", "wrap", "remove", "add"]))
        if act == "add":
            where = _at(body, draw(st.sampled_from(list(_containers(body)))))
            if isinstance(where, dict):
                where[draw(field_names)] = draw(junk)
            else:
                where.append(draw(junk))
            continue
        places = list(_places(body))
        if not places:
            continue
        path = draw(st.sampled_from(places))
        parent, key = _at(body, path[:-1]), path[-1]
        if act == "remove":
            del parent[key]
        elif act == "wrap":
            parent[key] = draw(st.sampled_from([[parent[key]], {"value": parent[key]}]))
        else:
            parent[key] = draw(junk)
    return body


APIS = {  # name -> (path, body strategy, envelope)
    "anthropic": ("/v1/messages", anthropic, "anthropic"),
    "anthropic-count": ("/v1/messages/count_tokens", anthropic, "anthropic"),
    "responses": ("/v1/responses", responses, "openai"),
    "ollama-chat": ("/api/chat", ollama_chat, "ollama"),
    "ollama-generate": ("/api/generate", ollama_generate, "ollama"),
    "ollama-embed": ("/api/embed", ollama_embed, "ollama"),
    "ollama-embeddings": ("/api/embeddings", ollama_embeddings, "ollama"),
    "openai-usage": ("/v1/chat/completions", openai_usage, "openai"),
}


def to_bytes(body) -> bytes:
    """JSON bytes as a client sends them (Python's encoder: big integers
    whole, NaN and infinities as the non-JSON tokens some clients write)."""
    return json.dumps(body, allow_nan=True).encode()


def raw_bodies(strategy):
    """The body's bytes (a mutated valid request); now and then not JSON,
    or JSON that is no object."""
    body = mutated(strategy).map(to_bytes)
    return st.one_of(body, body, body, body, body, body, st.binary(max_size=30),
                     junk.map(to_bytes),
                     st.just(b"[" * 1100 + b"]" * 1100), st.just(b'{"model": "m", "x": ' +
                                                                 b"[" * 300 + b"]" * 300 + b"}"))


def assert_envelope(kind: str, status: int, body: bytes) -> None:
    """``body`` is an error in the API's own envelope, with a 4xx ``status``."""
    assert 400 <= status < 500, (status, body[:300])
    doc = json.loads(body)
    if kind == "anthropic":
        assert doc["type"] == "error" and isinstance(doc["error"]["message"], str), doc
        assert isinstance(doc["error"]["type"], str), doc
    elif kind == "ollama":
        assert list(doc) == ["error"] and isinstance(doc["error"], str), doc
    else:
        assert isinstance(doc["error"]["message"], str), doc
        assert isinstance(doc["error"]["type"], str), doc


# ---- on bytes: ClientApis with a stub worker -------------------------------------------
@dataclass
class Answered:
    status: int
    body: bytes


class Conn:
    """The client connection as the handler sees it: records its answer."""

    def __init__(self) -> None:
        from ggmux.http1 import HttpLimits

        self.answers: list[Answered] = []
        self.limits = HttpLimits()
        self.write_paused = False
        self.write_paused_cb = None

    def send_response(self, req, status, body, content_type=b"application/json", headers=()):
        self.answers.append(Answered(status, bytes(body)))

    def send_json(self, req, status, obj, headers=()):
        self.answers.append(Answered(status, orjson.dumps(obj)))

    def send_error(self, req, status, message, code=None, headers=(), **extra):
        self.answers.append(Answered(status, orjson.dumps({"error": {"message": message,
                                                                     "type": "error"}})))

    def finish(self, req) -> None:
        pass

    # a streamed answer: its head, its bytes, and how it ended
    def start_stream(self, req, content_type=b"text/event-stream", headers=()) -> None:
        self.streamed = bytearray()

    def send_chunk(self, data: bytes) -> None:
        self.streamed += data

    def end_stream(self, req) -> None:
        self.answers.append(Answered(200, bytes(self.streamed)))

    def close(self) -> None:
        self.answers.append(Answered(200, bytes(self.streamed) + b"<cut>"))


def replica_answer(target: bytes, body: dict) -> tuple[bytes, bytes]:
    """``(content type, body)`` a replica would answer ``body`` sent to
    ``target`` with: a chat completion (a tool call when ``tools`` came, a
    stream when asked), a text completion, embeddings."""
    if target == b"/tokenize":  # Anthropic's count_tokens
        return b"application/json", orjson.dumps({"tokens": [1, 2, 3]})
    if target == b"/v1/embeddings":
        n = len(body["input"]) if isinstance(body.get("input"), list) else 1
        return b"application/json", orjson.dumps({"data": [
            {"index": i, "embedding": [0.5, -0.5]} for i in range(n)],
            "usage": {"prompt_tokens": n}})
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    if target == b"/v1/completions":
        choice = {"index": 0, "text": "hi", "finish_reason": "stop"}
        msg = delta = {"text": "hi"}
    else:
        tools = body.get("tools")
        fn = tools[0].get("function") if isinstance(tools, list) and tools and isinstance(
            tools[0], dict) else None
        if isinstance(fn, dict) and body.get("tool_choice") != "none":
            call = {"index": 0, "id": "call_1", "type": "function", "function": {
                "name": str(fn.get("name")), "arguments": '{"x": "1"}'}}
            msg = delta = {"role": "assistant", "content": None, "tool_calls": [call]}
            finish = "tool_calls"
        else:
            msg = delta = {"role": "assistant", "content": "hi", "reasoning_content": "so"}
            finish = "stop"
        choice = {"index": 0, "message": msg, "finish_reason": finish}
    if body.get("stream") is not True:  # as the replica reads it: a true, nothing else
        return b"application/json", orjson.dumps({"id": "x", "object": "chat.completion",
                                                   "created": 1, "model": body.get("model"),
                                                   "choices": [choice], "usage": usage})
    chunk = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
             "choices": [{"index": 0, "delta": delta, "text": delta.get("text"),
                          "finish_reason": choice["finish_reason"]}]}
    events = [chunk, {"id": "x", "choices": [], "usage": usage}]
    return b"text/event-stream", b"".join(b"data: " + orjson.dumps(e) + b"\n\n"
                                          for e in events) + b"data: [DONE]\n\n"


@dataclass
class Capture:
    status: int = 200
    body: bytes = b'{"prompt": "<rendered>"}'
    headers: list = field(default_factory=list)


class StubProxy:
    """The worker :class:`ClientApis` needs (its ``Proxy`` protocol): one
    ready model ``m``; ``_forward`` records what would reach the replica."""

    def __init__(self) -> None:
        self.names = {"m": 0}
        self.reg_models = [{"name": "m", "kind": "builtin", "args": ["--mmproj", "p.gguf"]}]
        self.errors: dict = {}
        self.ready = {0}
        self.commands: list[dict] = []
        self.forwarded: list[tuple[bytes, bytes]] = []
        self.stream_keepalive = 5.0  # seconds (--stream-keepalive)

    def refresh(self) -> None:
        pass

    def pick_model(self, name: str) -> int | None:
        from ggmux.proxy.apis.client_apis import resolve

        return resolve(self.names, name)  # no --model-fallback

    def name_for_unnamed(self) -> str | None:
        return None  # as a server of several models: a body without one is refused

    def command(self, cmd: dict) -> bool:
        self.commands.append(cmd)
        return True

    def admin_refusal(self, req: Request) -> str | None:
        return None  # the admin: keep_alive 0 unloads (the orders are checked below)

    def _listed(self, req: Request) -> list[dict]:
        return self.reg_models  # no keys file: every model

    def _key_allows(self, req: Request, mdl: dict) -> bool:
        return True

    async def _forward(self, conn, req, m, name, body, touch=True, stream=False, capture=False):
        """Record what reaches the replica and play the replica's answer
        into ``conn`` as the relay does (the answer's translation runs)."""
        self.forwarded.append((req.url, bytes(req.body)))
        if capture:
            return Capture()
        ctype, answer = replica_answer(req.url, orjson.loads(req.body))
        conn.write(conn.head(req, 200, [(b"content-type", ctype)], b""))
        for i in range(0, len(answer), 50):  # in pieces, as a replica's reads come
            conn.send_chunk(answer[i:i + 50])
        conn.end_stream(req)
        return None


def run_bytes(loop, path: str, raw: bytes, depth: int | None = None
              ) -> tuple[StubProxy, Conn]:
    """``raw`` to ``path`` through the client APIs' handler; ``depth``: the
    server's ``--max-json-depth`` (default: the option's default)."""
    p, conn = StubProxy(), Conn()
    if depth is not None:
        conn.limits.max_json_depth = depth
    req = Request()
    req.method, req.url, req.path, req.body = b"POST", path.encode(), path.encode(), raw
    req.headers = [(b"content-type", b"application/json")]
    apis = ClientApis(p)
    if path == "/v1/chat/completions":  # the proxy's own route hands these over
        loop.run_until_complete(apis.translated(conn, req, CHAT_WITH_USAGE))
    else:
        loop.run_until_complete(apis.handle(conn, req))
    return p, conn


OUTCOMES: Counter = Counter()  # (api, outcome) -> examples, for the long run's summary


def outcome(api: str, what: str) -> None:
    OUTCOMES[api, what] += 1
    event(f"{api}: {what}")


def check_bytes(loop, api: str, raw: bytes) -> None:
    path, _, kind = APIS[api]
    p, conn = run_bytes(loop, path, raw)  # an exception here would be the HTTP core's 500
    assert conn.answers, "no answer"
    a = conn.answers[-1]
    if not p.forwarded:
        if a.status == 200:  # Ollama's load idiom: answered by the router
            outcome(api, f"200 {json.loads(a.body).get('done_reason')}")
            return
        assert_envelope(kind, a.status, a.body)
        outcome(api, str(a.status))
        return
    for target, body in p.forwarded:
        doc = orjson.loads(body)
        assert isinstance(doc, dict) and doc.get("model") == "m", doc
        assert target.startswith(b"/"), target
    # the replica's good answer comes back whole, in the API's shape, never cut
    assert a.status == 200 and not a.body.endswith(b"<cut>"), a
    assert not ERROR_IN_ANSWER.search(a.body), a.body[-400:]
    outcome(api, "forwarded")


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


def run_on_bytes(loop, api: str, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=raw_bodies(APIS[api][1]))
    def prop(raw):
        check_bytes(loop, api, raw)

    prop()


@pytest.mark.parametrize("api", list(APIS))
def test_no_request_body_gives_a_5xx_or_a_foreign_envelope(loop, api):
    run_on_bytes(loop, api, SUITE_EXAMPLES)


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("api", list(APIS))
def test_no_request_body_gives_a_5xx_long_run(loop, api):
    run_on_bytes(loop, api, LONG_EXAMPLES)
    print(api, sorted((k[1], n) for k, n in OUTCOMES.items() if k[0] == api))


@pytest.mark.parametrize("raw", [
    b'{"model": "m", "prompt": "x", "options": {"num_predict": 1e30}}',
    b'{"model": "m", "prompt": "x", "options": {"num_predict": %d}}' % 2**70,
    b'{"model": "m", "prompt": "x", "options": {"seed": %d}}' % 2**70,
    b'{"model": "m", "prompt": "x", "keep_alive": ".s"}',
    b'{"model": "m", "prompt": "x", "keep_alive": "1..2s"}',
    b'{"model": "m", "prompt": "x", "keep_alive": "nan"}',
    b'{"model": "m", "prompt": "x", "keep_alive": "inf"}',
    b'{"model": "m", "prompt": "x", "format": ' + b"[" * 300 + b"]" * 300 + b"}",
])
def test_the_findings_ollama_inputs_get_400_in_ollamas_envelope(loop, raw):
    p, conn = run_bytes(loop, "/api/generate", raw)
    assert conn.answers and not p.forwarded, p.forwarded
    assert_envelope("ollama", conn.answers[-1].status, conn.answers[-1].body)
    assert conn.answers[-1].status == 400


@pytest.mark.parametrize("api,body", [
    ("responses", {"model": "m", "input": "x",
                   "text": {"format": {"type": "text", "x": nested(252, 0)}}}),
    ("responses", {"model": "m", "input": "x", "metadata": {"k": nested(300, 1)}}),
    ("anthropic", {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                   "metadata": {"user_id": "u", "x": nested(252, 1)}}),
    ("openai-usage", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                      "stream": True, "stream_options": {"include_usage": True},
                      "metadata": nested(252, 0)}),
])
def test_a_body_nested_deeper_than_the_limit_gets_400_before_it_is_sent(loop, api, body):
    # orjson reads such a body but cannot write it (254 levels): the Responses
    # API echoed text.format into its answer, whose encoding then failed in the
    # relay and the client waited for nothing
    path, _, kind = APIS[api]
    p, conn = run_bytes(loop, path, to_bytes(body))
    assert conn.answers and not p.forwarded, p.forwarded
    assert_envelope(kind, conn.answers[-1].status, conn.answers[-1].body)
    assert conn.answers[-1].status == 400 and b"nests deeper" in conn.answers[-1].body


def test_the_depth_limit_is_the_servers_option(loop):
    path = APIS["openai-usage"][0]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}, "metadata": nested(10, 0)}
    p, conn = run_bytes(loop, path, to_bytes(body))  # 128 by default: sent on
    assert p.forwarded
    p, conn = run_bytes(loop, path, to_bytes(body), depth=8)  # --max-json-depth 8
    assert not p.forwarded and conn.answers[-1].status == 400
    assert b"nests deeper than 8 levels" in conn.answers[-1].body


def test_keep_alive_durations_read_as_go_reads_them():
    from ggmux.proxy.apis.adapters.ollama import keep_alive_seconds

    assert keep_alive_seconds("1h30m") == 5400
    assert keep_alive_seconds("300ms") == pytest.approx(0.3)
    assert keep_alive_seconds(".5s") == 0.5 and keep_alive_seconds("0") == 0
    assert math.isinf(keep_alive_seconds("-1m")) and math.isinf(keep_alive_seconds(-1))
    assert keep_alive_seconds(90) == 90 and keep_alive_seconds(None) is None


# ---- through a real server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    from conftest import Server, free_port, write_fake

    d = tmp_path_factory.mktemp("api-fuzz")
    write_fake(d / "fakes", "m", tokens=2, ttft_s=0, token_s=0)
    s = Server(["--fake-models-dir", str(d / "fakes"), "--proxies", "1", "--spares", "0"],
               free_port(), d / "server.log")
    try:
        s.wait_ready()
        assert s.request("POST", "/models/load", {"model": "m"})[0] == 200
        yield s
        assert "Traceback" not in s.logs(), s.logs()[-3000:]
    finally:
        s.stop()


ERROR_IN_ANSWER = re.compile(rb'"error":\s*[{"]')  # an error object or Ollama's error line


def run_served(s, api: str, examples: int) -> None:
    """``examples`` requests to ``api``'s route of ``s``, each on a fresh
    connection, so that every one gets its own whole answer (a connection
    the server closed instead of answering fails the example that did it)."""
    path, strategy, kind = APIS[api]

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(raw=raw_bodies(strategy))
    def prop(raw):
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
        try:
            conn.request("POST", path, body=raw, headers={"content-type": "application/json"})
            r = conn.getresponse()
            body = r.read()
        finally:
            conn.close()
        if r.status == 200:
            # a replica that failed mid-answer over a client's input would count
            # a fault for everyone's requests (its circuit opens): none may
            assert not ERROR_IN_ANSWER.search(body), body[-400:]
            outcome(f"served {api}", "200")
            return
        assert_envelope(kind, r.status, body)
        outcome(f"served {api}", str(r.status))

    prop()


@pytest.mark.parametrize("api", list(APIS))
def test_no_request_body_gives_a_5xx_through_a_real_server(fake_server, api):
    run_served(fake_server, api, SERVE_EXAMPLES)


@pytest.mark.parametrize("stream", [False, True])
def test_a_function_whose_schema_has_no_type_is_called_with_an_object(fake_server, stream):
    """What the served fuzz test found once: a Responses function tool whose
    ``parameters`` name no ``type`` was answered with ``null`` arguments, a
    502 (or, streamed, a cut stream) for the client's schema; a function's
    arguments are an object, as every replica's grammar now makes them."""
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "stream": stream,
            "parallel_tool_calls": False, "tool_choice": "auto",
            "tools": [{"type": "function", "name": "_", "description": "",
                       "parameters": {"": None}}]}
    st, _, raw = fake_server.request("POST", "/v1/responses", body)
    assert st == 200 and not ERROR_IN_ANSWER.search(raw), raw[-400:]
    doc = json.loads(raw) if not stream else json.loads(raw.split(
        b"event: response.completed\ndata: ")[1].split(b"\n")[0])["response"]
    (call,) = [o for o in doc["output"] if o["type"] == "function_call"]
    assert json.loads(call["arguments"]) == {}


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("api", list(APIS))
def test_no_request_body_gives_a_5xx_through_a_real_server_long_run(fake_server, api):
    run_served(fake_server, api, max(50, LONG_EXAMPLES // 10))
    print("served", api, sorted((k[1], n) for k, n in OUTCOMES.items() if k[0] == f"served {api}"))
