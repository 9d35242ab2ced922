"""``--watch-config``: notice when a preset file or a models dir changed.

The supervisor's loop calls :meth:`ConfigWatch.check` every turn; at most
every ``interval`` seconds it compares a cheap signature of each watched
path (a file's inode, size and modification time; a folder's entries and
those of its subfolders, one level down, as ``--models-dir`` reads them)
with the last one, and names what changed, so the loop reloads as SIGHUP
does. Polling rather than inotify: no dependency, works on every file
system (network mounts, bind mounts in containers), and a few ``stat``
calls per interval cost nothing.
"""

from __future__ import annotations

import os
import time

NS = 1_000_000_000

Signature = tuple


def _stat(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def _entries(path: str) -> list[tuple[str, tuple[int, int, int] | None]]:
    try:
        with os.scandir(path) as it:
            names = sorted(e.name for e in it)
    except OSError:
        return []
    return [(n, _stat(os.path.join(path, n))) for n in names]


def signature(path: str) -> Signature:
    """What :class:`ConfigWatch` compares for ``path``: a file's
    ``(inode, size, mtime)``; for a folder, that of each entry and of the
    entries of each subfolder; None while the path does not exist."""
    if not os.path.isdir(path):
        return (_stat(path),)
    out = []
    for name, st in _entries(path):
        sub = os.path.join(path, name)
        out.append((name, st, tuple(_entries(sub)) if os.path.isdir(sub) else ()))
    return tuple(out)


class ConfigWatch:
    """Watches ``paths`` (preset files and model folders), at most every
    ``interval`` seconds. :meth:`check` returns a reason (``"preset.ini
    changed"``) when one changed since the previous look, else None."""

    def __init__(self, paths: list[str], interval: float = 0.5) -> None:
        self.paths = [p for p in dict.fromkeys(paths) if p]
        self.interval_ns = int(interval * NS)
        self.next_ns = 0
        self.seen = {p: signature(p) for p in self.paths}

    def check(self, now_ns: int | None = None) -> str | None:
        now = time.monotonic_ns() if now_ns is None else now_ns
        if not self.paths or now < self.next_ns:
            return None
        self.next_ns = now + self.interval_ns
        changed = []
        for p in self.paths:
            sig = signature(p)
            if sig != self.seen[p]:
                self.seen[p] = sig
                changed.append(p)
        if not changed:
            return None
        return ", ".join(changed) + " changed (--watch-config)"
