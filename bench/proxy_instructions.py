"""Instructions per forwarded request: the proxy under callgrind, pure Python
against the compiled build.

``proxy_cost.py`` measures time, which on a small shared VM spreads by 10-20%
from run to run: more than the difference between the two builds. This
harness counts instructions instead (valgrind's callgrind: the same count
for the same binary and input, whatever else the machine does). It starts
one ggmux server (a fake ``cmd`` instance, as ``proxy_cost.py``), then for
each build one more proxy process under callgrind, attached to that
server's segment and queue but listening on a port of its own; it sends
``--warmup`` requests on one keep-alive connection, zeroes the counters
(``callgrind_control -z``), sends ``--requests`` more, and dumps
(``callgrind_control -d``): the dump holds exactly those requests (with the
event loop's idle turns between them). Reports instructions per request
(user space: the interpreter, the compiled modules, uvloop, httptools,
libc; the kernel is not counted) per workload and build, and the top
functions of each dump (``callgrind_annotate``).

Needs valgrind (``apt-get install valgrind``; ``nginx`` for ``--builds
...,nginx``). Usage, from the repository root (a few minutes: the proxy
starts 50x slower under callgrind)::

    python -m bench.proxy_instructions
    python -m bench.proxy_instructions --requests 2000 --top 25
    python -m bench.proxy_instructions --builds compiled,nginx
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .compare_targets import NGINX_CONF
from .proxy_cost import CHAT_BODY, FAKE_CMD, free_port, wait_http

WORKLOADS = {
    "GET /health": b"GET /upstream/m/health HTTP/1.1\r\nhost: x\r\n\r\n",
    "POST chat 1 KiB": (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                        b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                        % (len(CHAT_BODY), CHAT_BODY.encode())),
}


def send(port: int, request: bytes, n: int) -> None:
    """``n`` requests one after another on one keep-alive connection, each
    answer read whole (by its content-length) before the next goes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        for _ in range(n):
            s.sendall(request)
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += s.recv(65536)
            head, _, body = buf.partition(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                raise RuntimeError(f"answer: {head[:200]!r}")
            length = int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE).group(1))
            while len(body) < length:
                body += s.recv(65536)


def totals(dump: Path) -> dict[str, int]:
    """The event totals of one callgrind dump (``Ir``, and the cache
    simulation's ``I1mr`` ... when it ran)."""
    events: list[str] = []
    for line in dump.read_text().splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith(("summary:", "totals:")):
            return dict(zip(events, (int(v) for v in line.split()[1:])))
    raise RuntimeError(f"no total in {dump}")


def nginx_measure(instance_port: str, args, tmp: Path) -> dict[str, tuple]:
    """The same counts for one nginx worker in front of the same instance
    (``master_process off``: the process callgrind runs is the worker),
    with ``bench/compare.py``'s configuration: the floor a proxy in C pays
    per request for the same framing and relaying."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    nd = tmp / "nginx"
    nd.mkdir()
    port = free_port()
    conf = nd / "nginx.conf"
    conf.write_text(NGINX_CONF.format(user="user root;\n" if os.geteuid() == 0 else "",
                                      workers=1, tmp=nd, upstream=instance_port, port=port))
    return _peer([nginx, "-p", str(nd), "-c", str(conf), "-g",
                  "daemon off; master_process off;"], port, tmp / "cg-nginx.out", args, 120)


def floor_measure(instance_port: str, args, tmp: Path) -> dict[str, tuple]:
    """The same counts for :mod:`bench.relay_floor` in front of the same
    instance: a relay on uvloop and httptools with none of ggmux's work."""
    port = free_port()
    return _peer([sys.executable, "-m", "bench.relay_floor", "--port", str(port),
                  "--upstream", instance_port], port, tmp / "cg-floor.out", args, 300)


def _peer(cmd: list[str], port: int, out: Path, args, start_s: float) -> dict[str, tuple]:
    """Every workload's counts for ``cmd`` (a server listening on ``port``,
    forwarding to the instance) run under callgrind into ``out``; the
    workloads' ``/upstream/m/`` is the instance's own path there."""
    proc = subprocess.Popen(
        ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
         *(["--cache-sim=yes"] if args.cache_sim else []), *cmd],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        cwd=Path(__file__).resolve().parents[1])
    results = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/health", start_s)
        for i, (name, request) in enumerate(WORKLOADS.items()):
            request = request.replace(b"/upstream/m/health", b"/health")
            results[name] = _count(proc.pid, port, request, out, i, args)
    finally:
        proc.terminate()
        _wait_or_kill(proc, 60)
    return results


def _wait_or_kill(proc: subprocess.Popen, timeout: float) -> None:
    """Wait ``timeout`` seconds for ``proc`` to exit, then kill it."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _count(pid: int, port: int, request: bytes, out: Path, i: int, args) -> tuple:
    """Warm up, zero, send ``args.requests``, dump: ``(Ir per request, top
    lines, other events per request)`` of dump ``i + 1``."""
    send(port, request, args.warmup)
    subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
    send(port, request, args.requests)
    subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
    dump = Path(f"{out}.{i + 1}")
    deadline = time.monotonic() + 60
    while not dump.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    top = subprocess.run(["callgrind_annotate", "--inclusive=no", "--threshold=100", str(dump)],
                         check=False, capture_output=True, text=True).stdout
    lines = [ln for ln in top.splitlines() if re.match(r"^\s*[\d,]+ \(", ln)
             and "PROGRAM TOTALS" not in ln]
    t = totals(dump)
    return (t["Ir"] / args.requests, "\n".join(lines[: args.top]),
            {k: v / args.requests for k, v in t.items() if k != "Ir"})


def measure(build: str, shm: str, mq: str, args, tmp: Path) -> dict[str, tuple]:
    """Instructions per request of one build's proxy for every workload, and
    the top of each dump's annotation."""
    port = free_port()
    out = tmp / f"cg-{build}.out"
    env = dict(os.environ)
    env.pop("GGMUX_PURE_PYTHON", None)
    if build == "pure":
        env["GGMUX_PURE_PYTHON"] = "1"
    with open(tmp / f"{build}.log", "w") as log:
        proc = subprocess.Popen(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             *(["--cache-sim=yes"] if args.cache_sim else []), sys.executable, "-m",
             "ggmux.proxy", "--index", "0", "--shm", shm, "--mq", mq, "--host", "127.0.0.1",
             "--port", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=log, env=env,
        )
    results = {}
    try:
        wait_http(f"http://127.0.0.1:{port}/upstream/m/health", 600)
        for i, (name, request) in enumerate(WORKLOADS.items()):
            results[name] = _count(proc.pid, port, request, out, i, args)
    finally:
        proc.stdin.close()  # the proxy's parent is gone: it drains and exits
        _wait_or_kill(proc, 120)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=1000, help="requests counted per workload")
    ap.add_argument("--warmup", type=int, default=200, help="requests before counting")
    ap.add_argument("--builds", default="pure,compiled",
                    help="comma-separated: pure, compiled, nginx (one nginx worker in front "
                         "of the same instance), floor (bench/relay_floor.py there)")
    ap.add_argument("--top", type=int, default=15, help="functions shown per dump")
    ap.add_argument("--cache-sim", action="store_true",
                    help="also simulate the caches (callgrind's I1/D1/LL misses per request)")
    ap.add_argument("--keep", action="store_true", help="keep the dumps (their folder is printed)")
    args = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="ggmux-instr-"))
    (tmp / "presets.ini").write_text(f"[m]\ncmd = {FAKE_CMD.format(python=sys.executable)}\n")
    port = free_port()
    with open(tmp / "ggmux.log", "w") as log:
        sup = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--models-preset",
             str(tmp / "presets.ini"), "--no-hf-cache", "--host", "127.0.0.1", "--port",
             str(port), "--proxies", "1", "--spares", "0", "--models-max", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/chat/completions", 60, CHAT_BODY.encode())
        found = re.search(r"starting m in slot \d+ \(pid \d+, port (\d+)\)",
                          (tmp / "ggmux.log").read_text())
        other = {"nginx": nginx_measure, "floor": floor_measure}
        rows = {b: other[b](found.group(1), args, tmp) if b in other else
                measure(b, f"ggmux-{port}", f"/ggmux-{port}-q", args, tmp)
                for b in args.builds.split(",")}
    finally:
        os.killpg(sup.pid, signal.SIGTERM)
        sup.wait(30)
    builds = list(rows)
    print(f"`python -m bench.proxy_instructions --requests {args.requests}` "
          f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, valgrind callgrind, "
          "user-space instructions of one proxy per forwarded request)\n")
    print("| workload | " + " | ".join(builds) + " |")
    print("| --- |" + " --- |" * len(builds))
    for name in WORKLOADS:
        first = rows[builds[0]][name][0]
        cells = [f"{rows[b][name][0]:,.0f} ({rows[b][name][0] / first:.2f}x)" for b in builds]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.cache_sim:
        print("\nSimulated cache misses per request (callgrind's I1/D1/LL model of this CPU):\n")
        for name in WORKLOADS:
            for b in builds:
                print(f"* {name}, {b}: " + ", ".join(
                    f"{k} {v:,.0f}" for k, v in rows[b][name][2].items()))
    for b in builds:
        for name in WORKLOADS:
            print(f"\n{b}, {name}: top functions (self, Ir over {args.requests} requests)\n")
            print(rows[b][name][1])
    if args.keep:
        print(f"\ndumps kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
