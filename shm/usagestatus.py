"""The usage ledger's status, in shared memory: one seqlocked JSON blob.

The supervisor (:class:`~ggmux.ledger.ledger.UsageLedger`)
writes it about once a second while something changed; every proxy reads
it for ``/metrics`` (per-key counters, the ledger's health) and the page's
usage view. It lives in shared memory, not a file, because the thing it
reports may be a full disk. A segment of its own, ``<segment>-use``
(mode 0600), made and removed by the supervisor like the request ring.

Layout: int64 words ``MAGIC``, ``SEQ`` (odd while being written),
``LENGTH`` (bytes of JSON), then the JSON. A status larger than the blob
is written without its ``keys`` (and says ``keys_truncated``).
"""

from __future__ import annotations

import mmap
import struct

import orjson
import posix_ipc

from .seqlock import fence

MAGIC = 0x47474D5855534531  # "GGMUXUS1"
HEADER = 24
STATUS_BYTES = 256 * 1024
"""The blob's size: a status of some thousand keys' counters."""
READ_TRIES = 100


def usage_status_name(segment: str) -> str:
    """Name of the status blob beside the state segment ``segment``."""
    return segment + "-use"


class UsageStatus:
    """The mapped blob: :meth:`create` (supervisor) or :meth:`attach` (proxies)."""

    def __init__(self, name: str, mm: mmap.mmap) -> None:
        self.name = name
        self._mm = mm

    @classmethod
    def create(cls, name: str, size: int = STATUS_BYTES) -> UsageStatus:
        """Create (replacing a stale one) an empty blob."""
        try:
            posix_ipc.unlink_shared_memory(name)
        except posix_ipc.ExistentialError:
            pass
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=HEADER + size)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        struct.pack_into("<q", mm, 0, MAGIC)
        return cls(name, mm)

    @classmethod
    def attach(cls, name: str) -> UsageStatus:
        """Attach to an existing blob. Raises ``posix_ipc.ExistentialError``
        when there is none, ``ValueError`` when it is not one."""
        shm = posix_ipc.SharedMemory(name)
        try:
            mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        if struct.unpack_from("<q", mm, 0)[0] != MAGIC:
            mm.close()
            raise ValueError(f"{name}: not a ggmux usage status")
        return cls(name, mm)

    def write(self, doc: dict) -> None:
        """Replace the status with ``doc`` (the one writer: the supervisor)."""
        data = orjson.dumps(doc)
        room = len(self._mm) - HEADER
        if len(data) > room:
            data = orjson.dumps({**doc, "keys": {}, "keys_truncated": True})[:room]
        mm = self._mm
        seq = struct.unpack_from("<q", mm, 8)[0]
        struct.pack_into("<q", mm, 8, seq + 1)
        fence()
        mm[HEADER : HEADER + len(data)] = data
        struct.pack_into("<q", mm, 16, len(data))
        fence()
        struct.pack_into("<q", mm, 8, seq + 2)

    def read(self) -> dict | None:
        """The last status written (None: none yet, or the writer kept it
        busy for every try)."""
        mm = self._mm
        for _ in range(READ_TRIES):
            seq = struct.unpack_from("<q", mm, 8)[0]
            if seq & 1:
                continue
            fence()
            n = struct.unpack_from("<q", mm, 16)[0]
            data = bytes(mm[HEADER : HEADER + max(0, min(n, len(mm) - HEADER))])
            fence()
            if struct.unpack_from("<q", mm, 8)[0] != seq:
                continue
            if seq == 0:
                return None
            try:
                return orjson.loads(data)
            except orjson.JSONDecodeError:
                return None
        return None

    def close(self) -> None:
        try:
            self._mm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory(self.name)
        except posix_ipc.ExistentialError:
            pass
