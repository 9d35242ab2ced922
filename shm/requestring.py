"""The request ring: a record of every request each proxy served, in shared memory.

What llama-swap's "Activity" page shows (issue 22): per request its time,
model, replica, API, status, tokens, TTFT and duration. Each proxy writes
only its own region (DESIGN.md's rule for per-proxy rows: one writer per
row, no lock between writers); readers (any proxy answering ``GET
/requests``) copy every region and merge the records by time. The
supervisor creates the segment (mode 0600, a stale one replaced) before
the proxies start and removes it on exit, like the log ring; it never
writes it.

Layout, int64 words unless said: a header (:data:`H_WORDS`), then per
proxy a counter line (:data:`P_WORDS`: ``P_WRITTEN``, the records it ever
wrote) and ``rows`` records of :data:`Q_WORDS`; then, when excerpts are
kept (``excerpt`` > 0 bytes), per proxy and row two text fields of
``excerpt`` bytes each (the prompt's and the answer's, UTF-8, their lengths
in ``Q_PROMPT_LEN`` / ``Q_ANSWER_LEN``).

Record ``k`` of a proxy (k = 0, 1, ...) lives in row ``k % rows``; its
sequence word ``Q_SEQ`` is ``2k + 1`` while it is being written and ``2k +
2`` once whole (a seqlock whose value also names the record), and only then
does ``P_WRITTEN`` become ``k + 1``. A reader keeps a row only when its
sequence word is ``2k + 2`` both before and after its copy, so a record
being overwritten, or left half-written by a proxy that died, is never
read. A replacement proxy carries on from ``P_WRITTEN``.

Values: times are ``time.time_ns()`` (``Q_WALL_NS``: the request's arrival)
and microseconds; a count that is not known is -1.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np
import posix_ipc

from .seqlock import NEEDS_FENCE, fence

try:
    import cython
except ImportError:  # no Cython at run time: @cython.locals does nothing
    from ..compiled import cython

MAGIC = 0x47474D5558524551  # "GGMUXREQ"
VERSION = 2  # 2: Q_KEY (issue 36)

H_MAGIC = 0
H_VERSION = 1
H_PROXIES = 2
H_ROWS = 3  # records kept per proxy
H_EXCERPT = 4  # bytes of each text field per record, 0: none kept
H_WORDS = 8

P_WRITTEN = 0  # records this proxy ever wrote
P_WORDS = 8  # the counter line (a cache line of its own)

Q_SEQ = 0
Q_WALL_NS = 1  # arrival, time.time_ns()
Q_MODEL = 2  # model index (the registry's)
Q_SLOT = 3  # replica slot, -1: no replica took it
Q_API = 4  # the client route, an index the writer defines (ggmux.proxy.activity)
Q_STATUS = 5  # HTTP status of the answer (499: the client left)
Q_PROMPT = 6  # prompt tokens, -1 unknown
Q_CACHED = 7  # of which served from the replica's cache, -1 unknown
Q_GENERATED = 8  # generated tokens, -1 unknown
Q_WAIT_US = 9  # arrival -> forwarded (waiting for a load or a free replica)
Q_TTFT_US = 10  # forwarded -> first byte of the answer, -1: none came
Q_DURATION_US = 11  # arrival -> end of the answer
Q_FLAGS = 12  # F_*
Q_BYTES = 13  # answer body bytes relayed
Q_PROMPT_LEN = 14  # bytes of the prompt excerpt
Q_ANSWER_LEN = 15  # bytes of the answer excerpt
Q_RID = 16  # the request id, 16 bytes (2 words), NUL-padded
Q_KEY = 18  # the admitting key's row of the key table, -1: no policy key (issue 36)
Q_WORDS = 20  # (word 19 spare, so a record stays 8-word aligned at 160 bytes)

REQUEST_EXCERPT_BYTES = 1024
"""Bytes of each text excerpt (prompt, answer) a record keeps with
``--log-requests-bodies`` (UTF-8, cut at a character boundary)."""

F_STREAM = 1  # the answer was streamed (SSE)
F_USAGE_REPLICA = 2  # token counts from the replica (its usage)
F_USAGE_COUNTED = 4  # generated tokens counted by the proxy (stream events)
F_FORWARDED = 8  # came from another cluster node, whose own record is the usage ledger's
F_KEY_REFUSED = 16  # its keys-file key did not admit it (a limit, a model it may not use)

FIELDS = struct.Struct("<" + "q" * (Q_RID - 1) + "16s" + "q")
"""Words ``Q_WALL_NS`` .. ``Q_ANSWER_LEN``, the request id, then ``Q_KEY``:
one record's body after its sequence word, written in one call."""
_pack_into = FIELDS.pack_into


def request_ring_name(segment: str) -> str:
    """Name of the request ring beside the state segment named ``segment``
    (``/ggmux-8080`` -> ``/ggmux-8080-req``)."""
    return segment + "-req"


@dataclass(slots=True, frozen=True)
class RingShape:
    """``proxies`` regions of ``rows`` records, ``excerpt`` text bytes per field."""

    proxies: int
    rows: int
    excerpt: int = 0

    def region_words(self) -> int:
        return P_WORDS + self.rows * Q_WORDS

    def text_offset(self) -> int:
        return 8 * (H_WORDS + self.proxies * self.region_words())

    def total_bytes(self) -> int:
        return self.text_offset() + self.proxies * self.rows * 2 * self.excerpt


class RequestRing:
    """A mapped request ring: :meth:`create` (supervisor) or :meth:`attach`
    (proxies: each writes its region through :meth:`write` and reads all
    through :meth:`read`)."""

    def __init__(self, name: str, mm: mmap.mmap, shape: RingShape) -> None:
        self.name = name
        self.shape = shape
        self._mm = mm
        self._buf = memoryview(mm)
        n = H_WORDS + shape.proxies * shape.region_words()
        self._words = np.frombuffer(mm, dtype=np.int64, count=n)
        self._q = self._buf[: 8 * n].cast("q")  # Python-level words: the writer's stores
        self._region, self._rows, self._text = shape.region_words(), shape.rows, shape.text_offset()
        regions = self._words[H_WORDS:].reshape(shape.proxies, shape.region_words())
        self.counts = regions[:, :P_WORDS]  # (proxies, P_WORDS)
        self.rows = regions[:, P_WORDS:].reshape(shape.proxies, shape.rows, Q_WORDS)

    @classmethod
    def create(cls, name: str, shape: RingShape) -> RequestRing:
        """Create (replacing a stale one) an empty ring. Raises ``ValueError``
        for a shape without rows or proxies."""
        if shape.rows < 1 or shape.proxies < 1 or shape.excerpt < 0:
            raise ValueError(f"bad request ring shape {shape}")
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600,
                                     size=shape.total_bytes())
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        h = np.frombuffer(mm, dtype=np.int64, count=H_WORDS)
        h[H_VERSION] = VERSION
        h[H_PROXIES] = shape.proxies
        h[H_ROWS] = shape.rows
        h[H_EXCERPT] = shape.excerpt
        fence()
        h[H_MAGIC] = MAGIC
        del h
        return cls(name, mm, shape)

    @classmethod
    def attach(cls, name: str) -> RequestRing:
        """Attach to an existing ring. Raises ``posix_ipc.ExistentialError``
        when there is none, ``ValueError`` when it is not a request ring of
        this version."""
        shm = posix_ipc.SharedMemory(name)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        magic, version, proxies, rows, excerpt = struct.unpack_from("<5q", mm, 0)
        if magic != MAGIC or version != VERSION:
            mm.close()
            raise ValueError(f"{name}: not a ggmux request ring of version {VERSION}")
        return cls(name, mm, RingShape(proxies, rows, excerpt))

    def close(self) -> None:
        """Drop the mapping (views must not be used afterwards)."""
        self._q.release()
        self._buf.release()
        del self._words, self.counts, self.rows
        try:
            self._mm.close()
        except BufferError:
            pass  # a caller still holds a view; the mapping goes with the process

    def unlink(self) -> None:
        """Remove the ring's name (the supervisor does this on exit)."""
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass

    # ---- writer: one proxy, its own region ----------------------------------
    @cython.locals(q=cython.longlong[:], base=cython.Py_ssize_t, k=cython.longlong,
                   pos=cython.Py_ssize_t, at=cython.Py_ssize_t)
    def write(self, proxy: int, values: tuple, prompt: bytes = b"", answer: bytes = b"") -> None:
        """Append one record to ``proxy``'s region: ``values`` are the
        fields :data:`FIELDS` packs (``Q_WALL_NS`` .. ``Q_ANSWER_LEN``, the
        request id as bytes, ``Q_KEY``); ``prompt`` / ``answer`` the excerpts
        (cut to the ring's excerpt size; the caller sets their lengths in
        ``values``). Only the proxy that owns the region may call this.
        (Once per request on the forwarding path: a few word stores and
        one pack.)"""
        q = self._q
        base = H_WORDS + proxy * self._region
        k = q[base]
        pos = k % self._rows
        at = base + P_WORDS + pos * Q_WORDS
        q[at] = 2 * k + 1
        if NEEDS_FENCE:
            fence()
        _pack_into(self._buf, 8 * at + 8, *values)
        ex = self.shape.excerpt
        if ex:
            off = self._text + ((proxy * self._rows + pos) * 2) * ex
            self._buf[off : off + len(prompt[:ex])] = prompt[:ex]
            self._buf[off + ex : off + ex + len(answer[:ex])] = answer[:ex]
        if NEEDS_FENCE:
            fence()
        q[at] = 2 * k + 2
        q[base] = k + 1

    # ---- readers ---------------------------------------------------------------
    def written(self) -> np.ndarray:
        """Records each proxy ever wrote, ``(proxies,)``: a cursor for :meth:`read`."""
        return self.counts[:, P_WRITTEN].copy()

    def read(self, since: np.ndarray | None = None, until: np.ndarray | None = None,
             ) -> tuple[list[tuple[int, np.ndarray, bytes, bytes]], np.ndarray]:
        """The records each proxy still holds after cursor ``since`` (a
        :meth:`written` of before; None: every one it holds), up to cursor
        ``until`` (None: the newest): ``([(proxy, row, prompt, answer)], new
        cursor)``, ``row`` a copy of the record's :data:`Q_WORDS` words,
        unordered. Records overwritten or being written while copied are
        left out. Never blocks."""
        shape = self.shape
        out = []
        ends = self.written()
        if until is not None:
            ends = np.minimum(ends, until)
        ex = shape.excerpt
        for p in range(shape.proxies):
            end = int(ends[p])
            start = max(end - shape.rows, 0 if since is None else min(int(since[p]), end))
            if start >= end:
                continue
            ks = np.arange(start, end, dtype=np.int64)
            pos = ks % shape.rows
            want = 2 * ks + 2
            fence()
            seq1 = self.rows[p, pos, Q_SEQ]  # (fancy indexing: copies)
            fence()
            data = self.rows[p, pos]
            texts = []
            if ex:
                base = shape.text_offset() + p * shape.rows * 2 * ex
                for i, r in zip(pos.tolist(), data):
                    t = base + i * 2 * ex
                    texts.append((bytes(self._buf[t : t + min(ex, max(0, int(r[Q_PROMPT_LEN])))]),
                                  bytes(self._buf[t + ex : t + ex + min(ex, max(0, int(
                                      r[Q_ANSWER_LEN])))])))
            fence()
            ok = (seq1 == want) & (self.rows[p, pos, Q_SEQ] == want)
            for j in np.flatnonzero(ok).tolist():
                # (a record overwritten meanwhile, or a dead writer's half one, is left out)
                prompt, answer = texts[j] if ex else (b"", b"")
                out.append((p, data[j], prompt, answer))
        return out, ends
