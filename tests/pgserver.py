"""A real PostgreSQL server for the usage ledger's tests: Debian's
``postgresql`` binaries (``/usr/lib/postgresql/*/bin``, which .ci/run
installs), a cluster made with ``initdb`` in a temporary directory, on a
free TCP port of 127.0.0.1 with ``trust`` authentication, stopped and
removed afterwards. PostgreSQL refuses to run as root: as root, the
``postgres`` user (made by the Debian package) runs it.

:func:`pg_or_skip` gives the reason to skip when no server can start (no
binaries, no psycopg, no non-root user).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile

from conftest import free_port

START_TIMEOUT_S = 60  # pg_ctl -w: initdb and start on a loaded 2-core machine


def _bin_dir() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return os.path.dirname(found[-1]) if found else None


class PgServer:
    """One server: :meth:`start`, :meth:`stop` (then :meth:`start` again: a
    database that went down and came back), :meth:`close`. ``url``: the
    connection string of database ``postgres`` as user ``postgres``."""

    def __init__(self, bin_dir: str, user: str | None) -> None:
        self.bin = bin_dir
        self.user = user  # run as this user (root's case), None: as ourselves
        self.dir = tempfile.mkdtemp(prefix="ggmux-pg-")  # /tmp: the postgres user reaches it
        self.data = os.path.join(self.dir, "data")
        self.port = free_port()
        self.url = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        if user is not None:
            pw = pwd.getpwnam(user)
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
        self._run("initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "-E", "UTF8",
                  "--no-sync")

    def _run(self, tool: str, *args: str) -> None:
        out = subprocess.run([os.path.join(self.bin, tool), *args], user=self.user, check=False,
                             cwd=self.dir, capture_output=True, text=True,
                             timeout=START_TIMEOUT_S)
        if out.returncode != 0:
            raise RuntimeError(f"{tool} failed ({out.returncode}): {out.stderr[-2000:]}")

    def start(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-l", os.path.join(self.dir, "log"), "-w",
                  "-t", str(START_TIMEOUT_S), "-o",
                  f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off",
                  "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            self.stop()
        except (RuntimeError, subprocess.TimeoutExpired):
            pass
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_or_skip() -> tuple[PgServer | None, str]:
    """A started :class:`PgServer`, or None and why not."""
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return None, "no psycopg (pip install 'psycopg[binary]')"
    bin_dir = _bin_dir()
    if bin_dir is None:
        return None, "no PostgreSQL server binaries (apt-get install postgresql)"
    user = None
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return None, "running as root and there is no 'postgres' user to run the server"
        user = "postgres"
    try:
        srv = PgServer(bin_dir, user)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return None, f"initdb failed: {e}"
    try:
        srv.start()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        srv.close()
        return None, f"PostgreSQL did not start: {e}"
    return srv, ""
