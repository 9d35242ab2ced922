"""More demand than memory (issue 34): ggmux's new scheduling policy beside
today's and beside llama.cpp's router, side by side in one run.

``python -m bench.contention [--quick] [--kinds fake,real]
[--workloads hog,roundrobin,bursts,agents] [--rounds N]
[--today DIR [--today-ref REV]] [--new DIR] [--new-args ARGS] [--out FILE]``

Peers, in alternating rounds (every workload runs each peer in turn, the
order rotated each round), each on a fresh server per run:

``new``
    ``ggmux serve`` from ``--new`` (default: this checkout), with
    ``--new-args`` (``--quick`` adds ``--max-wait 5 --min-residency 3``
    when that checkout has the options: the default bound, 4 loads and at
    least 30 s, is longer than the quick hog, and the default residency, 3
    loads, longer than that bound on this machine's slow loads).
``today``
    ``ggmux serve`` from ``--today``, a checkout of the policy before issue
    34 (``--today-ref REV`` makes it with ``git worktree add`` when the
    folder is missing). Both ggmux peers run in this interpreter, with
    ``PYTHONPATH`` holding a ``ggmux`` symlink to their checkout (ahead of
    an editable install's finder); the path ``import ggmux`` resolves to
    under that environment is checked and reported. Both run pure Python
    (``GGMUX_PURE_PYTHON=1``: a checkout in /tmp has no compiled hot path,
    and the figures here are seconds, not microseconds).
``llama-router``
    ``llama-server --models-preset`` (router mode; ``bench/llama_server.py``
    finds the binary) on the real-model workloads only.

The workloads (:mod:`bench.contention_load`) run on fake models (``fake``:
``a``, ``b``, ``c``, each loading in ``--fake-load-s``) and on the two demo
models (``real``: smollm2-135m, gemma3-270m; 1 llama.cpp thread each, 4
slots of 2048 tokens). Per run: wait max / p99 per model (the time to the
first token), swaps (completed loads: ggmux's ``/metrics``, llama-server's
"spawning server instance" log lines), requests per minute, output tokens
per second, and the share of wall time spent loading (ggmux's
``ggmux_model_load_seconds_total``; for llama-server the time its
``/v1/models`` said ``loading``, polled every 0.1 s), the engines' seconds per
output token after the first (TPOT: a router that takes CPU from its
instances on 2 cores shows here), the router's own CPU seconds (ggmux's
supervisor and proxies; llama-server's router process), with the 1-minute
load average of the machine at the run's start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server
from bench.contention_load import WORKLOADS, Workload, drive, figures, workloads
from bench.processes import ProcessSet, cleanup_on_exit, group_cpu_seconds, remove_ggmux_ipc
from bench.report import machine_info
from bench.targets import TargetError, demo_model_paths, free_port, http_request, wait_ready

logger = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]
FAKE_MODELS = ["a", "b", "c"]
REAL_CTX = 2048  # tokens per request (ggmux's ctx-size; llama-server's is x slots)
REAL_SLOTS = 4
DEFAULT_BOUND_LOADS, DEFAULT_BOUND_MIN_S = 4, 30.0  # the new policy's default --max-wait
QUICK_NEW_ARGS = "--max-wait 5 --min-residency 3"
SPAWN_LINE = re.compile(rb"spawning server instance with name=")


@dataclass(slots=True)
class Peer:
    """A server under test: ``ggmux`` from ``checkout`` with ``args``, or
    ``llama`` (llama-server's router, ``binary``)."""

    name: str
    kind: str
    checkout: Path | None = None
    binary: Path | None = None
    args: list[str] = field(default_factory=list)
    resolved: str = ""  # where ``import ggmux`` went, and its commit


def ggmux_peer_env(checkout: Path, workdir: Path, name: str) -> dict[str, str]:
    """Environment in which ``python -m ggmux.supervisor`` runs ``checkout``:
    a ``ggmux`` symlink to it first on ``PYTHONPATH``, empty model caches,
    pure Python, no ``GGMUX_*`` option from ours."""
    link = workdir / f"pkgs-{name}" / "ggmux"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists():
        link.symlink_to(checkout.resolve(), target_is_directory=True)
    empty = workdir / "empty-cache"
    empty.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
    env.update(PYTHONPATH=str(link.parent), GGMUX_PURE_PYTHON="1", HF_HUB_CACHE=str(empty),
               HF_HOME=str(empty), LLAMA_CACHE=str(empty))
    return env


def resolve(peer: Peer, workdir: Path) -> str:
    """Where ``import ggmux`` resolves in ``peer``'s environment, with that
    tree's commit; raises ``TargetError`` when it is not ``peer.checkout``
    (an editable install of another checkout would be measured instead)."""
    env = ggmux_peer_env(peer.checkout, workdir, peer.name)
    out = subprocess.run([sys.executable, "-c", ("import os, ggmux; print(os.path.dirname("
                          "os.path.realpath(ggmux.__file__)))")], capture_output=True, text=True,
                         env=env, cwd=workdir, check=False)
    path = out.stdout.strip()
    if out.returncode or Path(path) != peer.checkout.resolve():
        raise TargetError(f"{peer.name}: import ggmux gave {path or out.stderr[-300:]!r}, "
                          f"not {peer.checkout}")
    commit = subprocess.run(["git", "-C", path, "log", "-1", "--format=%h %s"],
                            capture_output=True, text=True, check=False).stdout.strip()
    dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return f"{path} @ {commit[:70]}" + (" (+ uncommitted changes)" if dirty else "")


def has_option(checkout: Path, option: str) -> bool:
    """Whether ``ggmux serve`` of ``checkout`` takes ``option``."""
    return option in (checkout / "supervisor" / "cli.py").read_text()


def write_preset(w: Workload, peer: Peer, workdir: Path, paths: dict[str, Path],
                 fake_load_s: float) -> Path:
    """The preset file of ``w`` for ``peer``: fake models as behaviour files
    (``instance/fake.py``), or the demo models with 4 slots and one thread;
    with ``w.tiers`` ggmux's KV tiers on (RAM and a fresh disk folder)."""
    ini = workdir / f"{w.kind}-{w.name}-{peer.name}.ini"
    sections = []
    for m in w.models:
        keys: dict[str, Any]
        if w.kind == "fake":
            behaviour = {"load_s": fake_load_s, "ttft_s": 0.01, "token_s": 0.05, "tokens": 256,
                         "parallel": REAL_SLOTS, "prefix_cache": True, "prefill_token_s": 0.001}
            path = workdir / f"{m}.json"
            path.write_text(json.dumps(behaviour))
            keys = {"model": path}
        else:
            ctx = REAL_CTX * (REAL_SLOTS if peer.kind == "llama" else 1)
            keys = {"model": paths[m], "ctx-size": ctx, "parallel": REAL_SLOTS, "threads": 1,
                    "threads-batch": 1}
        if w.tiers and peer.kind == "ggmux":
            disk = workdir / f"kv-{peer.name}-{w.kind}-{w.name}"
            shutil.rmtree(disk, ignore_errors=True)
            keys.update({"cache-ram": 512, "cache-disk": disk})
        sections.append(f"[{m}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    head = "version = 1\n\n" if peer.kind == "llama" else ""
    ini.write_text(head + "\n".join(sections))
    return ini


@dataclass(slots=True)
class Running:
    """One started server: its URL, process and log."""

    base_url: str
    proc: subprocess.Popen[bytes]
    log: Path


def start(peer: Peer, w: Workload, procs: ProcessSet, preset: Path, timeout: float) -> Running:
    """Start ``peer`` for ``w``; ready when ``GET /health`` is 200."""
    port = free_port()
    name = f"{peer.name}-{w.kind}-{w.name}"
    if peer.kind == "ggmux":
        cmd = [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(port),
               "--models-preset", str(preset), "--no-hf-cache", "--proxies", "1",
               "--spares", "0", "--models-max", str(w.models_max), *peer.args]
        env = ggmux_peer_env(peer.checkout, procs.workdir, peer.name)
        proc = procs.spawn(name, cmd, env=env, cleanup=lambda: remove_ggmux_ipc(port))
    else:
        empty = procs.workdir / "empty-cache"
        empty.mkdir(exist_ok=True)
        cmd = [str(peer.binary), "--models-preset", str(preset), "--models-max",
               str(w.models_max), "--host", "127.0.0.1", "--port", str(port), *peer.args]
        proc = procs.spawn(name, cmd, env=dict(os.environ, LLAMA_CACHE=str(empty)))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, "/health", proc, timeout)
    except TargetError as exc:
        raise TargetError(f"{name}: {exc}\n{procs.log_tail(name)}") from None
    return Running(base, proc, procs.workdir / f"{name}.log")


class Monitor(threading.Thread):
    """Polls ``GET /v1/models`` every ``interval`` seconds: the seconds any
    model's ``status.value`` said ``loading`` (summed over models)."""

    def __init__(self, base_url: str, interval: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.base_url, self.interval = base_url, interval
        self.loading_s = 0.0
        self.done = threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.done.wait(self.interval):
            try:
                _, doc = http_request(self.base_url, "GET", "/v1/models", timeout=2.0)
            except OSError:
                continue
            now = time.monotonic()
            data = doc.get("data", []) if isinstance(doc, dict) else []
            loading = sum((e.get("status") or {}).get("value") == "loading" for e in data
                          if isinstance(e.get("status"), dict))
            self.loading_s += loading * (now - last)
            last = now


def ggmux_loads(base_url: str) -> tuple[int, float]:
    """Completed loads and seconds spent loading, summed over models, from
    ggmux's ``/metrics``."""
    _, text = http_request(base_url, "GET", "/metrics", timeout=10.0)
    loads = seconds = 0.0
    for line in str(text).splitlines():
        if line.startswith("ggmux_model_loads_total{"):
            loads += float(line.rsplit(" ", 1)[1])
        elif line.startswith("ggmux_model_load_seconds_total{"):
            seconds += float(line.rsplit(" ", 1)[1])
    return int(loads), seconds


def router_cpu_s(proc: subprocess.Popen[bytes]) -> float:
    """CPU seconds (user + system) used so far by the router processes of
    the server ``proc`` leads, not its model instances: ggmux's supervisor
    and proxies (by process title), llama-server's router process itself.
    Read from /proc over ``proc``'s process group; what exited is not
    counted (the supervisor and the proxies live the whole run)."""
    return group_cpu_seconds({proc.pid}, lambda pid, cmd: pid == proc.pid
                             or b"ggmux: proxy" in cmd or b"ggmux: supervisor" in cmd)


def measure(peer: Peer, w: Workload, procs: ProcessSet, preset: Path, seed: int,
            timeout: float) -> dict[str, Any]:
    """One run of ``w`` on a fresh ``peer``: :func:`~bench.contention_load.figures`
    plus the machine's load average at its start and every record."""
    load_1m = os.getloadavg()[0]
    srv = start(peer, w, procs, preset, timeout)
    monitor = Monitor(srv.base_url)
    try:
        log_at = srv.log.stat().st_size
        cpu_at = router_cpu_s(srv.proc)
        monitor.start()
        records, wall = asyncio.run(drive(w, srv.base_url, seed))
        monitor.done.set()
        monitor.join()
        router_cpu = router_cpu_s(srv.proc) - cpu_at
        if peer.kind == "ggmux":
            loads, load_s = ggmux_loads(srv.base_url)
        else:
            with open(srv.log, "rb") as f:
                f.seek(log_at)
                loads = len(SPAWN_LINE.findall(f.read()))
            load_s = monitor.loading_s
    finally:
        monitor.done.set()
        procs.stop(srv.proc, 30.0)
    out = figures(records, wall, loads, load_s)
    out.update(load_1m=round(load_1m, 2), polled_loading_s=round(monitor.loading_s, 2),
               router_cpu_s=round(router_cpu, 2),
               records=[asdict(r) for r in records])
    return out


def bound_s(peer: Peer, load_time: float | None) -> float | None:
    """The wait bound the new policy applies: ``--max-wait`` when given,
    else 4 load times and at least 30 s (its default); None for the other
    peers, which have none."""
    if peer.name != "new":
        return None
    if "--max-wait" in peer.args:
        return float(peer.args[peer.args.index("--max-wait") + 1])
    if load_time is None:
        return None
    return max(DEFAULT_BOUND_LOADS * load_time, DEFAULT_BOUND_MIN_S)


# --------------------------------------------------------------------------
# the run


def run_all(args: argparse.Namespace, peers: list[Peer], procs: ProcessSet) -> dict[str, Any]:
    """Every workload of every kind on every peer, ``args.rounds`` rounds,
    peers alternating; ``{kind: {workload: {peer: [run, ...]}}}``."""
    paths = demo_model_paths() if "real" in args.kinds else {}
    runs: dict[str, Any] = {}
    for r in range(args.rounds):
        for kind in args.kinds:
            names = FAKE_MODELS if kind == "fake" else list(paths)
            for wname, w in workloads(kind, args.quick, names).items():
                if wname not in args.workloads:
                    continue
                order = [p for p in peers if p.kind == "ggmux" or kind == "real"]
                order = order[r % len(order):] + order[: r % len(order)]
                for peer in order:
                    preset = write_preset(w, peer, procs.workdir, paths, args.fake_load_s)
                    logger.info("round %d: %s %s on %s", r + 1, kind, wname, peer.name)
                    try:
                        got = measure(peer, w, procs, preset, args.seed + r, args.start_timeout)
                    except TargetError as exc:
                        got = {"error": str(exc)[-800:]}
                    got["round"] = r + 1
                    runs.setdefault(kind, {}).setdefault(wname, {}).setdefault(
                        peer.name, []).append(got)
                    logger.info("  %s", one_line(got))
    return runs


def one_line(run: dict[str, Any]) -> str:
    """A run's figures in one line (progress log)."""
    if "error" in run:
        return f"error: {run['error'][:200]}"
    return (f"wait max {_s(run['wait_max'])} s, swaps {run['swaps']}, "
            f"{_f(run['req_per_min'])} req/min, {_f(run['tok_s'])} tok/s, loading "
            f"{_pct(run['load_share'])}, failed {run['failed']}, {_t(run['tpot'])} s/token, "
            f"router CPU {_f(run['router_cpu_s'])} s, load {run['load_1m']}")


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _t(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f}"


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summary(runs: dict[str, Any], peers: list[Peer]) -> dict[str, Any]:
    """Per kind, workload and peer: the median over rounds of each figure
    (the max over rounds for the waits), and the targets' verdicts."""
    by_name = {p.name: p for p in peers}
    out: dict[str, Any] = {}
    for kind, per_w in runs.items():
        for wname, per_peer in per_w.items():
            rows = {}
            for pname, rs in per_peer.items():
                ok = [r for r in rs if "error" not in r]
                if not ok:
                    rows[pname] = {"error": rs[-1].get("error")}
                    continue
                models = sorted({m for r in ok for m in r["per_model"]})
                swaps = _median([r["swaps"] for r in ok])
                load_s = _median([r["load_s"] for r in ok])
                load_time = load_s / swaps if load_s is not None and swaps else None
                rows[pname] = {
                    "rounds": len(ok),
                    "wait_max": {m: max((r["per_model"][m]["max"] or 0) for r in ok
                                        if m in r["per_model"]) for m in models},
                    "wait_p99": {m: _median([r["per_model"].get(m, {}).get("p99") for r in ok])
                                 for m in models},
                    "swaps": swaps, "req_per_min": _median([r["req_per_min"] for r in ok]),
                    "tok_s": _median([r["tok_s"] for r in ok]),
                    "load_share": _median([r["load_share"] for r in ok]),
                    "failed": sum(r["failed"] for r in ok), "load_time": load_time,
                    "tpot": _median([r.get("tpot") for r in ok]),
                    "router_cpu_s": _median([r.get("router_cpu_s") for r in ok]),
                    "load_1m": [r["load_1m"] for r in ok],
                    "bound": bound_s(by_name[pname], load_time) if pname in by_name else None,
                }
            out.setdefault(kind, {})[wname] = {"rows": rows, "targets": targets(wname, rows)}
    return out


def targets(wname: str, rows: dict[str, Any]) -> list[str]:
    """The issue's targets for the new policy on one workload, each met or
    not with its figure."""
    new = rows.get("new")
    if not new or "error" in new:
        return []
    said = []
    if new["bound"] is not None and new["load_time"] is not None:
        limit = new["bound"] + new["load_time"]
        worst = max(new["wait_max"].values(), default=0.0)
        said.append(f"max wait {worst:.1f} s {'<=' if worst <= limit else '>'} bound "
                    f"{new['bound']:.0f} s + one load {new['load_time']:.1f} s: "
                    f"{'met' if worst <= limit else 'NOT met'}")
    if wname in ("bursts", "roundrobin"):
        for other in ("today", "llama-router"):
            o = rows.get(other)
            if not o or "error" in o or not new["swaps"] or o["swaps"] is None:
                continue
            fewer = o["swaps"] / new["swaps"]
            good = (new["req_per_min"] or 0) >= 0.95 * (o["req_per_min"] or 0)
            said.append(f"swaps {fewer:.1f}x fewer than {other} (target 2x), goodput "
                        f"{new['req_per_min']:.1f} vs {o['req_per_min']:.1f} req/min: "
                        f"{'met' if fewer >= 2 and good else 'NOT met'}")
        if new["load_share"] is not None:
            said.append(f"loading {100 * new['load_share']:.0f}% of wall time (target <= 25%): "
                        f"{'met' if new['load_share'] <= 0.25 else 'NOT met'}")
    return said


def format_report(report: dict[str, Any]) -> str:
    """Markdown tables, one per kind and workload, and the targets."""
    lines = []
    for kind, per_w in report["summary"].items():
        for wname, s in per_w.items():
            lines += [f"\n**{kind} / {wname}**\n",
                      ("| peer | wait max per model (s) | wait p99 (s) | swaps | req/min | tok/s "
                      "| loading | failed | s/token | router CPU s | load 1m |"),
                      "|" + " --- |" * 11]
            for pname, row in s["rows"].items():
                if "error" in row:
                    lines.append(f"| {pname} | error: {str(row['error'])[:80]} |" + " |" * 9)
                    continue
                lines.append(
                    f"| {pname} | {' / '.join(f'{m} {_s(v)}' for m, v in row['wait_max'].items())}"
                    f" | {' / '.join(_s(v) for v in row['wait_p99'].values())} | {_f(row['swaps'])}"
                    f" | {_f(row['req_per_min'])} | {_f(row['tok_s'])} | {_pct(row['load_share'])}"
                    f" | {row['failed']} | {_t(row.get('tpot'))} | {_f(row.get('router_cpu_s'))}"
                    f" | {', '.join(f'{x:.1f}' for x in row['load_1m'])} |")
            lines += [f"* {t}" for t in s["targets"]]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.contention",
                                description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="fake models only unless --kinds says more, short workloads, 1 round")
    p.add_argument("--kinds", help="fake, real or both (default: fake with --quick, else both)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--rounds", type=int, help="rounds (default: 1 with --quick, else 2)")
    p.add_argument("--new", type=Path, default=REPO, help="checkout of the new policy")
    p.add_argument("--new-args", default=None,
                   help=f"extra serve options of the new peer (--quick: {QUICK_NEW_ARGS!r} "
                        "when the checkout has --max-wait)")
    p.add_argument("--today", type=Path, help="checkout of today's policy (peer left out if not)")
    p.add_argument("--today-ref", help="git worktree add --detach TODAY REF when TODAY is missing")
    p.add_argument("--no-llama-router", action="store_true")
    p.add_argument("--llama-server", help="llama-server binary (default: bench/llama_server.py's)")
    p.add_argument("--fake-load-s", type=float, default=1.0, help="a fake model's load time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--start-timeout", type=float, default=180.0)
    p.add_argument("--out", type=Path, help="write every run and record as JSON here")
    p.add_argument("--report", type=Path, metavar="JSON", help="print a saved --out and exit")
    p.add_argument("--keep-logs", action="store_true")
    return p


def make_peers(args: argparse.Namespace) -> tuple[list[Peer], dict[str, str]]:
    """The peers this run can start, and why the others are left out."""
    skipped: dict[str, str] = {}
    new_args = args.new_args
    if new_args is None:
        new_args = QUICK_NEW_ARGS if args.quick and has_option(args.new, "--max-wait") else ""
    peers = [Peer("new", "ggmux", checkout=args.new, args=shlex.split(new_args))]
    if args.today:
        if not args.today.exists() and args.today_ref:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach",
                            str(args.today), args.today_ref], check=True)
        peers.append(Peer("today", "ggmux", checkout=args.today))
    else:
        skipped["today"] = "no --today checkout given"
    binary = llama_server.find(args.llama_server)
    if "real" not in args.kinds or args.no_llama_router:
        skipped["llama-router"] = "not asked (real-model workloads only)"
    elif binary is None:
        skipped["llama-router"] = llama_server.HOW_TO_GET
    else:
        peers.append(Peer("llama-router", "llama", binary=binary))
    return peers, skipped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.report:
        print(format_report(json.loads(args.report.read_text())))
        return 0
    args.kinds = (args.kinds or ("fake" if args.quick else "fake,real")).split(",")
    args.workloads = args.workloads.split(",")
    args.rounds = args.rounds or (1 if args.quick else 2)
    peers, skipped = make_peers(args)
    workdir = Path(tempfile.mkdtemp(prefix="contention-"))
    procs = ProcessSet(workdir)
    report: dict[str, Any] = {
        "command": shlex.join(["python -m bench.contention", *(argv or sys.argv[1:])]),
        "machine": machine_info(), "skipped": skipped}
    started = time.time()
    try:
        with cleanup_on_exit(procs):
            for p in peers:
                if p.kind == "ggmux":
                    p.resolved = resolve(p, workdir)
                else:
                    p.resolved = f"{p.binary} ({llama_server.version(p.binary)})"
                logger.info("peer %s: %s %s", p.name, p.resolved, shlex.join(p.args))
            runs = run_all(args, peers, procs)
    except KeyboardInterrupt:
        print("interrupted; every server was stopped", file=sys.stderr)
        return 130
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep_logs:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report.update(peers=[{"name": p.name, "code": p.resolved, "args": p.args} for p in peers],
                  seconds=round(time.time() - started), load_after=os.getloadavg()[0],
                  runs=runs, summary=summary(runs, peers))
    print(format_report(report))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
