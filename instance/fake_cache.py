"""The fake instance's KV tiers (issue 29): the built-in instance's contract
with controllable figures, for the router's tests (supervisor, proxies,
prefix index) without an engine.

Like the fake's slots (:mod:`.fake`), an entry is the text a slot held (its
prompt and answer, one token per 4 characters); options come as the
built-in instance's, in ``--llama-args``:

* ``--cache-ram MiB``: a slot's text about to be overwritten is kept in a
  host-RAM tier of at most that many bytes (each entry counts the
  behaviour's ``cache_entry_bytes``, 1000 by default), LRU; what leaves it
  goes to the disk tier when there is one (without ``--cache-ram``, straight
  there).
* ``--cache-disk DIR``: ``DIR/<fingerprint hex>/model.json`` (``{"model",
  "path", "fingerprint"}``) and one file per entry, ``<64 hex>.kv`` (a
  hash of its scope and text, never the text: named as the real entries),
  mode 0600, written under a temporary name and renamed; read back at
  load, so another replica, a reload or a
  restart finds them. ``--cache-disk-max GiB`` bounds it (oldest first);
  its bytes are the files' sizes.
* ``--cache-save-timeout S`` (2): on ``exit`` the slots' texts are written
  to disk; the write takes the behaviour's ``save_s`` (0) seconds, cut at
  the timeout unless ``save_ignores_timeout`` is true (a stuck save, for
  the supervisor's bound).

A request whose prompt no slot holds takes the longest prefix found in RAM,
then on disk (in its cache scope), and its answer says so:
``usage.prompt_tokens_details.cached_tokens`` and ``timings.cache_tier``
(``slot``, ``ram``, ``disk``). ``GET /cache`` and ``POST /cache/clear``
answer as the built-in instance does, and a ``cache`` state line
(``ram_bytes``, ``disk_bytes``, ``ram_entries``, ``disk_entries``) goes to
the supervisor on change, at most once a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict

from . import protocol

log = logging.getLogger(__name__)

LINE_INTERVAL_S = 1.0
CHARS_PER_TOKEN = 4


def _arg(args: list[str], name: str) -> str | None:
    found = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            found = args[i + 1]
    return found


def _common(a: str, b: str) -> int:
    return len(os.path.commonprefix([a, b]))


class FakeTiers:
    """See the module docstring. ``name``, ``path``: the model's; ``args``:
    its ``--llama-args``; ``cfg``: the behaviour; ``n_ctx``: for the
    fingerprint."""

    def __init__(self, name: str, path: str, args: list[str], cfg: dict, n_ctx: int) -> None:
        self.entry_bytes = int(cfg.get("cache_entry_bytes", 1000))
        self.save_s = float(cfg.get("save_s", 0.0))
        self.save_stuck = bool(cfg.get("save_ignores_timeout"))
        self.ram_limit = int(float(_arg(args, "--cache-ram") or 0) * (1 << 20))
        self.disk_limit = int(float(_arg(args, "--cache-disk-max") or 0) * (1 << 30))
        self.save_timeout = float(_arg(args, "--cache-save-timeout") or 2.0)
        disk = _arg(args, "--cache-disk")
        self.lock = threading.Lock()
        self.ram: OrderedDict[tuple[str, str], None] = OrderedDict()  # (scope, text), LRU
        self.disk: OrderedDict[tuple[str, str], str] = OrderedDict()  # -> file path
        self.sizes: dict[str, int] = {}  # file path -> bytes
        self.hits = {"slot": 0, "ram": 0, "disk": 0}
        self.misses = self.restored = self.saved = self.rejected = 0
        self.restore_s = 0.0
        self.restore_by_tier = {"ram": 0.0, "disk": 0.0}
        self.dir = ""
        if disk:
            fp = {"fake": os.path.abspath(path), "n_ctx": n_ctx}
            hexed = hashlib.blake2b(json.dumps(fp, sort_keys=True).encode(),
                                    digest_size=8).hexdigest()
            self.dir = os.path.join(disk, hexed)
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self._write(os.path.join(self.dir, "model.json"),
                        json.dumps({"model": name, "path": path, "fingerprint": fp}).encode())
            self._read_disk()
        self._last_line: tuple | None = None
        self._line_at = 0.0
        self._timer: threading.Timer | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.ram_limit or self.dir)

    # ---- disk ---------------------------------------------------------------
    @staticmethod
    def _write(path: str, data: bytes) -> None:
        tmp = f"{path}.tmp{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def _read_disk(self) -> None:
        files = []
        for e in os.scandir(self.dir):
            if e.name.endswith(".kv"):
                files.append((e.stat().st_mtime_ns, e.path))
        for _, path in sorted(files):
            try:
                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                self.disk[(doc["scope"], doc["text"])] = path
                self.sizes[path] = os.path.getsize(path)
            except (OSError, ValueError, KeyError, TypeError):
                self.rejected += 1  # never loaded: counted

    def _to_disk(self, key: tuple[str, str]) -> None:
        """Write one entry (lock held)."""
        if not self.dir or key in self.disk:
            return
        name = hashlib.blake2b(("\0".join(key)).encode(), digest_size=32).hexdigest()
        path = os.path.join(self.dir, name + ".kv")
        data = json.dumps({"scope": key[0], "text": key[1]}).encode()
        try:
            self._write(path, data)
        except OSError as e:
            log.warning("cache entry not written: %s", e)
            return
        self.disk[key] = path
        self.sizes[path] = len(data)
        self.saved += 1
        while self.disk_limit and sum(self.sizes.values()) > self.disk_limit:
            _, old = self.disk.popitem(last=False)
            self.sizes.pop(old, None)
            try:
                os.unlink(old)
            except OSError:
                pass

    # ---- tiers ----------------------------------------------------------------
    def keep(self, scope: str, text: str) -> None:
        """A slot's ``text`` (filled under ``scope``) is about to be overwritten."""
        if not text or not self.enabled:
            return
        with self.lock:
            key = (scope, text)
            if self.ram_limit:
                self.ram[key] = None
                self.ram.move_to_end(key)
                while len(self.ram) * self.entry_bytes > self.ram_limit:
                    old, _ = self.ram.popitem(last=False)
                    self._to_disk(old)
            else:
                self._to_disk(key)
        self.line()

    def lookup(self, scope: str | None, text: str, least: int = 1) -> tuple[int, str]:
        """The longest prefix of ``text`` (characters) in RAM, else on disk,
        among entries of ``scope`` (None: any); ``(0, "")`` for none or one
        shorter than ``least``."""
        best, tier = 0, ""
        t0 = time.monotonic()
        with self.lock:
            for where, keys in (("ram", self.ram), ("disk", self.disk)):
                for s, t in keys:
                    if scope is not None and s != scope:
                        continue
                    n = _common(t, text)
                    if n > best:
                        best, tier = n, where
                if best >= least:
                    break
                best, tier = 0, ""
            if best:
                self.hits[tier] += 1
                self.restored += best // CHARS_PER_TOKEN
            else:
                self.misses += 1
            dt = time.monotonic() - t0
            self.restore_s += dt
            if tier:
                self.restore_by_tier[tier] += dt
        return best, tier

    def slot_hit(self) -> None:
        with self.lock:
            self.hits["slot"] += 1

    def save(self, slots: list[tuple[str, str]]) -> None:
        """``exit``: write the slots' ``(scope, text)`` to disk, within the
        save timeout (module docstring)."""
        if not self.dir:
            return
        wait = self.save_s if self.save_stuck else min(self.save_s, self.save_timeout)
        time.sleep(wait)
        if wait < self.save_s:
            log.info("cache save cut at %.1f s (cache-save-timeout)", self.save_timeout)
            return
        with self.lock:
            for key in slots:
                if key[1]:
                    self._to_disk(key)
            for key in list(self.ram):
                self._to_disk(key)
        log.info("cache saved: %d entries on disk", len(self.disk))

    def clear(self) -> dict:
        """``POST /cache/clear``: ``{"cleared": {"ram": n, "disk": n}}``."""
        with self.lock:
            ram, disk = len(self.ram), len(self.disk)
            self.ram.clear()
            for path in self.disk.values():
                try:
                    os.unlink(path)
                except OSError:
                    pass
            self.disk.clear()
            self.sizes.clear()
        self.line()
        return {"cleared": {"ram": ram, "disk": disk}}

    def info(self) -> dict:
        """``GET /cache``."""
        with self.lock:
            return {"ram": {"entries": len(self.ram), "bytes": len(self.ram) * self.entry_bytes,
                            "limit_bytes": self.ram_limit},
                    "disk": {"entries": len(self.disk), "bytes": sum(self.sizes.values()),
                             "limit_bytes": self.disk_limit, "dir": self.dir},
                    "hits": dict(self.hits), "misses": self.misses,
                    "restored_tokens": self.restored,
                    "restore_seconds": round(self.restore_s, 6),
                    "restore_seconds_by_tier": {k: round(v, 6)
                                                for k, v in self.restore_by_tier.items()},
                    "saved": self.saved, "rejected": self.rejected}

    # ---- the state line ----------------------------------------------------------
    def line(self) -> None:
        """Send the ``cache`` line if the figures changed, at most once a second."""
        if not self.enabled:
            return
        with self.lock:
            if self._timer is not None:
                return
            wait = self._line_at + LINE_INTERVAL_S - time.monotonic()
            if wait > 0:
                self._timer = threading.Timer(wait, self._send)
                self._timer.daemon = True
                self._timer.start()
                return
        self._send()

    def _send(self) -> None:
        with self.lock:
            self._timer = None
            figures = (len(self.ram) * self.entry_bytes, sum(self.sizes.values()),
                       len(self.ram), len(self.disk))
            if figures == self._last_line:
                return
            self._last_line = figures
            self._line_at = time.monotonic()
        protocol.emit("cache", ram_bytes=figures[0], disk_bytes=figures[1],
                      ram_entries=figures[2], disk_entries=figures[3])
