"""The keys file of keys with limits (``ggmux serve --keys FILE``): its
settings, reading and checking it, and the helpers the admin routes' edits
use to rewrite its text (the registry that holds the keys read is
:mod:`.keys`).

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
logs carry names and hashes only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
import secrets
import stat
from dataclasses import dataclass
from datetime import UTC, datetime

from ..shm.keytable import DEFAULT_RESERVE_TOKENS
from ..shm.keytable import weighed as _weighed
from .presets import GLOBAL_SECTION, PresetError, read_ini

INT_KEYS = ("rpm", "tpm", "max-parallel", "tokens-per-day", "tokens-per-week",
            "tokens-per-month", "reserve-tokens")
FLOAT_KEYS = ("input-weight", "cached-weight", "output-weight", "spend-per-month")
KNOWN = frozenset((*INT_KEYS, *FLOAT_KEYS, "key", "key-sha256", "models", "expires",
                   "disabled"))
DEFAULT_RESERVE = DEFAULT_RESERVE_TOKENS
"""Completion tokens reserved at admission for a request that names no
``max_tokens`` (``reserve-tokens``), settled at its end."""
LIMIT_MAX = 10 ** 15
"""The largest count limit (``rpm``, ``tpm``, token budgets, ...): far past
any real one, and small enough that a window's counter plus a request's
reservation stays inside the key table's int64 words."""
WEIGHT_MAX = 1e6
"""The largest token weight: a weighed request stays inside int64."""
SPEND_MAX = 1e9
"""The largest ``spend-per-month`` in currency units: the key table counts
spend in nano-units, in int64 words."""
KEY_NAME = re.compile(r"[A-Za-z0-9_.@-]{1,64}\Z")
"""A key's name (its section): it shows in logs, routes and the ledger."""
SHA256_HEX = re.compile(r"[0-9a-f]{64}\Z")
"""A secret's SHA-256 as ``key-sha256`` holds it (lower-case hex)."""


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
        if not SHA256_HEX.match(v.lower()):
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
        if setting_name(line) != "key":
            continue
        value = COMMENT.split(line.split("=", 1)[1], 1)[0].strip().strip("\"'")
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
            if not KEY_NAME.match(s.name):
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


def weighed(p: KeyPolicy, prompt: int, cached: int, completion: int) -> int:
    """Tokens a request counts against ``p``'s budgets (:func:`~ggmux.shm.keytable.weighed`)."""
    return _weighed(p.input_weight, p.cached_weight, p.output_weight, prompt, cached, completion)


def not_literal(v: str) -> str | None:
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
    if COMMENT.search(v):
        return "';' or '#' after a space starts a comment in the keys file"
    return None


COMMENT = re.compile(r"(?:^|\s)[;#]")
"""Where a comment starts on a line of the file (``;`` or ``#`` after
whitespace, as :func:`~.presets.read_ini` reads it)."""


def setting_name(line: str) -> str | None:
    """The setting a line of the file gives (``rpm`` of ``rpm = 60``), None
    for a blank line, a comment or a section header."""
    s = line.strip()
    if not s or s[0] in ";#[" or "=" not in s:
        return None
    return s.split("=", 1)[0].strip()


def section_span(lines: list[str], name: str) -> tuple[int, int] | None:
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
