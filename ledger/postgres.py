"""The PostgreSQL ledger (``--ledger postgresql://USER:PASS@HOST/DB``): one
ledger for every node of a cluster, through psycopg 3.

The connection string may hold a password: it reaches the proxies through
the keys pipe, never a command line, and :attr:`where` (logs, the page,
``/metrics``) shows it with the password cut out. A connection that fails
(the server down or restarted) is dropped and the next call opens a new
one, with :data:`CONNECT_TIMEOUT_S`, so a down server costs the writer job
that long per try, never the poll loop.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

from .store import SqlStore

CONNECT_TIMEOUT_S = 5
"""Seconds a connection attempt may take (libpq's ``connect_timeout``)."""


def redact(url: str) -> str:
    """``url`` with its password replaced by ``***``."""
    u = urlsplit(url)
    if u.password is None:
        return url
    netloc = f"{u.username}:***@{u.hostname}" + (f":{u.port}" if u.port else "")
    return urlunsplit((u.scheme, netloc, u.path, u.query, u.fragment))


class PostgresStore(SqlStore):
    """The ledger in the PostgreSQL database ``url``. Raises ``ValueError``
    when psycopg is not installed (``pip install 'psycopg[binary]'``)."""

    P = "%s"
    DAY = "to_char(to_timestamp(time) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
    HOUR = "to_char(to_timestamp(time) AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24')"
    ID = "BIGSERIAL PRIMARY KEY"

    def __init__(self, url: str) -> None:
        super().__init__()
        try:
            import psycopg
        except ImportError as e:
            raise ValueError("--ledger postgresql://... needs the psycopg package "
                             "(pip install 'psycopg[binary]')") from e
        self.psycopg = psycopg
        self.ERRORS = (psycopg.Error, OSError)
        self.url = url
        self.where = f"postgresql {redact(url)}"

    def _connect(self):
        return self.psycopg.connect(self.url, connect_timeout=CONNECT_TIMEOUT_S, autocommit=True)

    def _transaction(self, conn):
        return conn.transaction()
