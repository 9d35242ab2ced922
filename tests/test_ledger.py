"""The usage ledger end to end (issue 36): real servers on fake models write
one row per finished request to SQLite (the default, in --state-dir) or to
a real PostgreSQL server; ``GET /usage`` (JSON, CSV, ranges, groups, the
admin key), ``ggmux usage``, ``/metrics``; a restart keeps the rows; a
full disk (a small tmpfs, where this machine lets us mount one) and a
database that goes down and comes back lose no row of a request that was
served."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading

import pytest
from conftest import alive, chat_body, children_of, wait_for, write_fake
from pgserver import pg_or_skip

ADMIN = "adm-secret"
AUTH = {"authorization": f"Bearer {ADMIN}"}


def usage(s, query: str = "", **kw) -> list[dict]:
    status, doc = s.json("GET", "/usage" + query, headers=AUTH, **kw)
    assert status == 200, doc
    return doc["data"]


def total(s, query: str = "?group=") -> int:
    return sum(r["requests"] for r in usage(s, query))


def ask(s, n: int, model: str = "alpha") -> None:
    for i in range(n):
        body = chat_body(model, stream=i % 2 == 0)
        assert s.request("POST", "/v1/chat/completions", body)[0] == 200


def rows(path) -> int:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT COUNT(*) FROM usage").fetchone()[0]
    finally:
        conn.close()


def test_sqlite_ledger_usage_route_cli_metrics_and_restart(serve, fakes, tmp_path):
    fakes.add("alpha", tokens=4)
    fakes.add("beta", tokens=2)
    state = tmp_path / "st"
    args = ("--fake-models-dir", str(fakes), "--proxies", "2", "--admin-key", ADMIN,
            "--state-dir", str(state))
    s = serve(*args)
    ask(s, 5)
    ask(s, 2, "beta")
    wait_for(lambda: total(s) == 7, 20, 0.1, "7 requests in the ledger")
    by = {(r["key"], r["model"]): r for r in usage(s, "?group=key,model")}
    assert set(by) == {("", "alpha"), ("", "beta")}
    assert (by["", "alpha"]["requests"], by["", "alpha"]["completion_tokens"],
            by["", "alpha"]["prompt_tokens"]) == (5, 20, 5)
    days = usage(s)  # default groups: key, model, day
    assert {tuple(sorted(r)) for r in days} and all(len(r["day"]) == 10 for r in days)
    assert usage(s, "?from=2000-01-01&to=2000-01-02") == []
    # CSV, by format or by Accept
    status, headers, body = s.request("GET", "/usage?group=model&format=csv", headers=AUTH)
    assert status == 200 and headers["content-type"].startswith("text/csv")
    lines = body.decode().splitlines()
    assert lines[0].startswith("model,requests,") and len(lines) == 3
    status, headers, _ = s.request("GET", "/usage", headers={**AUTH, "accept": "text/csv"})
    assert headers["content-type"].startswith("text/csv")
    # bad queries, and the admin key
    assert s.json("GET", "/usage?group=colour", headers=AUTH)[0] == 400
    assert s.json("GET", "/usage?from=yesterday", headers=AUTH)[0] == 400
    assert s.json("GET", "/usage")[0] == 401
    # /metrics: per key name and the ledger's health
    # (the status the proxies read is rewritten about once a second)
    text = wait_for(lambda: 'ggmux_key_requests_total{key=""} 7' in (
        t := s.request("GET", "/metrics")[2].decode()) and t, 10, 0.1, "the key's counters")
    assert "ggmux_ledger_up 1" in text and "ggmux_ledger_rows_lost_total 0" in text
    # ggmux usage: a table
    env = {**os.environ, "GGMUX_URL": s.base, "GGMUX_ADMIN_KEY": ADMIN}
    out = subprocess.run([sys.executable, "-m", "ggmux", "usage", "--group", "model"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    head, *table = out.stdout.splitlines()
    assert head.split()[:3] == ["MODEL", "REQUESTS", "ERRORS"]
    assert sorted(line.split()[:2] for line in table) == [["alpha", "5"], ["beta", "2"]]
    out = subprocess.run([sys.executable, "-m", "ggmux", "usage", "--csv"],
                         capture_output=True, text=True, env=env, timeout=60, check=False)
    assert out.returncode == 0 and out.stdout.startswith("key,model,day,requests")
    # a restart keeps every row, and the counting goes on
    port = s.port
    s.stop()
    s.stop = lambda *a, **k: None  # (its stop check would see the next server's segment)
    assert rows(state / f"usage-{port}.sqlite3") == 7  # one file per server (its port)
    s2 = serve(*args, port=port)
    ask(s2, 1)
    wait_for(lambda: total(s2) == 8, 20, 0.1, "8 requests after the restart")


def _can_mount_tmpfs(path) -> bool:
    path.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(path)],
                       capture_output=True, check=False)
    return r.returncode == 0


@pytest.mark.slow
def test_a_full_disk_loses_no_row_and_writing_resumes(serve, fakes, tmp_path):
    mnt = tmp_path / "small"
    if not _can_mount_tmpfs(mnt):
        pytest.skip("cannot mount a small tmpfs here (not root, or no CAP_SYS_ADMIN); "
                    "tests/test_ledger_store.py covers a store that raises ENOSPC")
    try:
        fakes.add("alpha", tokens=2)
        s = serve("--fake-models-dir", str(fakes), "--admin-key", ADMIN,
                  "--state-dir", str(mnt))
        ask(s, 2)
        wait_for(lambda: total(s) == 2, 20, 0.1, "2 rows")
        # fill the disk
        with open(mnt / "filler", "wb", buffering=0) as f:
            try:
                while True:
                    f.write(b"\0" * 4096)
            except OSError:
                pass  # ENOSPC: full
        ask(s, 60)  # served all the same
        wait_for(lambda: (st := s.json("GET", "/usage?group=", headers=AUTH)[1]["ledger"])
                 and not st["ok"], 30, 0.1, "the ledger reports the full disk")
        _, _, text = s.request("GET", "/metrics")
        assert b"ggmux_ledger_up 0" in text
        assert "usage ledger: writing to" in s.logs() and "failed" in s.logs()
        os.unlink(mnt / "filler")
        wait_for(lambda: total(s) == 62, 60, 0.2, "every row written once there is room")
        st = wait_for(lambda: (d := s.json("GET", "/usage", headers=AUTH)[1]["ledger"])["ok"]
                      and d, 10, 0.1, "the status says it works again")
        assert (st["lost"], st["dropped"], st["pending"]) == (0, 0, 0)
        assert "works again" in s.logs()
        s.stop()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


@pytest.fixture
def pg():
    srv, why = pg_or_skip()
    if srv is None:
        pytest.skip(f"PostgreSQL: {why}")
    yield srv
    srv.close()


@pytest.mark.slow
def test_postgresql_ledger_survives_the_database_going_down_and_a_restart(serve, fakes, pg):
    fakes.add("alpha", tokens=3)
    args = ("--fake-models-dir", str(fakes), "--proxies", "2", "--admin-key", ADMIN,
            "--ledger", pg.url)
    s = serve(*args)
    ask(s, 4)
    wait_for(lambda: total(s) == 4, 20, 0.1, "4 rows in PostgreSQL")
    pg.stop()
    ask(s, 6)  # the database is down: serving goes on
    assert s.json("GET", "/usage", headers=AUTH)[0] == 503
    wait_for(lambda: b"ggmux_ledger_up 0" in s.request("GET", "/metrics")[2], 30, 0.1,
             "the failure in /metrics")
    pg.start()
    def all_rows_back() -> bool:
        # the proxy's connection from before the restart may answer one 503
        # ("terminating connection") before it connects again
        status, doc = s.json("GET", "/usage?group=", headers=AUTH)
        return status == 200 and sum(r["requests"] for r in doc["data"]) == 10

    wait_for(all_rows_back, 90, 0.2, "every row written once the database is back")
    port = s.port
    s.stop()
    s.stop = lambda *a, **k: None  # (its stop check would see the next server's segment)
    s2 = serve(*args, port=port)
    ask(s2, 1)
    wait_for(lambda: total(s2) == 11, 30, 0.1, "11 rows after the restart")
    assert {r["node"] for r in usage(s2, "?group=node")} == {os.uname().nodename}


@pytest.mark.slow
def test_a_request_forwarded_to_another_node_is_one_row_of_a_shared_ledger(
        nats_server, serve, pg, tmp_path):
    """Two cluster nodes share a PostgreSQL ledger: a request node a forwards
    to node b is a's row (its replica: b), not b's too."""
    ns = nats_server()

    def node(name: str, model: str):
        d = tmp_path / f"models-{name}"
        write_fake(d, model, tokens=2)
        return serve("--fake-models-dir", str(d), "--no-hf-cache", "--proxies", "1",
                     "--cluster", ns.url, "--node-name", name, "--heartbeat", "0.5",
                     "--node-stale", "1.5", "--cluster-token", "tok", "--admin-key", ADMIN,
                     "--ledger", pg.url)

    a = node("a", "onlya")
    b = node("b", "onlyb")
    wait_for(lambda: "onlyb" in a.models(), 15, 0.05, "onlyb registered on a")
    assert a.request("POST", "/v1/chat/completions", chat_body("onlyb"),
                     headers=AUTH)[0] == 200
    # then one at b itself: b's ledger has read the forwarded record before it
    assert b.request("POST", "/v1/chat/completions", chat_body("onlyb"),
                     headers=AUTH)[0] == 200
    wait_for(lambda: total(a) >= 2, 30, 0.1, "two rows")
    got = {(r["node"], r["replica"]): r["requests"] for r in usage(a, "?group=node,replica")}
    assert got[("a", "b")] == 1, got
    assert [n for n, rep in got if n == "b"] == ["b"] and sum(got.values()) == 2, got


def test_two_servers_of_one_state_dir_keep_their_usage_apart_by_default(serve, fakes, tmp_path):
    """The default ledger is one file per server (its port): two servers of
    one user, sharing ``--state-dir``, never list each other's models."""
    fakes.add("alpha", tokens=2)
    other = tmp_path / "other"
    other.mkdir()
    write_fake(other, "beta", tokens=2)
    state = tmp_path / "st"
    a = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--admin-key", ADMIN,
              "--state-dir", str(state))
    b = serve("--fake-models-dir", str(other), "--proxies", "1", "--admin-key", ADMIN,
              "--state-dir", str(state))
    ask(a, 2)
    ask(b, 1, "beta")
    wait_for(lambda: total(a) == 2 and total(b) == 1, 20, 0.1, "each server's rows")
    assert {r["model"] for r in usage(a, "?group=model")} == {"alpha"}
    assert {r["model"] for r in usage(b, "?group=model")} == {"beta"}
    assert sorted(p.name for p in state.glob("usage-*.sqlite3")) == sorted(
        [f"usage-{a.port}.sqlite3", f"usage-{b.port}.sqlite3"])
    assert "also holds other servers' rows" not in a.logs()


def test_a_shared_ledger_shows_each_servers_rows_with_a_node_column(serve, fakes, tmp_path):
    """Servers that name one ledger file share it: the start log says the
    file holds other servers' rows, and the usage views add a node column
    (a row of one server is never taken for another's)."""
    fakes.add("alpha", tokens=2)
    shared = tmp_path / "shared.sqlite3"
    args = ("--fake-models-dir", str(fakes), "--proxies", "1", "--admin-key", ADMIN,
            "--ledger", str(shared))
    a = serve(*args, "--node-name", "a")
    ask(a, 2)
    wait_for(lambda: total(a) == 2, 20, 0.1, "a's rows")
    st, doc = a.json("GET", "/usage?group=model", headers=AUTH)
    assert st == 200 and doc["group"] == ["model"] and "node" not in doc["data"][0]  # one server: no column
    b = serve(*args, "--node-name", "b")
    wait_for(lambda: "also holds other servers' rows (a: 2 rows; this one is b)" in b.logs(),
             20, 0.1, "b's start line about a's rows")
    ask(b, 1)
    wait_for(lambda: total(b) == 3, 20, 0.1, "both servers' rows")
    st, doc = b.json("GET", "/usage?group=model", headers=AUTH)
    assert st == 200 and doc["group"] == ["model", "node"]
    assert sorted((r["node"], r["requests"]) for r in doc["data"]) == [("a", 2), ("b", 1)]


def test_a_supervisor_killed_with_sigkill_loses_no_answered_requests_row(
        serve, fakes, tmp_path, private_files):
    fakes.add("alpha", tokens=3, token_s=0.01, parallel=8)
    state = tmp_path / "st"
    keys = tmp_path / "keys.ini"
    keys.write_text("[k]\nkey = sk-k\ntokens-per-day = 1000000\n")
    args = ("--fake-models-dir", str(fakes), "--proxies", "2", "--admin-key", ADMIN,
            "--state-dir", str(state), "--keys", str(keys))
    s = serve(*args)
    body = chat_body("alpha", max_tokens=3)
    key = {"authorization": "Bearer sk-k"}
    assert s.request("POST", "/v1/chat/completions", body, headers=key)[0] == 200
    ledger = state / f"usage-{s.port}.sqlite3"  # the server's own file (its port)
    wait_for(lambda: rows(ledger) == 1, 20, 0.05, "the first row")
    kids = children_of(s.proc.pid)
    # a burst, and the supervisor killed as soon as it is answered: before the
    # ledger's next write (every 0.5 s) takes its rows from the request ring
    codes: list[int] = []

    def one() -> None:
        codes.append(s.request("POST", "/v1/chat/completions", body, headers=key)[0])

    threads = [threading.Thread(target=one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    answered = 1 + codes.count(200)
    assert codes.count(200) == 16
    for pid in kids:  # the proxies drain and exit once their supervisor is gone
        wait_for(lambda p=pid: not alive(p), 30, 0.05, f"child {pid} to exit")
    # (here the crash left the burst's rows unwritten: the ring held them)
    port = s.port
    s.stop = lambda *a, **k: None  # (the next server owns the name now)
    s2 = serve(*args, port=port)
    wait_for(lambda: rows(ledger) == answered, 20, 0.05,
             f"{answered} rows after the restart")
    # and the key's day window counts them all: 3 tokens each, and a prompt
    st, doc = s2.json("GET", "/keys/k", headers=AUTH)
    assert st == 200 and doc["usage"]["tokens_today"] >= 3 * answered
    # once written, a second restart writes none of them again
    s2.stop()
    s2.stop = lambda *a, **k: None
    serve(*args, port=port)
    assert rows(ledger) == answered
