"""The client commands of ``ggmux``: their options and parsers, ``load``,
``unload`` and ``cache clear``; ``ps`` (:mod:`.ps`), ``logs`` (:mod:`.logs`),
``run`` (:mod:`.run`), ``keys`` (:mod:`.keys`) and ``usage`` (:mod:`.usage`)
in modules of their own.

They talk to a running server over its public HTTP API (stdlib
``http.client``, nothing else), found by ``--url``, else ``$GGMUX_URL``,
else ``http://127.0.0.1:8080``. The key comes from ``$GGMUX_API_KEY``;
``load``, ``unload``, ``cache clear``, ``logs``, ``keys`` and ``usage`` use
``$GGMUX_ADMIN_KEY`` when it is set
(the server's admin routes), else the API key. Shaped after Ollama's CLI
(``ollama ps``, ``ollama run``): plain columns, streamed answers.

Every request has a deadline (``--timeout``) and every non-streamed
answer a size cap (``--max-answer-bytes``): :mod:`.http_client`.

Each ``cmd_*`` returns the process exit code: 0 done, 1 the server said no
(its message printed), 2 usage, 3 no usable answer (:class:`NoAnswer`:
nothing answered, nothing in time, not JSON, not the shape ggmux sends,
over the cap), always as one line, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .http_client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    MAX_ANSWER_BYTES,
    Client,
    NoAnswer,
    NoServer,
    ServerError,
    TimedOut,
    items,
    number,
    parse_json,
)
from .keys import add_keys_command
from .logs import cmd_logs
from .ps import cmd_ps, ps_table
from .run import COMPLETION_MAX_TOKENS, RUN_TIMEOUT_S, cmd_run
from .usage import add_usage_command

NO_ANSWER = NO_SERVER = 3


def client_from_args(args: argparse.Namespace) -> Client:
    """The :class:`Client` that ``--url`` / ``$GGMUX_URL``, ``--timeout``
    (not given: the command's default, :data:`DEFAULT_TIMEOUT_S` or for
    ``run`` :data:`RUN_TIMEOUT_S`), ``--max-answer-bytes`` and the key
    variables name."""
    url = getattr(args, "url", None) or os.environ.get("GGMUX_URL") or DEFAULT_URL
    timeout = getattr(args, "timeout", None)
    if timeout is None:
        timeout = getattr(args, "default_timeout", DEFAULT_TIMEOUT_S)
    max_bytes = getattr(args, "max_answer_bytes", None)
    # the server's $GGMUX_API_KEY may list several keys: the first one serves
    return Client(url, (os.environ.get("GGMUX_API_KEY") or "").split(",")[0].strip() or None,
                  os.environ.get("GGMUX_ADMIN_KEY") or None,
                  timeout,
                  MAX_ANSWER_BYTES if max_bytes is None else max_bytes)


def add_client_options(parser: argparse.ArgumentParser, top: bool) -> None:
    """``--url``, ``--timeout``, ``--max-answer-bytes`` on ``parser``: the
    top-level one (``top``: default None, "not given") and each client
    command's (no default, so a value given before the command stays
    unless given again after it: ``ggmux --url X ps`` and ``ggmux ps --url
    X`` alike)."""
    kw = {} if top else {"default": argparse.SUPPRESS}
    parser.add_argument("--url", **kw,
                        help=f"the server (default: $GGMUX_URL, else {DEFAULT_URL}); the key "
                             "comes from $GGMUX_API_KEY (load, unload, cache clear, logs, keys "
                             "and usage: $GGMUX_ADMIN_KEY when set)")
    parser.add_argument("--timeout", type=float, metavar="S", **kw,
                        help=f"seconds the server has to connect, to answer and to send a "
                             f"whole non-streamed answer (default: {DEFAULT_TIMEOUT_S:g}; run: "
                             f"{RUN_TIMEOUT_S:g} for its answer to begin); a stream (run, "
                             "logs -f, the wait of load and unload) lasts as long as it does "
                             "once it began")
    parser.add_argument("--max-answer-bytes", type=int, metavar="N", **kw,
                        help="largest non-streamed answer (and event of a stream) taken, "
                             f"bytes (default: {MAX_ANSWER_BYTES}, 16 MiB)")


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``ps``, ``load``, ``unload``, ``cache clear``, ``logs`` and ``run`` to ``sub``."""
    common = argparse.ArgumentParser(add_help=False)
    add_client_options(common, top=False)
    p = sub.add_parser("ps", parents=[common], help="models that run now (like ollama ps)")
    p.add_argument("--all", "-a", action="store_true", help="every model, unloaded ones too")
    p.add_argument("--json", action="store_true", help="the server's /ps document as JSON")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("load", parents=[common], help="load a model and wait until it serves")
    p.add_argument("name", help="the model (a name or alias)")
    p.add_argument("--no-wait", action="store_true", help="return once the server took it")
    p.add_argument("--wait", type=float, default=900.0, metavar="S",
                   help="seconds to wait for the load (default: 900)")
    p.set_defaults(func=cmd_load)
    p = sub.add_parser("unload", parents=[common], help="unload a model, or every idle one")
    p.add_argument("name", nargs="?", help="the model (a name or alias)")
    p.add_argument("--all", action="store_true", help="every idle model")
    p.add_argument("--no-wait", action="store_true", help="return once the server took it")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="seconds to wait for the unload (default: 120)")
    p.set_defaults(func=cmd_unload)
    p = sub.add_parser("cache", parents=[common], help="the models' KV tiers (prompt caches)")
    what = p.add_subparsers(dest="cache_op", metavar="clear", required=True)
    c = what.add_parser("clear", parents=[common],
                        help="empty the KV tiers of MODEL, or of every model (admin key)")
    c.add_argument("name", nargs="?", help="the model (default: every model)")
    c.set_defaults(func=cmd_cache_clear)
    add_keys_command(sub, common)  # issue 36: .keys
    p = sub.add_parser("logs", parents=[common],
                       help="recent log lines of the server and its models (--requests: "
                            "its requests)")
    p.add_argument("name", nargs="?", help="only this model's lines (or requests)")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    p.add_argument("--lines", "-n", type=int, default=None,
                   help="only the last N lines (default: all the server keeps; with -f, 100; "
                        "--requests -f: 50)")
    p.add_argument("--requests", "-r", action="store_true",
                   help="the requests the server served (GET /requests): time, model, "
                        "replica, API, status, tokens, TTFT, tokens/s, duration; newest last")
    p.set_defaults(func=cmd_logs)
    p = sub.add_parser("run", parents=[common],
                       help="chat with a model: one answer for PROMPT, else a conversation "
                            "(interactive, or one turn per line of piped input)")
    p.add_argument("name", help="the model (a name or alias)")
    p.add_argument("prompt", nargs="*", help="the message (piped input is appended)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens per answer (default: the server's; with --completion "
                        f"{COMPLETION_MAX_TOKENS}, since a base model may never stop)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the server's)")
    p.add_argument("--completion", action="store_true",
                   help="plain text completion (/v1/completions): for base models without "
                        "a chat template")
    p.set_defaults(func=cmd_run, default_timeout=RUN_TIMEOUT_S)
    add_usage_command(sub, common)  # the usage ledger (issue 36): .usage


def run_client(args: argparse.Namespace) -> int:
    """Run a client command; turns the client's errors into messages and
    exit codes."""
    try:
        client = client_from_args(args)
        return args.func(client, args)
    except ValueError as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 2
    except NoServer as e:
        print(f"ggmux: {e}; start one with 'ggmux serve', or point --url or $GGMUX_URL "
              "at it", file=sys.stderr)
        return NO_SERVER
    except NoAnswer as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return NO_ANSWER
    except ServerError as e:
        hint = ""
        if e.status == 401:
            hint = (" (ggmux sends $GGMUX_API_KEY, and $GGMUX_ADMIN_KEY for load, unload, "
                    "cache clear, logs, keys and usage)")
        print(f"ggmux: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ggmux logs | head`
        sys.stderr.close()
        return 0


def _state(client: Client, name: str) -> dict:
    doc = client.object("GET", "/v1/models")
    for m in items(client, "GET", "/v1/models", doc, "data", ("id",)):
        aliases = m.get("aliases")
        if m["id"] == name or (isinstance(aliases, list) and name in aliases):
            return m
    raise ServerError(404, f"model '{name}' not found")


def _wait_state(client: Client, name: str, want: tuple[str, ...], wait: float,
                progress: bool) -> dict:
    """Follow ``/models/sse`` until ``name`` reaches one of ``want`` (or a
    failed unloaded state), at most ``wait`` seconds (then a 504
    :class:`ServerError`); the last status object."""
    deadline = time.monotonic() + wait
    canonical = _state(client, name)["id"]
    status: dict = {}
    try:
        for event, data in client.events("GET", "/models/sse", deadline=deadline):
            if event != "model":
                continue
            try:
                doc = parse_json(data)
            except ValueError:
                raise client.shape("GET", "/models/sse",
                                   f"an event that is not JSON ({data[:60]!r})") from None
            if not isinstance(doc, dict) or doc.get("id") != canonical:
                continue
            status = doc.get("status") if isinstance(doc.get("status"), dict) else {}
            value, share = status.get("value"), number(status.get("progress"))
            if progress and value == "loading" and share is not None:
                print(f"\rloading {canonical}: {share:.0%}", end="", file=sys.stderr,
                      flush=True)
            if value in want or (value == "unloaded" and status.get("failed")):
                break
    except TimedOut:
        raise ServerError(504, f"'{canonical}' is still {status.get('value', '?')} after "
                               f"{wait:g} s (--wait)") from None
    finally:
        if progress:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
    return status


def cmd_load(client: Client, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    client.json("POST", "/models/load", {"model": args.name}, admin=True)
    if args.no_wait:
        print(f"loading {args.name}")
        return 0
    status = _wait_state(client, args.name, ("loaded",), args.wait, sys.stderr.isatty())
    if status.get("value") != "loaded":
        print(f"ggmux: {args.name} failed to load: {status.get('error', 'see ggmux logs')}",
              file=sys.stderr)
        return 1
    print(f"loaded {args.name} in {time.monotonic() - t0:.1f} s")
    return 0


def cmd_unload(client: Client, args: argparse.Namespace) -> int:
    if args.all == bool(args.name):
        print("ggmux: give a model NAME or --all", file=sys.stderr)
        return 2
    target = "*" if args.all else args.name
    client.json("POST", "/models/unload", {"model": target}, admin=True)
    if args.all:
        print("unloading every idle model")
        return 0
    if args.no_wait:
        print(f"unloading {args.name}")
        return 0
    _wait_state(client, args.name, ("unloaded",), args.wait, False)
    print(f"unloaded {args.name}")
    return 0



def cmd_cache_clear(client: Client, args: argparse.Namespace) -> int:
    """``ggmux cache clear [MODEL]``: ``POST /cache/clear`` (issue 29); one
    line per model with what went."""
    doc = client.object("POST", "/cache/clear", {"model": args.name} if args.name else {},
                        admin=True)
    cleared = doc.get("cleared")
    if not isinstance(cleared, dict):
        raise client.shape("POST", "/cache/clear", "no 'cleared' object")
    failed = 0
    for name, res in cleared.items():
        if not isinstance(res, dict):
            continue
        line = (f"{name}: {number(res.get('ram')) or 0:.0f} RAM and "
                f"{number(res.get('disk')) or 0:.0f} disk entries removed")
        errors = res.get("errors") if isinstance(res.get("errors"), list) else []
        failed += bool(errors)
        print(line + "".join(f"; {e}" for e in errors))
    return 1 if failed else 0




# ps_table: the table of `ggmux ps`, which other modules import from here too
__all__ = ["add_client_commands", "add_client_options", "client_from_args", "cmd_cache_clear",
           "cmd_load", "cmd_unload", "ps_table", "run_client"]
