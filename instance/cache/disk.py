"""The disk tier: one fingerprint's entries as files in ``DIR/<fingerprint>/``
(:mod:`.entry_file`), LRU by file mtime, bounded by ``--cache-disk-max``.

The directory is the contract with the router side and with every other
process of the model (a second replica, the model loaded again, ggmux
after a restart): ``model.json`` names the model and its fingerprint
fields; each ``<sha256>.kv`` is one entry. An instance indexes the headers
at start (:meth:`DiskTier.open`) and again when the directory changed, at
most once a second (:meth:`DiskTier.refresh`), so entries another process
wrote are found. A file that does not verify is never loaded: it is
counted in ``rejected``, logged once per kind, and removed when it is
torn or corrupt. A full or read-only disk is logged once and counted in
``write_errors``; requests are served by prefill meanwhile.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import orjson

from .checkpoint import pack
from .entry import Entry, contains
from .entry_file import (
    SUFFIX,
    TMP_SUFFIX,
    EntryFileError,
    SaveTimeout,
    read_checkpoints,
    read_header,
    read_payload,
    write_entry,
)
from .fingerprint import Fingerprint

log = logging.getLogger(__name__)

REFRESH_S = 1.0
"""Least time between two looks at the directory for other processes' files."""
STALE_TMP_S = 60.0
"""A temporary file older than this (seconds) is a save that was killed."""


class DiskTier:
    """The entries of one fingerprint on disk. Thread-safe: the decode
    thread looks up and reads, the writer thread writes, the HTTP side
    reports and clears."""

    def __init__(self, root: str, fp: Fingerprint, limit_bytes: int, model: str = "",
                 model_path: str = "") -> None:
        self.root = root
        self.fp = fp
        self.dir = os.path.join(root, fp.hex)
        self.limit_bytes = limit_bytes
        self.model, self.model_path = model, model_path
        self.lock = threading.Lock()
        self.entries: dict[str, Entry] = {}
        self.bytes = 0
        self.rejected = 0
        self.written = 0
        self.write_errors = 0
        self._bad: set[str] = set()  # names refused once: not read again
        self._logged: set[str] = set()
        self._dir_mtime = -1
        self._t_scan = 0.0

    # ---- index ---------------------------------------------------------------
    def open(self) -> bool:
        """Make the directory (0700) and its ``model.json``, index the
        entries. Returns False (logged) when the directory cannot be used
        at all; a read-only one that exists is still read."""
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
        except OSError as e:
            log.error("KV disk tier off: cannot make %s: %s", self.dir, e)
            return False
        meta = os.path.join(self.dir, "model.json")
        if not os.path.exists(meta):
            body = orjson.dumps({"model": self.model, "path": self.model_path,
                                 "fingerprint": self.fp.fields}, option=orjson.OPT_INDENT_2)
            tmp = f"{meta}.{os.getpid()}{TMP_SUFFIX}"
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "wb") as f:
                    f.write(body)
                os.replace(tmp, meta)
            except OSError as e:
                self._write_failed(e, "model.json")
        self.refresh(force=True)
        return True

    def refresh(self, force: bool = False) -> None:
        """Index files other processes wrote or removed since the last look
        (when the directory's mtime changed; at most every :data:`REFRESH_S`)."""
        now = time.monotonic()
        if not force and now - self._t_scan < REFRESH_S:
            return
        self._t_scan = now
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            return
        if mtime == self._dir_mtime and not force:
            return
        self._dir_mtime = mtime
        try:
            names = os.listdir(self.dir)
        except OSError as e:
            self._once("list", "KV disk tier: cannot list %s: %s", self.dir, e)
            return
        present = set()
        for name in names:
            path = os.path.join(self.dir, name)
            if name.endswith(TMP_SUFFIX):
                self._remove_stale(path)
                continue
            if not name.endswith(SUFFIX) or name in self._bad:
                continue
            key = name[: -len(SUFFIX)]
            present.add(key)
            with self.lock:
                if key in self.entries:
                    continue
            try:
                h = read_header(path, self.fp.hex)
                st = os.stat(path)
            except EntryFileError as e:
                self._reject(path, e)
                continue
            except OSError:
                continue
            self._add(Entry(h.key, h.scope, h.tokens, h.pos_min, h.file_bytes, st.st_mtime,
                            path=path, header=h))
        with self.lock:
            for key in [k for k in self.entries if k not in present]:
                self.bytes -= self.entries.pop(key).nbytes

    def _add(self, e: Entry) -> None:
        with self.lock:
            old = self.entries.pop(e.key, None)
            if old is not None:
                self.bytes -= old.nbytes
            self.entries[e.key] = e
            self.bytes += e.nbytes

    def _remove_stale(self, path: str) -> None:
        try:
            if time.time() - os.stat(path).st_mtime > STALE_TMP_S:
                os.unlink(path)
                log.info("KV disk tier: removed %s, a save that did not finish", path)
        except OSError:
            pass

    def candidates(self) -> list[Entry]:
        """A snapshot of the entries (for a lookup)."""
        with self.lock:
            return list(self.entries.values())

    # ---- read ----------------------------------------------------------------
    def load(self, e: Entry) -> memoryview | None:
        """The verified state of entry ``e``, or None (the file is gone,
        torn, corrupt or unreadable: counted, logged once, left out of the
        index). Marks it used (mtime) for every process's LRU."""
        try:
            data = read_payload(e.path, e.header)
        except EntryFileError as x:
            self._forget(e)
            if x.reason != "gone":
                self._reject(e.path, x)
            return None
        now = time.time()
        e.t_used = now
        try:
            os.utime(e.path, (now, now))
        except OSError:
            pass  # a read-only directory: its LRU is the writers' order
        return data

    def load_checkpoints(self, e: Entry) -> bytes | None:
        """The verified checkpoints section of entry ``e`` (b"" for none), or
        None (counted and logged as :meth:`load` does; the file stays: its
        state may still serve a prompt that needs no checkpoint)."""
        try:
            return read_checkpoints(e.path, e.header)
        except EntryFileError as x:
            if x.reason != "gone":
                self.rejected += 1
                self._once("reject-checkpoints:" + x.reason, "KV disk tier: not loading the "
                           "checkpoints of %s (%s): %s; logged once", os.path.basename(e.path),
                           x.reason, x)
            return None

    def _forget(self, e: Entry) -> None:
        with self.lock:
            if self.entries.get(e.key) is e:
                del self.entries[e.key]
                self.bytes -= e.nbytes

    def _reject(self, path: str, x: EntryFileError) -> None:
        self.rejected += 1
        name = os.path.basename(path)
        self._bad.add(name)
        self._once("reject:" + x.reason, "KV disk tier: not loading %s (%s): %s; "
                   "such files are counted in rejected, this is logged once", name,
                   x.reason, x)
        if x.reason in ("torn", "corrupt"):
            try:
                os.unlink(path)
                self._bad.discard(name)
            except OSError:
                pass

    # ---- write ---------------------------------------------------------------
    def holds(self, scope: str, tokens) -> bool:
        """Whether an entry of ``scope`` already contains ``tokens``."""
        with self.lock:
            return any(o.scope == scope and contains(o.tokens, tokens)
                       for o in self.entries.values())

    def write(self, e: Entry, deadline: float | None = None) -> bool:
        """Write RAM entry ``e`` (its ``data``) as a file, first removing the
        least recently used files until it fits within the limit; then drop
        the files it contains. Returns whether it was written. A state
        larger than the whole limit, a full or read-only disk, a passed
        ``deadline``: False, nothing left behind."""
        if self.limit_bytes and e.nbytes > self.limit_bytes:
            return False
        if self.holds(e.scope, e.tokens):
            return True
        self._make_room(e.nbytes)
        try:
            cks = e.checkpoints or []
            path, size = write_entry(self.dir, self.fp.hex, e.scope, e.tokens, e.pos_min,
                                     e.data, deadline, pack(cks, self.fp.hex),
                                     tuple(c.n_tokens for c in cks))
            h = read_header(path, self.fp.hex)
        except SaveTimeout:
            return False
        except EntryFileError as x:  # what we wrote does not read back: a broken disk
            self.write_errors += 1
            self._once("readback", "KV disk tier: a written entry does not verify: %s", x)
            return False
        except OSError as x:
            self._write_failed(x, os.path.basename(e.key))
            return False
        self.written += 1
        self._add(Entry(h.key, h.scope, h.tokens, h.pos_min, size, time.time(), path=path,
                        header=h))
        with self.lock:
            older = [o for o in self.entries.values() if o.key != h.key
                     and o.scope == h.scope and contains(h.tokens, o.tokens)]
        for o in older:
            self._unlink(o)
        self._make_room(0)  # another process may have written meanwhile
        return True

    def _make_room(self, nbytes: int) -> None:
        if not self.limit_bytes:
            return
        while True:
            with self.lock:
                if self.bytes + nbytes <= self.limit_bytes or not self.entries:
                    return
                oldest = min(self.entries.values(), key=lambda o: o.t_used)
            self._unlink(oldest)

    def _unlink(self, e: Entry) -> None:
        self._forget(e)
        try:
            os.unlink(e.path)
        except FileNotFoundError:
            pass
        except OSError as x:
            self._once("unlink", "KV disk tier: cannot remove %s: %s", e.path, x)

    def _write_failed(self, x: OSError, what: str) -> None:
        self.write_errors += 1
        kind = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is spent",
                errno.EROFS: "the disk is read-only", errno.EACCES: "no permission"}.get(
                    x.errno, "an error")
        self._once(f"write:{x.errno}", "KV disk tier: cannot write %s in %s (%s: %s); "
                   "requests are served by prefill; logged once", what, self.dir, kind, x)

    def clear(self) -> int:
        """Remove every entry file of this fingerprint; returns how many."""
        self.refresh(force=True)
        with self.lock:
            gone = list(self.entries.values())
        for e in gone:
            self._unlink(e)
        return len(gone)

    def _once(self, what: str, msg: str, *args) -> None:
        if what not in self._logged:
            self._logged.add(what)
            log.warning(msg, *args)

    def report(self) -> dict:
        """``{"entries", "bytes", "limit_bytes", "dir", "written", "write_errors"}``."""
        with self.lock:
            return {"entries": len(self.entries), "bytes": self.bytes,
                    "limit_bytes": self.limit_bytes, "dir": self.dir,
                    "written": self.written, "write_errors": self.write_errors}


__all__ = ["DiskTier"]
