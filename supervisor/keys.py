"""Keys with limits (issue 36): the keys file (``ggmux serve --keys FILE``),
the key registry, and the edits the admin routes make to the file.

The file is INI as the presets are (:func:`~.presets.read_ini`: comments,
``${env.NAME}``), one section per key name, ``[*]`` the defaults of every
key::

    [*]
    rpm = 60
    [alice]
    key-sha256 = 9f86d081...      ; or key = THE-SECRET (hashed when read)
    models = smollm2-135m, gemma3-*   ; names or globs; * (the default): all
    rpm = 100                     ; requests per minute
    tpm = 20000                   ; prompt + completion tokens per minute
    max-parallel = 4              ; requests in flight at once
    tokens-per-day = 1000000      ; weighed tokens per day (and -week, -month)
    input-weight = 1              ; weights of the budgets' tokens: prompt
    cached-weight = 1             ; tokens not cached, cached prompt tokens,
    output-weight = 1             ; completion tokens
    spend-per-month = 5.0         ; currency units on priced models
    reserve-tokens = 512          ; completion tokens reserved when a request
                                  ; names no max_tokens
    expires = 2026-12-31          ; ISO date or time (UTC), or epoch seconds
    disabled = false

A limit left out (or 0) is no limit. Secrets never leave this module but as
their SHA-256 (:func:`hash_secret`): the registry, the key table, routes and
logs carry names and hashes only. Rows: a key keeps its row of the key table
(:mod:`ggmux.shm.keytable`) for the server's life, so a reload or a rotation
keeps its windows; a removed key's row waits for its name to come back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import math
import os
import re
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

from ..shm.keytable import DEFAULT_RESERVE_TOKENS, KeyTable, TableShape
from ..shm.keytable import weighed as _weighed
from .presets import GLOBAL_SECTION, PresetError, read_ini

log = logging.getLogger(__name__)

INT_KEYS = ("rpm", "tpm", "max-parallel", "tokens-per-day", "tokens-per-week",
            "tokens-per-month", "reserve-tokens")
FLOAT_KEYS = ("input-weight", "cached-weight", "output-weight", "spend-per-month")
KNOWN = frozenset((*INT_KEYS, *FLOAT_KEYS, "key", "key-sha256", "models", "expires",
                   "disabled"))
DEFAULT_RESERVE = DEFAULT_RESERVE_TOKENS
"""Completion tokens reserved at admission for a request that names no
``max_tokens`` (``reserve-tokens``), settled at its end."""
DONE_KEPT = 64  # admin edits whose outcome stays published for the proxy that waits
LIMIT_MAX = 10 ** 15
"""The largest count limit (``rpm``, ``tpm``, token budgets, ...): far past
any real one, and small enough that a window's counter plus a request's
reservation stays inside the key table's int64 words."""
WEIGHT_MAX = 1e6
"""The largest token weight: a weighed request stays inside int64."""
SPEND_MAX = 1e9
"""The largest ``spend-per-month`` in currency units: the key table counts
spend in nano-units, in int64 words."""
_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")
_HEX = re.compile(r"[0-9a-f]{64}\Z")


def hash_secret(secret: str | bytes) -> str:
    """The SHA-256 of a key's secret, lower-case hex: what is stored and
    compared. A plain hash, not a slow one: API keys are long random strings,
    and the proxies hash every request's key."""
    if isinstance(secret, str):
        secret = secret.encode()
    return hashlib.sha256(secret).hexdigest()


def builtin_hashes(proxy_keys: dict[str, str]) -> dict[str, str]:
    """Hash -> option of the built-in secrets (``proxy_keys``: ``api_key``, a
    comma-separated list, and ``admin_key``), which a keys file may not
    reuse (:func:`read_keys_file`)."""
    out = {hash_secret(k.strip()): "--api-key"
           for k in (proxy_keys.get("api_key") or "").split(",") if k.strip()}
    if proxy_keys.get("admin_key"):
        out[hash_secret(proxy_keys["admin_key"])] = "--admin-key"
    return out


def new_secret() -> str:
    """A fresh key: ``sk-ggmux-`` and 192 random bits, URL-safe."""
    return "sk-ggmux-" + secrets.token_urlsafe(24)


@dataclass(slots=True)
class KeyPolicy:
    """One key: ``name``, ``sha256`` of its secret, ``models`` (names or
    globs; ``("*",)`` all), limits (0: none): ``rpm``, ``tpm``,
    ``max_parallel``, ``tokens_per_day|week|month`` (weighed tokens),
    ``spend_per_month`` (currency units), weights, ``reserve_tokens``;
    ``expires`` (epoch seconds, 0: never), ``disabled``."""

    name: str
    sha256: str
    models: tuple[str, ...] = ("*",)
    rpm: int = 0
    tpm: int = 0
    max_parallel: int = 0
    tokens_per_day: int = 0
    tokens_per_week: int = 0
    tokens_per_month: int = 0
    input_weight: float = 1.0
    cached_weight: float = 1.0
    output_weight: float = 1.0
    spend_per_month: float = 0.0
    reserve_tokens: int = DEFAULT_RESERVE
    expires: float = 0.0
    disabled: bool = False
    source: str = ""

    def public(self, row: int) -> dict:
        """The policy as the key table carries it (no secret; its hash, which
        the proxies look keys up by)."""
        d = dataclasses.asdict(self)
        d.pop("source")
        d["models"] = list(self.models)
        d["row"] = row
        return d

    def shown(self) -> dict:
        """The policy as ``GET /keys`` shows it: no secret, not even its hash."""
        d = dataclasses.asdict(self)
        d.pop("sha256")
        d.pop("source")
        d["models"] = list(self.models)
        return d


def parse_expires(v: str) -> float:
    """``expires``: epoch seconds, or an ISO date or time (UTC when it names
    no zone); raises ``ValueError``."""
    try:
        return float(v)
    except ValueError:
        pass
    d = datetime.fromisoformat(v)
    if d.tzinfo is None:
        d = d.replace(tzinfo=UTC)
    return d.timestamp()


def _bool(v: str) -> bool:
    low = v.strip().lower()
    if low in ("1", "true", "on", "yes", "enabled"):
        return True
    if low in ("0", "false", "off", "no", "disabled", ""):
        return False
    raise ValueError(f"expected true or false, not {v!r}")


def _apply(p: KeyPolicy, key: str, v: str) -> None:
    attr = key.replace("-", "_")
    if key in INT_KEYS:
        try:
            n = int(v)
        except ValueError:
            raise ValueError("expected a whole number (0: no limit)") from None
        if not 0 <= n <= LIMIT_MAX:
            raise ValueError(f"must be 0 (no limit) to {LIMIT_MAX}")
        setattr(p, attr, n)
    elif key in FLOAT_KEYS:
        top = SPEND_MAX if key == "spend-per-month" else WEIGHT_MAX
        try:
            x = float(v)
        except ValueError:
            raise ValueError("expected a number") from None
        if not (math.isfinite(x) and 0 <= x <= top):
            raise ValueError(f"must be a number from 0 to {top:g}")
        setattr(p, attr, x)
    elif key == "key":
        if len(v) >= 2 and v[0] == v[-1] and v[0] in "\"'":
            v = v[1:-1]  # key = "sk-..." is the secret sk-..., as a shell reads it
        if not v:
            raise ValueError("empty key")
        p.sha256 = hash_secret(v)
    elif key == "key-sha256":
        if not _HEX.match(v.lower()):
            raise ValueError("expected 64 hex digits (sha256sum of the key)")
        p.sha256 = v.lower()
    elif key == "models":
        names = tuple(s.strip() for s in v.split(",") if s.strip())
        if not names:  # an empty list read as "every model" would open what was meant shut
            raise ValueError("empty (* for every model; disabled = true for none)")
        p.models = names
    elif key == "expires":
        p.expires = parse_expires(v)
        if not math.isfinite(p.expires) or p.expires < 0:
            raise ValueError("must be a date or time, or epoch seconds (0 or more)")
    elif key == "disabled":
        p.disabled = _bool(v)


def check_file_mode(path: str) -> None:
    """Refuse a keys file other users may steer or read secrets from, as
    ``tenant.key`` and ``kv.key`` are refused (ssh's ``StrictModes``):
    owned by another user than this one or root, or writable by group or
    others (whoever can write it gives themselves a key without limits),
    or, when it holds a secret itself (a ``key =`` line whose value is not
    a ``${env.NAME}``), readable by group or others. A file of
    ``key-sha256`` lines may be world-readable (a ConfigMap's 0644): a hash
    opens nothing. The mode is the file's a link points to. Raises
    :class:`PresetError` naming the file (and the line of the secret),
    never the secret; ``OSError`` when it cannot be read."""
    st = os.stat(path)
    mode = stat.S_IMODE(st.st_mode)
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        raise PresetError(path, 0, f"owned by uid {st.st_uid}, not by this user (uid {uid}) "
                          "or root: refused (its owner could give itself any key)")
    if mode & 0o022:
        raise PresetError(path, 0, f"may be written by other users (mode {mode:o}): refused, "
                          "whoever can write it can give themselves a key without limits "
                          "(chmod go-w it)")
    if not mode & 0o044:
        return
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    for n, line in enumerate(text.splitlines(), start=1):
        if _item(line) != "key":
            continue
        value = _COMMENT.split(line.split("=", 1)[1], 1)[0].strip().strip("\"'")
        if not _ENV_ONLY.match(value):
            raise PresetError(path, n, f"a key's secret is written here and the file may be "
                              f"read by other users (mode {mode:o}): refused (chmod 600 it, "
                              "or write key-sha256 = its SHA-256, or key = ${env.NAME})")


_ENV_ONLY = re.compile(r"\$\{env\.[A-Za-z_][A-Za-z0-9_]*\}\Z")


def read_keys_file(path: str, builtin: dict[str, str] | None = None) -> list[KeyPolicy]:
    """The keys of ``path`` in file order. Raises :class:`PresetError`
    (``FILE:LINE: reason``) for a file others may write or read a secret
    from (:func:`check_file_mode`), an unknown key, a setting given twice in a
    section, a bad value, a bad name, a key without ``key``/``key-sha256``,
    two keys with one secret, or a key whose secret is a built-in one
    (``builtin``: hash -> the option that gave it, ``--admin-key`` or
    ``--api-key``: the built-in key would win, so the file's limits would
    silently never apply); ``OSError`` when the file cannot be read."""
    builtin = builtin or {}
    check_file_mode(path)
    top, sections = read_ini(path, quote=False)
    if top:
        raise PresetError(path, top[0].line, f"'{top[0].key}' outside a section")
    defaults = KeyPolicy(name="*", sha256="")
    out: list[KeyPolicy] = []
    seen: dict[str, str] = {}
    for s in sections:
        if s.name == GLOBAL_SECTION:
            p = defaults
        else:
            if not _NAME.match(s.name):
                raise PresetError(path, s.line, f"bad key name [{s.name}] (letters, digits, "
                                  "_ . @ -; at most 64)")
            p = dataclasses.replace(defaults, name=s.name, sha256="",
                                    source=f"{path}:{s.line}")
        given: set[str] = set()
        for it in s.items:
            if it.key in given:  # which one was meant? the file says twice
                raise PresetError(path, it.line, f"'{it.key}' given twice in [{s.name}]")
            if it.key in ("key", "key-sha256") and {"key", "key-sha256"} & given:
                raise PresetError(path, it.line, f"[{s.name}] has both key and key-sha256")
            given.add(it.key)
            if it.key not in KNOWN:
                raise PresetError(path, it.line, f"unknown key '{it.key}' (known: "
                                  f"{', '.join(sorted(KNOWN))})")
            if s.name == GLOBAL_SECTION and it.key in ("key", "key-sha256"):
                raise PresetError(path, it.line, "[*] holds defaults, not a secret")
            try:
                _apply(p, it.key, it.value)
            except ValueError as e:
                # never the value: it may be the secret
                raise PresetError(path, it.line, f"{it.key}: {e}") from None
        if s.name == GLOBAL_SECTION:
            continue
        if not p.sha256:
            raise PresetError(path, s.line, f"[{s.name}] has no key or key-sha256")
        if p.sha256 in seen:
            raise PresetError(path, s.line, f"[{s.name}] has the same secret as "
                              f"[{seen[p.sha256]}]")
        if p.sha256 in builtin:
            raise PresetError(path, s.line, f"[{s.name}] has the secret of "
                              f"{builtin[p.sha256]} (which is never limited): give it its own")
        seen[p.sha256] = s.name
        out.append(p)
    return out


class KeyRegistry:
    """The keys of the keys file, with their rows in the key table; the
    supervisor's, and the ledger's source of key names (:meth:`name_of`)."""

    def __init__(self, path: str | None, table: KeyTable | None = None,
                 builtin: dict[str, str] | None = None) -> None:
        self.path = path
        self.table = table
        self.builtin = builtin or {}  # hashes of --admin-key / --api-key secrets -> option
        self.keys: dict[str, KeyPolicy] = {}
        self.rows: dict[str, int] = {}  # name -> row, for the server's life
        self.names: dict[int, str] = {}
        self.done: dict[str, str | None] = {}  # admin edits by id -> error, the last ones

    @classmethod
    def open(cls, path: str | None, table_name: str, shape: TableShape,
             builtin: dict[str, str] | None = None) -> KeyRegistry:
        """The registry of keys file ``path`` (None: no keys, the table holds
        only the spend of priced replicas) with a fresh key table
        ``table_name``; ``builtin``: :func:`builtin_hashes`. Raises
        ``ValueError`` (the file's error) or ``OSError``, after removing the
        table."""
        table = KeyTable.create(table_name, shape)
        reg = cls(path, table, builtin)
        err = reg.load() if path else reg.publish()
        if err is not None:
            table.close()
            raise ValueError(err)
        return reg

    def close(self) -> None:
        """Remove the key table."""
        if self.table is not None:
            self.table.close()
            self.table = None

    def command(self, cmd: dict) -> None:
        """A proxy's ``{"op": "keys", "id", "do", "name", "sha256"?,
        "fields"?}`` (an admin route): :meth:`edit`, then its outcome
        published under its id (the route waits for it)."""
        do, name, sha = cmd.get("do"), cmd.get("name"), cmd.get("sha256")
        fields = cmd.get("fields") if isinstance(cmd.get("fields"), dict) else None
        if do in ("create", "rotate") and not (isinstance(sha, str) and _HEX.match(sha)):
            err = "a new secret's hash is missing"
        elif not isinstance(name, str) or not isinstance(do, str):
            err = "bad key command"
        else:
            err = self.edit(do, name, sha, fields)
        log.info("keys: %s %s: %s", do, name if isinstance(name, str) else "?",
                 err or "done")
        self.done[str(cmd.get("id"))] = err
        while len(self.done) > DONE_KEPT:
            self.done.pop(next(iter(self.done)))
        self.publish()

    def load(self) -> str | None:
        """(Re)read the file and publish; the error when it failed (then
        nothing changed), else None."""
        if self.path is None:
            return None
        try:
            keys = read_keys_file(self.path, self.builtin)
        except (OSError, ValueError) as e:
            return str(e)
        return self.apply(keys)

    def reload(self, why: str) -> str | None:
        """:meth:`load` for a reload (``why``: what asked), the failure logged;
        the error for the admin's reload call (``GET /models?reload=1``:
        its text names the file and line, never a secret), else None."""
        err = self.load()
        if err is None:
            return None
        log.error("%s: the keys file did not reload, keeping the current keys: %s", why, err)
        return f"the keys file did not reload, the keys are unchanged: {err}"

    def apply(self, keys: list[KeyPolicy]) -> str | None:
        """Take ``keys`` as the current keys and publish them; the error
        when the table has no row left for a new one (nothing changed)."""
        rows = dict(self.rows)
        cap = int(self.table.keys.shape[0]) if self.table is not None else 1 << 30
        fresh = []
        for p in keys:
            if p.name not in rows:
                if len(rows) >= cap:
                    return (f"the key table holds {cap} keys (--keys-max): no row for "
                            f"[{p.name}]")
                rows[p.name] = len(rows)
                fresh.append(rows[p.name])
        old = set(self.keys)
        self.keys = {p.name: p for p in keys}
        self.rows = rows
        self.names = {r: n for n, r in rows.items()}
        if self.table is not None:
            for r in fresh:
                self.table.clear_row(r)
        self.publish()
        added = sorted(set(self.keys) - old)
        dropped = sorted(old - set(self.keys))
        log.info("keys: %d (%s%s)", len(self.keys),
                 f"added {', '.join(added)}" if added else "no key added",
                 f"; removed {', '.join(dropped)}" if dropped else "")
        return None

    def publish(self) -> None:
        """Write the policies to the key table (no secret in them)."""
        if self.table is not None:
            self.table.publish({"keys": [p.public(self.rows[p.name])
                                         for p in self.keys.values()], "done": self.done})

    def name_of(self, row: int) -> str | None:
        """The name of the key in ``row`` (the ledger's key names), or None."""
        return self.names.get(row)

    def seed(self, totals_since: Callable[[float], dict]) -> None:
        """Seed the day, week and month windows from the ledger (restart
        keeps the windows: ``totals_since(since_s)`` -> name -> totals with
        ``prompt_tokens``, ``cached_tokens``, ``completion_tokens``,
        ``cost``; ``since_s`` wall-clock seconds): each window gets the
        weighed tokens since its start. With a ledger sync
        (:mod:`.ledger.sync`), ``totals_since`` gives this node's rows only
        and the sync adds the other nodes', so none counts twice."""
        from ..shm.keytable import (
            K_DAY,
            K_MONTH,
            K_SPEND_MONTH_NANO,
            K_TOK_DAY,
            K_TOK_MONTH,
            K_TOK_WEEK,
            K_WEEK,
            NANO,
            period_end,
            periods,
        )

        t = self.table
        if t is None:
            return
        ids = periods(t.now())
        for kind, word, tok, pid in (("day", K_DAY, K_TOK_DAY, ids[1]),
                                     ("week", K_WEEK, K_TOK_WEEK, ids[2]),
                                     ("month", K_MONTH, K_TOK_MONTH, ids[3])):
            start = t.wall(period_end(kind, pid - 1))
            for name, tot in totals_since(start).items():
                p = self.keys.get(name)
                if p is None:
                    continue
                w = weighed(p, tot.prompt_tokens, tot.cached_tokens, tot.completion_tokens)
                with t.locked(self.rows[name]) as row:
                    row[word] = pid
                    row[tok] = w
                    if kind == "month":
                        row[K_SPEND_MONTH_NANO] = int(tot.cost * NANO)

    # ---- the admin routes' edits -------------------------------------------------------
    def edit(self, op: str, name: str, sha256: str | None = None,
             fields: dict[str, str] | None = None) -> str | None:
        """Change the keys file for an admin route and reload it: ``create``
        (a new section with ``key-sha256`` and ``fields``), ``rotate`` (its
        ``key-sha256`` replaced, the old secret stops working), ``disable``,
        ``enable``, ``delete``. The error (nothing changed) or None. The file
        is rewritten under a temporary name and renamed; its comments and
        other sections stay as they were."""
        if self.path is None:
            return "no --keys file: keys are read from one"
        if not _NAME.match(name or ""):
            return f"bad key name {name!r} (letters, digits, _ . @ -; at most 64)"
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as e:
            return str(e)
        span = _section(lines, name)
        if op == "create":
            if span is not None or name in self.keys:
                return f"key '{name}' exists (rotate changes its secret)"
            new = ["", f"[{name}]", f"key-sha256 = {sha256}"]
            for k, v in (fields or {}).items():
                if k not in KNOWN or k in ("key", "key-sha256"):
                    return f"unknown key setting '{k}'"
                v = str(v)
                why = _not_literal(v)
                if why is not None:
                    return f"{k}: {why}"
                new.append(f"{k} = {v}")
            lines += new
        else:
            if span is None:
                return f"no key '{name}' in {os.path.basename(self.path)}"
            a, b = span
            body = [ln for ln in lines[a + 1:b]]
            if op == "rotate":
                body = [ln for ln in body if _item(ln) not in ("key", "key-sha256")]
                body.insert(0, f"key-sha256 = {sha256}")
            elif op in ("disable", "enable"):
                body = [ln for ln in body if _item(ln) != "disabled"]
                body.insert(0, f"disabled = {'true' if op == 'disable' else 'false'}")
            elif op == "delete":
                lines = lines[:a] + lines[b:]
                body = None
            else:
                return f"unknown operation {op!r}"
            if body is not None:
                lines = lines[:a + 1] + body + lines[b:]
        old_keys = list(self.keys.values())
        # a link (a ConfigMap's, configuration management's) stays a link:
        # its target is what is rewritten, so the operator's file is the one
        # that changes (replacing the link would leave it silently unused)
        target = os.path.realpath(self.path)
        tmp = f"{target}.tmp{os.getpid()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            keep = None
            try:
                with open(target, "rb") as f:
                    keep = f.read()
            except OSError:
                pass
            os.replace(tmp, target)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            if target != os.path.abspath(self.path):
                return (f"the keys file {self.path} is a link to {target}, which cannot be "
                        f"written ({e.strerror or e}): edit the file it comes from (a "
                        "ConfigMap, configuration management) instead")
            return str(e)
        err = self.load()
        if err is not None:  # put the file back as it was
            if keep is not None:
                with open(target, "wb") as f:
                    f.write(keep)
            self.apply(old_keys)
        return err


def _not_literal(v: str) -> str | None:
    """Why value ``v``, written into the keys file by an admin route, would
    not read back as itself (None: it would). The file is read as the
    presets are: ``${env.NAME}`` is replaced by the environment variable,
    and ``;`` or ``#`` after whitespace starts a comment, so a value holding
    either would read as something else, and an expansion would let whoever
    holds the admin key over HTTP read any environment variable of the
    server (a cloud credential, a database password) back through ``GET
    /keys``. No setting needs them; the file's author may still write
    ``${env.NAME}`` there by hand."""
    if "\n" in v or "\r" in v:
        return "a value is one line"
    if "${" in v:
        return ("'${' is not taken from a route (the keys file would expand it as an "
                "environment variable): write the value itself, or edit the file")
    if _COMMENT.search(v):
        return "';' or '#' after a space starts a comment in the keys file"
    return None


_COMMENT = re.compile(r"(?:^|\s)[;#]")


def _item(line: str) -> str | None:
    s = line.strip()
    if not s or s[0] in ";#[" or "=" not in s:
        return None
    return s.split("=", 1)[0].strip()


def _section(lines: list[str], name: str) -> tuple[int, int] | None:
    """``(index of [name], index of the next section or the end)``."""
    start = None
    for i, ln in enumerate(lines):
        s = ln.strip()
        if s.startswith("["):
            sec = s[1:].split("]", 1)[0].strip()
            if start is not None:
                return start, i
            if sec == name:
                start = i
    return (start, len(lines)) if start is not None else None


def model_prices(registry, name: str) -> tuple[float, float, float]:
    """``(input, cached input, output)`` prices per million tokens of model
    ``name`` of ``registry`` (a :class:`~.registry.Registry`); zeros for an
    unknown or unpriced model (the ledger's ``prices_of``). Only a ``cmd``
    model's and an ``upstream``'s answers are priced (a built-in replica of a
    model that also has upstreams is free): the caller that knows the replica
    should check that; this gives the model's prices."""
    i = registry.by_name.get(name)
    if i is None:
        return 0.0, 0.0, 0.0
    e = registry.entries[i]
    return e.price_input, e.price_cached_input, e.price_output


def weighed(p: KeyPolicy, prompt: int, cached: int, completion: int) -> int:
    """Tokens a request counts against ``p``'s budgets (:func:`~ggmux.shm.keytable.weighed`)."""
    return _weighed(p.input_weight, p.cached_weight, p.output_weight, prompt, cached, completion)


__all__ = [
    "DEFAULT_RESERVE",
    "KeyPolicy",
    "KeyRegistry",
    "TableShape",
    "hash_secret",
    "model_prices",
    "new_secret",
    "parse_expires",
    "read_keys_file",
    "weighed",
]
