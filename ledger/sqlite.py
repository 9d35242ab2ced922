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

from .store import SqlStore

BUSY_TIMEOUT_S = 5.0
"""How long a statement waits for another connection's lock (a reader's
checkpoint, a second writer) before it fails."""


class SqliteStore(SqlStore):
    """The ledger in the SQLite file ``path`` (its directory made, mode 0700)."""

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
        # one thread at a time, but not always the one that opened it (the jobs)
        conn = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
        try:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.Error:
            conn.close()
            raise
        return conn
