"""Keys with limits (issue 36) end to end: real servers with two proxies on
fake instances; every limit enforced exactly, in each client API's envelope."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import chat_body, connectable, free_port, minute_left, open_stream, wait_for

# keys files hold secrets: private, as ggmux requires (keys_file.check_file_mode)
pytestmark = pytest.mark.usefixtures("private_files")

CHAT = "/v1/chat/completions"
ADMIN = {"authorization": "Bearer adm"}


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def keyed(serve, fakes, tmp_path, keys: str, *args, preset: str | None = None):
    """A server of the fakes in ``fakes`` (and ``preset``) with keys file ``keys``."""
    kf = tmp_path / "keys.ini"
    kf.write_text(keys)
    extra = []
    if preset is not None:
        p = tmp_path / "models.ini"
        p.write_text(preset)
        extra = ["--models-preset", str(p)]
    s = serve("--fake-models-dir", str(fakes), *extra, "--no-hf-cache", "--proxies", "2",
              "--keys", str(kf), "--admin-key", "adm", *args)
    s.keys_file = kf
    return s


def usage_of(s, key: str) -> dict:
    st, doc = s.json("GET", f"/keys/{key}", headers=ADMIN)
    assert st == 200, doc
    return doc["usage"]


def test_rpm_holds_across_proxies_in_each_apis_envelope(serve, fakes, tmp_path):
    fakes.add("m", tokens=2)
    s = keyed(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\nrpm = 4\n", "--api-key", "plain")
    # fresh connections: spread over both proxies, one limit
    codes = []
    minute = minute_left()
    for _ in range(4):
        codes.append(s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-alice"))[0])
    assert codes == [200] * 4
    if int(time.time() // 60) != minute:
        pytest.skip("the minute turned during the test")
    st, hdr, body = s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-alice"))
    assert st == 429 and int(hdr["retry-after"]) >= 1
    err = json.loads(body)["error"]
    assert err["code"] == "rate_limit_exceeded" and "rpm 4" in err["message"]
    assert "resets in" in err["message"]
    st, hdr, body = s.request("POST", "/v1/messages", {
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "sk-alice"})
    assert st == 429 and hdr["retry-after"]
    doc = json.loads(body)
    assert doc["type"] == "error" and doc["error"]["type"] == "rate_limit_error"
    st, hdr, body = s.request("POST", "/api/chat", {
        "model": "m", "stream": False, "messages": [{"role": "user", "content": "hi"}]},
        headers=bearer("sk-alice"))
    assert st == 429 and hdr["retry-after"] and "rpm 4" in json.loads(body)["error"]
    # an --api-key key and the admin key are never limited
    for h in (bearer("plain"), ADMIN):
        assert s.request("POST", CHAT, chat_body("m"), headers=h)[0] == 200
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-nobody"))[0] == 401
    # a request settles once its last bytes are out, a moment after the
    # client has read them
    u = wait_for(lambda: (u := usage_of(s, "alice"))["in_flight"] == 0 and u, 10, 0.02,
                 "every request settled")
    assert u["requests_this_minute"] == 4 and u["refused"] == 3
    assert "sk-alice" not in s.logs()


def test_tpm_reserves_prompt_and_max_tokens_and_settles_with_usage(serve, fakes, tmp_path):
    fakes.add("m", tokens=8)
    s = keyed(serve, fakes, tmp_path, "[t]\nkey = sk-t\ntpm = 200\n")
    big = chat_body("m", max_tokens=500)
    st, _, body = s.request("POST", CHAT, big, headers=bearer("sk-t"))
    assert st == 429 and "tpm 200" in json.loads(body)["error"]["message"]
    minute = minute_left()
    used = 0
    for _ in range(40):
        b = chat_body("m", max_tokens=8)
        reserve = len(json.dumps(b).encode()) // 4 + 8
        st, _, data = s.request("POST", CHAT, b, headers=bearer("sk-t"))
        if int(time.time() // 60) != minute:
            pytest.skip("the minute turned during the test")
        if used + reserve > 200:
            assert st == 429, (used, reserve)
            assert json.loads(data)["error"]["code"] == "rate_limit_exceeded"
            break
        assert st == 200, (used, reserve, data)
        u = json.loads(data)["usage"]
        used += u["prompt_tokens"] + u["completion_tokens"]
        # settled to the usage (a moment after the client read the answer;
        # until then the reservation stands)
        wait_for(lambda used=used: usage_of(s, "t")["tokens_this_minute"] == used, 10, 0.02,
                 f"settled to {used}")
    else:
        raise AssertionError("tpm never refused")


def test_max_parallel_counts_streams_in_flight(serve, fakes, tmp_path):
    fakes.add("m", ttft_s=30, tokens=1)
    s = keyed(serve, fakes, tmp_path, "[p]\nkey = sk-p\nmax-parallel = 2\n")
    socks = [open_stream(s.port, chat_body("m", stream=True), timeout=60,
                         headers=bearer("sk-p")) for _ in range(2)]
    try:
        wait_for(lambda: usage_of(s, "p")["in_flight"] == 2, 30, 0.05, "two in flight")
        st, hdr, body = s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-p"))
        assert st == 429 and hdr["retry-after"] == "1"
        assert "max-parallel 2" in json.loads(body)["error"]["message"]
    finally:
        for k in socks:
            k.close()
    wait_for(lambda: usage_of(s, "p")["in_flight"] == 0, 30, 0.05, "streams ended")


@pytest.mark.slow  # waits for the next day of a 10000x clock
def test_streamed_answer_is_counted_and_day_budget_rolls_over(serve, fakes, tmp_path,
                                                            monkeypatch):
    # a day of 8.64 s (the key table's clock, 10000x)
    monkeypatch.setenv("GGMUX_LIMITS_CLOCK_SCALE", "10000")
    fakes.add("m", tokens=8)
    s = keyed(serve, fakes, tmp_path, "[d]\nkey = sk-d\ntokens-per-day = 120\n"
              "output-weight = 2\n")

    def stream_tokens() -> tuple[int, int]:
        st, _, data = s.request("POST", CHAT, chat_body(
            "m", stream=True, max_tokens=8, stream_options={"include_usage": True}),
            headers=bearer("sk-d"))
        if st != 200:
            return st, 0
        last = [json.loads(ln[6:]) for ln in data.decode().splitlines()
                if ln.startswith("data: {")][-1]["usage"]
        return st, last["prompt_tokens"] + 2 * last["completion_tokens"]

    st, w = stream_tokens()
    assert st == 200
    # the day may have turned already; then this request's tokens went with it
    wait_for(lambda: usage_of(s, "d")["tokens_today"] in (w, 0), 10, 0.02, "settled")

    def refused() -> bool:
        st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=8),
                                headers=bearer("sk-d"))
        if st == 429:
            err = json.loads(body)["error"]
            assert err["code"] == "insufficient_quota" and "tokens-per-day 120" in err["message"]
        return st == 429

    wait_for(refused, 60, 0, "the day's budget used up")
    wait_for(lambda: stream_tokens()[0] == 200, 60, 0.2, "the next day")


def test_allowed_models_listing_expiry_and_disabled(serve, fakes, tmp_path):
    fakes.add("alpha", tokens=1)
    fakes.add("beta", tokens=1)
    # expiry is the proxy's clock against the key's time at each request: one key on
    # each side of it (a key that expired during the run waited 20 s for nothing more)
    now = time.time()
    s = keyed(serve, fakes, tmp_path,
              f"[a]\nkey = sk-a\nmodels = al*\n[x]\nkey = sk-x\nexpires = {now + 3600}\n"
              f"[old]\nkey = sk-old\nexpires = {now - 1}\n"
              "[off]\nkey = sk-off\ndisabled = true\n")
    st, _, body = s.request("POST", CHAT, chat_body("beta"), headers=bearer("sk-a"))
    err = json.loads(body)["error"]
    assert st == 403 and err["code"] == "model_not_allowed" and "alpha" not in err["message"]
    assert s.request("POST", CHAT, chat_body("alpha"), headers=bearer("sk-a"))[0] == 200
    st, doc = s.json("GET", "/v1/models", headers=bearer("sk-a"))
    assert [m["id"] for m in doc["data"]] == ["alpha"]
    # the launch arguments (this machine's paths) are the operator's
    assert doc["data"][0]["status"]["args"] == []
    assert s.json("GET", "/v1/models/alpha", headers=bearer("sk-a"))[1]["status"]["args"] == []
    assert s.json("GET", "/v1/models", headers=ADMIN)[1]["data"][0]["status"]["args"]
    st, doc = s.json("GET", "/api/tags", headers=bearer("sk-a"))
    assert [m["name"] for m in doc["models"]] == ["alpha:latest"]
    st, doc = s.json("GET", "/v1/models", headers=ADMIN)
    assert sorted(m["id"] for m in doc["data"]) == ["alpha", "beta"]
    assert s.json("GET", "/v1/models/beta", headers=bearer("sk-a"))[0] == 403
    assert s.json("GET", "/v1/models/alpha", headers=bearer("sk-a"))[0] == 200
    assert s.json("POST", "/api/show", {"model": "beta"}, headers=bearer("sk-a"))[0] == 403
    st, _, body = s.request("POST", CHAT, chat_body("gamma"), headers=bearer("sk-a"))
    assert st == 404 and "beta" not in body.decode()  # the 404 lists only the key's models
    st, _, body = s.request("POST", "/api/chat", {"model": "beta", "stream": False, "messages": [
        {"role": "user", "content": "hi"}]}, headers=bearer("sk-a"))
    assert st == 403 and "may not use" in json.loads(body)["error"]
    st, _, body = s.request("POST", CHAT, chat_body("alpha"), headers=bearer("sk-off"))
    assert st == 401 and "disabled" in json.loads(body)["error"]["message"]
    assert s.request("POST", CHAT, chat_body("alpha"), headers=bearer("sk-x"))[0] == 200
    st, _, body = s.request("POST", CHAT, chat_body("alpha"), headers=bearer("sk-old"))
    assert st == 401 and "expired" in json.loads(body)["error"]["message"]


def test_reload_changes_a_policy_and_admin_routes_manage_keys(serve, fakes, tmp_path):
    fakes.add("m", tokens=1)
    s = keyed(serve, fakes, tmp_path, "[r]\nkey = sk-r\nrpm = 1\n")
    assert s.request("POST", CHAT, chat_body("m"), headers=ADMIN)[0] == 200  # loaded

    def two_in_a_minute() -> list[int]:
        minute = int(time.time() // 60)
        codes = [s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-r"))[0]
                 for _ in range(2)]
        return codes if int(time.time() // 60) == minute else []

    assert wait_for(two_in_a_minute, 130, 0.5, "two requests in one minute") == [200, 429] or \
        usage_of(s, "r")["requests_this_minute"] == 1
    s.keys_file.write_text("[r]\nkey = sk-r\nrpm = 1000\n")
    s.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-r"))[0] == 200,
             30, 0.1, "the reloaded policy")
    assert s.request("GET", "/keys", headers=bearer("sk-r"))[0] in (401, 403)
    # a keys file that does not read: the admin's reload says why, the keys stay
    good = s.keys_file.read_text()
    s.keys_file.write_text(good + "tpm = lots\n")
    st, doc = s.json("GET", "/models?reload=1", headers=ADMIN)
    assert st == 500 and "the keys file did not reload" in doc["error"]["message"], doc
    assert f"{s.keys_file}:4: tpm" in doc["error"]["message"]
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-r"))[0] == 200
    s.keys_file.write_text(good)
    assert s.json("GET", "/models?reload=1", headers=ADMIN)[0] == 200
    # a limit past int64 (it crashed the supervisor, and was written to the file)
    st, doc = s.json("POST", "/keys", {"name": "huge", "rpm": 10 ** 26}, headers=ADMIN)
    assert st == 400 and ":7: rpm: " in doc["error"]["message"], doc
    assert s.keys_file.read_text() == good and s.proc.poll() is None
    st, doc = s.json("POST", "/keys", {"name": "new", "models": ["m"], "rpm": 5},
                     headers=ADMIN)
    assert st == 201, doc
    secret = doc["key"]
    assert secret not in s.keys_file.read_text()
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(secret))[0] == 200
    st, doc = s.json("GET", "/keys", headers=ADMIN)
    listed = {k["name"]: k for k in doc["data"]}
    assert listed["new"]["rpm"] == 5 and secret not in json.dumps(doc)
    assert "sha256" not in listed["new"]
    st, doc = s.json("POST", "/keys/new/rotate", headers=ADMIN)
    assert st == 200 and doc["key"] != secret
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(secret))[0] == 401
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(doc["key"]))[0] == 200
    assert s.json("POST", "/keys/new/disable", headers=ADMIN)[0] == 200
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(doc["key"]))[0] == 401
    assert s.json("POST", "/keys/nobody/disable", headers=ADMIN)[0] == 404
    assert secret not in s.logs() and doc["key"] not in s.logs()
    # the same through ggmux keys
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")},
           "GGMUX_URL": s.base, "GGMUX_ADMIN_KEY": "adm"}

    def ggmux(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ggmux", "keys", *args], env=env,
                              capture_output=True, text=True, timeout=60, check=False)

    r = ggmux("create", "cli", "--models", "m", "--rpm", "7")
    assert r.returncode == 0, r
    made = r.stdout.split()[1]
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(made))[0] == 200
    r = ggmux()
    assert r.returncode == 0 and "rpm=7" in r.stdout and made not in r.stdout
    r = ggmux("usage")
    assert r.returncode == 0 and r.stdout.splitlines()[0].split()[:2] == ["NAME", "REQ/MIN"]
    assert ggmux("delete", "cli").returncode == 0
    assert s.request("POST", CHAT, chat_body("m"), headers=bearer(made))[0] == 401


@pytest.fixture
def remote(fakes, tmp_path):
    """A fake instance on its own port, as an upstream: its port."""
    yield from fake_upstream(tmp_path, {"tokens": 8})


def fake_upstream(tmp_path, behaviour_doc: dict):
    """Run a fake instance of ``behaviour_doc`` on its own port (an upstream):
    yields its port, stops it after."""
    behaviour = tmp_path / "remote.json"
    behaviour.write_text(json.dumps(behaviour_doc))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggmux.instance", "--fake", "--model", str(behaviour),
         "--name", "remote", "--port", str(port)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: connectable(port), 20, 0.05, what="remote server")
        yield port
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_upstream_over_its_spend_quota_is_skipped_and_the_local_replica_serves(
        serve, fakes, remote, tmp_path):
    local = fakes.add("m", tokens=8)
    p = tmp_path / "models.ini"
    p.write_text(f"[m]\nmodel = {local}\nupstream = http://127.0.0.1:{remote}\n"
                 "price-input = 100\nprice-output = 1000\nspend-per-day = 0.02\n"
                 f"[free-remote]\nupstream = http://127.0.0.1:{remote}\n"
                 "spend-per-day = 0.000001\n")
    # no keys file: spending budgets hold on any server
    s = serve("--models-preset", str(p), "--no-hf-cache", "--proxies", "2",
              "--api-key", "sk-free")
    # the upstream answers until its day's budget (0.02: 8 tokens at 1000 per
    # million and the prompt at 100 are ~0.009 a request) is spent
    seen = []

    # (max_tokens 8: a request reserves its worst case of the budget, ~0.008;
    # the third would pass it, so two are the upstream's)
    def spent() -> bool:
        st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=8),
                                headers=bearer("sk-free"))
        assert st == 200, body
        seen.append(b"[remote:" in body)
        return sum(seen) >= 2

    wait_for(spent, 60, 0.02, "the upstream to spend its budget")
    for _ in range(12):
        st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=8),
                                headers=bearer("sk-free"))
        assert st == 200 and b"[remote:" not in body  # the local replica serves
    # price 0 never blocks, whatever its budget
    for _ in range(3):
        assert s.request("POST", CHAT, chat_body("free-remote"), headers=bearer("sk-free"))[0] \
            == 200


def test_key_spend_per_month_refuses_once_spent(serve, fakes, remote, tmp_path):
    s = keyed(serve, fakes, tmp_path, "[k]\nkey = sk-k\nspend-per-month = 0.01\n",
              preset=f"[up]\nupstream = http://127.0.0.1:{remote}\nprice-output = 1000\n")
    # 8 completion tokens at 1000 per million: 0.008 a request; each reserves
    # its worst case (max_tokens 8: 0.008) first, so a second would pass 0.01
    eight = chat_body("up", max_tokens=8)
    assert s.request("POST", CHAT, eight, headers=bearer("sk-k"))[0] == 200
    st, hdr, body = s.request("POST", CHAT, eight, headers=bearer("sk-k"))
    err = json.loads(body)["error"]
    assert st == 429 and err["code"] == "insufficient_quota"
    assert "spend-per-month" in err["message"] and int(hdr["retry-after"]) > 0
    assert abs(usage_of(s, "k")["spend_this_month"] - 0.008) < 1e-9
    # the same refusal in Anthropic's and Ollama's envelopes
    st, hdr, body = s.request("POST", "/v1/messages", {
        "model": "up", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-api-key": "sk-k"})
    doc = json.loads(body)
    assert st == 429 and hdr["retry-after"] and doc["error"]["type"] == "rate_limit_error"
    assert "spend-per-month" in doc["error"]["message"]
    st, hdr, body = s.request("POST", "/api/chat", {
        "model": "up", "stream": False, "messages": [{"role": "user", "content": "hi"}]},
        headers=bearer("sk-k"))
    assert st == 429 and hdr["retry-after"] and "spend-per-month" in json.loads(body)["error"]
