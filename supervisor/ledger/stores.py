"""The store ``--ledger`` names (:func:`open_store`): SQLite or PostgreSQL."""

from __future__ import annotations

import os

from .store import SqlStore

SQLITE_FILE = "usage.sqlite3"
"""The SQLite ledger's file name in the state directory."""


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
