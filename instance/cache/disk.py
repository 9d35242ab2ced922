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
torn, corrupt or not a regular file. A full or read-only disk is logged
once and counted in ``write_errors``; requests are served by prefill
meanwhile.

Every file is opened from the folder's verified descriptor, never through
a link, regular files only (:mod:`.safe_files`); a ``DIR`` or fingerprint
folder that another user owns or may write, or that is a link, turns the
tier off with an error (issue 37, item 4). The index is kept by the tiers'
writer thread (:meth:`DiskTier.refresh`), never by the decode thread,
which only reads it and restores (item 12).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import weakref

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
from .safe_files import (
    MAC_KEY_FILE,
    UnsafeFile,
    create_new,
    mac_key,
    open_folder,
    open_regular,
    open_root,
    state_dir,
)

log = logging.getLogger(__name__)

REFRESH_S = 1.0
"""Least time between two looks at the directory for other processes' files."""
STALE_TMP_S = 60.0
"""A temporary file older than this (seconds) is a save that was killed."""


class DiskTier:
    """The entries of one fingerprint on disk. Thread-safe: the decode
    thread looks up and reads, the writer thread indexes and writes, the
    HTTP side reports and clears. ``model``: the name ``model.json``
    records (the registry's name: the supervisor finds a stopped model's
    folders by it); ``key``: the entries' MAC key (None: the server's,
    :func:`~.safe_files.mac_key`); ``max_tokens``: the most token ids an
    entry may hold (the context's size; 0: no bound)."""

    def __init__(self, root: str, fp: Fingerprint, limit_bytes: int, model: str = "",
                 model_path: str = "", key: bytes | None = None, max_tokens: int = 0) -> None:
        self.root = root
        self.fp = fp
        self.dir = os.path.join(root, fp.hex)
        self.dir_fd = -1
        self.limit_bytes = limit_bytes
        self.model, self.model_path = model, model_path
        self.key = key
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self._scan_lock = threading.Lock()
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
        """Check ``DIR`` and make the fingerprint's folder (0700) and its
        ``model.json`` (:mod:`.safe_files`), load the MAC key, index the
        entries. Returns False (logged) when the folders cannot be used or
        are not safe; a read-only one that exists is still read."""
        if self.key is None:
            try:
                self.key = mac_key()
            except OSError as e:
                log.error("KV disk tier off: no key to authenticate its entries with (%s/%s): "
                          "%s", state_dir(), MAC_KEY_FILE, e.strerror or e)
                return False
        try:
            root_fd = open_root(self.root)
            try:
                self.dir = os.path.join(os.path.realpath(self.root), self.fp.hex)
                self.dir_fd = open_folder(self.fp.hex, root_fd, make=True)
            finally:
                os.close(root_fd)
        except UnsafeFile as e:
            log.error("KV disk tier off: %s", e.strerror)
            return False
        except OSError as e:
            log.error("KV disk tier off: cannot use %s: %s", self.dir, e)
            return False
        weakref.finalize(self, os.close, self.dir_fd)
        self._write_meta()
        self.refresh(force=True)
        return True

    def _write_meta(self) -> None:
        """``model.json``, when missing or naming another model (a folder an
        older ggmux made, which wrote the GGUF's file name)."""
        try:
            with os.fdopen(open_regular("model.json", self.dir_fd), "rb") as f:
                if orjson.loads(f.read(1 << 16)).get("model") == self.model:
                    return
        except (OSError, ValueError, AttributeError):
            pass
        body = orjson.dumps({"model": self.model, "path": self.model_path,
                             "fingerprint": self.fp.fields}, option=orjson.OPT_INDENT_2)
        tmp = f".model.json.{os.getpid()}{TMP_SUFFIX}"
        try:
            fd = create_new(tmp, self.dir_fd)
            with os.fdopen(fd, "wb") as f:
                f.write(body)
            os.replace(tmp, "model.json", src_dir_fd=self.dir_fd, dst_dir_fd=self.dir_fd)
        except OSError as e:
            self._write_failed(e, "model.json")

    def refresh(self, force: bool = False) -> None:
        """Index files other processes wrote or removed since the last look
        (when the directory's mtime changed; at most every :data:`REFRESH_S`).
        Reads every new file's header: call it off the decode thread (the
        tiers' writer thread does, :class:`~.tiers.KVTiers`)."""
        with self._scan_lock:
            now = time.monotonic()
            if not force and now - self._t_scan < REFRESH_S:
                return
            self._t_scan = now
            try:
                mtime = os.fstat(self.dir_fd).st_mtime_ns
            except OSError:
                return
            if mtime == self._dir_mtime and not force:
                return
            self._dir_mtime = mtime
            try:
                names = os.listdir(self.dir_fd)
            except OSError as e:
                self._once("list", "KV disk tier: cannot list %s: %s", self.dir, e)
                return
            present = set()
            for name in names:
                if name.endswith(TMP_SUFFIX):
                    self._remove_stale(name)
                    continue
                if not name.endswith(SUFFIX) or name in self._bad:
                    continue
                key = name[: -len(SUFFIX)]
                present.add(key)
                with self.lock:
                    if key in self.entries:
                        continue
                try:
                    h = read_header(self.dir_fd, name, self.fp.hex, self.key, self.max_tokens)
                except EntryFileError as e:
                    if e.reason != "gone":
                        self._reject(name, e)
                    continue
                self._add(Entry(h.key, h.scope, h.tokens, h.pos_min, h.file_bytes, h.mtime,
                                path=os.path.join(self.dir, name), header=h))
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

    def _remove_stale(self, name: str) -> None:
        try:
            st = os.stat(name, dir_fd=self.dir_fd, follow_symlinks=False)
            if time.time() - st.st_mtime > STALE_TMP_S:
                os.unlink(name, dir_fd=self.dir_fd)
                log.info("KV disk tier: removed %s in %s, a save that did not finish", name,
                         self.dir)
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
        name = e.key + SUFFIX
        try:
            data = read_payload(self.dir_fd, name, e.header, self.key)
        except EntryFileError as x:
            self._forget(e)
            if x.reason != "gone":
                self._reject(name, x)
            return None
        now = time.time()
        e.t_used = now
        try:
            os.utime(name, (now, now), dir_fd=self.dir_fd, follow_symlinks=False)
        except OSError:
            pass  # a read-only directory: its LRU is the writers' order
        return data

    def load_checkpoints(self, e: Entry) -> bytes | None:
        """The verified checkpoints section of entry ``e`` (b"" for none), or
        None (counted and logged as :meth:`load` does; the file stays: its
        state may still serve a prompt that needs no checkpoint)."""
        try:
            return read_checkpoints(self.dir_fd, e.key + SUFFIX, e.header, self.key)
        except EntryFileError as x:
            if x.reason != "gone":
                self.rejected += 1
                self._once("reject-checkpoints:" + x.reason, "KV disk tier: not loading the "
                           "checkpoints of %s in %s (%s): %s; logged once", e.key + SUFFIX,
                           self.dir, x.reason, x)
            return None

    def _forget(self, e: Entry) -> None:
        with self.lock:
            if self.entries.get(e.key) is e:
                del self.entries[e.key]
                self.bytes -= e.nbytes

    def _reject(self, name: str, x: EntryFileError) -> None:
        self.rejected += 1
        self._bad.add(name)
        self._once("reject:" + x.reason, "KV disk tier: not loading %s in %s (%s): %s; "
                   "such files are counted in rejected, this is logged once", name,
                   self.dir, x.reason, x)
        if x.reason in ("torn", "corrupt", "unsafe"):  # a link or a FIFO: the name goes
            try:
                os.unlink(name, dir_fd=self.dir_fd)
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
            name, size = write_entry(self.dir_fd, self.fp.hex, e.scope, e.tokens, e.pos_min,
                                     e.data, self.key, deadline, pack(cks, self.fp.hex),
                                     tuple(c.n_tokens for c in cks))
            h = read_header(self.dir_fd, name, self.fp.hex, self.key)
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
        self._add(Entry(h.key, h.scope, h.tokens, h.pos_min, size, time.time(),
                        path=os.path.join(self.dir, name), header=h))
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
            os.unlink(e.key + SUFFIX, dir_fd=self.dir_fd)
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
        """Remove every entry file of this fingerprint (nothing else of the
        folder); returns how many."""
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
