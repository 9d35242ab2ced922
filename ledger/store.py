"""Where the usage rows go: the store's interface, its SQL, and the choice
of store from ``--ledger``.

Both stores (:mod:`.sqlite`, :mod:`.postgres`) hold one table, ``usage``
(:data:`~.records.COLUMNS`, an index on ``time``), and share the SQL here;
they differ in the driver, the placeholder and the day / hour expressions.
A store is used by one thread at a time (the writer job, or a proxy's
``/usage`` query thread); every driver error is raised as
:class:`StoreError` with the driver's text, so the caller tells "the store
is down or full" from a bug without knowing the driver.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from .records import COLUMNS, Totals, UsageRow

GROUPS = ("key", "model", "day", "hour", "node", "replica", "status")
"""What usage can be grouped by (``GET /usage?group=key,model,day``);
``day`` and ``hour`` are UTC, as ``2026-12-03`` and ``2026-12-03T19``."""

DEFAULT_GROUP = ("key", "model", "day")

ADDED = {"refused": "INTEGER"}
"""Columns added after the first ledgers were made: :meth:`SqlStore.schema`
adds them to an older table."""

class StoreError(Exception):
    """The store refused or failed (down, full, unreachable): the driver's text."""


class SqlStore:
    """The SQL both stores share. Subclasses set :attr:`P` (the
    placeholder), :attr:`DAY` / :attr:`HOUR` (SQL of a row's UTC day and
    hour from ``time``), :attr:`ID` (the id column's type), :attr:`ERRORS`
    (the driver's error classes) and :meth:`_connect`."""

    P = "?"
    DAY = HOUR = ""
    ID = "INTEGER PRIMARY KEY"
    ERRORS: tuple[type[BaseException], ...] = ()
    where = ""  # what the store is, for logs and the page (no password in it)

    def __init__(self) -> None:
        self.conn: Any = None

    # ---- connection --------------------------------------------------------
    def _connect(self) -> Any:
        raise NotImplementedError

    def _conn(self) -> Any:
        if self.conn is None:
            self.conn = self._connect()
        return self.conn

    def _drop(self) -> None:
        """Forget a connection that failed (the next call opens a new one)."""
        conn, self.conn = self.conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # closing a broken connection
                conn.close()

    def _transaction(self, conn: Any) -> Any:
        """A context manager around one transaction (sqlite3: the connection)."""
        return conn

    def _run(self, fn) -> Any:
        """``fn(conn)`` in one transaction; driver errors -> :class:`StoreError`
        (and the connection dropped: the next call reconnects)."""
        try:
            conn = self._conn()
            with self._transaction(conn):  # commit, or roll back on an error
                return fn(conn)
        except self.ERRORS as e:
            self._drop()
            raise StoreError(str(e).strip() or type(e).__name__) from e

    def schema(self) -> None:
        """Create the tables (``usage`` and its index, ``nodes``) when missing.
        Raises :class:`StoreError`."""
        cols = ", ".join(f"{c} {t}" for c, t in zip(COLUMNS, (
            "DOUBLE PRECISION NOT NULL", "TEXT", "TEXT NOT NULL", "TEXT NOT NULL", "TEXT",
            "TEXT", "INTEGER", "BIGINT", "BIGINT", "BIGINT", "DOUBLE PRECISION",
            "DOUBLE PRECISION", "DOUBLE PRECISION", "INTEGER")))

        def create(conn) -> None:
            cur = conn.cursor()
            cur.execute(f"CREATE TABLE IF NOT EXISTS usage (id {self.ID}, {cols})")
            cur.execute("CREATE INDEX IF NOT EXISTS usage_time ON usage (time)")
            # each server's claim on its node name (claim_node)
            cur.execute("CREATE TABLE IF NOT EXISTS nodes (name TEXT PRIMARY KEY, token TEXT, "
                        "seen DOUBLE PRECISION)")
            cur.execute("SELECT * FROM usage LIMIT 0")
            have = {d[0] for d in cur.description}
            for c, kind in ADDED.items():  # a ledger an older ggmux made: NULL in its rows
                if c not in have:
                    cur.execute(f"ALTER TABLE usage ADD COLUMN {c} {kind}")

        self._run(create)

    def claim_node(self, node: str, token: str, now: float) -> str | None:
        """Write ``token`` (one server's, random) and ``now`` (Unix s) as
        node ``node``'s claim in the ``nodes`` table (:meth:`schema`); the token it held
        before (None: none). Two live servers that write one ledger as one
        node each overwrite the other's claim, which is how they are told
        apart (:mod:`.sync`). Raises :class:`StoreError`."""
        P = self.P

        def claim(conn) -> str | None:
            cur = conn.cursor()
            cur.execute(f"SELECT token FROM nodes WHERE name = {P}", (node,))
            got = cur.fetchone()
            cur.execute(f"INSERT INTO nodes (name, token, seen) VALUES ({P}, {P}, {P}) "
                        "ON CONFLICT (name) DO UPDATE SET token = excluded.token, "
                        "seen = excluded.seen", (node, token, now))
            return got[0] if got else None

        return self._run(claim)

    # ---- writing -----------------------------------------------------------
    def write(self, rows: Sequence[UsageRow]) -> None:
        """Insert ``rows`` in one transaction: all or none. Raises
        :class:`StoreError` (then none was written)."""
        sql = (f"INSERT INTO usage ({', '.join(COLUMNS)}) VALUES "
               f"({', '.join([self.P] * len(COLUMNS))})")
        values = [r.values() for r in rows]
        self._run(lambda conn: conn.cursor().executemany(sql, values))

    # ---- reading -----------------------------------------------------------
    def totals_since(self, since_s: float, node: str | None = None) -> dict[str, Totals]:
        """Key name -> :class:`Totals` of the rows at or after ``since_s``
        (Unix seconds); only node ``node``'s rows when given. Raises
        :class:`StoreError`."""
        sql = ("SELECT key, COUNT(*), COALESCE(SUM(prompt_tokens), 0), "
               "COALESCE(SUM(cached_tokens), 0), COALESCE(SUM(completion_tokens), 0), "
               f"COALESCE(SUM(cost), 0) FROM usage WHERE time >= {self.P}"
               + (f" AND node = {self.P}" if node is not None else "") + " GROUP BY key")
        params = (since_s,) if node is None else (since_s, node)

        def read(conn):
            cur = conn.cursor()
            cur.execute(sql, params)
            return cur.fetchall()

        return {k: Totals(int(n), int(p), int(c), int(g), float(cost))
                for k, n, p, c, g, cost in self._run(read)}

    def requests_since(self, since_s: float, node: str) -> set[tuple[str, float]]:
        """``(request_id, time)`` of node ``node``'s rows at or after
        ``since_s`` (Unix seconds): which requests of a dead server's ring
        the store has already (:meth:`~.ledger.UsageLedger.recover`).
        Raises :class:`StoreError`."""
        sql = f"SELECT request_id, time FROM usage WHERE time >= {self.P} AND node = {self.P}"

        def read(conn):
            cur = conn.cursor()
            cur.execute(sql, (since_s, node))
            return cur.fetchall()

        return {(rid or "", float(t)) for rid, t in self._run(read)}

    def others_since(self, node: str, starts: Sequence[float],
                     until: float | None = None) -> dict[str, list[Totals]]:
        """Key name -> one :class:`Totals` per start of ``starts`` (Unix
        seconds; a window's start each, e.g. the minute's, day's, week's and
        month's) of the rows of keys (not ``""``) that their key admitted
        (``refused`` not set), written by nodes other than ``node`` at or
        after that start (and before ``until``, when given): the usage the
        other nodes of a shared ledger counted in each window (:mod:`.sync`).
        One query, one pass over the rows since the earliest start (the
        ``time`` index).
        Raises :class:`StoreError`."""
        P = self.P
        cols = []
        for _ in starts:
            cols += [f"SUM(CASE WHEN time >= {P} THEN 1 ELSE 0 END)"] + [
                f"COALESCE(SUM(CASE WHEN time >= {P} THEN {c} ELSE 0 END), 0)"
                for c in ("COALESCE(prompt_tokens, 0)", "COALESCE(cached_tokens, 0)",
                          "COALESCE(completion_tokens, 0)", "COALESCE(cost, 0)")]
        sql = (f"SELECT key, {', '.join(cols)} FROM usage WHERE time >= {P} "
               + (f"AND time < {P} " if until is not None else "")
               + f"AND node <> {P} AND key <> '' AND (refused IS NULL OR refused = 0) "
               "GROUP BY key")
        params = [s for s in starts for _ in range(5)] + [min(starts)] + (
            [until] if until is not None else []) + [node]

        def read(conn):
            cur = conn.cursor()
            cur.execute(sql, params)
            return cur.fetchall()

        out: dict[str, list[Totals]] = {}
        for rec in self._run(read):
            v = rec[1:]
            out[rec[0]] = [Totals(int(v[i] or 0), int(v[i + 1]), int(v[i + 2]), int(v[i + 3]),
                                  float(v[i + 4])) for i in range(0, len(v), 5)]
        return out

    def nodes(self) -> dict[str, int]:
        """Node name -> its rows in the ledger (every row, any time): who
        wrote this ledger. Raises :class:`StoreError`."""

        def read(conn):
            cur = conn.cursor()
            cur.execute("SELECT COALESCE(node, ''), COUNT(*) FROM usage GROUP BY node")
            return cur.fetchall()

        return {str(n): int(c) for n, c in self._run(read)}

    def usage(self, since_s: float, until_s: float,
              group: Sequence[str] = DEFAULT_GROUP) -> list[dict]:
        """Totals of the rows with ``since_s <= time < until_s``, grouped by
        ``group`` (names of :data:`GROUPS`), ordered by them: one dict per
        group with its names' values, ``requests``, ``errors`` (status >=
        400), ``refused`` (of the errors, those its key refused: a limit, a
        model it may not use), ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``,
        ``cost`` and ``ttft_ms_avg`` (None when no request had one).
        Raises ``ValueError`` for an unknown group name, :class:`StoreError`."""
        exprs = []
        for g in group:
            if g not in GROUPS:
                raise ValueError(f"unknown group {g!r} (one of {', '.join(GROUPS)})")
            exprs.append(self.DAY if g == "day" else self.HOUR if g == "hour" else g)
        sel = "".join(f"{e} AS g{i}, " for i, e in enumerate(exprs))
        by = f" GROUP BY {', '.join(f'g{i}' for i in range(len(exprs)))}" if exprs else ""
        order = f" ORDER BY {', '.join(f'g{i}' for i in range(len(exprs)))}" if exprs else ""
        sql = (f"SELECT {sel}COUNT(*), SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), "
               "SUM(CASE WHEN refused = 1 THEN 1 ELSE 0 END), COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(cached_tokens), 0), "
               "COALESCE(SUM(completion_tokens), 0), COALESCE(SUM(cost), 0), AVG(ttft_ms) "
               f"FROM usage WHERE time >= {self.P} AND time < {self.P}{by}{order}")

        def read(conn):
            cur = conn.cursor()
            cur.execute(sql, (since_s, until_s))
            return cur.fetchall()

        out = []
        for rec in self._run(read):
            n = len(group)
            doc = dict(zip(group, rec[:n]))
            reqs, errs, refused, p, c, g, cost, ttft = rec[n:]
            if not reqs:
                continue  # (no group: an empty range's one row)
            doc.update(requests=int(reqs), errors=int(errs or 0), refused=int(refused or 0),
                       prompt_tokens=int(p),
                       cached_tokens=int(c), completion_tokens=int(g),
                       cost=round(float(cost), 9),
                       ttft_ms_avg=None if ttft is None else round(float(ttft), 1))
            out.append(doc)
        return out

    def close(self) -> None:
        self._drop()
