"""The proxy's own cost per request: ggmux next to nginx, in front of one instance.

``compare.py`` measures whole targets with a Python load generator, which
takes a core of its own on a small machine. This harness isolates the
proxy: one fake ``cmd`` instance (``bench.fake_openai`` on uvloop, started
by ggmux from a preset's ``cmd``: instant answers, no model) serves
``direct``; nginx and ggmux both proxy to that same process; ``wrk`` (C,
one thread) drives the load. For every target it reports, per workload and
connection count:

* requests/s and wrk's latency percentiles (p50, p99); for the stream,
  SSE events/s counted by :func:`run_streams` (one epoll loop here: wrk
  counts only whole responses);
* CPU microseconds per request (per event for the stream) of the proxy
  processes (ggmux's proxies, nginx's workers; from ``/proc/PID/stat``,
  user + system, so the kernel's share of socket work and wake-ups counts)
  and of the instance.

Workloads: ``GET /health`` of the instance (ggmux:
``/upstream/m/health``), the cheapest request a proxy can forward; a 1 KiB
``POST /v1/chat/completions`` with ``max_tokens=1`` (ggmux routes it by the
body's ``model``); and a streamed chat of :data:`STREAM_EVENTS` SSE events
sent at the instance's full rate (16 and 64 streams at once). Rounds
alternate the targets (direct, nginx, ggmux, direct, ...) so drift of the
machine lands on all of them. ``--builds pure,compiled`` runs two ggmux
servers side by side, one with ``GGMUX_PURE_PYTHON=1`` (``ggmux-pure``) and
one with the compiled hot path (``ggmux``), alternating with the others.

Needs ``wrk`` and ``nginx`` on PATH (``apt-get install wrk nginx-light``); a
missing nginx drops that target. Usage, from the repository root::

    python -m bench.proxy_cost                      # 3 rounds, 1/16/64 conns
    python -m bench.proxy_cost --builds pure,compiled --out bench/out/proxy_cost.json
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

from .compare_targets import NGINX_CONF

# a 1 KiB chat request (the body's length, bytes: 1024)
_PAD = 1024 - len('{"model":"m","messages":[{"role":"user","content":""}],"max_tokens":1}')
CHAT_BODY = ('{"model":"m","messages":[{"role":"user","content":"' + "hi " * (_PAD // 3)
             + "h" * (_PAD % 3) + '"}],"max_tokens":1}')
STREAM_EVENTS = 2000  # content events of one streamed answer (then [DONE])
STREAM_BODY = ('{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
               f'"max_tokens":{STREAM_EVENTS}}}')
FAKE_CMD = ("{python} -m ggmux.bench.fake_openai --port ${{PORT}} --models m --ttft 0 "
            "--token-delay 0 --uvloop")


def wrk_post(body: str, auth: str = "") -> str:
    """A wrk Lua script POSTing ``body`` (JSON) with an optional bearer token."""
    out = f"""wrk.method = "POST"
wrk.body = '{body}'
wrk.headers["Content-Type"] = "application/json"
"""
    return out + (f'wrk.headers["Authorization"] = "Bearer {auth}"\n' if auth else "")


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
        # (wrk leaves out percentiles it has no samples for)
        "p50_ms": _ms(pct["50"]) if "50" in pct else float("nan"),
        "p99_ms": _ms(pct["99"]) if "99" in pct else float("nan"),
        "non2xx": int(errors.group(1)) if errors else 0,
        "socket_errors": sock.group(1) if sock else "",
    }


def run_streams(url: str, conns: int, duration: float, body: bytes) -> dict:
    """``conns`` connections each streaming answers to ``body`` back to back
    for ``duration`` seconds (keep-alive, a new request as one ends), read
    with one ``epoll`` loop in this process; SSE events counted exactly
    (``data: `` lines, partial streams included). wrk counts only whole
    responses, and a 2,000-event stream under load takes seconds.
    Returns events/s, streams completed and non-2xx answers."""
    import select

    host, _, rest = url.removeprefix("http://").partition(":")
    port_s, _, path = rest.partition("/")
    req = (f"POST /{path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
           f"content-length: {len(body)}\r\n\r\n").encode() + body
    ep = select.epoll()
    socks: dict[int, tuple[socket.socket, list]] = {}
    for _ in range(conns):
        s = socket.create_connection((host, int(port_s)))
        s.setblocking(False)
        s.sendall(req)
        socks[s.fileno()] = (s, [b"", True])  # tail of the last read, awaiting a head
        ep.register(s.fileno(), select.EPOLLIN)
    buf = bytearray(1 << 18)
    events = streams = bad = 0
    end = time.monotonic() + duration
    t0 = time.monotonic()
    try:
        while True:
            now = time.monotonic()
            if now >= end:
                break
            for fd, _ in ep.poll(end - now):
                s, st = socks[fd]
                n = s.recv_into(buf)
                if n == 0:
                    raise RuntimeError(f"{url} closed a stream connection")
                data = st[0] + bytes(buf[:n])
                if st[1]:
                    st[1] = False
                    if not data.startswith(b"HTTP/1.1 200"):
                        bad += 1
                events += data.count(b"data: ") - st[0].count(b"data: ")
                if data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk: the next request
                    streams += 1
                    st[0], st[1] = b"", True
                    s.sendall(req)
                else:
                    st[0] = data[-16:]
    finally:
        elapsed = time.monotonic() - t0
        for s, _ in socks.values():
            s.close()
        ep.close()
    return {"events": events, "events_per_s": events / elapsed, "requests": streams,
            "rps": streams / elapsed, "p50_ms": 0.0, "p99_ms": 0.0, "non2xx": bad,
            "socket_errors": ""}


class Targets:
    """The fake ``cmd`` instance, ggmux over it (one server per build, each
    with its own instance; ``direct`` and nginx use the first's), nginx
    over the same instance."""

    def __init__(self, tmp: Path, proxies: int, python: str, builds: list[str]) -> None:
        self.tmp = tmp
        self.proxies = proxies
        self.python = python
        self.builds = builds
        self.procs: list[subprocess.Popen] = []
        self.scripts: dict[tuple[str, str], Path] = {}
        # (name, base URL, proxy pids, instance pids) per ggmux server
        self.ggmux: list[tuple[str, str, list[int], list[int]]] = []

    def _ggmux(self, build: str) -> tuple[str, int, str, int]:
        """Start one ggmux server; (base URL, instance pid, instance port, supervisor pid)."""
        tmp = self.tmp / build
        tmp.mkdir()
        (tmp / "presets.ini").write_text(f"[m]\ncmd = {FAKE_CMD.format(python=self.python)}\n")
        port = free_port()
        env = dict(os.environ)
        env.pop("GGMUX_PURE_PYTHON", None)
        if build == "pure":
            env["GGMUX_PURE_PYTHON"] = "1"
        with open(tmp / "ggmux.log", "w") as log:
            sup = self._spawn(
                [self.python, "-m", "ggmux.supervisor", "serve", "--models-preset",
                 str(tmp / "presets.ini"), "--no-hf-cache", "--host", "127.0.0.1",
                 "--port", str(port), "--proxies", str(self.proxies), "--spares", "0",
                 "--models-max", "1"],
                stdout=log, stderr=subprocess.STDOUT, env=env,
            )
        base = f"http://127.0.0.1:{port}"
        wait_http(base + "/v1/chat/completions", 60, CHAT_BODY.encode())
        text = (tmp / "ggmux.log").read_text()
        m = re.search(r"starting m in slot \d+ \(pid (\d+), port (\d+)\)", text)
        if m is None:
            raise RuntimeError(f"no instance start in {tmp / 'ggmux.log'}")
        line = re.search(r"hot path (compiled|runs pure Python)[^\n]*", text)
        print(f"ggmux ({build}): {line.group(0) if line else 'no hot-path line'}",
              file=sys.stderr)
        return base, int(m.group(1)), m.group(2), sup.pid

    def start(self) -> None:
        tmp = self.tmp
        self.instance_pids: list[int] = []
        iport = ""
        for build in self.builds:
            base, ipid, port, sup = self._ggmux(build)
            name = "ggmux-pure" if build == "pure" else "ggmux"
            # the cmd's process and any under it (a shell's child)
            ipids = [ipid, *children(ipid)]
            self.ggmux.append((name, base, [p for p in children(sup)
                                            if is_child(cmdline(p), "proxy")], ipids))
            if not iport:
                iport, self.instance_pids = port, ipids
        self.direct = f"http://127.0.0.1:{iport}"
        for kind, body in (("chat", CHAT_BODY), ("stream", STREAM_BODY)):
            p = tmp / f"{kind}.lua"
            p.write_text(wrk_post(body))
            self.scripts[kind] = p
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
                user="user root;\n" if os.geteuid() == 0 else "", workers=self.proxies,
                tmp=nd, upstream=iport, port=nport))
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

    def table(self) -> list[tuple[str, str, list[int], list[int]]]:
        """(name, base URL, proxy pids, instance pids) per target; direct has
        no proxy; direct and nginx use the first ggmux server's instance."""
        out = [("direct", self.direct, [], self.instance_pids)]
        if self.nginx:
            out.append(("nginx", self.nginx, self.nginx_pids, self.instance_pids))
        return out + self.ggmux


WORKLOADS = {
    # name: (direct path, ggmux's path, wrk script or None, connection counts or None: all)
    "GET /health": ("/health", "/upstream/m/health", None, None),
    "POST chat 1 KiB": ("/v1/chat/completions", "/v1/chat/completions", "chat", None),
    # read by run_streams (SSE events counted), not wrk
    f"SSE stream {STREAM_EVENTS} events": ("/v1/chat/completions", "/v1/chat/completions",
                                           "stream", (16, 64)),
}


def measure(t: Targets, rounds: int, duration: float, conns: list[int],
            only: list[str] | None = None) -> dict:
    results: dict = {}
    for wl, (dpath, gpath, script, wl_conns) in WORKLOADS.items():
        if only and not any(o in wl for o in only):
            continue
        for c in conns:
            if wl_conns is not None and c not in wl_conns:
                continue
            key = f"{wl}, {c} conn" + ("s" if c > 1 else "")
            results[key] = {}
            for r in range(rounds):
                for name, base, pids, ipids in t.table():
                    path = dpath if name in ("direct", "nginx") else gpath
                    c0 = cpu_seconds(pids), cpu_seconds(ipids)
                    if script == "stream":
                        w = run_streams(base + path, c, duration, STREAM_BODY.encode())
                        n = max(w["events"], 1)
                    else:
                        w = run_wrk(base + path, c, duration,
                                    t.scripts[script] if script else None)
                        n = max(w["requests"], 1)
                        w["events_per_s"] = w["rps"]
                    c1 = cpu_seconds(pids), cpu_seconds(ipids)
                    w["proxy_cpu_us"] = (c1[0] - c0[0]) / n * 1e6
                    w["instance_cpu_us"] = (c1[1] - c0[1]) / n * 1e6
                    results[key].setdefault(name, []).append(w)
                    rate = (f"{w['events_per_s']:9.0f} ev/s" if script == "stream"
                            else f"{w['rps']:9.0f} req/s")
                    print(f"{key:34s} round {r + 1} {name:10s} {rate}  "
                          f"p50 {w['p50_ms']:.3f} ms  proxy {w['proxy_cpu_us']:6.1f} us"
                          + (f"  NON-2XX {w['non2xx']}" if w["non2xx"] else ""),
                          file=sys.stderr)
    return results


def report(results: dict, meta: dict) -> str:
    """Markdown: best round of the rate and p50, median of the CPU figures.
    Stream rows count SSE events (rate per second, CPU per event)."""
    title = (f"`{meta['command']}` ({meta['date']}, {meta['cpus']} CPUs, "
             f"{meta['proxies']} ggmux proxies / nginx workers, {meta['rounds']} rounds of "
             f"{meta['duration']:g} s, load {meta['load_before']:.2f} -> "
             f"{meta['load_after']:.2f})")
    lines = [title, "",
             ("| workload | target | req/s or events/s (x direct) | p50 ms (added) | p99 ms "
              "| proxy CPU us/req or /event | instance CPU us |"),
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, per in results.items():
        rate_of = "events_per_s" if key.startswith("SSE") else "rps"
        d = per["direct"]
        d_rate = max(max(w[rate_of] for w in d), 1e-9)
        d_p50 = min(w["p50_ms"] for w in d)
        for name, runs in per.items():
            rate = max(w[rate_of] for w in runs)
            p50 = min(w["p50_ms"] for w in runs)
            p99 = statistics.median(w["p99_ms"] for w in runs)
            pc = statistics.median(w["proxy_cpu_us"] for w in runs)
            ic = statistics.median(w["instance_cpu_us"] for w in runs)
            bad = sum(w["non2xx"] for w in runs)
            lat = ("- | -" if rate_of == "events_per_s"  # run_streams times no requests
                   else f"{p50:.3f} ({p50 - d_p50:+.3f}) | {p99:.3f}")
            lines.append(
                f"| {key} | {name} | {rate:.0f} ({rate / d_rate:.2f}x) | {lat} "
                f"| {pc:.1f} | {ic:.1f} |"
                + (f" {bad} non-2xx" if bad else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per wrk run")
    ap.add_argument("--conns", default="1,16,64", help="comma-separated connection counts")
    ap.add_argument("--proxies", type=int, default=1,
                    help="ggmux proxy processes, and nginx worker processes (default 1)")
    ap.add_argument("--builds", default="compiled",
                    help="ggmux servers to run side by side: compiled, pure, or both "
                         "(pure: GGMUX_PURE_PYTHON=1)")
    ap.add_argument("--only", default="",
                    help="comma-separated parts of workload names to run (default: all)")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args(argv)
    if shutil.which("wrk") is None:
        print("wrk is not installed (apt-get install wrk)", file=sys.stderr)
        return 2
    conns = [int(c) for c in args.conns.split(",")]
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    if not builds or set(builds) - {"pure", "compiled"}:
        print(f"--builds: pure and/or compiled, not {args.builds!r}", file=sys.stderr)
        return 2
    meta = {
        "command": "python -m bench.proxy_cost " + " ".join(argv if argv is not None
                                                            else sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpus": os.cpu_count(), "proxies": args.proxies, "rounds": args.rounds,
        "duration": args.duration, "load_before": os.getloadavg()[0], "builds": builds,
    }
    with tempfile.TemporaryDirectory(prefix="ggmux-proxy-cost-") as d:
        t = Targets(Path(d), args.proxies, sys.executable, builds)
        try:
            t.start()
            results = measure(t, args.rounds, args.duration, conns,
                              [o for o in args.only.split(",") if o])
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
