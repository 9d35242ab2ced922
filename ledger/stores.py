"""The store ``--ledger`` names (:func:`open_store`): SQLite or PostgreSQL."""

from __future__ import annotations

import os

from .store import SqlStore

SQLITE_FILE = "usage.sqlite3"
"""The SQLite ledger's file name in the state directory when no port names
it: the one every server of a user shared before the ledger was per server
(:func:`sqlite_file`)."""


def sqlite_file(port: int) -> str:
    """The default SQLite ledger's file name of the server on ``port``:
    one file per server, so that the servers of one user (a demo, a test
    run, the team's) never list each other's keys and models, while a
    restart on the same port keeps its windows (read back from the file).
    Servers meant to share one name it with ``--ledger PATH``."""
    return f"usage-{port}.sqlite3"


def open_store(spec: str, state_dir: str) -> SqlStore:
    """The store ``--ledger`` names: ``postgresql://...`` (or
    ``postgres://``) PostgreSQL, ``sqlite`` (the default) the file
    :data:`SQLITE_FILE` in ``state_dir``, anything else a SQLite file's
    path. Opens nothing yet (the first call connects). Raises
    ``ValueError`` for PostgreSQL without the ``psycopg`` package."""
    if spec.startswith(("postgresql://", "postgres://")):
        from .postgres import PostgresStore

        return PostgresStore(spec)
    from .sqlite import SqliteStore

    path = os.path.join(state_dir, SQLITE_FILE) if spec in ("", "sqlite") else spec
    return SqliteStore(os.path.abspath(os.path.expanduser(path)))
