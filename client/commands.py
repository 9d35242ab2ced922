"""The client commands of ``ggmux``: ``ps``, ``load``, ``unload``, ``logs``, ``run``.

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
import json
import os
import sys
import time
from urllib.parse import quote

from .http_client import (
    DEFAULT_TIMEOUT_S,
    DEFAULT_URL,
    MAX_ANSWER_BYTES,
    Client,
    NoAnswer,
    NoServer,
    ServerError,
    TimedOut,
    error_message,
    items,
    json_kind,
    number,
    parse_json,
)
from .keys import add_keys_command
from .usage import add_usage_command

NO_ANSWER = NO_SERVER = 3
# `ggmux run --completion` without --max-tokens: a base model (no end of
# turn) would run until the context is full
COMPLETION_MAX_TOKENS = 128
# `ggmux run` without --timeout: its answer's head comes with the first
# token (after the prompt is read and a slot is free), which may take long
# on a CPU; the server's own --first-byte-timeout (600 s) answers 504 by then
RUN_TIMEOUT_S = 600.0


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
    p.add_argument("name")
    p.add_argument("--no-wait", action="store_true", help="return once the server took it")
    p.add_argument("--wait", type=float, default=900.0, metavar="S",
                   help="seconds to wait for the load (default: 900)")
    p.set_defaults(func=cmd_load)
    p = sub.add_parser("unload", parents=[common], help="unload a model, or every idle one")
    p.add_argument("name", nargs="?")
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
    p.add_argument("name")
    p.add_argument("prompt", nargs="*", help="the message (piped input is appended)")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="most tokens per answer (default: the server's; with --completion "
                        f"{COMPLETION_MAX_TOKENS}, since a base model may never stop)")
    p.add_argument("--temperature", type=float, default=None)
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
            hint = (" (set $GGMUX_API_KEY, or $GGMUX_ADMIN_KEY for load, unload, cache clear, "
                    "logs, keys and usage)")
        print(f"ggmux: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ggmux logs | head`
        sys.stderr.close()
        return 0


# ---- ps ----------------------------------------------------------------------
def _bytes(n: int) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:.0f} min"


def _node_cell(m: dict) -> str:
    """The NODE cell of a model: the node that serves it, then (in
    parentheses) the other nodes holding or loading it; ``-`` for none."""
    node = m.get("node") if isinstance(m.get("node"), str) else None
    nodes = m.get("nodes") if isinstance(m.get("nodes"), list) else []
    others = [n["node"] for n in nodes if isinstance(n, dict) and isinstance(n.get("node"), str)
              and n["node"] != node]
    if node is None:
        return ", ".join(others) or "-"
    return node + (f" (+{', '.join(others)})" if others else "")


def _cache_cell(cache) -> str:
    """``RAM/DISK`` bytes of a model's KV tiers (``/ps``'s ``cache``); ``-``
    when both are 0 or the field is not an object."""
    if not isinstance(cache, dict):
        return "-"
    ram, disk = number(cache.get("ram")) or 0, number(cache.get("disk")) or 0
    return f"{_bytes(ram) if ram else 0}/{_bytes(disk) if disk else 0}" if ram or disk else "-"


def _drafts_cell(d) -> str:
    """The DRAFTS cell: the share of draft tokens accepted and how many
    were drafted (``83% of 120``), ``0 drafted`` when speculation is on and
    nothing was drafted yet, ``-`` for a model that does not draft."""
    if not isinstance(d, dict):
        return "-"
    drafted, accepted = number(d.get("drafted")) or 0, number(d.get("accepted")) or 0
    if not drafted:
        return "0 drafted"
    return f"{accepted / drafted:.0%} of {int(drafted)}"


def _memory_cell(state: str, mem: dict) -> str:
    """The MEMORY cell: what the model's replicas hold; while it loads, the
    minimum the ledger set aside for it, marked ``min``; ``-`` for a model
    that holds nothing (issue 31, item 14: an unloaded model showed its
    measured minimum, as if it held it)."""
    held = number(mem.get("effective")) or 0
    if held:
        return _bytes(held)
    low = number(mem.get("min")) or 0
    if state == "loading" and low:
        return _bytes(low) + " min"
    return "-"


def _media_cell(modalities) -> str:
    """``vision``, ``audio``, ``vision+audio`` (what a model's projector
    reads), ``-`` for none."""
    if not isinstance(modalities, dict):
        return "-"
    got = [k for k in ("vision", "audio") if modalities.get(k) is True]
    return "+".join(got) if got else "-"


def ps_table(doc: dict, every: bool = False) -> str:
    """The text of ``ggmux ps`` from a ``/ps`` document: NAME, STATE,
    (in cluster mode, when the document names this ``node``) NODE,
    REPLICAS, MEMORY (:func:`_memory_cell`), CACHE (its KV tiers: RAM/disk,
    issue 29; ``-`` for none), DRAFTS (when a model drafts:
    :func:`_drafts_cell`), MEDIA (when a model reads images or audio:
    :func:`_media_cell`), IN FLIGHT, WAITING, IDLE FOR, UNTIL UNLOAD, then
    one line per model whose requests wait saying why (issue 34);
    unloaded models only with ``every``. NODE is the node that serves the model (as
    ``ollama ps``'s PROCESSOR says where it runs), other nodes holding it
    after it. Each model has a string ``id`` and ``state`` (:func:`items`);
    another field of an unexpected type shows as ``-``. With no row to
    show, one line that says so (and that ``--all`` lists every model)."""
    cluster = isinstance(doc.get("node"), str)
    models = doc.get("models") or []
    # speculative decoding's acceptance, when a model drafts (its `drafts`)
    drafts = any(isinstance(m.get("drafts"), dict) for m in models)
    # what a model reads beside text (a projector's), when any model has one
    media = any(_media_cell(m.get("modalities")) != "-" for m in models)
    rows = [("NAME", "STATE", *(("NODE",) if cluster else ()), "REPLICAS", "MEMORY",
             "CACHE", *(("DRAFTS",) if drafts else ()), *(("MEDIA",) if media else ()),
             "IN FLIGHT", "WAITING", "IDLE FOR",
             "UNTIL UNLOAD")]
    for m in models:
        failed = bool(m.get("failed"))
        if not every and m["state"] == "unloaded" and not failed:
            continue
        state = m["state"] + (" (failed)" if failed else "")
        if any(isinstance(r, dict) and r.get("draining") is True
               for r in (m.get("replicas") if isinstance(m.get("replicas"), list) else [])):
            state += " (draining)"
        progress = number(m.get("progress"))
        if m["state"] == "loading" and progress is not None:
            state += f" {progress:.0%}"
        reps = m.get("replicas")
        reps = [r for r in reps if isinstance(r, dict)] if isinstance(reps, list) else []
        ready = sum(1 for r in reps if r.get("state") == "ready")
        mem = m.get("memory") if isinstance(m.get("memory"), dict) else {}
        idle, until = number(m.get("idle_s")), number(m.get("unload_in_s"))
        rows.append((
            m["id"], state, *((_node_cell(m),) if cluster else ()),
            f"{ready}/{len(reps)}" if reps else "-",
            _memory_cell(m["state"], mem), _cache_cell(m.get("cache")),
            *((_drafts_cell(m.get("drafts")),) if drafts else ()),
            *((_media_cell(m.get("modalities")),) if media else ()),
            str(m.get("in_flight", 0)), str(m.get("waiting", 0)), _seconds(idle),
            _seconds(until) if until is not None else ("never" if idle is not None else "-"),
        ))
    if len(rows) == 1:
        if every:
            return "the server has no models\n"
        return (f"no model is running ({len(models)} known; ggmux ps --all lists every "
                "model)\n")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    # why requests wait (issue 34), one line per waiting model under the table
    why = [f"{m['id']}: {q['why']} ({q.get('waiters', 0)} waiting, oldest "
           f"{_seconds(number(q.get('oldest_wait_s')))})"
           for m in models if isinstance(q := m.get("queue"), dict)
           and isinstance(q.get("why"), str) and q["why"]]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows) + "\n" + "".join(w + "\n" for w in why)


def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    doc = client.object("GET", "/ps")
    items(client, "GET", "/ps", doc, "models", ("id", "state"))
    if args.json:
        try:
            text = json.dumps(doc, indent=2)
        except RecursionError:
            raise client.shape("GET", "/ps", "JSON nested too deep") from None
        print(text)
    else:
        sys.stdout.write(ps_table(doc, every=args.all))
    return 0


# ---- load / unload ---------------------------------------------------------------
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


# ---- logs ---------------------------------------------------------------------
REQUEST_COLUMNS = (("TIME", 12), ("MODEL", 24), ("REPLICA", 9), ("API", 37), ("STATUS", 6),
                   ("PROMPT", 6), ("CACHED", 6), ("GEN", 6), ("TTFT", 9), ("TOK/S", 7),
                   ("DURATION", 9))
"""``ggmux logs --requests``: its columns and their widths (a followed table
cannot measure its rows first)."""


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
    for event, data in client.events("GET", "/requests/stream" + qs, admin=True):
        if event == "comment":
            continue
        try:
            rec = parse_json(data)
        except ValueError:
            continue
        if isinstance(rec, dict):
            print(request_line(rec), flush=True)
    return 0


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
    for event, data in client.events("GET", "/logs/stream" + qs, admin=True):
        if event == "comment":
            continue
        try:
            rec = parse_json(data)
        except ValueError:
            continue
        if isinstance(rec, dict):  # a time that is not a number shows as the epoch
            print(format_line({**rec, "ts": number(rec.get("ts")) or 0.0}), flush=True)
    return 0


# ---- run ------------------------------------------------------------------------
def _answer(client: Client, args: argparse.Namespace, body: dict, out=None) -> str:
    """Stream one answer to ``out`` (stdout), return its text."""
    out = out or sys.stdout
    path = "/v1/completions" if args.completion else "/v1/chat/completions"
    text = []
    waiting_shown = False
    for event, data in client.events("POST", path, body):
        if event == "comment":
            if data.startswith("waiting for") and sys.stderr.isatty():
                print(f"\r{data}", end="", file=sys.stderr, flush=True)
                waiting_shown = True
            continue
        if data.strip() == "[DONE]":
            break
        for piece in _pieces(client, path, data):
            if waiting_shown:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
                waiting_shown = False
            if piece:
                text.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    out.flush()
    return "".join(text)


def _pieces(client: Client, path: str, data: str) -> list[str]:
    """The text of one streamed chunk (chat ``delta.content`` or completion
    ``text``, one per choice); an error event is a :class:`ServerError`,
    a chunk of another shape :class:`NoAnswer`."""
    try:
        chunk = parse_json(data)
    except ValueError:
        raise client.shape("POST", path, f"an event that is not JSON ({data[:60]!r})") from None
    if not isinstance(chunk, dict):
        raise client.shape("POST", path, f"an event that is a JSON {json_kind(chunk)}")
    if chunk.get("error"):
        raise ServerError(502, error_message(data.encode()))
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise client.shape("POST", path, "an event whose 'choices' are not objects")
    out = []
    for choice in choices:
        delta = choice.get("delta")
        piece = (delta.get("content") if isinstance(delta, dict) else None) \
            if "delta" in choice else choice.get("text")
        out.append(piece if isinstance(piece, str) else "")
    return out or [""]


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    base: dict = {"model": args.name, "stream": True}
    if args.max_tokens is not None:
        base["max_tokens"] = args.max_tokens
    elif args.completion:
        base["max_tokens"] = COMPLETION_MAX_TOKENS
    if args.temperature is not None:
        base["temperature"] = args.temperature
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompt = " ".join(args.prompt)
    piped = not sys.stdin.isatty()
    if prompt:  # one answer; piped input is part of the prompt (as ollama run does)
        if piped:
            extra = sys.stdin.read().strip()
            prompt = f"{prompt}\n\n{extra}" if extra else prompt
        _answer(client, args, _request(args, base, system, [], prompt))
        return 0
    history: list[dict] = []
    while True:  # a conversation: interactive, or one turn per piped line
        try:
            line = input() if piped else input(">>> ")
        except EOFError:
            if not piped:
                print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/bye", "/exit", "/quit"):
            return 0
        if line == "/clear":
            history = []
            continue
        answer = _answer(client, args, _request(args, base, system, history, line))
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def _request(args: argparse.Namespace, base: dict, system: list[dict], history: list[dict],
             line: str) -> dict:
    if args.completion:
        prior = "".join(f"{m['content']}\n" for m in history)
        return {**base, "prompt": prior + line}
    return {**base, "messages": [*system, *history, {"role": "user", "content": line}]}
