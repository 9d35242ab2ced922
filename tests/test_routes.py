"""The proxy's HTTP surface end to end on fake instances (issue 5)."""

from __future__ import annotations

import inspect
import json
import os
import re
import signal
import socket
import time
from pathlib import Path

import pytest
from conftest import Server, chat_body, free_port, open_stream, served_by, wait_for, write_fake
from ggmux.proxy import apis, routes
from ggmux.proxy.server import Proxy
from ggmux.shm import layout as L

openai = pytest.importorskip("openai")
CHAT = "/v1/chat/completions"
APIS = Path(__file__).resolve().parent.parent / "docs" / "apis.md"


def _readme_routes() -> list[tuple[str, list[tuple[str, str]]]]:
    """The manual's "HTTP surface" table (docs/apis.md): per row, its text and the ``(method,
    path)`` pairs of its first column (a method carries on to the paths
    after it; placeholders such as ``{id}``, ``<model>`` and ``...``
    become a sample segment, a query is dropped)."""
    text = APIS.read_text().split("## HTTP surface", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split(" | ", 1)[0]
        pairs, method = [], "ANY"
        for item in re.findall(r"`([^`]+)`", first):
            m = re.fullmatch(r"(?:([A-Z]+) )?(/\S*)", item)
            if m is None:
                continue
            method = m.group(1) or method
            path = re.sub(r"\{[^}]+\}|<[^>]+>|\.\.\.", "x", m.group(2).split("?", 1)[0])
            pairs.append((method, path))
        rows.append((line, pairs))
    return rows


def test_readme_route_table_and_the_proxys_route_table_agree():
    rows = _readme_routes()
    listed = [pair for _, pairs in rows for pair in pairs]
    assert len(listed) > 30  # the table was read
    for method, path in listed:  # every route the table names is served, by that method
        route = routes.match(path.encode())
        assert route is not None, path
        assert method == "ANY" or not route.methods or method.encode() in route.methods, (
            method, path)
    mentioned = {p for line, _ in rows for p in re.findall(r"`(?:[A-Z]+ )?(/[^`?\s]*)", line)}
    for route in routes.ROUTES:  # and the table names every route of the proxy
        path = route.path.decode()
        assert (any(p.startswith(path) for p in mentioned) if route.prefix
                else path in mentioned), path


def test_route_table_names_real_handlers_and_never_depends_on_its_order():
    prefixes = [r.path for r in routes.ROUTES if r.prefix]
    for route in routes.ROUTES:
        assert inspect.iscoroutinefunction(getattr(Proxy, route.handler)), route.handler
        assert not route.guard or callable(getattr(Proxy, route.guard))
        assert route.prefix or not route.path.startswith(tuple(prefixes)), route.path
        assert route.foreign == apis.handles(route.path), route.path  # the apis' envelope
    exact = [r.path for r in routes.ROUTES if not r.prefix]
    assert len(exact) == len(set(exact))
    assert routes.match(b"/v1/models/org/m").handler == "_client_api"
    assert routes.match(b"/upstream/a/health").handler == "_passthrough"
    assert routes.match(b"/nope") is None
    assert [r.path for r in routes.ROUTES if r.needs_admin(b"")] == [
        b"/models/load", b"/models/unload", b"/cache/clear", b"/logs", b"/logs/stream",
        b"/requests", b"/requests/stream", b"/usage", b"/keys", b"/keys/", b"/cluster/drain"]
    assert routes.match(b"/models").needs_admin(b"reload=1")



# One server for the tests below that need no option of their own: each
# test has its own models (a test's loads, unloads and counts are its own
# whatever ran before it), so the order of the tests does not matter.
SHARED = {"a": "sdk", "b": "sdk", "c": "routes", "d": "routes", "u": "upstream",
          "m": "metrics", "n": "metrics", "s": "sse"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("routes")
    for name in SHARED:
        write_fake(d / "fakes", name, load_s=0.1)
    s = Server(["--fake-models-dir", str(d / "fakes"), "--no-hf-cache", "--proxies", "2",
                "--models-max", str(len(SHARED))],
               free_port(), d / "server.log")
    try:
        yield s.wait_ready(60)
    finally:
        s.stop()


def _slot_of(server, pid: int) -> int:
    """The replica slot of the instance process ``pid``."""
    return server.seg.replicas[:, L.R_PID].tolist().index(pid)


@pytest.mark.slow
def test_openai_sdk_works_unchanged(server):
    c = openai.OpenAI(base_url=server.base + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="a", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content.startswith("[a:")
    text = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hi"}], stream=True))
    assert text.startswith("[a:")
    assert c.completions.create(model="b", prompt="x").choices[0].text.startswith("[b:")
    assert len(c.embeddings.create(model="a", input=["x", "yy"]).data) == 2
    assert {m.id for m in c.models.list().data} == set(SHARED)


def test_llama_cpp_routes_by_body_and_by_query(server):
    s = server
    st, doc = s.json("POST", "/tokenize", {"model": "c", "content": "hello big world"})
    assert st == 200 and doc["tokens"] == [5, 3, 5]
    st, doc = s.json("POST", "/detokenize", {"model": "c", "tokens": [2]})
    assert st == 200 and doc["content"] == "xx"
    st, _, body = s.request("POST", "/completion", {"model": "c", "prompt": "x", "n_predict": 3})
    doc = json.loads(body)
    assert st == 200 and doc["content"].startswith("[c:") and doc["stop"] is True
    slot = _slot_of(s, served_by(body)[1])  # c is loaded: it answered
    # ?model= routes neither load a model nor refresh its last use
    st, doc = s.json("GET", "/props?model=d")
    assert st == 503 and doc["error"]["code"] == "model_not_loaded"
    used = s.seg.counters[:, slot, L.C_LAST_USED_NS].max()
    st, doc = s.json("GET", "/props?model=c")
    assert st == 200 and doc["model_alias"] == "c"
    assert s.json("GET", "/slots?model=c")[0] == 200
    st, _, text = s.request("GET", "/metrics?model=c")
    assert st == 200 and b"ggmux_instance_requests_total" in text
    assert s.seg.counters[:, slot, L.C_LAST_USED_NS].max() == used
    assert s.json("GET", "/props?model=nope")[0] == 404
    st, doc = s.json("GET", "/props")  # several models: the router's own (llama-server's)
    assert st == 200 and doc["role"] == "router"
    assert s.json("GET", "/slots")[0] == 400


def test_upstream_pass_through_and_url_decoded_names(server):
    st, _, body = server.request("POST", "/upstream/u/v1/chat/completions",
                                 chat_body("whatever"))
    assert st == 200 and served_by(body)[0] == "u"
    st, doc = server.json("GET", "/upstream/%75/health")
    assert st == 200 and doc["status"] == "ok"
    assert server.json("GET", "/upstream/zzz/health")[0] == 404


def test_router_metrics_count_requests_ttft_loads_and_memory(server):
    for _ in range(3):
        assert server.request("POST", CHAT, chat_body("m"))[0] == 200
    counted = ('ggmux_requests_total{model="m"} 3', 'ggmux_ttft_seconds_count{model="m"} 3',
               'ggmux_ttft_seconds_bucket{model="m",le="+Inf"} 3')

    def scrape() -> str | None:
        st, headers, text = server.request("GET", "/metrics")
        assert st == 200 and headers["content-type"].startswith("text/plain")
        t = text.decode()
        return t if all(c in t for c in counted) else None

    # a proxy counts a request right after its answer left (the next turn of
    # its loop): a scrape through the other proxy may come between the two
    t = wait_for(scrape, 10, 0.01, "the three requests counted")
    assert 'ggmux_requests_total{model="m"} 3' in t
    assert 'ggmux_ttft_seconds_count{model="m"} 3' in t
    assert 'ggmux_ttft_seconds_bucket{model="m",le="+Inf"} 3' in t
    assert 'ggmux_model_loads_total{model="m"} 1' in t
    assert 'ggmux_requests_total{model="n"} 0' in t
    assert 'ggmux_device_memory_bytes{device="host",kind="total"}' in t


def test_models_sse_streams_status_changes_as_they_happen(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(b"GET /models/sse HTTP/1.1\r\nhost: x\r\n\r\n")
    buf = b""
    while b'"id":"s"' not in buf:  # the initial snapshot: an event per model
        buf += sock.recv(65536)
    assert buf.startswith(b"HTTP/1.1 200") and b"event: model" in buf
    assert b'"id":"s","status":{"value":"unloaded"' in buf
    assert server.json("POST", "/models/load", {"model": "s"})[0] == 200
    deadline = time.monotonic() + 10
    while b'"id":"s","status":{"value":"loaded"' not in buf:
        assert time.monotonic() < deadline, buf
        buf += sock.recv(65536)
    assert b'"id":"s","status":{"value":"loading"' in buf
    sock.close()


def test_load_wait_budget_gives_503_with_a_loading_object(serve, fakes):
    fakes.add("slow", load_s=5)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--load-wait", "0.5")
    st, headers, body = s.request("POST", CHAT, chat_body("slow"))
    assert st == 503 and headers["retry-after"]
    err = json.loads(body)["error"]
    assert err["code"] == "model_loading" and "--load-wait" in err["message"]
    assert err["loading"]["model"] == "slow" and err["loading"]["state"] == "loading"


def test_api_key_protects_everything_but_health(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--api-key", "sekrit", "--admin-key", "boss")
    assert s.request("GET", "/health")[0] == 200
    st, _, body = s.request("GET", "/v1/models")
    assert st == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    assert s.request("GET", "/v1/models", headers={"authorization": "Bearer wrong"})[0] == 401
    assert s.request("GET", "/v1/models", headers={"authorization": "Bearer sekrit"})[0] == 200
    assert s.request("POST", CHAT, chat_body("a"), headers={"x-api-key": "sekrit"})[0] == 200
    load = {"model": "a"}
    assert s.request("POST", "/models/unload", load, headers={"x-api-key": "sekrit"})[0] == 401
    assert s.request("POST", "/models/unload", load, headers={"x-api-key": "boss"})[0] == 200


def _raw_stream(port: int, model: str) -> bytes:
    sock = open_stream(port, chat_body(model, stream=True), 20)
    buf = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        _, sep, body = buf.partition(b"\r\n\r\n")
        if sep and body.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of the body
            break
    sock.close()
    return buf


@pytest.mark.slow
def test_streaming_client_gets_keepalives_while_its_model_loads(serve, fakes):
    fakes.add("slow", load_s=1.5)
    fakes.add("broken", load_s=1.0, fail_load="bad tensor")
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--stream-keepalive", "0.3")
    out = _raw_stream(s.port, "slow")
    assert out.startswith(b"HTTP/1.1 200")
    assert out.count(b": waiting for slow to load") >= 2
    assert b"[slow:" in out and out.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    out = _raw_stream(s.port, "broken")
    assert out.startswith(b"HTTP/1.1 200") and b": waiting for broken" in out
    assert b'"code":"model_load_failed"' in out and b"bad tensor" in out
    assert not out.endswith(b"0\r\n\r\n")  # an error never ends cleanly


def test_request_right_after_its_replica_was_killed_is_served_by_the_next_one(serve, fakes):
    """The proxy holds an idle pooled connection to the replica; a request
    sent the moment the replica dies meets that dead connection (or a
    refused connect) before the supervisor has noticed the exit. It must
    wait for the reload and be served, not fail, and nothing may stay
    counted in flight."""
    fakes.add("a", load_s=0.05)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    st, _, body = s.request("POST", CHAT, chat_body("a", max_tokens=1))
    assert st == 200
    pid = served_by(body)[1]
    for _ in range(3):
        for _ in range(3):  # the pooled connection is in use, then idle
            assert served_by(s.request("POST", CHAT, chat_body("a", max_tokens=1))[2])[1] == pid
        os.kill(pid, signal.SIGKILL)
        st, _, body = s.request("POST", CHAT, chat_body("a", max_tokens=1))
        assert st == 200, body
        new = served_by(body)[1]
        assert new != pid
        pid = new
    wait_for(lambda: s.seg.counters[:, :, L.C_IN_FLIGHT].sum() == 0, 5, what="none in flight")


def _pipelined(port: int, body: dict, n: int) -> list[tuple[int, bytes]]:
    """Send ``n`` chat requests back to back on one connection; their
    (status, body) in the order they came back."""
    data = json.dumps(body).encode()
    one = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
           b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(data), data))
    out, buf = [], b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(one * n)
        while len(out) < n:
            while b"\r\n\r\n" not in buf:
                buf += sock.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(buf) < length:
                buf += sock.recv(65536)
            out.append((int(head[9:12]), buf[:length]))
            buf = buf[length:]
    return out


def test_pipelined_requests_each_count_once_and_failures_open_the_circuit(serve, fakes):
    """Requests pipelined on one connection go out one after another on the
    same pooled replica connection; each must be counted with its own
    outcome (requests, TTFT samples, errors), so a replica failing them all
    opens its circuit as it does for requests sent one at a time."""
    f = fakes.add("m", tokens=1)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    pid = served_by(s.request("POST", CHAT, chat_body("m"))[2])[1]
    s.request("POST", CHAT, chat_body("m"))  # a pooled connection is idle now
    row = s.seg.counters[0, 0]
    # counted just after the answer left: wait for both before the baseline
    wait_for(lambda: row[L.C_REQUESTS] == 2, 5, what="warm-up counted")
    before = row.copy()
    got = _pipelined(s.port, chat_body("m"), 20)
    assert [st for st, _ in got] == [200] * 20
    assert all(served_by(b)[1] == pid for _, b in got)
    # each is counted just after its answer left: wait for the last one
    wait_for(lambda: row[L.C_REQUESTS] - before[L.C_REQUESTS] >= 20, 5, what="20 counted")
    assert row[L.C_REQUESTS] - before[L.C_REQUESTS] == 20
    assert row[L.C_TTFT_COUNT] - before[L.C_TTFT_COUNT] == 20
    assert row[L.C_IN_FLIGHT] == 0
    f.with_name(f"{f.name}.fail-{pid}").touch()  # the replica now answers 500
    before = row.copy()
    got = _pipelined(s.port, chat_body("m"), 3)
    assert [st for st, _ in got] == [500] * 3
    wait_for(lambda: row[L.C_ERRORS] - before[L.C_ERRORS] >= 3, 5, what="3 errors counted")
    assert row[L.C_ERRORS] - before[L.C_ERRORS] == 3
    assert row[L.C_CIRCUIT] == L.CircuitState.OPEN
