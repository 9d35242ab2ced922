"""``GET /usage``: the usage ledger's totals (issue 36), and its figures for
``/metrics`` and the page.

The supervisor writes the ledger (:mod:`ggmux.ledger`); any
proxy answers ``/usage`` by querying the store itself, on a thread of its
own (one query at a time per proxy), so the event loop never waits on the
database. Rows the supervisor still holds in memory (written within about
a second, or waiting for a store that is down) are not in the answer yet;
``ledger.pending`` says how many.

Query: ``from`` / ``to`` (a Unix time, an ISO date or time, UTC unless it
says otherwise, or an age such as ``30m``, ``24h``, ``7d``; default: all
time until now), ``group`` (comma-separated, of ``key``, ``model``,
``day``, ``hour``, ``node``, ``replica``, ``status``; default
``key,model,day``), ``format`` (``json``, default, or ``csv``; an
``Accept: text/csv`` asks for CSV too). JSON::

    {"object": "usage", "from": 1733011200.0, "to": 1733097600.0,
     "group": ["key", "model", "day"],
     "data": [{"key": "alice", "model": "smollm2-135m", "day": "2026-12-03",
               "requests": 12, "errors": 0, "refused": 0, "prompt_tokens": 380,
               "cached_tokens": 64, "completion_tokens": 512, "cost": 0.0,
               "ttft_ms_avg": 41.5}],
     "ledger": {"store": "sqlite /var/lib/ggmux/usage.sqlite3", "ok": true, ...}}

``key`` is "" for requests without a key of the keys file. 503 when the
ledger is off or its store cannot be read.
"""

from __future__ import annotations

import asyncio
import csv
import io
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from urllib.parse import parse_qs

import posix_ipc

from ...http1 import HttpConnection, Request
from ...ledger.store import DEFAULT_GROUP, GROUPS, StoreError
from ...ledger.stores import open_store
from ...shm.usagestatus import UsageStatus, usage_status_name

_AGE = re.compile(r"^(\d+(?:\.\d+)?)([smhdw])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
VALUE_COLUMNS = ("requests", "errors", "refused", "prompt_tokens", "cached_tokens", "completion_tokens",
                 "cost", "ttft_ms_avg")


def parse_time(text: str, now: float) -> float:
    """Unix seconds from a Unix time, an ISO 8601 date or date-time (UTC
    unless it names a zone) or an age before ``now`` (``90s``, ``30m``,
    ``24h``, ``7d``, ``2w``). Raises ``ValueError``."""
    text = text.strip()
    m = _AGE.match(text)
    if m:
        return now - float(m.group(1)) * _UNIT_S[m.group(2)]
    try:
        v = float(text)
        if math.isfinite(v):
            return v
    except ValueError:
        pass
    try:
        d = datetime.fromisoformat(text.replace("Z", "+00:00"))  # noqa: FURB162 - 3.10
    except ValueError:
        raise ValueError(f"{text!r} is not a time (Unix seconds, 2026-12-03, "
                         "2026-12-03T10:00, or an age such as 24h or 7d)") from None
    if d.tzinfo is None:
        d = d.replace(tzinfo=timezone.utc)  # noqa: UP017 - 3.10 has no datetime.UTC
    return d.timestamp()


def usage_csv(group: list[str], rows: list[dict]) -> bytes:
    """The rows as CSV: the group's columns, then :data:`VALUE_COLUMNS`."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow([*group, *VALUE_COLUMNS])
    for r in rows:
        w.writerow([*(r.get(g) for g in group),
                    *("" if r.get(c) is None else r.get(c) for c in VALUE_COLUMNS)])
    return buf.getvalue().encode()


def _label(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def usage_metrics(status: dict | None, only_key: str | None = None) -> bytes:
    """Prometheus text of the ledger's status: per key name (``key=""``: no
    policy key) requests, prompt, cached and completion tokens and cost
    since the server started (``only_key``: that key's alone, for a caller
    who presents it: a tenant sees no other tenant's name or usage); the
    ledger's health and its row counts."""
    if status is None:
        return b""
    out: list[str] = []
    keys = status.get("keys") or {}
    if only_key is not None:
        keys = {k: v for k, v in keys.items() if k == only_key}
    for i, (name, kind, help_) in enumerate((
            ("ggmux_key_requests_total", "counter", "Requests per key name."),
            ("ggmux_key_prompt_tokens_total", "counter", "Prompt tokens per key name."),
            ("ggmux_key_cached_tokens_total", "counter",
             "Prompt tokens served from a cache, per key name."),
            ("ggmux_key_completion_tokens_total", "counter", "Completion tokens per key name."),
            ("ggmux_key_cost_total", "counter",
             "Cost per key name, in the prices' currency (priced replicas only)."))):
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n")
        out.extend(f'{name}{{key="{_label(k)}"}} {v[i]:g}\n' for k, v in sorted(keys.items()))
    for name, kind, help_, value in (
            ("ggmux_ledger_up", "gauge", "1 while the usage ledger's store takes writes.",
             1 if status.get("ok") else 0),
            ("ggmux_ledger_rows_pending", "gauge",
             "Usage rows in memory, waiting to be written.", status.get("pending", 0)),
            ("ggmux_ledger_rows_written_total", "counter", "Usage rows written.",
             status.get("written", 0)),
            ("ggmux_ledger_rows_lost_total", "counter",
             "Requests the ledger missed: the request ring lapped before it was read.",
             status.get("lost", 0)),
            ("ggmux_ledger_rows_dropped_total", "counter",
             "Usage rows dropped from a full buffer (--ledger-buffer).",
             status.get("dropped", 0))):
        out.append(f"# HELP {name} {help_}\n# TYPE {name} {kind}\n{name} {value}\n")
    return "".join(out).encode()


class UsageView:
    """One proxy's reader of the ledger: ``spec`` the store (as the
    supervisor resolved ``--ledger``; "" when off), ``shm`` the state
    segment's name (the status blob's is derived)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, spec: str, shm: str) -> None:
        self.loop = loop
        self.spec = spec
        self.blob_name = usage_status_name(shm)
        self.blob: UsageStatus | None = None
        self.store = None
        self.pool: ThreadPoolExecutor | None = None

    def status(self) -> dict | None:
        """The supervisor's last ledger status (None: the ledger is off)."""
        if not self.spec:
            return None
        if self.blob is None:
            try:
                self.blob = UsageStatus.attach(self.blob_name)
            except (OSError, ValueError, posix_ipc.Error):
                return None
        return self.blob.read()

    def _query(self, since: float, until: float,
               group: list[str]) -> tuple[list[str], list[dict]]:
        """``(group, rows)``: ``group`` with ``node`` added when the rows come
        from several servers (a ledger they share), so that none is taken for
        another's."""
        if self.store is None:
            store = open_store(self.spec, "")
            store.schema()  # (before the supervisor's first write, an empty ledger)
            self.store = store
        if "node" in group:
            return group, self.store.usage(since, until, group)
        rows = self.store.usage(since, until, [*group, "node"])
        if len({r["node"] for r in rows}) > 1:
            return [*group, "node"], rows
        for r in rows:
            del r["node"]
        return group, rows

    async def answer(self, conn: HttpConnection, req: Request) -> None:
        """``GET /usage`` (the module docstring)."""
        if not self.spec:
            conn.send_error(req, 503, "the usage ledger is off (ggmux serve --ledger)")
            return
        q = parse_qs(req.query.decode("latin-1"))
        now = time.time()
        try:
            since = parse_time(q["from"][0], now) if "from" in q else 0.0
            until = parse_time(q["to"][0], now) if "to" in q else now + 1.0
            group = ([g.strip() for g in q["group"][0].split(",") if g.strip()]
                     if "group" in q else list(DEFAULT_GROUP))
            bad = [g for g in group if g not in GROUPS]
            if bad:
                raise ValueError(f"cannot group by {', '.join(bad)} "
                                 f"(group by any of {', '.join(GROUPS)})")
            fmt = q.get("format", [""])[0] or (
                "csv" if b"text/csv" in (req.header(b"accept") or b"") else "json")
            if fmt not in ("json", "csv"):
                raise ValueError("'format' must be json or csv")
        except ValueError as e:
            conn.send_error(req, 400, str(e))
            return
        if self.pool is None:  # one query at a time: the store's connection is not shared
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="usage")
        try:
            group, rows = await self.loop.run_in_executor(self.pool, self._query, since, until,
                                                          group)
        except (StoreError, ValueError) as e:
            conn.send_error(req, 503, f"the usage ledger cannot be read: {e}")
            return
        if fmt == "csv":
            conn.send_response(req, 200, usage_csv(group, rows), b"text/csv; charset=utf-8")
            return
        conn.send_json(req, 200, {"object": "usage", "from": since, "to": until,
                                  "group": group, "data": rows, "ledger": self.status()})
