"""Large request bodies on the proxy (issue 37, item 11): a 51.5 MB Responses
body of 1.59 M items stopped another tenant's stream on the same proxy for
15-19 s, since the proxy parsed and translated it on the loop that writes
every stream. Now a body's items are bounded (413 before any translation)
and a large body is parsed and translated on the proxy's worker thread:
the loop runs on meanwhile (counted in its own turns, never in seconds)."""

from __future__ import annotations

import asyncio
import json

from conftest import chat_body
from ggmux.http1 import HttpLimits, Request
from ggmux.proxy.apis.adapters import responses
from ggmux.proxy.apis.client_apis import ClientApis


class Conn:
    """What a translated request's answer writes (tests/test_translate.py's)."""

    write_paused = False
    write_paused_cb = None

    def __init__(self, limits: HttpLimits) -> None:
        self.limits = limits
        self.out: list = []

    def cork(self): pass
    def uncork(self): pass
    def finish(self, req): pass
    def close(self): pass
    def send_response(self, req, status, body, content_type=b"application/json", headers=()):
        self.out.append((status, body))


class Proxy:
    """The proxy as :class:`ClientApis` sees it: one built-in model ``m``;
    ``_forward`` notes the loop's turns counted so far and answers 200."""

    stream_keepalive = 10.0

    def __init__(self, turns: list[int]) -> None:
        self.reg_models = [{"name": "m", "kind": "llama"}]
        self.names = {"m": 0}
        self.turns = turns
        self.forwarded: list[tuple[int, bytes]] = []

    def refresh(self): pass
    def pick_model(self, name): return self.names.get(name)
    def name_for_unnamed(self): return "m"
    def admin_refusal(self, req): return None

    async def _forward(self, conn, req, m, name, body, stream=False, **_kw):
        self.forwarded.append((self.turns[0], req.body))
        conn.send_response(req, 200, b"{}")


def translate(body: bytes, limits: HttpLimits) -> tuple[Conn, Proxy, int]:
    """Run one ``POST /v1/responses`` of ``body`` through :class:`ClientApis`
    beside a task that counts the loop's turns: ``(conn, proxy, turns at
    the end)``."""
    turns = [0]

    async def main() -> int:
        done = asyncio.Event()

        async def ticker() -> None:
            while not done.is_set():
                turns[0] += 1
                await asyncio.sleep(0)

        t = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        start = turns[0]
        req = Request()
        req.method, req.path, req.body = b"POST", b"/v1/responses", body
        await ClientApis(proxy).translated(conn, req, responses.Responses())
        done.set()
        await t
        return start

    conn, proxy = Conn(limits), Proxy(turns)
    start = asyncio.run(main())
    proxy.turns_at_start = start
    return conn, proxy, turns[0]


def items(n: int) -> bytes:
    return json.dumps({"model": "m", "input": [
        {"role": "user", "content": f"message {i}"} for i in range(n)]}).encode()


def test_a_large_body_is_parsed_and_translated_while_the_loop_runs_on():
    limits = HttpLimits(offloop_body_bytes=1024 * 1024)
    body = items(60000)  # 2.6 MB: well past the threshold, under max_input_items
    conn, proxy, _ = translate(body, limits)
    assert conn.out == [(200, b"{}")], conn.out[:1]
    (turns, sent), = proxy.forwarded
    assert json.loads(sent)["messages"][-1]["content"] == "message 59999"
    # the loop went round while the body was parsed and translated (on the loop: 0)
    assert turns - proxy.turns_at_start > 0
    small = items(3)
    conn, proxy, _ = translate(small, limits)
    (turns, _), = proxy.forwarded
    assert turns == proxy.turns_at_start  # a small one is worked on at once, on the loop


def test_too_many_items_are_413_before_any_translation():
    limits = HttpLimits(max_input_items=1000)
    conn, proxy, _ = translate(items(1001), limits)
    assert proxy.forwarded == []
    (status, body), = conn.out
    assert status == 413 and "--max-input-items" in json.loads(body)["error"]["message"]
    conn, proxy, _ = translate(items(1000), limits)
    assert [s for s, _ in conn.out] == [200]


def test_messages_and_token_ids_over_their_limits_are_413_on_every_route(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--max-messages", "10", "--max-token-ids", "100", "--max-input-items", "5")
    assert s.request("POST", "/v1/chat/completions", chat_body("m"))[0] == 200
    many = [{"role": "user", "content": "hi"}] * 11
    for path in ("/v1/chat/completions", "/v1/chat/completions"):  # fast path, then again
        status, _, out = s.request("POST", path, {"model": "m", "messages": many})
        assert status == 413 and "--max-messages" in json.loads(out)["error"]["message"], out
    status, _, out = s.request("POST", "/v1/messages", {"model": "m", "max_tokens": 4,
                                                         "messages": many})
    assert status == 413 and json.loads(out)["error"]["type"] == "request_too_large", out
    status, _, out = s.request("POST", "/completion", {"model": "m", "prompt": [1] * 101})
    assert status == 413 and "--max-token-ids" in json.loads(out)["error"]["message"], out
    status, _, out = s.request("POST", "/v1/embeddings", {"model": "m", "input": ["a"] * 6})
    assert status == 413 and "--max-input-items" in json.loads(out)["error"]["message"], out
    assert s.request("POST", "/completion", {"model": "m", "prompt": [1] * 100})[0] == 200


def parts(n: int) -> dict:
    return {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * n}]}


def test_the_issues_million_content_parts_are_413_before_anything_parses_them(monkeypatch):
    # one message of 1.7 M one-letter parts (46 MB, under the body limit): orjson
    # held the GIL 0.58 s parsing it, on whatever thread, and every stream waited
    from ggmux.proxy import bodies

    data = json.dumps(parts(1_700_000)).encode()
    assert len(data) < HttpLimits().max_body_bytes

    def no_parse(_data):
        raise AssertionError("parsed")

    monkeypatch.setattr(bodies.orjson, "loads", no_parse)
    conn, proxy, _ = translate(json.dumps({"model": "m", "input": [{
        "role": "user", "content": [{"type": "input_text", "text": "a"}] * 1_700_000}]}).encode(),
        HttpLimits())
    (status, body), = conn.out
    assert status == 413 and proxy.forwarded == []
    assert "--max-content-parts" in json.loads(body)["error"]["message"]
    try:
        bodies.parse_object(HttpLimits(), data)
        raise AssertionError("not refused")
    except bodies.BodyError as e:
        assert e.status == 413 and "JSON objects" in str(e)


def test_content_parts_are_counted_over_messages_input_items_and_system():
    from ggmux.proxy.bodies import content_parts, item_refusal, object_refusal

    body = {"system": [{"type": "text", "text": "s"}] * 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 3},
                         {"role": "user", "content": "plain"}],
            "input": [{"content": [{"type": "input_text", "text": "b"}] * 4}, "x"]}
    assert content_parts(body) == 9
    assert item_refusal(HttpLimits(max_content_parts=9), body) is None
    assert "--max-content-parts" in item_refusal(HttpLimits(max_content_parts=8), body)
    # objects are counted outside strings only ("{" in text, escaped quotes and all)
    few = HttpLimits(max_messages=1, max_input_items=1, max_content_parts=1)
    assert object_refusal(few, b'{"a": "{{{{\\"{{ \\\\", "b": {}, "c": "}"}') is None
    assert object_refusal(few, b'{"a": {}, "b": {}, "c": [{}]}') is not None


def test_content_parts_over_their_limit_are_413_on_the_routes(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--max-content-parts", "50")
    assert s.request("POST", "/v1/chat/completions", parts(50))[0] == 200
    status, _, out = s.request("POST", "/v1/chat/completions", parts(51))
    assert status == 413 and "--max-content-parts" in json.loads(out)["error"]["message"], out
    status, _, out = s.request("POST", "/v1/messages", {**parts(51), "max_tokens": 4})
    assert status == 413 and json.loads(out)["error"]["type"] == "request_too_large", out
    # the issue's body, on a real server: 413 before the proxy parses it
    status, _, out = s.request("POST", "/v1/chat/completions", parts(1_700_000), timeout=120)
    assert status == 413 and "JSON objects" in json.loads(out)["error"]["message"], out
    assert s.request("POST", "/v1/chat/completions", chat_body("m"))[0] == 200
