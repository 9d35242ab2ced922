"""One disk-tier entry as a file: a sequence's KV state and what it holds.

Layout (little-endian; version 2)::

    magic    8 bytes   b"GGMUXKV\\0"
    version  u32       2
    hlen     u32       bytes of the header JSON
    header   hlen      JSON: fingerprint (hex), scope, n_tokens, pos_min,
                       payload_bytes, tokens_xxh3, payload_xxh3 (xxh3_64 hex);
                       since version 2, when checkpoints follow:
                       checkpoints_bytes, checkpoints_xxh3, checkpoints (the
                       token count of each)
    tokens   4 x n     the token ids (int32) whose KV the payload holds
    payload  n bytes   llama_state_seq_get_data of one sequence
    checkpoints        (version 2, optional) the context checkpoints' blob
                       (:mod:`.checkpoint`, issue 35)

A version 1 file (no checkpoints section) is read as one without
checkpoints; a reader of version 1 refuses a version 2 file as foreign
(never as torn: it is left in place).

The file is named ``<key>.kv``, ``key`` = sha256 of the scope and the token
ids (:func:`entry_key`): the name tells nothing of the prompt. It is
written to a temporary name beside it (``.<key>.<pid>.tmp``), mode 0600,
and renamed (DESIGN.md "KV tiers", issue 29): a reader sees
a whole file or none, and kill -9 mid-write leaves only a temporary file,
which the next scan removes. :func:`read_header` and :func:`read_payload`
refuse anything that does not verify (:class:`EntryFileError`).
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
import orjson
import xxhash

MAGIC = b"GGMUXKV\0"
VERSION = 2
READS = (1, 2)
"""Format versions this reader takes (1: before context checkpoints)."""
_FIXED = struct.Struct("<8sII")
HEADER_MAX = 1 << 16
"""Largest header JSON read (bytes): a longer one is not ours."""
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
WRITE_CHUNK = 16 << 20
"""Bytes written between two looks at the deadline (:func:`write_entry`)."""


class EntryFileError(ValueError):
    """A file that is not a whole, verified entry of this fingerprint
    (torn, corrupt, another model's, unreadable); ``reason`` says which."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class SaveTimeout(TimeoutError):
    """A write passed its deadline; the temporary file was removed."""


@dataclass(slots=True)
class FileHeader:
    """What an entry file says it holds; ``data_offset``: where its payload
    starts (bytes), ``file_bytes``: its whole size."""

    key: str
    fingerprint: str
    scope: str
    tokens: np.ndarray  # int32
    pos_min: int
    payload_bytes: int
    payload_xxh3: str
    data_offset: int
    file_bytes: int
    ckpt_bytes: int = 0  # the checkpoints section (0: none)
    ckpt_xxh3: str = ""
    ckpt_tokens: tuple[int, ...] = ()  # each checkpoint's token count


def entry_key(scope: str, tokens: np.ndarray) -> str:
    """sha256 hex of ``scope`` and the token ids (int32 little-endian): an
    entry's name in every tier."""
    h = hashlib.sha256(scope.encode("utf-8"))
    h.update(b"\0")
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def checksum(data) -> str:
    """xxh3_64 of a bytes-like object, 16 hex digits (several GB/s: a
    restore's check costs a small part of reading the bytes)."""
    return xxhash.xxh3_64_hexdigest(data)


def write_entry(directory: str, fingerprint: str, scope: str, tokens: np.ndarray, pos_min: int,
                payload, deadline: float | None = None, checkpoints: bytes = b"",
                ckpt_tokens: tuple[int, ...] = ()) -> tuple[str, int]:
    """Write one entry file into ``directory`` (temporary name, 0600,
    rename; no fsync: a file a power loss tore fails its checks); returns
    ``(path, bytes)``. ``payload`` is bytes-like; ``checkpoints``: the
    checkpoints' blob, ``ckpt_tokens`` their token counts;
    ``deadline`` (``time.monotonic()``) ends a write that passes it with
    :class:`SaveTimeout`. Raises OSError (a full or read-only disk) after
    removing the temporary file."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    key = entry_key(scope, tokens)
    tbytes = tokens.tobytes()
    view = memoryview(payload).cast("B")
    fields = {"fingerprint": fingerprint, "scope": scope,
              "n_tokens": int(tokens.size), "pos_min": int(pos_min),
              "payload_bytes": len(view), "tokens_xxh3": checksum(tbytes),
              "payload_xxh3": checksum(view)}
    if checkpoints:
        fields.update(checkpoints_bytes=len(checkpoints), checkpoints_xxh3=checksum(checkpoints),
                      checkpoints=[int(n) for n in ckpt_tokens])
    header = orjson.dumps(fields)
    head = _FIXED.pack(MAGIC, VERSION, len(header)) + header + tbytes
    final = os.path.join(directory, key + SUFFIX)
    tmp = os.path.join(directory, f".{key}.{os.getpid()}{TMP_SUFFIX}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            _write_all(fd, memoryview(head))
            for i in range(0, len(view), WRITE_CHUNK):
                if deadline is not None and time.monotonic() > deadline:
                    raise SaveTimeout(f"writing {key[:12]} passed its deadline")
                _write_all(fd, view[i:i + WRITE_CHUNK])
            if checkpoints:
                _write_all(fd, memoryview(checkpoints))
        finally:
            os.close(fd)
        os.chmod(tmp, 0o600)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return final, len(head) + len(view) + len(checkpoints)


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def read_header(path: str, fingerprint: str) -> FileHeader:
    """The header of entry file ``path``, checked: magic, version, this
    ``fingerprint``, the file's size, the token ids' checksum and the name
    (the key of its scope and tokens). Raises :class:`EntryFileError`."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            fixed = f.read(_FIXED.size)
            if len(fixed) < _FIXED.size:
                raise EntryFileError("torn", f"{path}: shorter than a header")
            magic, version, hlen = _FIXED.unpack(fixed)
            if magic != MAGIC:
                raise EntryFileError("foreign", f"{path}: not a ggmux KV entry")
            if version not in READS:
                raise EntryFileError("foreign", f"{path}: format version {version}, "
                                                f"not {VERSION}")
            if hlen > HEADER_MAX:
                raise EntryFileError("corrupt", f"{path}: header of {hlen} bytes")
            raw = f.read(hlen)
            try:
                h = orjson.loads(raw)
                n, pbytes = int(h["n_tokens"]), int(h["payload_bytes"])
                cbytes = int(h.get("checkpoints_bytes", 0)) if version >= 2 else 0
                ctokens = tuple(int(x) for x in h.get("checkpoints", ())) if cbytes else ()
            except (ValueError, KeyError, TypeError):
                raise EntryFileError("torn" if len(raw) < hlen else "corrupt",
                                     f"{path}: unreadable header") from None
            if h.get("fingerprint") != fingerprint:
                raise EntryFileError("foreign", f"{path}: another model or context "
                                                f"(fingerprint {str(h.get('fingerprint'))[:12]})")
            offset = _FIXED.size + hlen + 4 * n
            if n <= 0 or pbytes <= 0 or cbytes < 0 or size != offset + pbytes + cbytes:
                raise EntryFileError("torn", f"{path}: {size} bytes, the header says "
                                             f"{offset + pbytes + cbytes}")
            tbytes = f.read(4 * n)
    except OSError as e:
        raise EntryFileError("unreadable", f"{path}: {e}") from None
    if checksum(tbytes) != h.get("tokens_xxh3"):
        raise EntryFileError("corrupt", f"{path}: token ids do not match their checksum")
    tokens = np.frombuffer(tbytes, dtype="<i4").astype(np.int32)
    scope = str(h.get("scope", ""))
    key = entry_key(scope, tokens)
    if os.path.basename(path) != key + SUFFIX:
        raise EntryFileError("corrupt", f"{path}: its name is not its contents' key")
    return FileHeader(key, fingerprint, scope, tokens, int(h.get("pos_min", 0)), pbytes,
                      str(h.get("payload_xxh3")), offset, size, cbytes,
                      str(h.get("checkpoints_xxh3", "")), ctokens)


def read_payload(path: str, header: FileHeader) -> memoryview:
    """The payload of an entry whose header was read, verified against its
    checksum: a read-only view of ``header.payload_bytes`` over a shared,
    prefaulted mapping of the file (the page cache's own pages: no copy and
    no fresh memory to fault in, which cost more than the read itself;
    bench/RESULTS.md "KV tiers: restore"). Entry files are only ever
    replaced by a rename, never rewritten in place, so the mapping stays
    whole. Raises :class:`EntryFileError` (changed or shortened since,
    corrupt, gone)."""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != header.file_bytes:
                raise EntryFileError("torn", f"{path}: its size changed")
            mm = mmap.mmap(f.fileno(), header.file_bytes,
                           flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                           prot=mmap.PROT_READ)
    except FileNotFoundError:
        raise EntryFileError("gone", f"{path}: removed") from None
    except (OSError, ValueError) as e:
        raise EntryFileError("unreadable", f"{path}: {e}") from None
    view = memoryview(mm)[header.data_offset:header.data_offset + header.payload_bytes]
    if checksum(view) != header.payload_xxh3:
        raise EntryFileError("corrupt", f"{path}: payload does not match its checksum")
    return view


def read_checkpoints(path: str, header: FileHeader) -> bytes:
    """The checkpoints section of an entry whose header was read (b"" for
    none), verified against its checksum. Raises :class:`EntryFileError`."""
    if not header.ckpt_bytes:
        return b""
    try:
        with open(path, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != header.file_bytes:
                raise EntryFileError("torn", f"{path}: its size changed")
            f.seek(header.data_offset + header.payload_bytes)
            blob = f.read(header.ckpt_bytes)
    except FileNotFoundError:
        raise EntryFileError("gone", f"{path}: removed") from None
    except OSError as e:
        raise EntryFileError("unreadable", f"{path}: {e}") from None
    if len(blob) != header.ckpt_bytes or checksum(blob) != header.ckpt_xxh3:
        raise EntryFileError("corrupt", f"{path}: checkpoints do not match their checksum")
    return blob


__all__ = ["EntryFileError", "FileHeader", "SaveTimeout", "checksum", "entry_key",
           "read_checkpoints", "read_header", "read_payload", "write_entry"]
