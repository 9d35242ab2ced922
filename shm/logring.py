"""The log ring: recent log lines of the supervisor and every child, in shared memory.

The supervisor is the only writer (its own log records and the lines it
reads from its children's stderr, each tagged); proxies read it to answer
``GET /logs`` and ``GET /logs/stream``. Why shared memory and not a file or a
request to the supervisor: proxies answer HTTP and the supervisor does not;
a ring in shm costs the supervisor one copy per line, costs a reader no
system call and no round trip (a ``/logs/stream`` subscriber polls one
word), is bounded in size whatever a child prints, and lives and dies with
the server like the state segment (one POSIX segment, mode 0600, removed on
exit, a stale one replaced at start).

Layout: a header of int64 words, then ``capacity`` bytes of data. A record
is a 4-byte little-endian length and that many bytes of payload (one JSON
object per line). Positions are byte offsets since the ring was created
(never wrapped); a position ``p`` lives at ``data[p % capacity]``.

* ``head``: end of the last complete record (stored after its bytes);
* ``tail``: start of the oldest record not being overwritten; the writer
  advances it past the records a new one will overwrite *before* it writes.

So a reader that copies ``[from, head)`` and then reads ``tail`` knows every
record at or after that ``tail`` was intact while it copied (x86-64 keeps
stores and loads in order; :func:`~ggmux.shm.seqlock.fence` covers aarch64
as the seqlock does).
"""

from __future__ import annotations

import logging
import mmap
import re
import struct
import sys
import time

import posix_ipc

from .seqlock import fence

MAGIC = 0x47474D55584C4F47  # "GGMUXLOG"
VERSION = 1

H_MAGIC = 0
H_VERSION = 1
H_CAPACITY = 2
H_HEAD = 3
H_TAIL = 4
H_RECORDS = 5  # records ever written
H_WORDS = 8
DATA = 8 * H_WORDS  # first data byte

MAX_RECORD = 8192
"""Largest record, bytes (length word included); longer payloads are refused
by :meth:`LogRing.append` (callers shorten the line first)."""

_LEN = struct.Struct("<I")
_RAW_CONTROL = re.compile(rb"[\x00-\x1f\x7f]")


def log_ring_name(segment: str) -> str:
    """Name of the log ring beside the state segment named ``segment``
    (``/ggmux-8080`` -> ``/ggmux-8080-log``)."""
    return segment + "-log"


class LogRing:
    """A mapped log ring: :meth:`create` (supervisor, writer) or
    :meth:`attach` (proxies, readers)."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm
        self._h = memoryview(mm)[:DATA].cast("q")
        self.capacity = self._h[H_CAPACITY]

    @classmethod
    def create(cls, name: str, capacity: int) -> LogRing:
        """Create (replacing a stale one) an empty ring of ``capacity`` data
        bytes (at least 4 x :data:`MAX_RECORD`; raises ``ValueError`` under)."""
        if capacity < 4 * MAX_RECORD:
            raise ValueError(f"log ring capacity {capacity} < {4 * MAX_RECORD} bytes")
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=DATA + capacity)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        h = memoryview(mm)[:DATA].cast("q")
        h[H_VERSION] = VERSION
        h[H_CAPACITY] = capacity
        fence()
        h[H_MAGIC] = MAGIC
        h.release()
        return cls(name, mm)

    @classmethod
    def attach(cls, name: str) -> LogRing:
        """Attach to an existing ring. Raises ``posix_ipc.ExistentialError``
        when there is none, ``ValueError`` when it is not a log ring."""
        shm = posix_ipc.SharedMemory(name)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        magic, version = struct.unpack_from("<qq", mm, 0)
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise ValueError(f"{name}: not a ggmux log ring of version {VERSION}")
        return cls(name, mm)

    def close(self) -> None:
        """Drop the mapping."""
        self._h.release()
        self._mm.close()

    def unlink(self) -> None:
        """Remove the ring's name (the supervisor does this on exit)."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    @property
    def head(self) -> int:
        """End of the last complete record (bytes since creation)."""
        return self._h[H_HEAD]

    # ---- writer (the supervisor) ----------------------------------------
    def append(self, payload: bytes) -> None:
        """Append one record. Raises ``ValueError`` when it is longer than
        :data:`MAX_RECORD` with its length word, or holds a raw control byte
        (a record is one line of JSON whose text went through
        :func:`escape_controls`, issue 31 item 3)."""
        n = _LEN.size + len(payload)
        if n > MAX_RECORD:
            raise ValueError(f"log record of {n} bytes > {MAX_RECORD}")
        if _RAW_CONTROL.search(payload) is not None:
            raise ValueError("log record holds a raw control byte")
        h, cap = self._h, self.capacity
        head, tail = h[H_HEAD], h[H_TAIL]
        while head + n - tail > cap:  # drop the oldest records this one overwrites
            tail += _LEN.size + self._length_at(tail)
        h[H_TAIL] = tail
        fence()
        self._put(head, _LEN.pack(len(payload)) + payload)
        fence()
        h[H_HEAD] = head + n
        h[H_RECORDS] += 1

    def _length_at(self, pos: int) -> int:
        return _LEN.unpack(self._get(pos, _LEN.size))[0]

    def _put(self, pos: int, data: bytes) -> None:
        cap, mm = self.capacity, self._mm
        i = pos % cap
        first = min(len(data), cap - i)
        mm[DATA + i : DATA + i + first] = data[:first]
        if first < len(data):
            mm[DATA : DATA + len(data) - first] = data[first:]

    def _get(self, pos: int, n: int) -> bytes:
        cap, mm = self.capacity, self._mm
        i = pos % cap
        first = min(n, cap - i)
        if first == n:
            return mm[DATA + i : DATA + i + n]
        return mm[DATA + i : DATA + cap] + mm[DATA : DATA + n - first]

    # ---- readers (proxies) ---------------------------------------------
    def read(self, cursor: int | None = None,
             until: int | None = None) -> tuple[list[bytes], int, bool]:
        """Records after position ``cursor`` (None: every record the ring
        still holds), up to ``until`` (a cursor this ring returned before;
        None: the newest): ``(payloads, new cursor, lost)``; ``lost`` says
        the writer overwrote records after ``cursor`` before they were read.
        Never blocks, never fails on a writer caught mid-record."""
        h = self._h
        end = h[H_HEAD]
        if until is not None:
            end = min(end, until)
        fence()
        start = max(end - self.capacity, 0 if cursor is None else min(cursor, end))
        data = self._get(start, end - start) if end > start else b""
        fence()
        tail = h[H_TAIL]  # records from here on were intact while we copied
        lost = cursor is not None and cursor < tail
        pos = max(start, tail)
        out: list[bytes] = []
        while pos + _LEN.size <= end:
            off = pos - start
            (n,) = _LEN.unpack_from(data, off)
            if pos + _LEN.size + n > end:
                break  # cannot happen with one writer; never read past head
            out.append(data[off + _LEN.size : off + _LEN.size + n])
            pos += _LEN.size + n
        return out, end, lost


# what a log line may not hold raw: C0 controls (newline, CR, ESC, ...), DEL,
# C1 controls (0x9b is a terminal's CSI), Unicode line and paragraph
# separators, and the bidirectional overrides and isolates that reorder what
# a terminal or a page shows (issue 31, item 3: a forged line, escape codes)
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                       "\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match) -> str:
    c = m.group()
    named = _NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control character written out as an escape
    (``\\n``, ``\\t``, ``\\x1b``, ``\\u2028``): what is left is one line
    that a terminal shows as it reads, so no log record can hold escape codes
    or look like several records (issue 31, item 3). Backslashes stay as
    they are, so escaping twice changes nothing."""
    if text.isascii() and text.isprintable():  # the common case, no regex
        return text
    return _CONTROLS.sub(_escape, text)


class OneLineFormatter(logging.Formatter):
    """A ``logging.Formatter`` whose every record, exception and stack
    included, is one line with :func:`escape_controls` applied: what the
    supervisor reads from a child's stderr is then one record per line, and
    a message holding a newline cannot pass for another record."""

    def format(self, record: logging.LogRecord) -> str:
        return escape_controls(super().format(record))


def log_to_stderr(level: int | str, fmt: str) -> None:
    """``logging.basicConfig(level=level, stream=sys.stderr, format=fmt)``
    with a :class:`OneLineFormatter`; like ``basicConfig``, nothing when the
    root logger has handlers already."""
    root = logging.getLogger()
    if root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLineFormatter(fmt))
    root.addHandler(handler)
    root.setLevel(level)


def format_line(rec: dict) -> str:
    """One record as a text line: ``2024-12-01 08:10:00.123 INFO [src] msg``;
    level, source and message go through :func:`escape_controls` (a record
    written before that rule, or by someone else, is shown safe too)."""
    ts = rec.get("ts") or 0.0
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts)) + f".{int(ts * 1000) % 1000:03d}"
    level, src, msg = (escape_controls(str(rec.get(k, d)))
                       for k, d in (("level", "INFO"), ("src", "?"), ("msg", "")))
    return f"{stamp} {level} [{src}] {msg}"
