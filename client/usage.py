"""``ggmux usage``: the usage ledger's totals as a table (``GET /usage``, issue 36).

One line per group (default: key, model, day), with requests, errors
(and of them those the key refused), prompt / cached / completion tokens, cost and the average TTFT; ``--csv``
prints the server's CSV, ``--json`` its document. Times as ``GET /usage``
takes them (``--from 7d``, ``--from 2026-12-01 --to 2026-12-02``). Uses
``$GGMUX_ADMIN_KEY`` when set (an admin route), else the API key.
"""

from __future__ import annotations

import argparse
import json
import sys
from urllib.parse import urlencode

from .http_client import Client, items

COLUMNS = (("requests", "REQUESTS"), ("errors", "ERRORS"), ("refused", "REFUSED"),
           ("prompt_tokens", "PROMPT"),
           ("cached_tokens", "CACHED"), ("completion_tokens", "COMPLETION"),
           ("cost", "COST"), ("ttft_ms_avg", "TTFT"))


def add_usage_command(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``usage`` to ``sub`` (``common``: the client options)."""
    p = sub.add_parser("usage", parents=[common],
                       help="what each key used, per model and day (the usage ledger)")
    p.add_argument("--from", dest="since", default=None, metavar="TIME",
                   help="from this time: Unix seconds, 2026-12-03[T10:00] (UTC), or an age "
                        "such as 24h or 7d (default: all)")
    p.add_argument("--to", dest="until", default=None, metavar="TIME",
                   help="until this time (default: now)")
    p.add_argument("--group", default=None, metavar="LIST",
                   help="comma-separated: key, model, day, hour, node, replica, status "
                        "(default: key,model,day)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--csv", action="store_true", help="the server's CSV")
    out.add_argument("--json", action="store_true", help="the server's JSON document")
    p.set_defaults(func=cmd_usage)


def _cell(col: str, v) -> str:
    if v is None:
        return "-"
    if col == "cost":
        return f"{float(v):.4f}"
    if col == "ttft_ms_avg":
        return f"{float(v):.0f}ms"
    return str(v)


def usage_table(doc: dict) -> str:
    """The ``/usage`` document as aligned columns (a key of "" shows ``-``)."""
    group = [g for g in doc.get("group") or () if isinstance(g, str)]
    head = [g.upper() for g in group] + [t for _, t in COLUMNS]
    rows = []
    for r in doc.get("data") or ():
        if not isinstance(r, dict):
            continue
        rows.append([str(r.get(g)) if r.get(g) not in (None, "") else "-" for g in group]
                    + [_cell(c, r.get(c)) for c, _ in COLUMNS])
    widths = [max([len(h)] + [len(row[i]) for row in rows]) for i, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    ledger = doc.get("ledger")
    if isinstance(ledger, dict) and not ledger.get("ok", True):
        lines.append(f"(the ledger is failing: {ledger.get('error')}; "
                     f"{ledger.get('pending', 0)} rows wait in memory)")
    return "\n".join(lines) + "\n"


def cmd_usage(client: Client, args: argparse.Namespace) -> int:
    """``ggmux usage``: the table, ``--csv`` or ``--json``."""
    q = {k: v for k, v in (("from", args.since), ("to", args.until), ("group", args.group))
         if v}
    if args.csv:
        q["format"] = "csv"
    path = "/usage" + ("?" + urlencode(q) if q else "")
    if args.csv:
        sys.stdout.write(client.text(path, admin=True))
        return 0
    doc = client.object("GET", path, admin=True)
    items(client, "GET", "/usage", doc, "data", ())
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(usage_table(doc))
    return 0
