"""Keys' limits across nodes (issue 36): two servers (``--node-name`` a and
b) share one ledger (a SQLite file; PostgreSQL, slow) and one keys file;
each reconciles its keys' windows from the other's rows every
``--ledger-sync`` (ledger/sync.py). Real servers on fake
instances."""

from __future__ import annotations

import json
import time

import pytest
from conftest import chat_body, minute_left, wait_for
from pgserver import pg_or_skip

# keys files hold secrets: private, as ggmux requires (keys_file.check_file_mode)
pytestmark = pytest.mark.usefixtures("private_files")

CHAT = "/v1/chat/completions"
ADMIN = {"authorization": "Bearer adm"}
KEY = {"authorization": "Bearer sk-k"}
SYNC_S = "0.2"


def pair(serve, fakes, tmp_path, keys: str, ledger: str | None = None):
    """Servers a and b: one keys file, one ledger (a SQLite file unless
    ``ledger`` names one)."""
    fakes.add("m", tokens=4)
    kf = tmp_path / "keys.ini"
    kf.write_text(keys)
    ledger = ledger or str(tmp_path / "shared" / "usage.sqlite3")

    def node(name: str, port: int | None = None):
        return serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
                     "--keys", str(kf), "--admin-key", "adm", "--ledger", ledger,
                     "--node-name", name, "--ledger-sync", SYNC_S, port=port)

    return node("a"), node("b"), node


def usage(s) -> dict:
    st, doc = s.json("GET", "/keys/k", headers=ADMIN)
    assert st == 200, doc
    return doc["usage"]


def ledger_tokens(s) -> int:
    """Prompt + completion tokens of key k in the shared ledger (every node)."""
    st, doc = s.json("GET", "/usage?group=key", headers=ADMIN)
    assert st == 200, doc
    return sum(r["prompt_tokens"] + r["completion_tokens"] for r in doc["data"]
               if r["key"] == "k")


def test_a_day_budget_holds_across_two_servers_sharing_the_ledger(serve, fakes, tmp_path):
    a, b, node = pair(serve, fakes, tmp_path, "[k]\nkey = sk-k\ntokens-per-day = 60\n")
    day = int(time.time() // 86400)
    admitted = {"a": 0, "b": 0}
    turn = 0
    while True:  # alternate, each request seen by both before the next
        s = (a, b)[turn % 2]
        st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=4), headers=KEY)
        if st != 200:
            break
        admitted["ab"[turn % 2]] += 1
        turn += 1
        wait_for(lambda: usage(a)["tokens_today"] == usage(b)["tokens_today"] == ledger_tokens(a)
                 > 0, 30, 0.05, "both servers count every request")
        assert turn < 100, "the budget never refused"
    if int(time.time() // 86400) != day:
        pytest.skip("the day turned during the test")
    assert st == 429 and json.loads(body)["error"]["code"] == "insufficient_quota"
    assert admitted["a"] >= 1 and admitted["b"] >= 1, admitted  # both took part
    used = ledger_tokens(a)
    assert used <= 60 and usage(a)["tokens_today"] == usage(b)["tokens_today"] == used
    # the other server refuses as well: what a used up, b knows, and the other way round
    for s in (a, b):
        st, _, body = s.request("POST", CHAT, chat_body("m", max_tokens=4), headers=KEY)
        assert st == 429 and "tokens-per-day 60" in json.loads(body)["error"]["message"]
    # a restart of b: its own rows seeded, a's added by the sync, none twice
    port = b.port
    b.stop()
    b.stop = lambda *a, **k: None  # (its stop check would see the next server's segment)
    b2 = node("b", port)
    assert usage(b2)["tokens_today"] == used
    assert b2.request("POST", CHAT, chat_body("m", max_tokens=4), headers=KEY)[0] == 429
    # a restart under its name is not two servers of one name
    for s in (a, b2):
        n = ledger_status(s)["syncs"]
        wait_for(lambda s=s, n=n: ledger_status(s)["syncs"] > n + 2, 30, 0.05,
                 "three more syncs")
        assert ledger_status(s)["warning"] is None


def ledger_status(s) -> dict:
    st, doc = s.json("GET", "/usage?group=key", headers=ADMIN)
    assert st == 200, doc
    return doc["ledger"]


def test_two_servers_with_one_node_name_are_told_so(serve, fakes, tmp_path):
    # each would take the other's rows for its own: neither counts them
    fakes.add("m", tokens=4)
    kf = tmp_path / "keys.ini"
    kf.write_text("[k]\nkey = sk-k\nrpm = 100\n")
    ledger = str(tmp_path / "shared" / "usage.sqlite3")
    same = [serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
                  "--keys", str(kf), "--admin-key", "adm", "--ledger", ledger,
                  "--node-name", "twin", "--ledger-sync", SYNC_S) for _ in range(2)]
    for s in same:
        wait_for(lambda s=s: (ledger_status(s)["warning"] or "").startswith(
            "another server writes"), 30, 0.1, "the warning")
        assert "give each server its own --node-name" in s.logs()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.slow)])
def store_url(request):
    """The shared ledger's URL: None (a SQLite file the pair shares) or a
    real PostgreSQL server's. Named before ``serve`` by the tests, so the
    servers stop (and write their last rows) while the database is still up:
    stopped first, each server's last write waited out its retries (10 s)."""
    if request.param == "sqlite":
        yield None
        return
    srv, why = pg_or_skip()
    if srv is None:
        pytest.skip(f"PostgreSQL: {why}")
    yield srv.url
    srv.close()


def test_rpm_holds_across_two_servers_and_the_other_server_refuses(store_url, serve, fakes,
                                                                  tmp_path):
    url = store_url
    a, b, _ = pair(serve, fakes, tmp_path, "[k]\nkey = sk-k\nrpm = 4\n", url)
    minute = minute_left(15)

    def same_minute() -> None:  # after a turn every count starts again at 0
        if int(time.time() // 60) != minute:
            pytest.skip("the minute turned during the test")

    def counted(s, n: int) -> bool:
        same_minute()
        return usage(s)["requests_this_minute"] == n

    codes = [a.request("POST", CHAT, chat_body("m"), headers=KEY)[0] for _ in range(3)]
    assert codes == [200] * 3
    wait_for(lambda: counted(b, 3), 30, 0.05, "b sees a's 3 requests")
    codes = [b.request("POST", CHAT, chat_body("m"), headers=KEY)[0] for _ in range(2)]
    wait_for(lambda: counted(a, 4), 30, 0.05, "a sees b's request")
    codes.append(a.request("POST", CHAT, chat_body("m"), headers=KEY)[0])
    same_minute()
    assert codes == [200, 429, 429], codes
    assert usage(a)["admitted"] + usage(b)["admitted"] == 4
