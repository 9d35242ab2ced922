"""``ggmux serve``'s usage-ledger options (issue 36): ``--ledger``,
``--ledger-buffer``, ``--ledger-sync``, ``--state-dir``."""

from __future__ import annotations

import argparse
import os

from .ledger import DEFAULT_BUFFER
from .stores import sqlite_file
from .sync import DEFAULT_SYNC_S


def default_state_dir() -> str:
    """Where ggmux keeps what outlives a run: ``$XDG_STATE_HOME/ggmux``, else
    ``~/.local/state/ggmux`` (the XDG base directory rule)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "ggmux")


def add_ledger_options(s: argparse.ArgumentParser) -> None:
    """Add the options to ``serve``'s parser ``s``."""
    s.add_argument("--ledger", default="sqlite", metavar="STORE",
                   help="the usage ledger, one row per finished request: 'sqlite' (the file "
                        "usage-PORT.sqlite3 in --state-dir: one per server), a SQLite file's "
                        "path (servers that share it share their usage and limits), postgresql://USER:PASS@HOST/DB "
                        "(one ledger for a cluster; needs psycopg), or 'off'")
    s.add_argument("--ledger-buffer", type=int, default=DEFAULT_BUFFER, metavar="N",
                   help="usage rows kept in memory while the ledger cannot be written (a "
                        "database down, a full disk); beyond, the oldest are dropped and counted")
    s.add_argument("--ledger-sync", type=float, default=DEFAULT_SYNC_S, metavar="SECONDS",
                   help="with --keys: every SECONDS, add the usage other nodes sharing the "
                        "ledger (rows of another --node-name) wrote since each window's start "
                        "to the keys' windows, so limits hold across servers; together they may "
                        "admit more than a limit by what the others admit within about "
                        "SECONDS + 0.6 s + a request's duration; 0: off (limits per server)")
    s.add_argument("--state-dir", default=None, metavar="DIR",
                   help="where ggmux keeps state that outlives a run, such as the SQLite "
                        "ledger (default: $XDG_STATE_HOME/ggmux or ~/.local/state/ggmux)")


def ledger_refusal(args: argparse.Namespace) -> str | None:
    """Why the ledger options cannot be used (None: they can)."""
    if args.ledger_buffer < 1:
        return "--ledger-buffer must be at least 1"
    if not args.ledger_sync >= 0:
        return f"--ledger-sync must be 0 (off) or more seconds, not {args.ledger_sync:g}"
    spec = args.ledger.strip()
    if spec.startswith(("postgresql://", "postgres://")):
        import importlib.util

        if importlib.util.find_spec("psycopg") is None:
            return ("--ledger postgresql://... needs the psycopg package: pip install "
                    "'psycopg[binary]' (or pip install -e '.[postgresql]' in ggmux's checkout)")
    return None


def ledger_spec(args: argparse.Namespace, state_dir: str) -> str:
    """``--ledger`` resolved: "" (off), a PostgreSQL URL, or a SQLite file's
    absolute path (``sqlite``: this server's :func:`~.stores.sqlite_file` in
    ``state_dir``)."""
    spec = args.ledger.strip()
    if spec.lower() in ("off", "none", ""):
        return ""
    if spec.startswith(("postgresql://", "postgres://")):
        return spec
    if spec == "sqlite":
        spec = os.path.join(state_dir, sqlite_file(args.port))
    return os.path.abspath(os.path.expanduser(spec))
