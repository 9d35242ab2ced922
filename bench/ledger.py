"""The usage ledger's bench (issue 36): rows per second written to SQLite and
to PostgreSQL, and serving throughput while the ledger writes.

* ``store``: :data:`ROWS` synthetic rows written through the store's own
  ``write`` in batches of the ledger's :data:`~ggmux.ledger.ledger.BATCH_ROWS`
  (one transaction each), to a SQLite file (WAL) and to a PostgreSQL server
  started here (Debian's binaries, as the tests do: tests/pgserver.py).
* ``serving``: one ``ggmux serve`` per ledger setting (``off``, ``sqlite``,
  ``postgresql``) on a fake model that answers at once, driven by a small
  asyncio client (keep-alive connections posting a chat request) for
  ``--duration`` seconds per round, rounds alternating the servers so drift
  lands on all of them; requests/s per setting, and, after the rounds, the
  ledger's row count against the requests the servers answered (no row
  lost at the proxies' top rate).

Usage, from the repository root::

    python -m ggmux.bench.ledger                       # both parts
    python -m ggmux.bench.ledger --rounds 3 --duration 10 --conns 16 --proxies 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ..ledger.ledger import BATCH_ROWS
from ..ledger.records import UsageRow
from ..ledger.stores import open_store
from .proxy_cost import free_port, wait_http

ROWS = 100_000
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
ADMIN = "bench-admin"


def _pg():
    """A started PostgreSQL server (tests/pgserver.py), or None and why."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from pgserver import pg_or_skip

    return pg_or_skip()


def rows(n: int) -> list[UsageRow]:
    now = time.time()
    return [UsageRow(now + i * 1e-4, f"r{i}", f"key{i % 8}", f"model{i % 4}", "local/0", "n1",
                     200, 100 + i % 50, i % 30, 20 + i % 40, 12.5, 80.0, 0.0)
            for i in range(n)]


def store_rate(spec: str, n: int) -> float:
    """Rows per second writing ``n`` rows to store ``spec`` in ledger batches."""
    store = open_store(spec, "")
    store.schema()
    data = rows(n)
    t0 = time.perf_counter()
    for i in range(0, n, BATCH_ROWS):
        store.write(data[i : i + BATCH_ROWS])
    dt = time.perf_counter() - t0
    store._run(lambda conn: conn.cursor().execute("DELETE FROM usage"))  # (serving counts next)
    store.close()
    return n / dt


async def _one_conn(port: int, until: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json"
           b"\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY))
    try:
        while time.monotonic() < until:
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            lower = head.lower()
            if b"content-length:" in lower:
                n = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
                await reader.readexactly(n)
            else:  # chunked
                while True:
                    size = int((await reader.readuntil(b"\r\n")).strip() or b"0", 16)
                    await reader.readexactly(size + 2)
                    if size == 0:
                        break
            counts[0 if head.startswith(b"HTTP/1.1 200") else 1] += 1
    finally:
        writer.close()


def drive(port: int, conns: int, duration: float) -> tuple[int, int]:
    """(answered 200, other answers) of ``conns`` connections for ``duration`` s."""
    counts = [0, 0]

    async def run() -> None:
        until = time.monotonic() + duration
        await asyncio.gather(*(_one_conn(port, until, counts) for _ in range(conns)))

    asyncio.run(run())
    return counts[0], counts[1]


def start_server(ledger: str, fakes: Path, state: Path, proxies: int, log: Path):
    port = free_port()
    env = {**os.environ, "GGMUX_STATE_DIR": str(state)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ggmux", "serve", "--port", str(port), "--fake-models-dir",
         str(fakes), "--proxies", str(proxies), "--spares", "0", "--admin-key", ADMIN,
         "--ledger", ledger, "--requests-kept", "1000"],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env=env)
    wait_http(f"http://127.0.0.1:{port}/health")
    wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", 120, BODY)  # the model loaded
    return proc, port


def ledger_requests(port: int) -> int:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/usage?group=model",
                                 headers={"authorization": f"Bearer {ADMIN}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        doc = json.load(r)
    return sum(x["requests"] for x in doc["data"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=ROWS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--conns", type=int, default=16)
    ap.add_argument("--proxies", type=int, default=2)
    ap.add_argument("--skip-store", action="store_true")
    ap.add_argument("--skip-serving", action="store_true")
    args = ap.parse_args(argv)
    pg, why = _pg()
    if pg is None:
        print(f"no PostgreSQL: {why}")
    tmp = Path(tempfile.mkdtemp(prefix="ggmux-bench-ledger-"))
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load": os.getloadavg()}
    try:
        if not args.skip_store:
            out["store_rows_per_s"] = {"sqlite": store_rate(str(tmp / "w.sqlite3"), args.rows)}
            if pg is not None:
                out["store_rows_per_s"]["postgresql"] = store_rate(pg.url, args.rows)
            print("rows/s written:", {k: round(v) for k, v in out["store_rows_per_s"].items()},
                  flush=True)
        if not args.skip_serving:
            fakes = tmp / "fakes"
            fakes.mkdir()
            (fakes / "m.json").write_text(json.dumps({"tokens": 1}))
            settings = ["off", "sqlite"] + (["postgresql"] if pg is not None else [])
            servers = {}
            for s in settings:
                spec = pg.url if s == "postgresql" else s
                servers[s] = start_server(spec, fakes, tmp / f"state-{s}", args.proxies,
                                          tmp / f"{s}.log")
            rates: dict[str, list[float]] = {s: [] for s in settings}
            answered = {s: 1 for s in settings}  # (the warm-up request)
            try:
                for _ in range(args.rounds):
                    for s in settings:
                        ok, bad = drive(servers[s][1], args.conns, args.duration)
                        answered[s] += ok + bad
                        rates[s].append(ok / args.duration)
                        print(f"{s}: {ok / args.duration:.0f} req/s ({bad} not 200)", flush=True)
                time.sleep(3)  # the last batch written
                out["serving_req_per_s"] = {s: statistics.median(v) for s, v in rates.items()}
                out["rounds"] = rates
                out["ledger_rows_vs_answered"] = {
                    s: [ledger_requests(servers[s][1]), answered[s]]
                    for s in settings if s != "off"}
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                for proc, _ in servers.values():
                    proc.wait(60)
        out["args"] = vars(args)
        print(json.dumps(out, indent=2))
    finally:
        if pg is not None:
            pg.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
