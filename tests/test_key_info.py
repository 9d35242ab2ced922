"""A team's first hour with keys: a key sees its own limits and what is
left (``GET /key/info``, ``ggmux keys info``); a server with a keys file
and no admin key says so at start and in each refusal, and every 401 names
the keys the server takes. Real servers on fake instances."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import chat_body, wait_for

CHAT = "/v1/chat/completions"


def bearer(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def keys_server(serve, fakes, tmp_path, keys: str, *args):
    fakes.add("m", tokens=2)
    kf = tmp_path / "keys.ini"
    kf.touch(mode=0o600)  # its secrets readable by no one else, as ggmux requires
    kf.write_text(keys)
    return serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
                 "--keys", str(kf), *args)


def cli(s, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
    env["GGMUX_URL"] = s.base
    if key is not None:
        env["GGMUX_API_KEY"] = key
    return subprocess.run([sys.executable, "-m", "ggmux", *args], capture_output=True,
                          text=True, timeout=60, env=env, check=False)


def test_a_key_sees_its_own_limits_what_is_used_and_left_and_when_each_resets(
        serve, fakes, tmp_path):
    s = keys_server(serve, fakes, tmp_path,
                    "[alice]\nkey = sk-alice\nmodels = m\nrpm = 50\ntokens-per-day = 100000\n"
                    "[bob]\nkey = sk-bob\n", "--admin-key", "adm")
    minute = int(time.time() // 60)
    for _ in range(2):
        assert s.request("POST", CHAT, chat_body("m"), headers=bearer("sk-alice"))[0] == 200

    def settled():
        st, doc = s.json("GET", "/key/info", headers=bearer("sk-alice"))
        return st == 200 and doc["usage"]["in_flight"] == 0 and doc

    doc = wait_for(settled, 10, 0.02, "alice's requests settled")
    assert (doc["kind"], doc["name"], doc["models"]) == ("keys-file", "alice", ["m"])
    by = {lim["limit"]: lim for lim in doc["limits"]}
    assert set(by) == {"rpm", "tokens_per_day"}  # only the limits the key has
    if int(time.time() // 60) == minute:
        assert by["rpm"]["used"] == 2 and by["rpm"]["left"] == 48
        assert 0 < by["rpm"]["resets_in_s"] <= 60
    day = by["tokens_per_day"]
    assert day["used"] > 0 and day["left"] == 100000 - day["used"]
    assert 0 < day["resets_in_s"] <= 86400
    assert "sha256" not in doc and "sk-alice" not in str(doc)
    # about itself only: bob's view is bob's, with no limits
    st, bob = s.json("GET", "/key/info", headers=bearer("sk-bob"))
    assert st == 200 and bob["name"] == "bob" and bob["limits"] == []
    # the command line: the key in $GGMUX_API_KEY, no admin key needed
    r = cli(s, "keys", "info", key="sk-alice")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("key alice: models m\n"), r.stdout
    assert "rpm" in r.stdout and "tokens-per-day" in r.stdout and "RESETS IN" in r.stdout
    # the admin key is never limited; a wrong key is refused
    st, adm = s.json("GET", "/key/info", headers=bearer("adm"))
    assert st == 200 and adm["kind"] == "admin" and adm["limits"] == []
    assert s.json("GET", "/key/info", headers=bearer("sk-nobody"))[0] == 401
    assert cli(s, "keys", "info", key="adm").stdout.strip() == "the admin key: no limits"


def test_key_info_on_a_server_without_keys_says_there_are_no_limits(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
    st, doc = s.json("GET", "/key/info")
    assert st == 200 and doc["kind"] == "none" and doc["limits"] == []
    s2 = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
               "--api-key", "plain")
    st, doc = s2.json("GET", "/key/info", headers=bearer("plain"))
    assert st == 200 and doc["kind"] == "api-key"


def test_a_keys_file_without_an_admin_key_says_so_at_start_and_in_every_refusal(
        serve, fakes, tmp_path):
    s = keys_server(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\n")
    wait_for(lambda: "keys, usage, logs and requests are closed: set --admin-key" in s.logs(),
             10, 0.05, "the start's warning")
    # no key: the 401 names the keys this server takes
    st, doc = s.json("GET", "/v1/models")
    assert st == 401 and "this server takes a key of its keys file" in doc["error"]["message"]
    # an admin route: there is no admin key, and the answer says how to set one
    for headers, status in (({}, 401), (bearer("sk-alice"), 403)):
        st, doc = s.json("GET", "/usage", headers=headers)
        assert st == status, doc
        assert "this server has none: start it with --admin-key" in doc["error"]["message"]
    r = cli(s, "keys", key="sk-alice")
    assert r.returncode == 1 and "start it with --admin-key" in r.stderr, r.stderr
    # the member's own view still works
    st, doc = s.json("GET", "/key/info", headers=bearer("sk-alice"))
    assert st == 200 and doc["name"] == "alice"


def test_with_an_admin_key_the_start_says_nothing_and_the_401_names_every_kind(
        serve, fakes, tmp_path):
    s = keys_server(serve, fakes, tmp_path, "[alice]\nkey = sk-alice\n", "--admin-key", "adm",
                    "--api-key", "plain")
    st, doc = s.json("GET", "/v1/models")
    assert st == 401
    assert doc["error"]["message"].endswith(
        "this server takes a key of its keys file, an --api-key key or the admin key")
    assert "are closed: set --admin-key" not in s.logs()


def test_a_missing_keys_file_is_refused_with_how_to_make_one(tmp_path, fakes):
    fakes.add("m", tokens=2)
    r = subprocess.run([sys.executable, "-m", "ggmux", "serve", "--fake-models-dir", str(fakes),
                        "--no-hf-cache", "--keys", str(tmp_path / "keys.ini")],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2
    assert f"touch {tmp_path / 'keys.ini'}, then ggmux keys create NAME" in r.stderr
