"""The router's side of the KV tiers (issue 29; DESIGN.md "KV tiers").

What the supervisor needs to know and do about a model's prompt caches
outside its slots, without running an engine:

* :func:`tiers_of`: a model's tier settings from its preset and ``serve``
  options: the built-in instance's disk tier (``--cache-disk DIR``, its
  ``--cache-save-timeout``), a ``cmd`` llama-server's ``slot-save-path``.
* :func:`stop_budget`: seconds from ``exit`` to SIGTERM: the model's
  ``stop-timeout`` plus, with a disk tier, its save timeout, since an
  instance that stops writes its slots to disk within that bound before
  it exits (so the save is never cut by the supervisor's SIGTERM, and the
  eviction never waits past ``stop-timeout + cache-save-timeout``).
* :func:`disk_use` / :func:`clear_disk`: the disk tier's layout, as the
  built-in instance writes it: ``DIR/<fingerprint hex>/model.json``
  (``{"model": name, "path": gguf, "fingerprint": {...}}``) and one file
  per cached prefix, hash-named. A model's folders are those whose
  ``model.json`` names it (several: a GGUF or setting changed since).
* :func:`slot_file`, :func:`save_slots`, :func:`restore_slots`: a ``cmd``
  llama-server's slots saved through ``POST /slots/{id}?action=save``
  before it stops and restored (``action=restore``) after its next load,
  best effort, as Unsloth Studio does around its idle unload. File names
  are ``ggmux-<model hash>-<config hash>-slot<id>.bin``: no prompt text, no
  model name; the config hash covers the command line and the size and
  modification time of every GGUF file it names (the model, a projector,
  LoRA adapters), so a slot saved by another GGUF or context size is never
  restored.

The blocking parts (HTTP to a replica, directory walks) run on
:class:`~ggmux.supervisor.jobs.Jobs` threads, each bounded by the save
timeout.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import secrets
import shlex
import time
from dataclasses import dataclass, field

from ...instance.cache.safe_files import (
    make_secret,
    open_folder,
    open_regular,
    open_root,
    read_secret,
)
from ..registry import ModelEntry

log = logging.getLogger(__name__)

DEFAULT_SAVE_TIMEOUT_S = 2.0
"""``--cache-save-timeout`` when none is given (issue 29: "default small,
e.g. 2 s")."""

MODEL_JSON = "model.json"
MODEL_JSON_MAX = 64 << 10  # a model.json larger than this is not ours: skipped
SLOT_SAVE_PLACEHOLDER = "${SLOT_SAVE_PATH}"


@dataclass(slots=True, frozen=True)
class Tiers:
    """A model's tier settings: ``disk_dir`` the built-in instance's disk
    tier (``""``: none), ``save_timeout`` seconds a stopping replica may
    spend saving, ``slot_dir`` a ``cmd`` llama-server's ``slot-save-path``
    (``""``: none)."""

    disk_dir: str = ""
    save_timeout: float = DEFAULT_SAVE_TIMEOUT_S
    slot_dir: str = ""

    @property
    def on_disk(self) -> bool:
        """Whether prefixes of this model outlive its replicas on disk."""
        return bool(self.disk_dir or self.slot_dir)


def _option(args: list[str], name: str) -> str | None:
    """The value of the last ``name VALUE`` (or ``name=VALUE``) in ``args``."""
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
        elif a.startswith(name + "="):
            found = a[len(name) + 1:]
    return found


def tiers_of(entry: ModelEntry) -> Tiers:
    """The tier settings of ``entry``: ``--cache-disk`` and
    ``--cache-save-timeout`` among its llama options (preset keys) or its
    ``serve`` options (the preset wins); for a ``cmd`` model, its preset's
    ``slot-save-path``, else the ``--slot-save-path`` of its command line."""
    args = [*entry.instance_args, *entry.extra_args]  # the preset's last: it wins
    disk = _option(args, "--cache-disk") or ""
    timeout = DEFAULT_SAVE_TIMEOUT_S
    t = _option(args, "--cache-save-timeout")
    if t is not None:
        try:
            timeout = max(0.0, float(t))
        except ValueError:
            pass
    slot = ""
    if entry.kind == "cmd":
        slot = _option(entry.extra_args, "--slot-save-path") or ""
        if not slot:
            try:
                given = _option(shlex.split(entry.cmd or ""), "--slot-save-path") or ""
            except ValueError:
                given = ""
            slot = "" if given == SLOT_SAVE_PLACEHOLDER else given
        disk = ""  # a command has no built-in disk tier
    return Tiers(os.path.expanduser(disk) if disk else "", timeout,
                 os.path.expanduser(slot) if slot else "")


def stop_budget(entry: ModelEntry) -> float:
    """Seconds from ``exit`` (or, for a ``cmd`` replica, from the end of its
    slot save) to SIGTERM: ``stop-timeout``, plus the save timeout for a
    built-in instance with a disk tier (module docstring)."""
    t = tiers_of(entry)
    return entry.stop_timeout + (t.save_timeout if t.disk_dir else 0.0)


def cmd_line(entry: ModelEntry, line: str) -> str:
    """A ``cmd`` model's command line with its ``slot-save-path``: the
    ``${SLOT_SAVE_PATH}`` placeholder replaced, or, when the preset names a
    path the line does not, ``--slot-save-path PATH`` appended. The folder
    is made (mode 0700) when missing: llama-server refuses one that is not
    there."""
    slot = tiers_of(entry).slot_dir
    if not slot:
        return line
    try:
        os.makedirs(slot, mode=0o700, exist_ok=True)
    except OSError as e:
        log.warning("%s: cannot make slot-save-path %s: %s", entry.name, slot, e)
    if SLOT_SAVE_PLACEHOLDER in line:
        return line.replace(SLOT_SAVE_PLACEHOLDER, shlex.quote(slot))
    if "--slot-save-path" not in line:
        return f"{line} --slot-save-path {shlex.quote(slot)}"
    return line


TENANT_KEY_FILE = "tenant.key"


def tenant_secret(entries) -> str:
    """The key the proxies hash API keys into tenant ids with
    (:func:`ggmux.http1.auth.tenant`), 32 hex digits: random per start, but
    kept in ``DIR/tenant.key`` (mode 0600) of the first disk tier of
    ``entries`` (registry entries) when there is one, so that under
    ``cache-scope key`` a key is the same tenant after a restart and the
    entries it saved to disk are restored for it (and for no one else).
    Servers sharing the folder share the key (made once, linked into
    place). The disk tier's rules hold (:mod:`~ggmux.instance.cache.safe_files`,
    issue 37): a ``DIR`` another user owns or may write, and a
    ``tenant.key`` that is a link, a FIFO, another's or readable by
    others, are not used (logged; a random key instead)."""
    dirs = sorted({t.disk_dir for e in entries if (t := tiers_of(e)).disk_dir})
    for d in dirs:
        path = os.path.join(d, TENANT_KEY_FILE)
        try:
            fd = open_root(d)
        except OSError as e:
            log.error("not keeping the tenant key in %s: %s", d, e.strerror or e)
            continue
        try:
            try:
                raw = read_secret(TENANT_KEY_FILE, fd)
            except FileNotFoundError:
                raw = make_secret(TENANT_KEY_FILE, (secrets.token_hex(16) + "\n").encode(), fd)
        except OSError as e:
            log.error("%s not used: %s", path, e.strerror or e)
            continue
        finally:
            os.close(fd)
        key = raw.decode("ascii", "replace").strip()
        if re.fullmatch(r"[0-9a-f]{32}", key):
            return key
        log.warning("%s is not 32 hex digits: not used", path)
    return secrets.token_hex(16)


# ---- the built-in instance's disk tier ------------------------------------


@dataclass(slots=True)
class DiskUse:
    """What a model holds on disk: ``entries`` files, ``bytes`` their size."""

    entries: int = 0
    bytes: int = 0


ENTRY_RE = re.compile(r"\.?[0-9a-f]{64}(\.kv|\.[0-9]+\.tmp)")
"""An entry's file name (``<sha256>.kv``) or a save's temporary one
(``.<sha256>.<pid>.tmp``): the only files a clear removes (issue 37, item 6:
an operator's notes in the folder stay)."""


def _model_folders(disk_dir: str, name: str, fn) -> list:
    """``fn(fd, path)`` for each folder of ``disk_dir`` whose ``model.json``
    names model ``name``, ``fd`` its descriptor (opened without following a
    link, checked as the instance checks it); their results. A missing or
    unsafe directory has none (an unsafe one is logged); an unreadable or
    foreign model.json is skipped."""
    out = []
    try:
        root = open_folder(os.path.realpath(disk_dir))
    except FileNotFoundError:
        return out
    except OSError as e:
        log.error("KV disk tier %s not used: %s", disk_dir, e.strerror or e)
        return out
    try:
        subs = sorted(n for n in os.listdir(root) if not n.startswith("."))
        for sub in subs:
            try:
                fd = open_folder(sub, root)
            except OSError:
                continue  # a file, a link, another's: not a folder of ours
            try:
                try:
                    mfd = open_regular(MODEL_JSON, fd)
                    with os.fdopen(mfd, "rb") as f:
                        doc = json.loads(f.read(MODEL_JSON_MAX + 1)[:MODEL_JSON_MAX])
                except (OSError, ValueError):
                    continue
                if isinstance(doc, dict) and doc.get("model") == name:
                    out.append(fn(fd, os.path.join(disk_dir, sub)))
            finally:
                os.close(fd)
    finally:
        os.close(root)
    return out


def model_folders(disk_dir: str, name: str) -> list[str]:
    """The folders of ``disk_dir`` whose ``model.json`` names model ``name``."""
    return _model_folders(disk_dir, name, lambda fd, path: path)


def _entries(fd: int) -> list[str]:
    try:
        return [n for n in os.listdir(fd) if ENTRY_RE.fullmatch(n)]
    except OSError:
        return []


def _use_in(fd: int, path: str) -> DiskUse:
    use = DiskUse()
    for n in _entries(fd):
        try:
            use.bytes += os.stat(n, dir_fd=fd, follow_symlinks=False).st_size
            use.entries += 1
        except OSError:
            continue
    return use


def _clear_in(fd: int, path: str) -> int:
    n = 0
    for name in _entries(fd):
        try:
            os.unlink(name, dir_fd=fd)
            n += 1
        except OSError as err:
            log.warning("cannot remove %s in %s: %s", name, path, err)
    return n


def disk_use(disk_dir: str, name: str) -> DiskUse:
    """Entries and bytes of model ``name`` in disk tier ``disk_dir`` (the
    entry files of its folders)."""
    use = DiskUse()
    for u in _model_folders(disk_dir, name, _use_in):
        use.entries += u.entries
        use.bytes += u.bytes
    return use


def clear_disk(disk_dir: str, name: str) -> int:
    """Remove model ``name``'s entries from disk tier ``disk_dir`` (entry
    files only: its ``model.json`` and whatever else an operator keeps
    there stay); the number of files removed."""
    return sum(_model_folders(disk_dir, name, _clear_in))


# ---- a cmd llama-server's slots ---------------------------------------------


def _files(folder: str, keep: tuple[str, ...] = ()) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return [e for e in it if e.name not in keep and e.is_file(follow_symlinks=False)]
    except OSError:
        return []


def _use_of(entries) -> DiskUse:
    """Count and bytes of the files ``entries`` (``os.DirEntry``)."""
    use = DiskUse()
    for e in entries:
        try:
            use.bytes += e.stat(follow_symlinks=False).st_size
            use.entries += 1
        except OSError:
            continue
    return use


def _remove(entries) -> int:
    """Remove the files ``entries`` (``os.DirEntry``); how many went."""
    n = 0
    for e in entries:
        try:
            os.unlink(e.path)
            n += 1
        except OSError as err:
            log.warning("cannot remove %s: %s", e.path, err)
    return n



def _digest(*parts: str) -> str:
    return hashlib.blake2b("\0".join(parts).encode(), digest_size=6,
                           person=b"ggmux-slots").hexdigest()


def slot_prefix(entry: ModelEntry) -> str:
    """The start of every slot file name of model ``entry`` (any config)."""
    return f"ggmux-{_digest(entry.name)}-"


def slot_file(entry: ModelEntry, slot_id: int) -> str:
    """The file name (no folder) slot ``slot_id`` of ``entry`` is saved as
    (module docstring: no prompt text, no model name; the config hash
    covers the command line and the GGUF files it names)."""
    try:
        argv = shlex.split(entry.cmd or "")
    except ValueError:
        argv = [entry.cmd or ""]
    stats = []
    for a in argv:
        if a.endswith(".gguf") and os.path.isfile(a):
            st = os.stat(a)
            stats.append(f"{a}:{st.st_size}:{st.st_mtime_ns}")
    return f"{slot_prefix(entry)}{_digest(entry.cmd or '', *stats)}-slot{int(slot_id)}.bin"


def slot_use(slot_dir: str, entry: ModelEntry) -> DiskUse:
    """Slot files of ``entry`` in ``slot_dir`` (any config): count and bytes."""
    prefix = slot_prefix(entry)
    return _use_of(e for e in _files(slot_dir, ()) if e.name.startswith(prefix))


def clear_slots(slot_dir: str, entry: ModelEntry) -> int:
    """Remove every slot file of ``entry`` from ``slot_dir``; how many."""
    prefix = slot_prefix(entry)
    return _remove(e for e in _files(slot_dir, ()) if e.name.startswith(prefix))


@dataclass(slots=True)
class SlotResult:
    """What a save or restore did: ``done`` ``[(slot id, tokens)]``,
    ``errors`` one line each, ``seconds`` it took."""

    done: list[tuple[int, int]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0


def call_json(port: int, secret: str, method: str, path: str, body: dict | None,
          deadline: float) -> object:
    """One request to the replica on 127.0.0.1:``port``, its JSON answer;
    raises ``OSError``/``ValueError`` with the reason (a timeout past
    ``deadline``, a status that is not 200)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no time left (cache-save-timeout)")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=left)
    headers = {"content-type": "application/json"}
    if secret:
        headers["authorization"] = f"Bearer {secret}"
    try:
        conn.request(method, path, json.dumps(body) if body is not None else None, headers)
        resp = conn.getresponse()
        data = resp.read(1 << 20)
    finally:
        conn.close()
    if resp.status != 200:
        raise ValueError(f"{method} {path}: {resp.status} {data[:200].decode('utf-8', 'replace')}")
    return json.loads(data)


def _slots(port: int, secret: str, deadline: float) -> list[dict]:
    doc = call_json(port, secret, "GET", "/slots", None, deadline)
    return [s for s in doc if isinstance(s, dict) and isinstance(s.get("id"), int)] if isinstance(
        doc, list) else []


def save_slots(port: int, secret: str, entry: ModelEntry, timeout: float) -> SlotResult:
    """Ask the llama-server on ``port`` to save every slot holding a prompt
    (``n_prompt_tokens`` > 0 in ``GET /slots``) as :func:`slot_file`;
    whatever is not done within ``timeout`` seconds is left (best effort)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    out = SlotResult()
    try:
        slots = _slots(port, secret, deadline)
    except (OSError, ValueError) as e:
        out.errors.append(f"GET /slots: {e}")
        slots = []
    for s in slots:
        if not int(s.get("n_prompt_tokens") or 0) > 0:
            continue
        sid = s["id"]
        try:
            doc = call_json(port, secret, "POST", f"/slots/{sid}?action=save",
                        {"filename": slot_file(entry, sid)}, deadline)
            out.done.append((sid, int(doc.get("n_saved", 0)) if isinstance(doc, dict) else 0))
        except (OSError, ValueError) as e:
            out.errors.append(f"slot {sid}: {e}")
    out.seconds = time.monotonic() - t0
    return out


def restore_slots(port: int, secret: str, entry: ModelEntry, slot_dir: str,
                  timeout: float) -> SlotResult:
    """Ask the llama-server on ``port`` to restore each of its slots whose
    :func:`slot_file` is in ``slot_dir`` (saved by a replica of the same
    command line and files); within ``timeout`` seconds, best effort."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    out = SlotResult()
    try:
        ids = [s["id"] for s in _slots(port, secret, deadline)]
    except (OSError, ValueError) as e:
        out.errors.append(f"GET /slots: {e}")
        ids = []
    for sid in ids:
        name = slot_file(entry, sid)
        if not os.path.isfile(os.path.join(slot_dir, name)):
            continue
        try:
            doc = call_json(port, secret, "POST", f"/slots/{sid}?action=restore",
                        {"filename": name}, deadline)
            out.done.append((sid, int(doc.get("n_restored", 0)) if isinstance(doc, dict) else 0))
        except (OSError, ValueError) as e:
            out.errors.append(f"slot {sid}: {e}")
    out.seconds = time.monotonic() - t0
    return out
