"""Loads against serving replicas (issue 31, item 11): latency of 1-token
requests to a loaded model (the demo smollm2-135m) alone, and while another
model (the demo gemma3-270m) loads, unloads and loads again, with loads at
the serving priority (``--load-nice 0``, as before the fix) and lowered
(``--load-nice 10``, the default after it), in one run.

``python -m bench.load_isolation [--rounds 2] [--requests 40] [--loads 3] [--out FILE]``

Each round starts one ``ggmux serve`` per setting in turn (the order
alternates between rounds; nothing else of ggmux runs meanwhile), loads
smollm2, then measures:

* ``alone``: ``--requests`` sequential 1-token chat requests to smollm2;
* ``loads``: sequential 1-token requests to smollm2 while a second client
  loads gemma3 (``POST /models/load``), waits until it is loaded, unloads
  it and waits until it is gone, ``--loads`` times (the spare instance the
  server starts again after a load runs meanwhile too: it is load work).

Each request's latency is the client's (request sent to answer read). The
figures: p50, p99 and max per case and setting, and the ratio of
``loads`` to ``alone`` (the issue asks for at most 3x), over all rounds
and per round (each round's own ``alone`` p50 as the pace: on a shared
machine the pace itself moves between rounds).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prefix_routing import end_process, free_port

SERVING, LOADING = "smollm2-135m", "gemma3-270m"
SETTINGS = {"before": "0", "after": "10"}  # --load-nice


def call(port: int, method: str, path: str, body: dict | None = None,
         timeout: float = 300.0) -> tuple[float, dict]:
    """Seconds to the whole answer, and the answer's JSON."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method,
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        doc = json.loads(r.read() or b"{}")
    return time.perf_counter() - t0, doc


def one_token(port: int) -> float:
    """Seconds of one 1-token chat request to the serving model."""
    dt, doc = call(port, "POST", "/v1/chat/completions", {
        "model": SERVING, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hi."}]})
    if not doc.get("choices"):
        raise RuntimeError(f"no answer: {doc}")
    return dt


def status(port: int, model: str) -> str:
    _, doc = call(port, "GET", "/v1/models", timeout=30)
    for m in doc["data"]:
        if m["id"] == model:
            return m["status"]["value"]
    raise RuntimeError(f"{model} is not listed")


def wait_status(port: int, model: str, want: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while status(port, model) != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{model} not {want} after {timeout} s")
        time.sleep(0.05)


class Server:
    """One ``ggmux serve`` with ``--load-nice nice`` and the demo models."""

    def __init__(self, nice: str, workdir: Path, threads: int | None) -> None:
        self.port = free_port()
        self.log = open(workdir / f"serve-nice{nice}.log", "ab")  # noqa: SIM115 - its life
        argv = [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(self.port),
                "--proxies", "1", "--models-max", "2", "--load-nice", nice]
        if threads:
            argv += ["--threads", str(threads)]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self, timeout: float = 300.0) -> None:
        """Up, with the serving model loaded and answering."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited (see {self.log.name})")
            try:
                one_token(self.port)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("the server did not get ready")

    def stop(self) -> None:
        end_process(self.proc)
        self.log.close()


def tree_ticks(root: int) -> int:
    """CPU clock ticks (user + system) used so far by ``root``'s
    descendants (the proxies, instances and spares of a server)."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                data = f.read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2:].split()
        parents[int(entry)] = int(fields[1])
        ticks[int(entry)] = int(fields[11]) + int(fields[12])
    total = 0
    for pid, t in ticks.items():
        p = pid
        while p in parents and p != root:
            p = parents[p]
        if p == root and pid != root:
            total += t
    return total


def settle(server: Server, quiet_after: float = 4.0, timeout: float = 60.0) -> None:
    """Let the start's own work finish before the ``alone`` case: wait
    ``quiet_after`` s (the spare starts ``--spare-delay`` 3 s after a
    load), then until the server's children use under 5% of a core."""
    time.sleep(quiet_after)
    hz = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        a = tree_ticks(server.proc.pid)
        time.sleep(1.0)
        if tree_ticks(server.proc.pid) - a < 0.05 * hz:
            return


def measure(server: Server, requests: int, loads: int) -> dict[str, list[float]]:
    """``{"alone": [s, ...], "loads": [s, ...], "load_s": [s, ...]}``."""
    alone = [one_token(server.port) for _ in range(requests)]
    done = threading.Event()
    load_s: list[float] = []
    errors: list[BaseException] = []

    def cycle() -> None:
        try:
            for _ in range(loads):
                t0 = time.perf_counter()
                call(server.port, "POST", "/models/load", {"model": LOADING})
                wait_status(server.port, LOADING, "loaded")
                load_s.append(time.perf_counter() - t0)
                call(server.port, "POST", "/models/unload", {"model": LOADING})
                wait_status(server.port, LOADING, "unloaded")
        except BaseException as e:  # noqa: BLE001 - reported by the measuring thread
            errors.append(e)
        finally:
            done.set()

    during: list[float] = []
    t = threading.Thread(target=cycle, daemon=True)
    t.start()
    while not done.is_set():
        during.append(one_token(server.port))
    t.join()
    if errors:
        raise errors[0]
    return {"alone": alone, "loads": during, "load_s": load_s}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.load_isolation")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--requests", type=int, default=40, help="requests of the alone case")
    ap.add_argument("--loads", type=int, default=3, help="loads of gemma3 per round")
    ap.add_argument("--threads", type=int, default=None,
                    help="--threads of ggmux serve (default: the backend's, every core)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args()
    t0 = time.time()
    load0 = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    runs: dict[str, dict[str, list[float]]] = {
        k: {"alone": [], "loads": [], "load_s": []} for k in SETTINGS}
    # per round: (p50, p90, max) of the requests during loads over the alone p50
    ratios: dict[str, list[tuple[float, float, float]]] = {k: [] for k in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="ggmux-load-isolation-") as tmp:
        for rnd in range(args.rounds):
            order = list(SETTINGS) if rnd % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                server = Server(SETTINGS[name], Path(tmp), args.threads)
                try:
                    server.ready()
                    settle(server)
                    got = measure(server, args.requests, args.loads)
                finally:
                    server.stop()
                for k, v in got.items():
                    runs[name][k] += v
                a50 = statistics.median(got["alone"])
                ratios[name].append((statistics.median(got["loads"]) / a50,
                                     pct(got["loads"], 0.9) / a50, max(got["loads"]) / a50))
                print(f"round {rnd + 1} {name:>6} (--load-nice {SETTINGS[name]}): alone p50 "
                      f"{statistics.median(got['alone']) * 1e3:.0f} ms, during loads p50 "
                      f"{statistics.median(got['loads']) * 1e3:.0f} ms max "
                      f"{max(got['loads']) * 1e3:.0f} ms ({len(got['loads'])} requests), "
                      f"load {statistics.median(got['load_s']):.2f} s", flush=True)
    report = {
        "command": "python -m bench.load_isolation " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "commit": commit,
        "nproc": os.cpu_count(), "load_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "seconds": round(time.time() - t0), "runs": runs, "round_ratios": ratios}
    print(f"\n{report['date']}  {report['nproc']} cores  commit {commit}  load "
          f"{report['load_1m'][0]} -> {report['load_1m'][1]}  ({report['seconds']} s)")
    print(f"{'setting':<22}{'case':<7}{'n':>5}{'p50 ms':>9}{'p99 ms':>9}{'max ms':>9}"
          f"{'p50 x':>8}{'p99 x':>8}{'max x':>8}{'load s':>8}")
    for name, r in runs.items():
        a50, a99, amax = (pct(r["alone"], 0.5), pct(r["alone"], 0.99), max(r["alone"]))
        for case in ("alone", "loads"):
            xs = r[case]
            p50, p99, mx = pct(xs, 0.5), pct(xs, 0.99), max(xs)
            print(f"{name + ' (nice ' + SETTINGS[name] + ')':<22}{case:<7}{len(xs):>5}"
                  f"{p50 * 1e3:>9.1f}{p99 * 1e3:>9.1f}{mx * 1e3:>9.1f}{p50 / a50:>8.2f}"
                  f"{p99 / a99:>8.2f}{mx / amax:>8.2f}"
                  f"{statistics.median(r['load_s']) if case == 'loads' else 0:>8.2f}")
    print("\nduring loads over alone p50, each round side by side (p50 / p90 / max), and the "
          "median of the rounds:")
    for name, rs in ratios.items():
        each = "  ".join(f"{a:.2f}/{b:.2f}/{c:.2f}" for a, b, c in rs)
        med = [statistics.median(x[i] for x in rs) for i in range(3)]
        print(f"{name:<8}{each}   median {med[0]:.2f} / {med[1]:.2f} / {med[2]:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
