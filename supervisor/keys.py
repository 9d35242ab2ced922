"""Keys with limits (issue 36): the key registry, the keys of the keys file
(:mod:`.keys_file`: its format, reading and checking it) with their rows in
the key table, and the edits the admin routes make to the file.

Secrets never leave the keys file's reader but as their SHA-256
(:func:`~.keys_file.hash_secret`): the registry, the key table, routes and
logs carry names and hashes only. Rows: a key keeps its row of the key table
(:mod:`ggmux.shm.keytable`) for the server's life, so a reload or a rotation
keeps its windows; a removed key's row waits for its name to come back.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable

from ..shm.keytable import KeyTable, TableShape
from .keys_file import (
    KEY_NAME,
    KNOWN,
    SHA256_HEX,
    KeyPolicy,
    not_literal,
    read_keys_file,
    section_span,
    setting_name,
    weighed,
)

log = logging.getLogger(__name__)

DONE_KEPT = 64  # admin edits whose outcome stays published for the proxy that waits


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
        if do in ("create", "rotate") and not (isinstance(sha, str) and SHA256_HEX.match(sha)):
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
        if not KEY_NAME.match(name or ""):
            return f"bad key name {name!r} (letters, digits, _ . @ -; at most 64)"
        try:
            with open(self.path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            lines = []
        except OSError as e:
            return str(e)
        span = section_span(lines, name)
        if op == "create":
            if span is not None or name in self.keys:
                return f"key '{name}' exists (rotate changes its secret)"
            new = ["", f"[{name}]", f"key-sha256 = {sha256}"]
            for k, v in (fields or {}).items():
                if k not in KNOWN or k in ("key", "key-sha256"):
                    return f"unknown key setting '{k}'"
                v = str(v)
                why = not_literal(v)
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
                body = [ln for ln in body if setting_name(ln) not in ("key", "key-sha256")]
                body.insert(0, f"key-sha256 = {sha256}")
            elif op in ("disable", "enable"):
                body = [ln for ln in body if setting_name(ln) != "disabled"]
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
