"""The usage ledger in-process (issue 36): request-ring records become rows
in the store, with key names and costs; a failing store (a full disk: a
store that raises ENOSPC's error, or a database that is down) keeps rows in
the bounded buffer and writing resumes; a lapped ring and a full buffer are
counted; ``totals_since`` (the keys' windows after a restart) and the
``/usage`` totals. On SQLite and on a real PostgreSQL server (tests/pgserver.py)."""

from __future__ import annotations

import os
import time

import pytest
from conftest import wait_for
from ggmux.ledger import ledger as ledger_mod
from ggmux.ledger.ledger import UsageLedger
from ggmux.ledger.records import RowContext, UsageRow, cost_of
from ggmux.ledger.store import StoreError
from ggmux.ledger.stores import open_store
from ggmux.ledger.sync import FULL_EVERY_S, LedgerSync
from ggmux.proxy.operator.usage import parse_time, usage_csv, usage_metrics
from ggmux.shm import requestring as Q
from ggmux.shm.keytable import (
    K_REQS,
    K_SPEND_MONTH_NANO,
    K_TOK_DAY,
    K_TOKENS,
    KeyTable,
    TableShape,
    period_end,
    periods,
    roll,
)
from ggmux.shm.requestring import RequestRing, RingShape
from ggmux.supervisor.jobs import Jobs
from ggmux.supervisor.keys import KeyRegistry
from pgserver import pg_or_skip

# keys files hold secrets: private, as ggmux requires (keys_file.check_file_mode)
pytestmark = pytest.mark.usefixtures("private_files")

PRICES = {"paid": (2.0, 0.5, 8.0)}  # per million: input, cached input, output
KEYS = {0: "alice", 1: "bob"}


@pytest.fixture(scope="module")
def pg():
    srv, why = pg_or_skip()
    if srv is None:
        pytest.skip(f"PostgreSQL: {why}")
    yield srv
    srv.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        s = open_store(str(tmp_path / "usage.sqlite3"), "")
    else:
        pg = request.getfixturevalue("pg")
        s = open_store(pg.url, "")
        s.schema()
        s._run(lambda conn: conn.cursor().execute("DELETE FROM usage"))
    yield s
    s.close()


@pytest.fixture
def ring():
    r = RequestRing.create(f"/ggmux-test-ledger-{os.getpid()}", RingShape(proxies=2, rows=8))
    yield r
    r.unlink()
    r.close()


def ctx() -> RowContext:
    return RowContext(model_name=lambda m: ("free", "paid")[m],
                      replica_name=lambda slot: f"local/{slot}",
                      key_name=KEYS.get, prices_of=lambda m: PRICES.get(m, (0.0, 0.0, 0.0)),
                      node="n1")


def record(ring: RequestRing, proxy: int, t: float, model: int = 0, key: int = -1,
           prompt: int = 10, cached: int = 2, gen: int = 5, status: int = 200,
           flags: int = 0) -> None:
    ring.write(proxy, (int(t * 1e9), model, 3, 1, status, prompt, cached, gen, 0,
                       1500, 9000, flags, 100, 0, 0, f"r{t}".encode(), key))


class Flaky:
    """A store that fails like a full disk while ``failing``."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.failing = False
        self.where = "flaky " + inner.where

    def schema(self) -> None:
        self.inner.schema()

    def write(self, rows) -> None:
        if self.failing:
            raise StoreError("[Errno 28] No space left on device")
        self.inner.write(rows)

    def totals_since(self, since_s, node=None):
        if self.failing:
            raise StoreError("[Errno 28] No space left on device")
        return self.inner.totals_since(since_s, node)

    def close(self) -> None:
        self.inner.close()


def run_until(led: UsageLedger, jobs: Jobs, cond, what: str, timeout: float = 20.0):
    def turn():
        jobs.step()
        led.step()
        return cond()

    return wait_for(turn, timeout, 0.02, what)


def test_ring_records_become_rows_with_key_names_and_costs(store, ring):
    jobs = Jobs()
    led = UsageLedger(store, ring, ctx(), jobs)
    now = time.time()
    record(ring, 0, now - 1, model=1, key=0, prompt=1000, cached=400, gen=100)
    record(ring, 1, now - 0.5, model=0, key=1)
    record(ring, 0, now, model=0, key=-1, status=503, prompt=-1, cached=-1, gen=-1)
    record(ring, 1, now, model=0, key=1, status=429, prompt=-1, cached=-1, gen=-1,
           flags=Q.F_KEY_REFUSED)
    run_until(led, jobs, lambda: led.written == 4, "4 rows written")
    got = store.usage(0, now + 10, ["key", "model"])
    by = {(r["key"], r["model"]): r for r in got}
    assert set(by) == {("alice", "paid"), ("bob", "free"), ("", "free")}
    alice = by["alice", "paid"]
    assert (alice["requests"], alice["prompt_tokens"], alice["cached_tokens"],
            alice["completion_tokens"], alice["errors"]) == (1, 1000, 400, 100, 0)
    # 600 uncached at 2, 400 cached at 0.5, 100 out at 8, per million
    assert alice["cost"] == pytest.approx((600 * 2 + 400 * 0.5 + 100 * 8) / 1e6)
    assert alice["ttft_ms_avg"] == 1.5
    assert by["", "free"]["errors"] == 1 and by["", "free"]["prompt_tokens"] == 0
    assert by["", "free"]["refused"] == 0 and by["alice", "paid"]["refused"] == 0
    assert (by["bob", "free"]["requests"], by["bob", "free"]["errors"],
            by["bob", "free"]["refused"]) == (2, 1, 1)
    day = time.strftime("%Y-%m-%d", time.gmtime(now))
    assert {r["day"] for r in store.usage(0, now + 10, ["day"])} == {day}
    assert [r["requests"] for r in store.usage(0, now + 10, [])] == [4]
    assert store.usage(now + 5, now + 10, ["key"]) == []
    csv = usage_csv(["key", "model"], got).decode().splitlines()
    assert csv[0] == ("key,model,requests,errors,refused,prompt_tokens,cached_tokens,"
                      "completion_tokens,cost,ttft_ms_avg")
    assert len(csv) == 4
    tot = led.totals_since(now - 0.75)
    assert set(tot) == {"bob", ""} and tot["bob"].prompt_tokens == 10
    st = led.status()
    assert (st["ok"], st["written"], st["lost"], st["pending"]) == (True, 4, 0, 0)
    assert st["keys"]["alice"][:4] == [1, 1000, 400, 100]
    text = usage_metrics(st).decode()
    assert 'ggmux_key_requests_total{key="alice"} 1' in text
    assert "ggmux_ledger_up 1" in text
    led.close()


def test_a_failing_store_keeps_rows_in_memory_and_writing_resumes(store, ring, monkeypatch):
    monkeypatch.setattr(ledger_mod, "RETRY_S", 0.05)
    jobs = Jobs()
    flaky = Flaky(store)
    flaky.failing = True
    led = UsageLedger(flaky, ring, ctx(), jobs, buffer=100)
    now = time.time()
    for i in range(5):
        record(ring, i % 2, now + i / 10, key=0)
    run_until(led, jobs, lambda: led.error is not None, "the failure seen")
    assert "No space left" in led.status()["error"] and not led.status()["ok"]
    assert "ggmux_ledger_up 0" in usage_metrics(led.status()).decode()
    # served meanwhile: more rows wait, none written, none lost
    record(ring, 0, now + 1, key=1)
    run_until(led, jobs, lambda: led.status()["pending"] == 6, "6 rows waiting")
    assert led.written == 0
    # totals read while the store fails: what memory holds
    assert led.totals_since(0)["alice"].requests == 5
    flaky.failing = False
    run_until(led, jobs, lambda: led.written == 6, "every row written once the store works")
    assert led.error is None and led.dropped == 0 and led.lost == 0
    assert sum(r["requests"] for r in store.usage(0, now + 10, ["key"])) == 6
    led.close()


def test_a_full_buffer_drops_the_oldest_rows_and_counts_them(store, ring):
    jobs = Jobs()
    flaky = Flaky(store)
    flaky.failing = True
    led = UsageLedger(flaky, ring, ctx(), jobs, buffer=3)
    now = time.time()
    for i in range(5):
        record(ring, 0, now + i, gen=i)
    led.read()
    assert (len(led.pending), led.dropped) == (3, 2)
    assert [r.completion_tokens for r in led.pending] == [2, 3, 4]  # the newest kept
    assert led.status()["dropped"] == 2
    led.close(timeout=0.2)


def test_a_ring_that_laps_before_it_is_read_counts_what_it_lost(store, ring):
    jobs = Jobs()
    led = UsageLedger(store, ring, ctx(), jobs)
    now = time.time()
    for i in range(11):  # 8 rows per proxy
        record(ring, 0, now + i)
    record(ring, 1, now)
    assert led.read() == 9
    assert led.lost == 3
    assert "ggmux_ledger_rows_lost_total 3" in usage_metrics(led.status()).decode()
    led.close()


def test_another_nodes_forwarded_request_is_left_to_that_nodes_row(store, ring):
    jobs = Jobs()
    led = UsageLedger(store, ring, ctx(), jobs)
    now = time.time()
    record(ring, 0, now, flags=Q.F_FORWARDED)  # served here for another node
    record(ring, 0, now + 1)
    assert led.read() == 1
    assert [r.time for r in led.pending] == [now + 1]
    led.close()


def test_close_writes_what_is_left(store, ring):
    jobs = Jobs()
    led = UsageLedger(store, ring, ctx(), jobs)
    now = time.time()
    record(ring, 0, now)
    record(ring, 1, now)
    led.close()
    assert store.usage(0, now + 10, [])[0]["requests"] == 2


def test_costs_and_times():
    assert cost_of((0.0, 0.0, 0.0), 100, 0, 100) == 0.0
    assert cost_of((1.0, 1.0, 1.0), None, None, None) == 0.0
    assert cost_of((1e6, 0.0, 0.0), 10, 20, 0) == 0.0  # cached over prompt: capped
    assert parse_time("24h", 100000.0) == 100000.0 - 86400
    assert parse_time("2026-12-03", 0) == parse_time("2026-12-03T00:00:00Z", 0)
    assert parse_time("1733011200", 0) == 1733011200.0
    with pytest.raises(ValueError):
        parse_time("yesterday", 0)
    with pytest.raises(ValueError):
        open_store("sqlite", "/nonexistent").usage(0, 1, ["colour"])


def test_a_postgresql_password_is_a_secret_and_never_shown():
    from ggmux.ledger.postgres import redact
    from ggmux.supervisor.cli import build_parser, secret_values

    url = "postgresql://ggmux:pa55word@db.example:5433/usage"
    args = build_parser({}).parse_args(["serve", "--ledger", url])
    assert "pa55word" in secret_values(args)  # hidden from ps like --api-key
    assert redact(url) == "postgresql://ggmux:***@db.example:5433/usage"


def usage_row(t: float, key: str, node: str, prompt: int = 10, cached: int = 0,
              gen: int = 5, cost: float = 0.0, refused: bool = False) -> UsageRow:
    return UsageRow(time=t, request_id=f"r{t}{node}", key=key, model="free", replica="local/0",
                    node=node, status=429 if refused else 200, prompt_tokens=prompt,
                    cached_tokens=cached, completion_tokens=gen, ttft_ms=1.0, duration_ms=2.0,
                    cost=cost, refused=refused)


def test_ledger_sync_adds_only_the_other_nodes_growth_to_the_keys_windows(store, tmp_path):
    """Limits across nodes (issue 36): the sync adds what the other nodes of
    a shared ledger used since each window's start, and on the next sync
    only what grew; this node's rows and live counts are not counted twice."""
    table = KeyTable.create(f"/ggmux-test-sync-{os.getpid()}", TableShape(4, 1, 2))
    try:
        f = tmp_path / "k.ini"
        f.write_text("[a]\nkey = sk-a\nrpm = 100\ntpm = 100000\ntokens-per-day = 100000\n"
                     "output-weight = 2\nspend-per-month = 9\n[free]\nkey = sk-free\n")
        reg = KeyRegistry(str(f), table)
        assert reg.load() is None
        store.schema()
        now = table.now()
        minute_start = period_end("minute", periods(now)[0] - 1)
        ago = max(minute_start, now - 50)  # in this minute (and day)
        yesterday = period_end("day", periods(now)[1] - 1) - 10
        store.write([usage_row(ago, "a", "n2", prompt=10, gen=5, cost=0.5),
                     usage_row(ago, "a", "n3", prompt=20, cached=4, gen=1),
                     usage_row(ago, "a", "n1", prompt=1000, gen=1000),  # ours: not added
                     usage_row(ago, "", "n2", prompt=1000),  # no key of the file
                     usage_row(ago, "a", "n2", prompt=1000, refused=True),  # its key refused it
                     usage_row(yesterday, "a", "n2", prompt=1000)])  # another day
        got = store.others_since("n1", [minute_start, yesterday + 10])
        assert set(got) == {"a"} and [t.requests for t in got["a"]] == [2, 2]
        sync = LedgerSync(reg, store, "n1", Jobs(), interval=0.1)
        with table.locked(0) as r:  # this node's live counts, as a proxy's admission left them
            roll(r, periods(table.now()))
            r[K_REQS], r[K_TOKENS], r[K_TOK_DAY] = 3, 30, 40
        minute = periods(table.now())[0]
        sync.now()
        if periods(table.now())[0] != minute:
            pytest.skip("the minute turned during the test")
        r = table.keys[0]
        # n2 and n3: 2 requests, 36 tokens; weighed 26 + 4 + 2 * 6 = 42; cost 0.5
        assert (int(r[K_REQS]), int(r[K_TOKENS]), int(r[K_TOK_DAY])) == (5, 66, 82)
        assert int(r[K_SPEND_MONTH_NANO]) == 500_000_000
        assert int(table.keys[1][K_REQS]) == 0  # a key without limits is left alone
        store.write([usage_row(ago + 1, "a", "n2", prompt=1, gen=1)])
        sync.now()
        sync.now()  # nothing new: nothing added
        if periods(table.now())[0] != minute:
            pytest.skip("the minute turned during the test")
        assert (int(r[K_REQS]), int(r[K_TOKENS]), int(r[K_TOK_DAY])) == (6, 68, 85)
        # through the loop's step: a job, its result applied on the "loop"
        store.write([usage_row(ago + 2, "a", "n3", prompt=2, gen=0)])
        wait_for(lambda: (sync.jobs.step(), sync.step(), int(r[K_TOK_DAY]) == 87)[-1], 20, 0.02,
                 "the step's sync")
        assert sync.syncs == 4 and sync.error is None
        # a row that reached the ledger later than LATE_S after its time: counted by
        # the next full read, not before
        late = sync.cut - 1
        if late >= period_end("day", periods(table.now())[1] - 1):
            store.write([usage_row(late, "a", "n2", prompt=3, gen=0)])
            sync.now()
            assert int(r[K_TOK_DAY]) == 87
            sync.full_at -= FULL_EVERY_S
            sync.now()
            assert int(r[K_TOK_DAY]) == 90
    finally:
        table.close()


def test_an_older_ledger_gets_the_refused_column(tmp_path):
    import sqlite3

    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as c:  # the table as the first ledgers made it
        c.execute("CREATE TABLE usage (id INTEGER PRIMARY KEY, time DOUBLE PRECISION NOT NULL, "
                  "request_id TEXT, key TEXT NOT NULL, model TEXT NOT NULL, replica TEXT, "
                  "node TEXT, status INTEGER, prompt_tokens BIGINT, cached_tokens BIGINT, "
                  "completion_tokens BIGINT, ttft_ms DOUBLE PRECISION, duration_ms DOUBLE "
                  "PRECISION, cost DOUBLE PRECISION)")
        c.execute("INSERT INTO usage (time, key, model, node, status, prompt_tokens) "
                  "VALUES (100, 'a', 'm', 'n2', 200, 7)")
    c.close()
    s = open_store(str(path), "")
    try:
        s.schema()
        s.write([usage_row(101, "a", "n2", prompt=1, gen=0, refused=True)])
        got = s.others_since("n1", [0.0])
        assert got["a"][0].requests == 1 and got["a"][0].prompt_tokens == 7
        assert s.totals_since(0)["a"].requests == 2
    finally:
        s.close()


def test_connections_opening_one_new_sqlite_file_at_once_never_fail_locked(tmp_path):
    """A server's start opens its new ledger file from two threads at once
    (the writer's totals for the keys' windows, the other-nodes query):
    turning a new file to WAL from two connections together is a deadlock
    SQLite answers at once with "database is locked", busy timeout or not;
    the store tries again instead. Many rounds of three threads, a new
    file each (without the retry about one round in 30 failed)."""
    import threading

    failed = []

    def open_and_read(path):
        s = open_store(path, "")
        try:
            s.schema()
            s.totals_since(0)
        except StoreError as e:
            failed.append(e)
        finally:
            s.close()

    for i in range(150):
        path = str(tmp_path / f"usage-{i}.sqlite3")
        threads = [threading.Thread(target=open_and_read, args=(path,)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failed == []
