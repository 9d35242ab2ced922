"""``ggmux keys``: the keys of a server's keys file (issue 36), through its
admin routes ``/keys`` (``$GGMUX_ADMIN_KEY``).

* ``ggmux keys`` (``list``): one line per key: its models and limits.
* ``ggmux keys usage``: its current windows (requests and tokens this
  minute, in flight, tokens today, this week, this month, spend).
* ``ggmux keys create NAME [--models A,B*] [--rpm N] [--tpm N] ...``: prints
  the new secret, once (the server keeps only its hash).
* ``ggmux keys rotate NAME``: a new secret (printed); the old one stops.
* ``ggmux keys disable NAME``, ``enable NAME``, ``delete NAME``.
* ``ggmux keys info``: the caller's own key (``$GGMUX_API_KEY``), through
  ``GET /key/info``: its limits, what is used and left, and when each
  window resets. Any key may ask, about itself; no admin key needed.
"""

from __future__ import annotations

import argparse
import time
from urllib.parse import quote

from .http_client import Client

LIMITS = (("models", str), ("rpm", int), ("tpm", int), ("max-parallel", int),
          ("tokens-per-day", int), ("tokens-per-week", int), ("tokens-per-month", int),
          ("spend-per-month", float), ("expires", str))

_LIMIT_HELP = {  # (metavar, help) of each of create's options: the keys file's settings
    "models": ("LIST", ("the models the key may use: names or globs, comma-separated "
                       "(default: every model)")),
    "rpm": ("N", "requests per minute"),
    "tpm": ("N", "prompt and completion tokens per minute"),
    "max-parallel": ("N", "requests in flight at once"),
    "tokens-per-day": ("N", "token budget per day (UTC)"),
    "tokens-per-week": ("N", "token budget per ISO week"),
    "tokens-per-month": ("N", "token budget per month"),
    "spend-per-month": ("X", "currency units spent on priced models per month"),
    "expires": ("WHEN", "ISO date or time (UTC), or epoch seconds"),
}


def add_keys_command(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Add ``keys`` and its operations to ``sub``."""
    p = sub.add_parser("keys", parents=[common],
                       help="keys with limits (the server's --keys file; admin key)")
    ops = p.add_subparsers(dest="keys_op", metavar="list|usage|create|rotate|disable|enable|"
                                                   "delete|info")
    p.set_defaults(func=cmd_keys, keys_op=None)
    ops.add_parser("list", parents=[common], help="every key: models and limits")
    ops.add_parser("usage", parents=[common], help="every key: its current windows")
    c = ops.add_parser("create", parents=[common], help="a new key; prints its secret once")
    c.add_argument("name", help="the key's name (a section of the keys file)")
    for opt, typ in LIMITS:
        metavar, help_ = _LIMIT_HELP[opt]
        c.add_argument(f"--{opt}", type=typ, default=None, metavar=metavar,
                       help=help_ + ("" if opt in ("models", "expires") else " (default: none)"))
    for op in ("rotate", "disable", "enable", "delete"):
        o = ops.add_parser(op, parents=[common], help=f"{op} key NAME")
        o.add_argument("name", help="the key's name")
    ops.add_parser("info", parents=[common],
                   help="your own key ($GGMUX_API_KEY): its limits, what is used and left, "
                        "when each resets (any key; no admin key needed)")


def _limit_cells(k: dict) -> str:
    out = []
    for name in ("rpm", "tpm", "max_parallel", "tokens_per_day", "tokens_per_week",
                 "tokens_per_month", "spend_per_month"):
        v = k.get(name)
        if v:
            out.append(f"{name.replace('_', '-')}={v:g}" if isinstance(v, float)
                       else f"{name.replace('_', '-')}={v}")
    if k.get("expires"):
        out.append("expires")
    if k.get("disabled"):
        out.append("DISABLED")
    return " ".join(out) or "-"


def keys_table(doc: dict, usage: bool) -> str:
    """The lines of ``ggmux keys`` (or ``keys usage``) for ``GET /keys``'s ``doc``."""
    rows = doc.get("data") if isinstance(doc.get("data"), list) else []
    if usage:
        head = ("NAME", "REQ/MIN", "TOK/MIN", "IN FLIGHT", "TODAY", "WEEK", "MONTH", "SPEND")
        lines = [head]
        for k in rows:
            u = k.get("usage") or {}
            lines.append((str(k.get("name")), str(u.get("requests_this_minute", 0)),
                          str(u.get("tokens_this_minute", 0)), str(u.get("in_flight", 0)),
                          str(u.get("tokens_today", 0)), str(u.get("tokens_this_week", 0)),
                          str(u.get("tokens_this_month", 0)),
                          f"{u.get('spend_this_month', 0):g}"))
    else:
        lines = [("NAME", "MODELS", "LIMITS")]
        for k in rows:
            lines.append((str(k.get("name")), ", ".join(k.get("models") or ["*"]),
                          _limit_cells(k)))
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in lines)


def _in(seconds) -> str:
    if seconds is None:
        return "-"
    s = int(seconds)
    return (f"{s} s" if s < 120 else f"{s // 60} min" if s < 7200 else
            f"{s // 3600} h" if s < 172800 else f"{s // 86400} days")


def key_info_text(doc: dict) -> str:
    """The lines of ``ggmux keys info`` for ``GET /key/info``'s ``doc``."""
    kind = doc.get("kind")
    if kind != "keys-file":
        return {"admin": "the admin key: no limits",
                "api-key": "an --api-key key: no limits",
                "none": "no key (this server takes none): no limits"}.get(kind, f"{kind}: no limits")
    head = f"key {doc.get('name')}: models {', '.join(doc.get('models') or ['*'])}"
    if doc.get("disabled"):
        head += ", DISABLED"
    if doc.get("expires"):
        head += ", expires " + time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(doc["expires"]))
    limits = doc.get("limits") or []
    if not limits:
        return head + "\nno limits"
    lines = [("LIMIT", "MAX", "USED", "LEFT", "RESETS IN")]
    for lim in limits:
        lines.append((lim["limit"].replace("_", "-"), f"{lim['max']:g}", f"{lim['used']:g}",
                      f"{lim['left']:g}", _in(lim.get("resets_in_s"))))
    widths = [max(len(r[i]) for r in lines) for i in range(len(lines[0]))]
    return head + "\n" + "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                                     for r in lines)


def cmd_keys(client: Client, args: argparse.Namespace) -> int:
    op = args.keys_op or "list"
    if op == "info":  # the caller's own key: the API key (the admin key when it is the only one)
        print(key_info_text(client.object("GET", "/key/info", admin=client.key is None)))
        return 0
    if op in ("list", "usage"):
        print(keys_table(client.object("GET", "/keys", admin=True), op == "usage"))
        return 0
    name = quote(args.name, safe="")
    if op == "create":
        body = {"name": args.name}
        for opt, _ in LIMITS:
            v = getattr(args, opt.replace("-", "_"))
            if v is not None:
                body[opt] = v
        doc = client.object("POST", "/keys", body, admin=True)
    elif op == "delete":
        doc = client.object("DELETE", f"/keys/{name}", admin=True)
    else:
        doc = client.object("POST", f"/keys/{name}/{op}", {}, admin=True)
    if doc.get("key"):
        print(f"{args.name}: {doc['key']}")
        print("(shown once: the server keeps only its hash)")
    else:
        print(f"{args.name}: {op}d" if op != "delete" else f"{args.name}: deleted")
    return 0


__all__ = ["add_keys_command", "cmd_keys", "key_info_text", "keys_table"]
