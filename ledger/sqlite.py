"""The SQLite ledger (the default): stdlib ``sqlite3``, one file, WAL.

WAL lets the proxies' ``/usage`` queries read while the supervisor's
writer job writes; ``synchronous=NORMAL`` (WAL's usual pairing) syncs at
checkpoints, not every commit: a power cut may lose the last commits, a
process crash loses nothing. A full disk raises ``SQLITE_FULL`` from the
write, which rolls back (:class:`~.store.StoreError`): the rows stay in the
ledger's buffer for the next try.
"""

from __future__ import annotations

import os
import sqlite3
import time

from .store import SqlStore

BUSY_TIMEOUT_S = 5.0
"""How long a statement waits for another connection's lock (a reader's
checkpoint, a second writer) before it fails."""


def private(path: str) -> None:
    """Make the database file ``path`` mode 0600 (created so when missing,
    made so when it is ours and others may read it), and its WAL and
    shared-memory files with it: its rows name keys, models and who used
    what, which is no business of the machine's other users. SQLite makes
    the ``-wal`` and ``-shm`` files with the database file's mode.

    By path only, never through a descriptor of an existing file: closing
    any descriptor of a file drops every POSIX lock this process holds on
    it, SQLite's locks of another open connection included (the ledger's
    writer and the keys' sync each have one), after which one connection's
    commits are lost to the others."""
    if not os.path.exists(path):
        try:  # nothing of this process has it open: it did not exist
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            pass
    uid = os.geteuid()
    for name in (path, path + "-wal", path + "-shm"):
        try:
            st = os.stat(name)
        except FileNotFoundError:
            continue
        if st.st_mode & 0o077 and st.st_uid == uid:
            os.chmod(name, 0o600)


class SqliteStore(SqlStore):
    """The ledger in the SQLite file ``path`` (its directory made, mode
    0700; the file 0600: :func:`private`)."""

    P = "?"
    DAY = "strftime('%Y-%m-%d', time, 'unixepoch')"
    HOUR = "strftime('%Y-%m-%dT%H', time, 'unixepoch')"
    ID = "INTEGER PRIMARY KEY"
    ERRORS = (sqlite3.Error, OSError)

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.where = f"sqlite {path}"

    def _connect(self) -> sqlite3.Connection:
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
        private(self.path)
        # one thread at a time, but not always the one that opened it (the jobs)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        try:
            _wal(conn)
            conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error:
            conn.close()
            raise
        return conn


def _wal(conn: sqlite3.Connection, timeout: float = BUSY_TIMEOUT_S) -> None:
    """Put the database of ``conn`` in WAL mode, trying again for up to
    ``timeout`` seconds while it is locked. Turning a new file to WAL takes
    an exclusive lock from a shared one; two connections doing it at once
    (the ledger's writer and the start's other-nodes query open the same new
    file together) are a deadlock that SQLite answers with an immediate
    ``database is locked``, without its busy handler. Raises
    ``sqlite3.Error`` past the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)
