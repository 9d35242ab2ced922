"""The client commands of ``ggmux``: ``ps``, ``load``, ``unload``, ``logs``, ``run``.

They talk to a running server over its public HTTP API (stdlib
``http.client``, nothing else), found by ``--url``, else ``$GGMUX_URL``,
else ``http://127.0.0.1:8080``. The key comes from ``$GGMUX_API_KEY``;
``load``, ``unload`` and ``logs`` use ``$GGMUX_ADMIN_KEY`` when it is set
(the server's admin routes), else the API key. Shaped after Ollama's CLI
(``ollama ps``, ``ollama run``): plain columns, streamed answers.

Each ``cmd_*`` returns the process exit code: 0 done, 1 the server said no
(its message printed), 2 usage, 3 no server answered.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from collections.abc import Iterator
from urllib.parse import quote, urlsplit

DEFAULT_URL = "http://127.0.0.1:8080"
CONNECT_TIMEOUT_S = 5.0
NO_SERVER = 3
# `ggmux run --completion` without --max-tokens: a base model (no end of
# turn) would run until the context is full
COMPLETION_MAX_TOKENS = 128


class ServerError(Exception):
    """The server answered with an error status: ``status`` and its message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class NoServer(Exception):
    """Nothing answered at the URL (refused, unreachable, timed out)."""


class Client:
    """A small HTTP client of one ggmux server at ``url`` (``http://`` or
    ``https://``, an optional path prefix), sending ``key`` as a Bearer token
    (``admin_key`` on admin routes when given)."""

    def __init__(self, url: str, key: str | None = None, admin_key: str | None = None,
                 timeout: float = CONNECT_TIMEOUT_S) -> None:
        u = urlsplit(url if "://" in url else "http://" + url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        self.url = url
        self.scheme = u.scheme
        self.host = u.hostname
        self.port = u.port or (443 if u.scheme == "https" else 80)
        self.prefix = u.path.rstrip("/")
        self.key = key
        self.admin_key = admin_key
        self.timeout = timeout

    def _open(self, method: str, path: str, body=None, admin: bool = False,
              timeout: float | None = None) -> http.client.HTTPResponse:
        cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        headers = {"accept": "*/*"}
        key = (self.admin_key if admin and self.admin_key else None) or self.key
        if key:
            headers["authorization"] = "Bearer " + key
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["content-type"] = "application/json"
        try:
            conn.connect()
        except OSError as e:
            conn.close()
            raise NoServer(f"no server answers at {self.url} ({e.strerror or e})") from None
        conn.sock.settimeout(timeout)  # None: wait as long as a stream lasts
        try:
            conn.request(method, self.prefix + path, body=data, headers=headers)
            resp = conn.getresponse()
        except (ConnectionError, http.client.HTTPException) as e:
            conn.close()
            raise NoServer(f"the server at {self.url} closed the connection ({e})") from None
        if resp.status >= 400:
            text = resp.read()
            conn.close()
            raise ServerError(resp.status, _message(text) or f"HTTP {resp.status}")
        return resp

    def json(self, method: str, path: str, body=None, admin: bool = False,
             timeout: float | None = 60.0):
        """The decoded JSON answer; raises :class:`ServerError`, :class:`NoServer`."""
        resp = self._open(method, path, body, admin, timeout)
        try:
            return json.loads(resp.read() or b"null")
        finally:
            resp.close()

    def text(self, path: str, admin: bool = False) -> str:
        resp = self._open("GET", path, admin=admin, timeout=60.0)
        try:
            return resp.read().decode("utf-8", "replace")
        finally:
            resp.close()

    def events(self, method: str, path: str, body=None,
               admin: bool = False) -> Iterator[tuple[str, str]]:
        """Server-sent events as ``(event, data)``; a comment comes as
        ``("comment", text)`` (ggmux's "waiting for the model" lines)."""
        resp = self._open(method, path, body, admin, None)
        try:
            event, data = "message", []
            while True:
                raw = resp.readline()
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if not line:
                    if data:
                        yield event, "\n".join(data)
                    event, data = "message", []
                elif line.startswith(":"):
                    yield "comment", line[1:].strip()
                else:
                    field, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if field == "event":
                        event = value
                    elif field == "data":
                        data.append(value)
        finally:
            resp.close()


def _message(body: bytes) -> str:
    try:
        doc = json.loads(body)
    except ValueError:
        return body.decode("utf-8", "replace").strip()[:500]
    if isinstance(doc, dict):
        err = doc.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return str(doc)[:500]


def client_from_args(args: argparse.Namespace) -> Client:
    """The :class:`Client` that ``--url`` / ``$GGMUX_URL`` and the key
    variables name."""
    url = args.url or os.environ.get("GGMUX_URL") or DEFAULT_URL
    # the server's $GGMUX_API_KEY may list several keys: the first one serves
    return Client(url, (os.environ.get("GGMUX_API_KEY") or "").split(",")[0].strip() or None,
                  os.environ.get("GGMUX_ADMIN_KEY") or None)


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """Add ``ps``, ``load``, ``unload``, ``logs`` and ``run`` to ``sub``."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=None,
                        help=f"the server (default: $GGMUX_URL, else {DEFAULT_URL}); the key "
                             "comes from $GGMUX_API_KEY (load, unload and logs: "
                             "$GGMUX_ADMIN_KEY when set)")
    p = sub.add_parser("ps", parents=[common], help="models that run now (like ollama ps)")
    p.add_argument("--all", "-a", action="store_true", help="every model, unloaded ones too")
    p.add_argument("--json", action="store_true", help="the server's /ps document as JSON")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("load", parents=[common], help="load a model and wait until it serves")
    p.add_argument("name")
    p.add_argument("--no-wait", action="store_true", help="return once the server took it")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds to wait for the load (default: 900)")
    p.set_defaults(func=cmd_load)
    p = sub.add_parser("unload", parents=[common], help="unload a model, or every idle one")
    p.add_argument("name", nargs="?")
    p.add_argument("--all", action="store_true", help="every idle model")
    p.add_argument("--no-wait", action="store_true", help="return once the server took it")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds to wait for the unload (default: 120)")
    p.set_defaults(func=cmd_unload)
    p = sub.add_parser("logs", parents=[common],
                       help="recent log lines of the server and its models")
    p.add_argument("name", nargs="?", help="only this model's lines")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new lines")
    p.add_argument("--lines", "-n", type=int, default=None,
                   help="only the last N lines (default: all the server keeps; with -f, 100)")
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
    p.set_defaults(func=cmd_run)


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
    except ServerError as e:
        hint = ""
        if e.status == 401:
            hint = " (set $GGMUX_API_KEY, or $GGMUX_ADMIN_KEY for load, unload and logs)"
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


def ps_table(doc: dict, every: bool = False) -> str:
    """The text of ``ggmux ps`` from a ``/ps`` document: NAME, STATE,
    REPLICAS, MEMORY, IN FLIGHT, WAITING, IDLE FOR, UNTIL UNLOAD; unloaded
    models only with ``every``."""
    rows = [("NAME", "STATE", "REPLICAS", "MEMORY", "IN FLIGHT", "WAITING", "IDLE FOR",
             "UNTIL UNLOAD")]
    for m in doc.get("models", []):
        state = m["state"] + (" (failed)" if m.get("failed") else "")
        if not every and m["state"] == "unloaded" and not m.get("failed"):
            continue
        if m["state"] == "loading" and "progress" in m:
            state += f" {m['progress']:.0%}"
        reps = m.get("replicas") or []
        ready = sum(1 for r in reps if r["state"] == "ready")
        mem = m.get("memory") or {}
        until = m.get("unload_in_s")
        rows.append((
            m["id"], state, f"{ready}/{len(reps)}" if reps else "-",
            _bytes(mem.get("effective") or mem.get("min") or 0), str(m.get("in_flight", 0)),
            str(m.get("waiting", 0)), _seconds(m.get("idle_s")),
            _seconds(until) if until is not None else ("never" if m.get("idle_s") is not None
                                                       else "-"),
        ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows) + "\n"


def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    doc = client.json("GET", "/ps")
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write(ps_table(doc, every=args.all))
    return 0


# ---- load / unload ---------------------------------------------------------------
def _state(client: Client, name: str) -> dict:
    doc = client.json("GET", "/v1/models")
    for m in doc.get("data", []):
        if m["id"] == name or name in (m.get("aliases") or []):
            return m
    raise ServerError(404, f"model '{name}' not found")


def _wait_state(client: Client, name: str, want: tuple[str, ...], timeout: float,
                progress: bool) -> dict:
    """Follow ``/models/sse`` until ``name`` reaches one of ``want`` (or a
    failed unloaded state); the last status object."""
    deadline = time.monotonic() + timeout
    canonical = _state(client, name)["id"]
    status: dict = {}
    for event, data in client.events("GET", "/models/sse"):
        if event == "model":
            doc = json.loads(data)
            if doc.get("id") != canonical:
                continue
            status = doc.get("status") or {}
            value = status.get("value")
            if progress and value == "loading" and "progress" in status:
                print(f"\rloading {canonical}: {status['progress']:.0%}", end="",
                      file=sys.stderr, flush=True)
            if value in want or (value == "unloaded" and status.get("failed")):
                break
        if time.monotonic() > deadline:
            raise ServerError(504, f"'{canonical}' is still {status.get('value', '?')} after "
                                   f"{timeout:g} s (--timeout)")
    if progress:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    return status


def cmd_load(client: Client, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    client.json("POST", "/models/load", {"model": args.name}, admin=True)
    if args.no_wait:
        print(f"loading {args.name}")
        return 0
    status = _wait_state(client, args.name, ("loaded",), args.timeout, sys.stderr.isatty())
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
    _wait_state(client, args.name, ("unloaded",), args.timeout, False)
    print(f"unloaded {args.name}")
    return 0


# ---- logs ---------------------------------------------------------------------
def cmd_logs(client: Client, args: argparse.Namespace) -> int:
    from ..proxy.logs import format_line

    query = []
    if args.name:
        query.append("model=" + quote(args.name, safe=""))
    if args.lines is not None:
        query.append(f"lines={args.lines}")
    qs = ("?" + "&".join(query)) if query else ""
    if not args.follow:
        sys.stdout.write(client.text("/logs" + qs, admin=True))
        return 0
    for event, data in client.events("GET", "/logs/stream" + qs, admin=True):
        if event == "comment":
            continue
        try:
            rec = json.loads(data)
        except ValueError:
            continue
        print(format_line(rec), flush=True)
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
        chunk = json.loads(data)
        if chunk.get("error"):
            raise ServerError(502, _message(data.encode()))
        if waiting_shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)
            waiting_shown = False
        for choice in chunk.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content") if "delta" in choice \
                else choice.get("text")
            if piece:
                text.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    out.flush()
    return "".join(text)


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
