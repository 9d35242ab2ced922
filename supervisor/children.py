"""Child processes of the supervisor and their pipes in its poll set.

Every child (proxy, instance, spare, measure child, ``cmd`` command) is
started by :meth:`ChildSet.start`: stdin a pipe (commands; EOF when the
supervisor dies), stdout and usually stderr non-blocking in the one
``select.poll()`` set. stderr lines go to the log under the child's tag,
at the level the line starts with (and, tagged, to the log ring:
:mod:`.logs`);
stdout lines go to the child's ``on_line`` callback, whole lines without
the newline. :func:`state_line` parses the instance line protocol
(``state:{json}``), so any child speaking it (an instance, the cluster
agent) is started, read and stopped the same way: ``start``, lines to
``on_line``, ``send`` a command line or ``close_stdin`` (EOF: exit),
``kill`` to escalate, :meth:`ChildSet.reap` once it exited.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import select
import signal
import socket
import subprocess
from collections.abc import Callable

import orjson

from ..shm.logring import escape_controls
from .logs import child_level

log = logging.getLogger(__name__)

OnLine = Callable[["Child", bytes], None]


class Child:
    """A child process with non-blocking stdout/stderr line buffers.

    ``on_line(child, line)`` receives each stdout line (bytes, no newline);
    ``None`` drops them.
    """

    __slots__ = ("err", "group", "on_line", "out", "proc", "stdin_fd", "tag")

    def __init__(self, proc: subprocess.Popen, tag: str, on_line: OnLine | None = None,
                 group: bool = False) -> None:
        self.proc = proc
        self.tag = tag
        self.on_line = on_line
        self.out = b""
        self.err = b""
        self.stdin_fd = proc.stdin.fileno() if proc.stdin is not None else -1
        # it leads its own process group, and signals go to the whole group
        self.group = group

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, line: bytes) -> bool:
        """Write a command line to the child's stdin without blocking."""
        if self.stdin_fd < 0:
            return False
        try:
            os.write(self.stdin_fd, line)
            return True
        except (BlockingIOError, BrokenPipeError, OSError):
            return False

    def close_stdin(self) -> None:
        """EOF on the child's stdin (an instance or a proxy then exits)."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        self.stdin_fd = -1

    def kill(self, sig: int) -> None:
        """Send ``sig`` (to its whole process group when it leads one); a
        child already gone is no error."""
        if self.group:
            try:
                os.killpg(self.proc.pid, sig)
                return
            except (ProcessLookupError, PermissionError, OSError):
                if self.proc.poll() is not None:
                    return
        try:
            self.proc.send_signal(sig)
        except (ProcessLookupError, OSError):
            pass

    def kill_leftovers(self) -> None:
        """SIGKILL what is left of its process group once it exited (the
        server a wrapper shell started, which outlived the shell: issue 37,
        a ``tests/recorder.py`` left running after the suite)."""
        if self.group:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError, OSError):
                pass


def state_line(child: Child, line: bytes) -> dict | None:
    """The JSON object of a ``state:{...}`` stdout line (the instance line
    protocol), or ``None`` (logged) for a stray or malformed line."""
    if not line.startswith(b"state:"):
        log.warning("[%s] stray stdout: %r", child.tag, line[:200])
        return None
    try:
        return orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        log.warning("[%s] bad state line: %r", child.tag, line[:200])
        return None


class ChildSet:
    """The children's stdout/stderr descriptors in the supervisor's poll set.

    ``poller`` is the loop's ``select.poll()`` object (shared with the
    command queue, the signal pipe and probes).
    """

    def __init__(self, poller: select.poll) -> None:
        self.poller = poller
        self.fds: dict[int, tuple[Child, str]] = {}  # fd -> (child, "out" | "err")

    def start(
        self, argv: list[str], tag: str, *, on_line: OnLine | None = None,
        env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = (),
        log_stderr: bool = True, nice: int = 0, group: bool = False,
    ) -> Child:
        """Start a child: stdin a pipe (commands; EOF when we die), stdout
        (and stderr, unless inherited) in the poll set, PR_SET_PDEATHSIG and
        SIGINT/SIGHUP ignored (:func:`die_with_parent`), its nice value
        raised by ``nice`` before it runs anything (a load's lower priority:
        :mod:`.priority`). Raises ``OSError`` when it cannot be started."""
        proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if log_stderr else None, env=env, pass_fds=pass_fds,
            preexec_fn=_nicer(nice, group),  # noqa: PLW1509 - no threads
        )
        child = Child(proc, tag, on_line, group)
        os.set_blocking(child.stdin_fd, False)
        self._register(child, stdout=True, stderr=log_stderr)
        return child

    def start_with_socket(
        self, argv: list[str], tag: str, *, on_line: OnLine | None = None,
        env: dict[str, str] | None = None, pass_fds: tuple[int, ...] = (), nice: int = 0,
    ) -> tuple[Child, int]:
        """Start an instance-protocol child with a listening socket bound here
        (127.0.0.1, port 0) and passed as ``--fd``, so no other process can
        take its port between bind and listen. ``argv``'s ``--fd`` value is
        replaced by the descriptor; ``pass_fds`` are passed too. Returns
        ``(child, port)``; raises ``OSError`` like :meth:`start`."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        argv = list(argv)
        argv[argv.index("--fd") + 1] = str(sock.fileno())
        try:
            child = self.start(argv, tag, on_line=on_line, env=env,
                               pass_fds=(sock.fileno(), *pass_fds), nice=nice)
        finally:
            sock.close()
        return child, port

    def on_event(self, fd: int) -> bool:
        """Read what a poll event on ``fd`` announced; False if ``fd`` is
        not a child's."""
        owner = self.fds.get(fd)
        if owner is None:
            return False
        child, stream = owner
        self._read(fd, child, stream)
        return True

    def reap(self, child: Child) -> int | None:
        """The exit code once ``child`` exited (its pipes then read to the
        end and closed), else ``None``."""
        code = child.proc.poll()
        if code is not None:
            self.release(child)
        return code

    def release(self, child: Child) -> None:
        """Read what is left in the child's pipes, take them out of the poll
        set, close them and its stdin."""
        for f in (child.proc.stdout, child.proc.stderr):
            if f is None or f.closed:
                continue
            fd = f.fileno()
            # read what is left so no log line or state line is lost
            if fd in self.fds:
                self._read(fd, child, self.fds[fd][1])
            if fd in self.fds:
                del self.fds[fd]
                self.poller.unregister(fd)
            f.close()
        child.close_stdin()

    def _register(self, child: Child, stdout: bool = True, stderr: bool = True) -> None:
        for stream, f in (("out", child.proc.stdout if stdout else None),
                          ("err", child.proc.stderr if stderr else None)):
            if f is None:
                continue
            fd = f.fileno()
            fl = fcntl.fcntl(fd, fcntl.F_GETFL)
            fcntl.fcntl(fd, fcntl.F_SETFL, fl | os.O_NONBLOCK)
            self.fds[fd] = (child, stream)
            self.poller.register(fd, select.POLLIN | select.POLLHUP)

    def _read(self, fd: int, child: Child, stream: str) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                data = b""
            if not data:
                if fd in self.fds:
                    del self.fds[fd]
                    self.poller.unregister(fd)
                return
            if stream == "err":
                buf = child.err + data
                *lines, child.err = buf.split(b"\n")
                for line in lines:
                    if line:
                        # escaped here, once: the supervisor's stderr and the
                        # ring get one line without control bytes (issue 31,
                        # item 3); a child's records are one line each already
                        level, text = child_level(escape_controls(
                            line.decode("utf-8", "replace")))
                        log.log(level, "[%s] %s", child.tag, text,
                                extra={"child": child.tag, "line": text})
            else:
                buf = child.out + data
                *lines, child.out = buf.split(b"\n")
                if child.on_line is not None:
                    for line in lines:
                        child.on_line(child, line)


_libc = ctypes.CDLL(None, use_errno=True)


def _nicer(nice: int, group: bool = False) -> Callable[[], None]:
    """:func:`die_with_parent`, then the nice value raised by ``nice``, and
    with ``group`` a process group of its own (a ``cmd`` replica: a wrapper
    shell's server is signalled with it, and SIGKILLed once it exits)."""
    def run() -> None:
        die_with_parent()
        if group:
            os.setpgid(0, 0)
        if nice:
            os.nice(nice)

    return run


def die_with_parent() -> None:
    """In the child, before exec: SIGKILL when the supervisor dies
    (prctl PR_SET_PDEATHSIG), besides the stdin-EOF rule, so a supervisor
    killed with SIGKILL never leaves children behind; and ignore SIGINT and
    SIGHUP, so a Ctrl-C or a closed terminal (or ``pkill -HUP``) reaches
    only the supervisor, which stops the children in order or reloads."""
    _libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
