"""A tenant with one key of the keys file, trying what an attacker would:
every route keeps to the key's models and limits, and shows it only its
own models (real servers on fake instances)."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest
from conftest import chat_body, minute_left, wait_for
from ggmux.shm import layout as L
from ggmux.shm.seqlock import read_table
from test_keys import ADMIN, bearer, fake_upstream, keyed, usage_of

# keys files hold secrets: private, as ggmux requires (keys_file.check_file_mode)
pytestmark = pytest.mark.usefixtures("private_files")


def loads_of(s, name: str) -> int:
    m = s.seg.read_registry()[1]["names"][name]
    return int(read_table(s.seg.models)[m, L.M_LOADS])


class KeepBusy:
    """``n`` clients of key ``key`` asking model ``model`` one request after
    the other until :meth:`stop`; ``codes``: their statuses."""

    def __init__(self, s, model: str, key: str, n: int = 2) -> None:
        self.codes: list[int] = []
        self.done = threading.Event()

        def run() -> None:
            while not self.done.is_set():
                self.codes.append(s.request("POST", "/v1/chat/completions", chat_body(model),
                                            headers=bearer(key), timeout=60)[0])

        self.threads = [threading.Thread(target=run, daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()
        wait_for(lambda: 200 in self.codes, 60, 0.02, f"{model} serving")

    def stop(self) -> list[int]:
        self.done.set()
        for t in self.threads:
            t.join(60)
        return self.codes


# ---- item 1: Ollama's load form ---------------------------------------------------------

@pytest.mark.parametrize("route,body", [
    ("/api/generate", {"prompt": ""}),
    ("/api/chat", {"messages": []}),
    ("/api/generate", {"prompt": "", "keep_alive": "10m"}),
])
def test_ollamas_load_form_of_a_model_outside_the_keys_list_is_refused_and_loads_nothing(
        serve, fakes, tmp_path, route, body):
    fakes.add("mine", load_s=0.05)
    fakes.add("theirs", load_s=0.05)
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\nmodels = mine\n")
    for name in ("theirs", "THEIRS", "theirs:latest"):
        st, _, raw = s.request("POST", route, {"model": name, **body},
                               headers=bearer("sk-alice"))
        if name == "THEIRS":  # no such model: 404, as for any route
            assert st == 404, raw
            continue
        assert st == 403, raw
        assert "may not use model" in json.loads(raw)["error"]
    # the same key may load its own model that way
    st, _, raw = s.request("POST", route, {"model": "mine", **body}, headers=bearer("sk-alice"))
    assert st == 200 and json.loads(raw)["done_reason"] == "load", raw
    assert loads_of(s, "theirs") == 0
    assert loads_of(s, "mine") == 1


def test_a_load_form_for_a_model_the_key_may_not_use_never_drains_another_tenants_model(
        serve, fakes, tmp_path):
    # --models-max 1, a short bound: a load that went ahead would drain busy "a"
    fakes.add("a", token_s=0.05, tokens=20, parallel=4, load_s=0.05)
    fakes.add("b", load_s=0.05)
    s = keyed(serve, fakes, tmp_path,
              "[owner]\nkey = sk-owner\nmodels = a\n\n[other]\nkey = sk-other\nmodels = c*\n",
              "--models-max", "1", "--max-wait", "0.5", "--min-residency", "0")
    busy = KeepBusy(s, "a", "sk-owner")
    try:
        for route, body in (("/api/generate", {"prompt": ""}), ("/api/chat", {"messages": []})):
            for _ in range(3):
                st, _, raw = s.request("POST", route, {"model": "b", **body},
                                       headers=bearer("sk-other"), timeout=30)
                assert st == 403, raw
        # longer than the bound: a waiter would have drained "a" by now
        time.sleep(1.0)
    finally:
        codes = busy.stop()
    assert set(codes) == {200}
    assert loads_of(s, "b") == 0
    assert "draining a" not in s.logs()
    assert int(read_table(s.seg.models)[s.seg.read_registry()[1]["names"]["a"],
                                        L.M_DRAINS]) == 0


def test_the_load_form_counts_in_the_keys_limits(serve, fakes, tmp_path):
    fakes.add("mine", load_s=0.05)
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\nmodels = mine\nrpm = 2\n")
    minute = minute_left()
    got = [s.request("POST", "/api/generate", {"model": "mine", "prompt": ""},
                     headers=bearer("sk-alice"))[0] for _ in range(3)]
    if int(time.time() // 60) != minute:
        pytest.skip("the minute turned during the test")
    assert got == [200, 200, 429]
    u = wait_for(lambda: (u := usage_of(s, "alice"))["in_flight"] == 0 and u, 10, 0.02,
                 "settled")
    # counted as requests, and their token reservations given back (they generate nothing)
    assert u["requests_this_minute"] == 2 and u["refused"] == 1
    assert u["tokens_this_minute"] == 0
    assert s.json("GET", "/keys/alice", headers=ADMIN)[0] == 200


# ---- item 2: the tokens a route generates, not the field admission read ----------------

def test_completions_n_predict_is_reserved_not_the_smaller_max_tokens(serve, fakes, tmp_path):
    # the fake generates what the route's limit allows, up to 300 tokens
    fakes.add("m", tokens=300)
    s = keyed(serve, fakes, tmp_path,
              "[alice]\nkey = sk-alice\ntpm = 100\ntokens-per-day = 100\n")
    body = {"model": "m", "prompt": "hi", "max_tokens": 1, "n_predict": 300}
    got: list[tuple[int, bytes]] = []

    def one() -> None:
        st, _, raw = s.request("POST", "/completion", body, headers=bearer("sk-alice"))
        got.append((st, raw))

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [st for st, _ in got] == [429] * 4, got
    msg = json.loads(got[0][1])["error"]["message"]
    assert int(re.search(r"this request reserves (\d+)", msg)[1]) >= 300, msg
    u = wait_for(lambda: (u := usage_of(s, "alice"))["in_flight"] == 0 and u, 10, 0.02,
                 "settled")
    assert u["tokens_today"] == 0 and u["admitted"] == 0
    # what fits is served, and the day's count stays within the budget
    ok = {"model": "m", "prompt": "hi", "max_tokens": 1, "n_predict": 20}
    assert s.request("POST", "/completion", ok, headers=bearer("sk-alice"))[0] == 200
    u = wait_for(lambda: (u := usage_of(s, "alice"))["in_flight"] == 0 and u, 10, 0.02,
                 "settled")
    assert 20 <= u["tokens_today"] <= 100


def test_a_reservation_takes_the_largest_limit_field_each_choice_and_each_prompt():
    from ggmux.proxy.admission import requested_tokens

    assert requested_tokens({"max_tokens": 1, "n_predict": 300}, 512) == 300
    assert requested_tokens({"max_completion_tokens": 7, "max_tokens": 3}, 512) == 7
    assert requested_tokens({"options": {"num_predict": 90}, "max_tokens": 2}, 512) == 90
    # a field that asks for no limit: the route may read that one
    assert requested_tokens({"max_tokens": 5, "n_predict": -1}, 512) == 512
    assert requested_tokens({"max_tokens": 900, "n_predict": -1}, 512) == 900
    assert requested_tokens({}, 512) == 512 and requested_tokens(None, 64) == 64
    # several answers: n choices, several prompts (a list of ids is one prompt)
    assert requested_tokens({"max_tokens": 10, "n": 3}, 512) == 30
    assert requested_tokens({"max_tokens": 10, "prompt": ["a", "b"]}, 512) == 20
    assert requested_tokens({"max_tokens": 10, "prompt": [[1, 2], [3]], "n": 2}, 512) == 40
    assert requested_tokens({"max_tokens": 10, "prompt": [1, 2, 3]}, 512) == 10


def test_an_image_reserves_the_embeddings_it_may_become_not_its_base64():
    """A 1 MB image is a few hundred tokens to the model: reserving a
    quarter of its base64 (about 340,000 tokens) would refuse it to any key
    with a tpm, and count megabytes of text against a budget."""
    import orjson
    from ggmux.proxy.admission import MEDIA_TOKENS, prompt_estimate

    data = "A" * 1_400_000
    chat = {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 400},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]}]}
    est = prompt_estimate(chat, len(orjson.dumps(chat)))
    assert MEDIA_TOKENS <= est <= MEDIA_TOKENS + 200
    two = {"messages": [{"role": "user", "content": "look", "images": [data, data]}]}
    assert prompt_estimate(two, len(orjson.dumps(two))) < 2 * MEDIA_TOKENS + 50
    anth = {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": data}}]}]}
    assert prompt_estimate(anth, len(orjson.dumps(anth))) < MEDIA_TOKENS + 50
    native = {"prompt": {"prompt_string": "<m>", "multimodal_data": [data]}}
    assert prompt_estimate(native, len(orjson.dumps(native))) < MEDIA_TOKENS + 50
    text = {"messages": [{"role": "user", "content": "y" * 4000}]}
    assert prompt_estimate(text, len(orjson.dumps(text))) >= 1000  # text as before


# ---- item 4: a key sees its own models only, everywhere ---------------------------------

def sse_events(port: int, key: str, n: int, timeout: float = 10.0) -> list[dict]:
    """The first ``n`` events of ``GET /models/sse`` as ``key`` sees them."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        sock.sendall(b"GET /models/sse HTTP/1.1\r\nhost: x\r\nauthorization: Bearer %s\r\n\r\n"
                     % key.encode())
        data = b""
        deadline = time.monotonic() + timeout
        while data.count(b"event: model") < n and time.monotonic() < deadline:
            try:
                got = sock.recv(65536)
            except TimeoutError:
                break
            if not got:
                break
            data += got
    finally:
        sock.close()
    return [json.loads(line[6:]) for line in data.split(b"\n") if line.startswith(b"data: ")]


def test_a_key_sees_its_own_models_only_on_every_route_and_not_who_holds_the_capacity(
        serve, fakes, tmp_path):
    fakes.add("hog", token_s=0.05, tokens=40, parallel=4, load_s=0.05)
    fakes.add("one", load_s=0.05)
    s = keyed(serve, fakes, tmp_path,
              "[owner]\nkey = sk-owner\nmodels = hog\n\n[other]\nkey = sk-other\nmodels = one\n",
              "--models-max", "1", "--max-wait", "600", "--load-wait", "4")
    other = bearer("sk-other")
    busy = KeepBusy(s, "hog", "sk-owner")
    waiting: list = []
    waiter = threading.Thread(target=lambda: waiting.append(s.request(
        "POST", "/v1/chat/completions", chat_body("one"), headers=other)), daemon=True)
    try:
        waiter.start()

        def queue():
            st, doc = s.json("GET", "/v1/models", headers=other)
            assert st == 200
            return doc["data"][0]["status"].get("queue") and doc

        doc = wait_for(queue, 30, 0.02, "one's queue")
        assert [m["id"] for m in doc["data"]] == ["one"]
        q = doc["data"][0]["status"]["queue"]
        assert q["holder"] == "another model" and "hog" not in json.dumps(doc)
        assert q["why"].startswith("waiting for capacity held by another model")
        assert doc["data"][0]["status"]["args"] == []
        st, one = s.json("GET", "/v1/models/one", headers=other)
        assert st == 200 and one["status"]["queue"]["holder"] == "another model"
        # the owner of the capacity, and the admin key, still read the name
        st, doc = s.json("GET", "/v1/models", headers=ADMIN)
        assert next(m for m in doc["data"] if m["id"] == "one")["status"]["queue"][
            "holder"] == "hog"
        st, ps = s.json("GET", "/ps", headers=other)
        assert st == 200 and [m["id"] for m in ps["models"]] == ["one"]
        assert ps["models"][0]["queue"]["holder"] == "another model"
        st, ps = s.json("GET", "/ps", headers=ADMIN)
        assert {m["id"] for m in ps["models"]} == {"hog", "one"}
        st, ops = s.json("GET", "/api/ps", headers=other)
        assert st == 200 and ops["models"] == []
        st, ops = s.json("GET", "/api/ps", headers=bearer("sk-owner"))
        assert [m["name"] for m in ops["models"]] == ["hog:latest"]
        st, _, text = s.request("GET", "/metrics", headers=other)
        text = text.decode()
        assert st == 200 and 'model="one"' in text
        assert "hog" not in text and "owner" not in text
        st, _, text = s.request("GET", "/metrics", headers=ADMIN)
        assert 'model="hog"' in text.decode()
        events = sse_events(s.port, "sk-other", 1)
        assert [e["id"] for e in events] == ["one"] and events[0]["status"]["args"] == []
        assert [e["id"] for e in sse_events(s.port, "sk-owner", 1)] == ["hog"]
        # an unknown model's 404 names none of the other tenant's models
        st, _, raw = s.request("GET", "/props?model=nope", headers=other)
        assert st == 404 and b"hog" not in raw
        waiter.join(60)
    finally:
        busy.stop()
    st, _, raw = waiting[0]
    assert st == 503
    err = json.loads(raw)["error"]
    assert "held by another model" in err["message"] and "hog" not in raw.decode()


# ---- item 9: an admin edit's values are literal -----------------------------------------

def test_an_admin_route_cannot_write_an_environment_expansion_into_the_keys_file(
        serve, fakes, tmp_path, monkeypatch):
    monkeypatch.setenv("GGMUX_TEST_SECRET_VAR", "cloud-credential-1234")
    fakes.add("m")
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\n")
    for fields in ({"models": "${env.GGMUX_TEST_SECRET_VAR}"},
                   {"models": "m, ${env.HOME}"},
                   {"expires": "${env.GGMUX_TEST_SECRET_VAR}"},
                   {"models": "m ;the rest would be a comment"}):
        st, doc = s.json("POST", "/keys", {"name": "x", **fields}, headers=ADMIN)
        assert st == 400, doc
        assert s.json("GET", "/keys/x", headers=ADMIN)[0] == 404
        assert "cloud-credential" not in json.dumps(doc)
    text = s.keys_file.read_text()
    assert "[x]" not in text and "${" not in text
    # the same settings without the macro are written as given
    st, doc = s.json("POST", "/keys", {"name": "x", "models": "m"}, headers=ADMIN)
    assert st == 201, doc
    assert s.json("GET", "/keys/x", headers=ADMIN)[1]["models"] == ["m"]


# ---- item 3: spending budgets are reserved ----------------------------------------------

@pytest.fixture
def slow_remote(tmp_path):
    """A fake instance on its own port, as a priced upstream: 8 tokens in about
    0.4 s (long enough for a burst to overlap), its port."""
    yield from fake_upstream(tmp_path, {"tokens": 8, "token_s": 0.05, "parallel": 32})


def burst(s, n: int, body: dict, key: str) -> list[int]:
    """``n`` concurrent requests of ``body``: their statuses."""
    codes: list[int] = []
    go = threading.Event()

    def one() -> None:
        go.wait()
        codes.append(s.request("POST", "/v1/chat/completions", body, headers=bearer(key))[0])

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    go.set()
    for t in threads:
        t.join(120)
    return codes


def test_a_burst_cannot_spend_past_a_keys_monthly_budget(serve, fakes, tmp_path, slow_remote):
    # 8 completion tokens at 2,500,000 per million: 20 a request; the budget is 30
    s = keyed(serve, fakes, tmp_path, "[k]\nkey = sk-k\nspend-per-month = 30\n",
              preset=f"[up]\nupstream = http://127.0.0.1:{slow_remote}\n"
                     "price-output = 2500000\n")
    codes = burst(s, 30, chat_body("up", max_tokens=8), "sk-k")
    assert codes.count(200) == 1 and codes.count(429) == 29, codes
    u = wait_for(lambda: (u := usage_of(s, "k"))["in_flight"] == 0 and u, 10, 0.02, "settled")
    assert u["spend_this_month"] == pytest.approx(20)
    # a request that names no max_tokens reserves the key's reserve-tokens (512: 1280)
    st, _, raw = s.request("POST", "/v1/chat/completions", chat_body("up"),
                           headers=bearer("sk-k"))
    assert st == 429 and "this request may cost 1280" in json.loads(raw)["error"]["message"]


def test_a_burst_cannot_spend_past_a_priced_models_budget(serve, fakes, tmp_path, slow_remote):
    p = tmp_path / "models.ini"
    p.write_text(f"[up]\nupstream = http://127.0.0.1:{slow_remote}\nprice-output = 2500000\n"
                 "spend-per-week = 70\n")
    s = serve("--models-preset", str(p), "--no-hf-cache", "--proxies", "2",
              "--admin-key", "adm")
    codes = burst(s, 30, chat_body("up", max_tokens=8), "adm")
    # 20 a request against 70: three fit, whichever proxy took them
    assert codes.count(200) == 3 and codes.count(429) == 27, codes
    st, _, raw = s.request("POST", "/v1/chat/completions", chat_body("up", max_tokens=8),
                           headers=ADMIN)
    assert st == 429 and "spend-per-week budget (70)" in json.loads(raw)["error"]["message"]
