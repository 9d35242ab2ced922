"""The child processes of a benchmark harness: :class:`ProcessSet` (every
server a run starts, each in its own process group, stopped however the run
ends: :func:`cleanup_on_exit`), the environment an interpreter imports
ggmux in (:func:`ggmux_env`), and the shared memory a crashed ggmux leaves
(:func:`remove_ggmux_ipc`). Used by :mod:`bench.compare` and the harnesses
built on it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shlex
import signal
import subprocess
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]


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
        return group_cpu_seconds({proc.pid for child, proc in self._procs if child in names})

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


def group_cpu_seconds(groups: set[int],
                      keep: Callable[[int, bytes], bool] | None = None) -> float:
    """User + system CPU seconds used so far by the live processes of the
    process groups ``groups`` (read from /proc; what exited is not counted),
    only those for which ``keep(pid, cmdline)`` is true when it is given."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if int(fields[2]) not in groups:  # pgrp; then utime, stime in ticks
                continue
            if keep is not None:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if not keep(int(entry.name), f.read()):
                        continue
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _interrupt(signum: int, _frame: object) -> None:
    # SIGTERM and SIGHUP end the run the way Ctrl-C does, through the
    # event loop's clean cancellation and every ``finally``.
    raise KeyboardInterrupt(f"signal {signum}")


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
