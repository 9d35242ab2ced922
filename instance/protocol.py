"""The instance side of the supervisor <-> instance protocol (DESIGN.md).

* stdout carries only ``state:{json}`` lines (``loading``, ``ready``,
  ``sleeping``, ``measured``, ``error``) - :func:`emit`. Everything else that
  would reach fd 1 (a stray ``print``, C libraries) is sent to stderr by
  :func:`claim_stdout`, so a state line can never be interleaved.
* stdin carries command lines (``exit``; more later). :func:`watch_stdin`
  reads them on its own thread from the start, so ``exit`` works during a
  load (which holds the GIL in C for long stretches only between Python
  calls), and stdin EOF ends the process at once: a supervisor that died,
  even by SIGKILL, never leaves an instance holding memory.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

import orjson

_state_fd: int | None = None
_lock = threading.Lock()


def claim_stdout() -> None:
    """Keep a private copy of fd 1 for state lines and point fd 1 at stderr."""
    global _state_fd
    if _state_fd is not None:
        return
    _state_fd = os.dup(1)
    os.set_inheritable(_state_fd, False)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def emit(state: str, **payload) -> None:
    """Write one ``state:{json}`` line (``{"state": state, **payload}``)."""
    line = b"state:" + orjson.dumps({"state": state, **payload}) + b"\n"
    fd = _state_fd if _state_fd is not None else 1
    with _lock:
        os.write(fd, line)


LOAD_PROGRESS_S = 0.2
"""Least time between two ``loading`` lines of a load's progress (the first
and the last always go): llama-server's router throttles its own so."""


class LoadProgress:
    """A load-progress callback (``0.0`` .. ``1.0``) that emits
    ``state:{"state": "loading", "progress": p}`` lines, at most one per
    :data:`LOAD_PROGRESS_S` but for the first and the last, as llama-server
    reports a model load to its router (``load_progress_callback`` in
    ``tools/server/server-context.cpp``). The supervisor publishes it as the
    model's ``status.progress`` (issue 22: it showed 0% until ready)."""

    def __init__(self, emit_line: Callable[..., None] | None = None) -> None:
        self.emit = emit_line or emit
        self.last = 0.0

    def __call__(self, progress: float) -> None:
        now = time.monotonic()
        done = progress >= 1.0
        if self.last and not done and now - self.last < LOAD_PROGRESS_S:
            return
        self.last = now
        self.emit("loading", progress=round(min(1.0, max(0.0, progress)), 3))


def watch_stdin(on_command: Callable[[str], None]) -> threading.Thread:
    """Start the daemon thread that reads command lines from stdin.

    ``on_command(line)`` runs on that thread for each line. On EOF the
    process ends at once with ``os._exit(0)`` (the supervisor is gone).
    """

    def run() -> None:
        fd = sys.stdin.fileno()
        buf = b""
        while True:
            try:
                chunk = os.read(fd, 4096)
            except InterruptedError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                os._exit(0)
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                text = line.decode("utf-8", "replace").strip()
                if text:
                    on_command(text)

    t = threading.Thread(target=run, name="stdin", daemon=True)
    t.start()
    return t


def rss_bytes() -> int:
    """Resident set size of this process, bytes (from /proc/self/statm)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
