"""``ggmux logs``: the server's log lines (``GET /logs``, ``/logs/stream``
with ``-f``) and, with ``--requests``, the requests it served (``GET
/requests``, ``/requests/stream``), one line each (admin key when set)."""

from __future__ import annotations

import argparse
import sys
import time
from urllib.parse import quote

from .http_client import (
    Client,
    items,
    number,
    parse_json,
)

# ---- logs ---------------------------------------------------------------------
REQUEST_COLUMNS = (("TIME", 12), ("MODEL", 24), ("REPLICA", 9), ("API", 37), ("STATUS", 6),
                   ("PROMPT", 6), ("CACHED", 6), ("GEN", 6), ("TTFT", 9), ("TOK/S", 7),
                   ("DURATION", 9))
"""``ggmux logs --requests``: its columns and their widths (a followed table
cannot measure its rows first)."""


def _ms_cell(v) -> str:
    v = number(v)
    if v is None:
        return "-"
    return f"{v:.0f} ms" if v < 10_000 else f"{v / 1000:.1f} s"


def request_line(rec: dict) -> str:
    """One record of ``GET /requests`` as a line of :data:`REQUEST_COLUMNS`
    (a field of an unexpected type shows as ``-``; control characters of a
    model name or path escaped, issue 31 item 3)."""
    from ..shm.logring import escape_controls

    def count(key: str) -> str:
        v = rec.get(key)
        return str(v) if type(v) is int else "-"

    ts = number(rec.get("time")) or 0.0
    stamp = time.strftime("%H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    where = rec.get("where") if isinstance(rec.get("where"), str) else None
    replica = rec.get("replica")
    rep = "-" if type(replica) is not int else (f"#{replica}" if where in (None, "local")
                                                 else f"#{replica}@{where}")
    api = f"{rec.get('api', '?')} {rec.get('path', '')}".strip()
    if rec.get("stream") is True:
        api += " (stream)"
    rate = number(rec.get("tokens_per_s"))
    cells = (stamp, str(rec.get("model") or "-"), rep, api, count("status"),
             count("prompt_tokens"), count("cached_tokens"),
             count("generated_tokens") + ("~" if rec.get("tokens_from") == "proxy" else ""),
             _ms_cell(rec.get("ttft_ms")), "-" if rate is None else f"{rate:.1f}",
             _ms_cell(rec.get("duration_ms")))
    return escape_controls(
        "  ".join(c.ljust(w) for c, (_, w) in zip(cells, REQUEST_COLUMNS)).rstrip())


def _request_header() -> str:
    return "  ".join(h.ljust(w) for h, w in REQUEST_COLUMNS).rstrip()


def cmd_requests(client: Client, args: argparse.Namespace) -> int:
    """``ggmux logs --requests [-f] [NAME]``: the request ring as a table,
    oldest first (``-n``: the last N), then, with ``-f``, each new request
    as it ends. A count the server does not know shows ``-``; generated
    tokens counted by the proxy (from a stream's events) end with ``~``."""
    query = []
    if args.name:
        query.append("model=" + quote(args.name, safe=""))
    if args.lines is not None:
        query.append(f"limit={args.lines}")
    qs = ("?" + "&".join(query)) if query else ""
    print(_request_header(), flush=True)
    if not args.follow:
        doc = client.object("GET", "/requests" + qs, admin=True)
        for rec in reversed(items(client, "GET", "/requests", doc, "data", ())):
            print(request_line(rec))
        return 0
    for rec in _json_events(client, "/requests/stream" + qs):
        print(request_line(rec), flush=True)
    return 0


def _json_events(client: Client, path: str):
    """The JSON objects of the admin event stream ``path``, in order: its
    comments (keep-alives) and any event that is not a JSON object left out."""
    for event, data in client.events("GET", path, admin=True):
        if event == "comment":
            continue
        try:
            rec = parse_json(data)
        except ValueError:
            continue
        if isinstance(rec, dict):
            yield rec


def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    """``ggmux logs``: ``/logs`` (``-f``: ``/logs/stream``) as lines, every
    control character escaped again here (:func:`escape_controls`): what
    the server sends never reaches the terminal as escape codes or as a
    line it did not write (issue 31, item 3)."""
    from ..shm.logring import escape_controls, format_line

    if args.requests:
        return cmd_requests(client, args)

    query = []
    if args.name:
        query.append("model=" + quote(args.name, safe=""))
    if args.lines is not None:
        query.append(f"lines={args.lines}")
    qs = ("?" + "&".join(query)) if query else ""
    if not args.follow:
        text = client.text("/logs" + qs, admin=True)
        lines = text.split("\n")
        if lines[-1] == "":
            lines.pop()
        sys.stdout.write("".join(escape_controls(line) + "\n" for line in lines))
        return 0
    for rec in _json_events(client, "/logs/stream" + qs):
        # a time that is not a number shows as the epoch
        print(format_line({**rec, "ts": number(rec.get("ts")) or 0.0}), flush=True)
    return 0


