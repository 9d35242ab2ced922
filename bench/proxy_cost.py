"""The proxy's own cost per request: ggmux next to nginx, in front of one instance.

``compare.py`` measures whole targets with a Python load generator, which
takes a core of its own on a small machine. This harness isolates the
proxy: one fake instance (``python -m ggmux.instance --fake``: an instant
one-token chat answer, no model) serves ``direct``; nginx and ggmux both
proxy to that same process; ``wrk`` (C, one thread) drives the load. For
every target it reports, per workload and connection count:

* requests/s and wrk's latency percentiles (p50, p99);
* CPU microseconds per request of the proxy processes (ggmux's proxies,
  nginx's workers; from ``/proc/PID/stat``, user + system, so the kernel's
  share of socket work and wake-ups counts) and of the instance.

Workloads: ``GET /health`` of the instance (ggmux:
``/upstream/m/health``), the cheapest request a proxy can forward, and a
``POST /v1/chat/completions`` with ``max_tokens=1`` (ggmux routes it by
the body's ``model``). Rounds alternate the targets (direct, nginx, ggmux,
direct, ...) so drift of the machine lands on all of them.

Needs ``wrk`` and ``nginx`` on PATH (``apt-get install wrk nginx``); a
missing nginx drops that target. Usage, from the repository root::

    python -m bench.proxy_cost                      # 3 rounds, 1/16/64 conns
    python -m bench.proxy_cost --rounds 5 --duration 5 --out bench/out/proxy_cost.json
    python -m bench.proxy_cost --proxies 2          # ggmux proxies = nginx workers
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from ggmux.proxy.auth import secret_text
from ggmux.shm import layout as L
from ggmux.shm.segment import Segment, segment_name

from .compare import NGINX_CONF

CHAT_BODY = '{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
WRK_POST = f"""wrk.method = "POST"
wrk.body = '{CHAT_BODY}'
wrk.headers["Content-Type"] = "application/json"
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (children not included)."""
    tck = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / tck


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split()]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def is_child(cmd: str, kind: str) -> bool:
    """Whether command line ``cmd`` is a ggmux child of ``kind`` (``proxy``,
    ``instance``): ``python -m ggmux.KIND ...`` or its title ``ggmux: KIND ...``."""
    return f"ggmux.{kind}" in cmd or cmd.startswith(f"ggmux: {kind}")


def wait_http(url: str, deadline_s: float = 60.0, data: bytes | None = None) -> None:
    """Until ``url`` answers 200, or raise after ``deadline_s`` seconds."""
    end = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < end:
        try:
            req = urllib.request.Request(url, data=data,
                                         headers={"content-type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except Exception as e:  # noqa: BLE001 - not up yet
            last = e
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not answer within {deadline_s:g} s: {last}")


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    if m is None:
        raise ValueError(f"wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def run_wrk(url: str, conns: int, duration: float, script: Path | None) -> dict:
    """One wrk run; requests/s, p50/p99 (ms), request and error counts."""
    cmd = ["wrk", "-t1", f"-c{conns}", f"-d{duration:g}s", "--latency"]
    if script is not None:
        cmd += ["-s", str(script)]
    out = subprocess.run([*cmd, url], capture_output=True, text=True, check=True).stdout
    pct = dict(re.findall(r"^\s+(\d+)%\s+(\S+)$", out, re.MULTILINE))
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock = re.search(r"Socket errors: (.*)$", out, re.MULTILINE)
    return {
        "requests": int(re.search(r"(\d+) requests in", out).group(1)),
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": _ms(pct["50"]),
        "p99_ms": _ms(pct["99"]),
        "non2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": sock.group(1) if sock else "",
    }


class Targets:
    """The fake instance, ggmux over it, nginx over the same instance."""

    def __init__(self, tmp: Path, proxies: int, python: str) -> None:
        self.tmp = tmp
        self.proxies = proxies
        self.python = python
        self.procs: list[subprocess.Popen] = []

    def start(self) -> None:
        tmp, proxies, python = self.tmp, self.proxies, self.python
        (tmp / "m.json").write_text('{"ttft_s":0,"token_s":0,"tokens":1,"load_s":0}')
        (tmp / "post.lua").write_text(WRK_POST)
        self.post_script = tmp / "post.lua"
        port = free_port()
        with open(tmp / "ggmux.log", "w") as log:
            sup = self._spawn(
                [python, "-m", "ggmux.supervisor", "serve", "--fake-models-dir", str(tmp),
                 "--no-hf-cache", "--host", "127.0.0.1", "--port", str(port),
                 "--proxies", str(proxies), "--spares", "0", "--models-max", "1"],
                stdout=log, stderr=subprocess.STDOUT,
            )
        self.ggmux = f"http://127.0.0.1:{port}"
        wait_http(self.ggmux + "/v1/chat/completions", 60, CHAT_BODY.encode())
        kids = children(sup.pid)
        # by module, or by the process title a child sets (``ggmux: proxy 0 :PORT``)
        self.ggmux_pids = [p for p in kids if is_child(cmdline(p), "proxy")]
        inst = [p for p in kids if is_child(cmdline(p), "instance")]
        if len(inst) != 1:
            raise RuntimeError(f"expected one instance under the supervisor, found {inst}")
        self.instance_pids = inst
        m = re.search(r"port (\d+)\)", (tmp / "ggmux.log").read_text())
        self.direct = f"http://127.0.0.1:{m.group(1)}"
        # the instance takes only its secret (what ggmux's proxies send): direct
        # requests and nginx send it too, so all three do the same work
        seg = Segment.attach(segment_name(port))
        try:
            row = seg.replicas[seg.replicas[:, L.R_PORT] == int(m.group(1))][0]
            secret = secret_text(int(row[L.R_SECRET_HI]), int(row[L.R_SECRET_LO]))
        finally:
            seg.close()
        (tmp / "post-direct.lua").write_text(
            WRK_POST + f'wrk.headers["Authorization"] = "Bearer {secret}"\n')
        self.direct_post_script = tmp / "post-direct.lua"
        self.nginx: str | None = None
        self.nginx_pids: list[int] = []
        nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists()
                                          else None)
        if nginx:
            nport = free_port()
            nd = tmp / "nginx"
            nd.mkdir()
            conf = nd / "nginx.conf"
            conf.write_text(NGINX_CONF.format(
                user="user root;\n" if os.geteuid() == 0 else "", workers=proxies, tmp=nd,
                upstream=m.group(1), port=nport).replace(
                    'proxy_set_header Connection "";',
                    f'proxy_set_header Connection "";\n'
                    f'            proxy_set_header Authorization "Bearer {secret}";'))
            master = self._spawn([nginx, "-p", str(nd), "-c", str(conf), "-g", "daemon off;"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            self.nginx = f"http://127.0.0.1:{nport}"
            wait_http(self.nginx + "/health", 20)
            self.nginx_pids = children(master.pid)

    def _spawn(self, cmd: list[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(cmd, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def table(self) -> list[tuple[str, str, list[int]]]:
        """(name, base URL, proxy pids) per target; direct has no proxy."""
        out = [("direct", self.direct, [])]
        if self.nginx:
            out.append(("nginx", self.nginx, self.nginx_pids))
        out.append(("ggmux", self.ggmux, self.ggmux_pids))
        return out


WORKLOADS = {
    # name: (direct path, proxied path for ggmux, POST?)
    "GET /health": ("/health", "/upstream/m/health", False),
    "POST chat max_tokens=1": ("/v1/chat/completions", "/v1/chat/completions", True),
}


def measure(t: Targets, rounds: int, duration: float, conns: list[int]) -> dict:
    results: dict = {}
    for wl, (dpath, gpath, post) in WORKLOADS.items():
        for c in conns:
            key = f"{wl}, {c} conn" + ("s" if c > 1 else "")
            results[key] = {}
            for r in range(rounds):
                for name, base, pids in t.table():
                    path = gpath if name == "ggmux" else dpath
                    c0 = cpu_seconds(pids), cpu_seconds(t.instance_pids)
                    script = (t.post_script if name == "ggmux" else t.direct_post_script)
                    w = run_wrk(base + path, c, duration, script if post else None)
                    c1 = cpu_seconds(pids), cpu_seconds(t.instance_pids)
                    n = max(w["requests"], 1)
                    w["proxy_cpu_us"] = (c1[0] - c0[0]) / n * 1e6
                    w["instance_cpu_us"] = (c1[1] - c0[1]) / n * 1e6
                    results[key].setdefault(name, []).append(w)
                    print(f"{key:34s} round {r + 1} {name:7s} {w['rps']:9.0f} req/s  "
                          f"p50 {w['p50_ms']:.3f} ms  proxy {w['proxy_cpu_us']:6.1f} us/req"
                          + (f"  NON-2XX {w['non2xx']}" if w["non2xx"] else ""),
                          file=sys.stderr)
    return results


def report(results: dict, meta: dict) -> str:
    """Markdown: best round of req/s and p50, median of the CPU figures."""
    title = (f"`{meta['command']}` ({meta['date']}, {meta['cpus']} CPUs, "
             f"{meta['proxies']} ggmux proxies / nginx workers, {meta['rounds']} rounds of "
             f"{meta['duration']:g} s, load {meta['load_before']:.2f} -> "
             f"{meta['load_after']:.2f})")
    lines = [title, "",
             ("| workload | target | req/s (x direct) | p50 ms (added) | p99 ms "
             "| proxy CPU us/req | instance CPU us/req |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, per in results.items():
        d = per["direct"]
        d_rps = max(w["rps"] for w in d)
        d_p50 = min(w["p50_ms"] for w in d)
        for name, runs in per.items():
            rps = max(w["rps"] for w in runs)
            p50 = min(w["p50_ms"] for w in runs)
            p99 = statistics.median(w["p99_ms"] for w in runs)
            pc = statistics.median(w["proxy_cpu_us"] for w in runs)
            ic = statistics.median(w["instance_cpu_us"] for w in runs)
            bad = sum(w["non2xx"] for w in runs)
            lines.append(
                f"| {key} | {name} | {rps:.0f} ({rps / d_rps:.2f}x) | {p50:.3f} "
                f"({p50 - d_p50:+.3f}) | {p99:.3f} | {pc:.1f} | {ic:.1f} |"
                + (f" {bad} non-2xx" if bad else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    ap.add_argument("--conns", default="1,16,64", help="comma-separated connection counts")
    ap.add_argument("--proxies", type=int, default=1,
                    help="ggmux proxy processes, and nginx worker processes (default 1)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    conns = [int(c) for c in args.conns.split(",")]
    meta = {
        "command": "python -m bench.proxy_cost " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(), "proxies": args.proxies, "rounds": args.rounds,
        "duration": args.duration, "load_before": os.getloadavg()[0],
    }
    with tempfile.TemporaryDirectory(prefix="ggmux-proxy-cost-") as d:
        t = Targets(Path(d), args.proxies, sys.executable)
        try:
            t.start()
            results = measure(t, args.rounds, args.duration, conns)
        finally:
            t.close()
    meta["load_after"] = os.getloadavg()[0]
    text = report(results, meta)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
