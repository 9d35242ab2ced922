"""Keys with limits (issue 36): what the key checks cost, and how exactly
the limits hold across proxies.

Three parts (``--parts micro,latency,accuracy``):

* ``micro``: in one process, the key table's calls as a proxy makes them
  per request: the key's lookup (SHA-256 of the presented key, a dict),
  ``admit`` (row lock, windows rolled, five checks, counts) and ``settle``
  (row lock, reservation replaced by the usage); and the row lock's pair of
  ``fcntl`` calls alone. Microseconds per request, median of rounds.
* ``latency``: two servers side by side on the fake instance (instant
  answers), one proxy each: ``off`` with ``--api-key`` (no policy), ``on``
  with ``--keys`` (a key with every limit set, none reached); a keep-alive
  load of 1 and 64 connections of non-streamed chat requests, rounds
  alternating off/on; requests/s and latency p50/p99 (ms).
* ``accuracy``: one server with 4 proxies, a key with ``rpm`` 100 and
  ``tpm`` 20000, a client at 3x the rpm (300 requests a window, over 16
  keep-alive connections spread over the proxies) for 3 windows, answers of
  100 completion tokens (rpm binds) then 300 (tpm binds), on the key
  table's clock run ``--clock-scale`` times faster (a window of 60/scale
  s). Per window: requests admitted, their tokens (the answers' usage), and
  the allowed (100 requests; 20000 tokens).
* ``two-node`` (not in the default: 3 wall-clock minutes a run): the same
  client and key over two servers of 2 proxies each that share one SQLite
  ledger (``--node-name n0``, ``n1``; ``--ledger-sync``, 2 s): limits
  across nodes, reconciled from the ledger (ledger/sync.py);
  per window also what each node admitted.
* ``sync-query``: the sync's one query on a SQLite ledger of
  ``--sync-rows`` rows (other nodes', over the last 30 days): a full read
  since the month's start (a monthly budget, every 60 s), a sync between
  full reads, and a read since the minute's start.

Usage, from the repository root::

    python -m bench.keys                       # all three parts
    python -m bench.keys --parts micro --out bench/out/keys.json
    python -m bench.keys --parts two-node --out bench/out/keys-two-node.json
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

CHAT = b"/v1/chat/completions"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- micro ----------------------------------------------------------------------------
def micro(n: int = 20000, rounds: int = 5) -> dict:
    from ggmux.proxy.admission import KeyAdmission
    from ggmux.shm.keytable import KeyTable, TableShape
    from ggmux.supervisor.keys import KeyRegistry

    with tempfile.TemporaryDirectory() as d:
        kf = Path(d) / "keys.ini"
        kf.touch(mode=0o600)  # a keys file with a secret in it must be private
        kf.write_text("[k]\nkey = sk-bench-key-0123456789abcdef\nrpm = 1000000000\n"
                      "tpm = 1000000000000\nmax-parallel = 1000000\n"
                      "tokens-per-day = 1000000000000\nspend-per-month = 1000000\n")
        table = KeyTable.create(f"/ggmux-bench-keys-{os.getpid()}", TableShape(8, 1, 4))
        try:
            KeyRegistry(str(kf), table).load()
            ka = KeyAdmission(table.name, 0)
            key = b"sk-bench-key-0123456789abcdef"
            body = {"model": "m", "max_tokens": 16, "messages": []}
            out: dict[str, list[float]] = {"lookup": [], "admit_settle": [], "lock_pair": []}
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(n):
                    ka.row_of(key)
                out["lookup"].append((time.perf_counter() - t0) / n * 1e6)
                t0 = time.perf_counter()
                for _ in range(n):
                    h = ka.admit(0, body, 200)
                    ka.settle(h, 40, 0, 16, 0)
                out["admit_settle"].append((time.perf_counter() - t0) / n * 1e6)
                t0 = time.perf_counter()
                for _ in range(n):
                    table.lock(0)
                    table.unlock(0)
                out["lock_pair"].append((time.perf_counter() - t0) / n * 1e6)
        finally:
            table.close()
    return {k: {"median_us": statistics.median(v), "rounds_us": v} for k, v in out.items()}


# ---- servers ----------------------------------------------------------------------------
class Server:
    """One ``ggmux serve`` on the fake instance."""

    def __init__(self, tmp: Path, name: str, args: list[str], env: dict | None = None,
                 tokens: int = 100) -> None:
        self.port = _free_port()
        fakes = tmp / f"fakes-{name}"
        fakes.mkdir(exist_ok=True)
        (fakes / "m.json").write_text(json.dumps({"ttft_s": 0, "token_s": 0, "tokens": tokens}))
        self.log_path = tmp / f"{name}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--fake-models-dir", str(fakes),
             "--no-hf-cache", "--port", str(self.port), "--spares", "0", "--threads", "1",
             *args], stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.close()
                    raise RuntimeError(f"{name} did not start: "
                                       f"{self.log_path.read_text()[-2000:]}") from None
                time.sleep(0.1)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()


def _request(key: str, max_tokens: int = 1) -> bytes:
    body = json.dumps({"model": "m", "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "Say hi " * 20}]}).encode()
    return (b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer %s\r\ncontent-length: %d\r\n\r\n%s"
            % (CHAT, key.encode(), len(body), body))


async def _read_response(r: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    n = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            n = int(line.split(b":", 1)[1])
    return status, await r.readexactly(n)


async def _load(port: int, req: bytes, conns: int, seconds: float) -> dict:
    lat: list[float] = []
    codes: dict[int, int] = {}
    end = time.monotonic() + seconds

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while time.monotonic() < end:
            t0 = time.perf_counter()
            w.write(req)
            st, _ = await _read_response(r)
            lat.append(time.perf_counter() - t0)
            codes[st] = codes.get(st, 0) + 1
        w.close()

    t0 = time.monotonic()
    await asyncio.gather(*(one() for _ in range(conns)))
    took = time.monotonic() - t0
    lat.sort()
    return {"rps": len(lat) / took, "p50_ms": lat[len(lat) // 2] * 1e3,
            "p99_ms": lat[int(len(lat) * 0.99)] * 1e3, "codes": codes}


def latency(tmp: Path, rounds: int, seconds: float, conns: list[int]) -> dict:
    (tmp / "keys.ini").touch(mode=0o600)  # a keys file with a secret in it must be private
    (tmp / "keys.ini").write_text(
        "[k]\nkey = sk-on\nrpm = 1000000000\ntpm = 1000000000000\nmax-parallel = 100000\n"
        "tokens-per-day = 1000000000000\nspend-per-month = 1000000\n")
    off = Server(tmp, "off", ["--proxies", "1", "--api-key", "sk-off"])
    on = Server(tmp, "on", ["--proxies", "1", "--keys", str(tmp / "keys.ini")])
    out: dict = {}
    try:
        for s, key in ((off, "sk-off"), (on, "sk-on")):  # load the model, warm up
            asyncio.run(_load(s.port, _request(key), 4, 2.0))
        for c in conns:
            for _ in range(rounds):
                for name, s, key in (("off", off, "sk-off"), ("on", on, "sk-on")):
                    res = asyncio.run(_load(s.port, _request(key), c, seconds))
                    out.setdefault(f"{name}@{c}", []).append(res)
                    print(f"latency {name} {c} conns: {res['rps']:.0f} req/s p50 "
                          f"{res['p50_ms']:.2f} ms p99 {res['p99_ms']:.2f} ms {res['codes']}",
                          file=sys.stderr)
    finally:
        off.close()
        on.close()
    return out


def accuracy(tmp: Path, scale: float, windows: int, tokens: int = 100, nodes: int = 1,
             sync_s: float = 2.0) -> dict:
    """The accuracy part (module docstring); ``nodes`` 2: two servers of 2
    proxies each sharing one SQLite ledger (``--node-name a``, ``b``,
    ``--ledger-sync sync_s``), the client's connections split between them,
    on the wall clock (``scale`` must be 1: each server's scaled clock
    starts from its own start)."""
    from ggmux.shm.keytable import H_ANCHOR_S, KeyTable, key_table_name
    from ggmux.shm.segment import segment_name

    if nodes > 1 and scale != 1:
        raise SystemExit("the two-node accuracy runs on the wall clock (--two-node-scale 1)")
    (tmp / "acc.ini").touch(mode=0o600)
    (tmp / "acc.ini").write_text("[k]\nkey = sk-acc\nrpm = 100\ntpm = 20000\n")
    common = ["--keys", str(tmp / "acc.ini"), "--admin-key", "adm"]
    env = {"GGMUX_LIMITS_CLOCK_SCALE": str(scale)} if scale != 1 else {}
    servers: list[Server] = []
    if nodes == 1:
        servers.append(Server(tmp, f"accuracy-{tokens}", ["--proxies", "4", *common], env=env,
                              tokens=tokens))
    else:
        ledger = tmp / f"shared-{tokens}.sqlite3"
        for i in range(nodes):
            servers.append(Server(tmp, f"node{i}-{tokens}", [
                "--proxies", str(max(1, 4 // nodes)), *common, "--ledger", str(ledger),
                "--node-name", f"n{i}", "--ledger-sync", str(sync_s)], env=env, tokens=tokens))
    results: list[tuple[float, float, int, int, int]] = []  # sent, received, status, tokens, node
    try:
        t = KeyTable.attach(key_table_name(segment_name(servers[0].port)))
        anchor = float(t.header[H_ANCHOR_S])

        def now() -> float:
            return anchor + (time.time() - anchor) * scale

        window = 60.0
        w0 = (now() // window + 1) * window  # the next window's start
        while now() < w0:
            time.sleep(0.01)
        per_window = 300
        gap = window / scale / per_window  # real seconds between requests: 3x the rpm
        req = _request("sk-acc", max_tokens=tokens)

        async def run() -> None:
            conns = [(i % nodes, *await asyncio.open_connection(
                "127.0.0.1", servers[i % nodes].port)) for i in range(16)]
            free = asyncio.Queue()
            for c in conns:
                free.put_nowait(c)
            end = w0 + windows * window

            async def one(c) -> None:
                node, r, w = c
                a = now()
                w.write(req)
                st, body = await _read_response(r)
                b = now()
                tok = 0
                if st == 200:
                    u = json.loads(body)["usage"]
                    tok = u["prompt_tokens"] + u["completion_tokens"]
                results.append((a, b, st, tok, node))
                free.put_nowait(c)

            tasks = []
            nxt = time.monotonic()
            while now() < end:
                c = await free.get()
                tasks.append(asyncio.create_task(one(c)))
                nxt += gap
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
            await asyncio.gather(*tasks)
            for _, _, w in conns:
                w.close()

        asyncio.run(run())
    finally:
        for s in servers:
            s.close()
    out = []
    for i in range(windows):
        lo, hi = w0 + i * window, w0 + (i + 1) * window
        inside = [x for x in results if lo <= x[0] and x[1] < hi]
        edge = [x for x in results if x[0] < hi and x[1] >= lo and not (lo <= x[0] and x[1] < hi)
                and x[2] == 200]
        ok = [x for x in inside if x[2] == 200]
        out.append({"window": i, "sent": len(inside), "admitted": len(ok),
                    "tokens": sum(x[3] for x in ok), "admitted_across_edges": len(edge),
                    "refused_429": sum(1 for x in inside if x[2] == 429),
                    "admitted_per_node": [sum(1 for x in ok if x[4] == n) for n in range(nodes)],
                    "allowed_requests": 100, "allowed_tokens": 20000})
        print(f"accuracy ({nodes} node(s)) window {i}: {out[-1]}", file=sys.stderr)
    return {"windows": out, "clock_scale": scale, "completion_tokens": tokens, "nodes": nodes,
            "ledger_sync_s": sync_s if nodes > 1 else None}


def sync_query(tmp: Path, rows: int, keys: int = 50, rounds: int = 5) -> dict:
    """The ledger sync's query (ledger/sync.py) on a SQLite
    ledger of ``rows`` rows of ``keys`` keys from two other nodes spread
    over the last 30 days: seconds per query with the month's start as its
    earliest window (a full read with a monthly budget), since the last
    full read's cut (the sync between full reads), and with the minute's
    alone (rpm / tpm only), median of ``rounds``."""
    import random

    from ggmux.ledger.records import UsageRow
    from ggmux.ledger.stores import open_store
    from ggmux.ledger.sync import FULL_EVERY_S, LATE_S
    from ggmux.shm.keytable import period_end, periods

    store = open_store(str(tmp / "sync-query.sqlite3"), "")
    store.schema()
    now = time.time()
    rng = random.Random(1)
    batch = []
    for i in range(rows):
        batch.append(UsageRow(now - rng.random() * 30 * 86400, f"r{i}", f"k{i % keys}", "m",
                              "local/0", ("n1", "n2")[i % 2], 200, 100, 10, 50, 1.0, 2.0, 0.0))
        if len(batch) == 50_000:
            store.write(batch)
            batch = []
    if batch:
        store.write(batch)
    ids = periods(now)
    month = [period_end(k, pid - 1) for k, pid in zip(("minute", "day", "week", "month"), ids)]
    out = {"rows": rows, "keys": keys}
    recent = [max(x, now - LATE_S - FULL_EVERY_S) for x in month]  # a sync between full reads
    for name, starts in (("month", month), ("recent", recent), ("minute", month[:1])):
        took = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = store.others_since("n0", starts)
            took.append(time.perf_counter() - t0)
        out[f"{name}_s"] = statistics.median(took)
        out[f"{name}_keys"] = len(got)
        out[f"{name}_rows_read"] = sum(max(t.requests for t in v) for v in got.values())
        print(f"sync query ({name}) over {rows} rows: {out[f'{name}_rows_read']} rows read, "
              f"{out[f'{name}_s'] * 1e3:.1f} ms", file=sys.stderr)
    store.close()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.keys")
    ap.add_argument("--parts", default="micro,latency,accuracy",
                    help="also: two-node (minutes of wall clock: not in the default), "
                         "sync-query")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0, help="per latency run")
    ap.add_argument("--conns", default="1,64")
    ap.add_argument("--clock-scale", type=float, default=6.0,
                    help="the key table's clock speed-up in the accuracy part")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--accuracy-tokens", default="100,300",
                    help="completion tokens per answer (and max_tokens) of each accuracy run: "
                         "100 makes rpm the binding limit, 300 tpm")
    ap.add_argument("--ledger-sync", type=float, default=2.0,
                    help="the two-node part's --ledger-sync, seconds")
    ap.add_argument("--two-node-tokens", default="100,300",
                    help="completion tokens per answer of each two-node run (as --accuracy-tokens)")
    ap.add_argument("--sync-rows", type=int, default=1_000_000,
                    help="ledger rows of the sync-query part")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "load_before": os.getloadavg(), "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if "micro" in parts:
            res["micro"] = micro()
            print(f"micro: {json.dumps({k: round(v['median_us'], 2) for k, v in res['micro'].items()})}"
                  " us", file=sys.stderr)
        if "latency" in parts:
            res["latency"] = latency(tmp, args.rounds, args.seconds,
                                     [int(c) for c in args.conns.split(",")])
        if "accuracy" in parts:
            res["accuracy"] = [accuracy(tmp, args.clock_scale, args.windows, int(n))
                               for n in args.accuracy_tokens.split(",")]
        if "sync-query" in parts:
            res["sync_query"] = sync_query(tmp, args.sync_rows)
        if "two-node" in parts:
            res["two_node"] = [accuracy(tmp, 1.0, args.windows, int(n), nodes=2,
                                        sync_s=args.ledger_sync)
                               for n in args.two_node_tokens.split(",")]
    res["load_after"] = os.getloadavg()
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

