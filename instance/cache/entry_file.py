"""One disk-tier entry as a file: a sequence's KV state and what it holds.

Layout (little-endian; version 3)::

    magic    8 bytes   b"GGMUXKV\\0"
    version  u32       3
    hlen     u32       bytes of the header JSON
    mac      32 bytes  HMAC-SHA256 over magic .. hlen, the header and the tokens
    header   hlen      JSON: fingerprint (hex), scope, n_tokens, pos_min,
                       payload_bytes, payload_mac (HMAC-SHA256 hex); when
                       checkpoints follow: checkpoints_bytes,
                       checkpoints_mac (HMAC-SHA256 hex), checkpoints (the
                       token count of each)
    tokens   4 x n     the token ids (int32) whose KV the payload holds
    payload  n bytes   llama_state_seq_get_data of one sequence
    checkpoints        (optional) the context checkpoints' blob
                       (:mod:`.checkpoint`, issue 35)

The MACs are keyed by the server's secret kept outside the folder
(:func:`~.safe_files.mac_key`; issue 37, item 4): whoever can write the
folder cannot make an entry that answers a tenant what they chose (an
unkeyed checksum let them). The checkpoints' MAC also covers the entry's
key (its scope and tokens), and the header MAC covers the checkpoints' MAC:
a section cannot be forged, nor moved from one entry into another.
Versions 1 (xxh3 checksums, no MAC: the forgery path the MAC closes) and 2
(a MAC without checkpoints, or checkpoints without a MAC: two branches
used the number) are refused as ``foreign``: never read, left in place. The file is named ``<key>.kv``, ``key`` =
sha256 of the scope and the token ids (:func:`entry_key`): the name tells
nothing of the prompt. It is written to a temporary name beside it
(``.<key>.<pid>.tmp``, created ``O_EXCL``, mode 0600) and renamed (DESIGN.md
"KV tiers", issue 29): a reader sees a whole file or none, and kill -9
mid-write leaves only a temporary file, which the next scan removes. Every
file is opened from the folder's verified descriptor without following a
link, and only a regular file is read (:mod:`.safe_files`).
:func:`read_header` and :func:`read_payload` refuse anything that does not
verify (:class:`EntryFileError`); :func:`read_header` refuses a token count
over the context's before it reads or allocates anything (item 12).
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import struct
import time
from dataclasses import dataclass

import numpy as np
import orjson

from .safe_files import UnsafeFile, create_new, open_regular

MAGIC = b"GGMUXKV\0"
VERSION = 3
_FIXED = struct.Struct("<8sII")
MAC_BYTES = 32
_HEAD_MAC = b"ggmux-kv-head\0"  # what each MAC covers, so one never passes for the other
_PAYLOAD_MAC = b"ggmux-kv-payload\0"
_CKPT_MAC = b"ggmux-kv-checkpoints\0"
CKPT_COUNT_MAX = 4096
"""Most checkpoint token counts a header may list (:data:`.checkpoint.COUNT_MAX`)."""
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
    """What an entry file says it holds (its MAC verified); ``data_offset``:
    where its payload starts (bytes), ``file_bytes``: its whole size,
    ``mtime``: its modification time (s, the LRU's clock on disk)."""

    key: str
    fingerprint: str
    scope: str
    tokens: np.ndarray  # int32
    pos_min: int
    payload_bytes: int
    payload_mac: str
    data_offset: int
    file_bytes: int
    mtime: float = 0.0
    ckpt_bytes: int = 0  # the checkpoints section after the payload (0: none)
    ckpt_mac: str = ""
    ckpt_tokens: tuple[int, ...] = ()  # each checkpoint's token count


def entry_key(scope: str, tokens: np.ndarray) -> str:
    """sha256 hex of ``scope`` and the token ids (int32 little-endian): an
    entry's name in every tier."""
    h = hashlib.sha256(scope.encode("utf-8"))
    h.update(b"\0")
    h.update(np.ascontiguousarray(tokens, dtype="<i4").tobytes())
    return h.hexdigest()


def payload_mac(mac_key: bytes, data) -> str:
    """HMAC-SHA256 hex of a payload (bytes-like; ~1 GB/s with the CPU's SHA
    instructions, the GIL released: a restore's check costs about what
    reading the bytes does)."""
    m = hmac.new(mac_key, _PAYLOAD_MAC, "sha256")
    m.update(data)
    return m.hexdigest()


def checkpoints_mac(mac_key: bytes, key: str, blob) -> str:
    """HMAC-SHA256 hex of the checkpoints section ``blob`` of the entry
    whose key (:func:`entry_key`) is ``key``: bound to that entry, so a
    section copied into another entry's file does not verify."""
    m = hmac.new(mac_key, _CKPT_MAC, "sha256")
    m.update(key.encode("ascii"))
    m.update(b"\0")
    m.update(blob)
    return m.hexdigest()


def _head_mac(mac_key: bytes, fixed: bytes, header: bytes, tbytes) -> bytes:
    m = hmac.new(mac_key, _HEAD_MAC, "sha256")
    m.update(fixed)
    m.update(header)
    m.update(tbytes)
    return m.digest()


def write_entry(dir_fd: int, fingerprint: str, scope: str, tokens: np.ndarray, pos_min: int,
                payload, mac_key: bytes, deadline: float | None = None,
                checkpoints: bytes = b"", ckpt_tokens: tuple[int, ...] = ()) -> tuple[str, int]:
    """Write one entry file into the folder ``dir_fd`` (a temporary name
    created ``O_EXCL``, 0600, renamed; no fsync: a file a power loss tore
    fails its checks); returns ``(name, bytes)``. ``payload`` is
    bytes-like; ``checkpoints``: the checkpoints' blob (:func:`.checkpoint.pack`,
    b"" for none), ``ckpt_tokens`` their token counts; ``mac_key``
    authenticates all of it (:func:`~.safe_files.mac_key`);
    ``deadline`` (``time.monotonic()``) ends a write that passes it with
    :class:`SaveTimeout`. Raises OSError (a full or read-only disk) after
    removing the temporary file."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    key = entry_key(scope, tokens)
    tbytes = tokens.tobytes()
    view = memoryview(payload).cast("B")
    fields = {"fingerprint": fingerprint, "scope": scope,
              "n_tokens": int(tokens.size), "pos_min": int(pos_min),
              "payload_bytes": len(view), "payload_mac": payload_mac(mac_key, view)}
    if checkpoints:
        fields.update(checkpoints_bytes=len(checkpoints),
                      checkpoints_mac=checkpoints_mac(mac_key, key, checkpoints),
                      checkpoints=[int(n) for n in ckpt_tokens])
    header = orjson.dumps(fields)
    fixed = _FIXED.pack(MAGIC, VERSION, len(header))
    head = fixed + _head_mac(mac_key, fixed, header, tbytes) + header + tbytes
    final = key + SUFFIX
    tmp = f".{key}.{os.getpid()}{TMP_SUFFIX}"
    fd = create_new(tmp, dir_fd)
    try:
        try:
            _write_all(fd, memoryview(head))
            for i in range(0, len(view), WRITE_CHUNK):
                if deadline is not None and time.monotonic() > deadline:
                    raise SaveTimeout(f"writing {key[:12]} passed its deadline")
                _write_all(fd, view[i:i + WRITE_CHUNK])
            if checkpoints:
                _write_all(fd, memoryview(checkpoints).cast("B"))
        finally:
            os.close(fd)
        os.replace(tmp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise
    return final, len(head) + len(view) + len(checkpoints)


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        n = os.write(fd, view)
        view = view[n:]


def _open(dir_fd: int, name: str) -> int:
    try:
        return open_regular(name, dir_fd)
    except UnsafeFile as e:
        raise EntryFileError("unsafe", f"{name}: {e.strerror}") from None
    except FileNotFoundError:
        raise EntryFileError("gone", f"{name}: removed") from None
    except OSError as e:
        raise EntryFileError("unreadable", f"{name}: {e}") from None


def read_header(dir_fd: int, name: str, fingerprint: str, mac_key: bytes,
                max_tokens: int = 0) -> FileHeader:
    """The header of entry file ``name`` in folder ``dir_fd``, checked:
    a regular file (:mod:`.safe_files`), magic, version, at most
    ``max_tokens`` token ids (the context's size; 0: no bound) before any
    is read, the file's size (payload and checkpoints section included),
    the MAC over header and tokens (the checkpoints' MAC among them), this
    ``fingerprint`` and the name (the key of its scope and tokens). Raises
    :class:`EntryFileError` (reason ``unsafe``, ``gone``, ``unreadable``,
    ``torn``, ``foreign``, ``corrupt``)."""
    fd = _open(dir_fd, name)
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            size = st.st_size
            fixed = f.read(_FIXED.size)
            mac = f.read(MAC_BYTES)
            if len(mac) < MAC_BYTES:
                raise EntryFileError("torn", f"{name}: shorter than a header")
            magic, version, hlen = _FIXED.unpack(fixed)
            if magic != MAGIC:
                raise EntryFileError("foreign", f"{name}: not a ggmux KV entry")
            if version != VERSION:  # 1 and 2 included: never read (module docstring)
                raise EntryFileError("foreign", f"{name}: format version {version}, "
                                                f"not {VERSION}")
            if hlen > HEADER_MAX:
                raise EntryFileError("corrupt", f"{name}: header of {hlen} bytes")
            raw = f.read(hlen)
            try:
                h = orjson.loads(raw)
                n, pbytes = int(h["n_tokens"]), int(h["payload_bytes"])
                cbytes = int(h.get("checkpoints_bytes", 0))
                clist = h.get("checkpoints", []) if cbytes else []
                if not isinstance(clist, list) or len(clist) > CKPT_COUNT_MAX:
                    raise TypeError("checkpoints")
                ctokens = tuple(int(x) for x in clist)
            except (ValueError, KeyError, TypeError, AttributeError):
                raise EntryFileError("torn" if len(raw) < hlen else "corrupt",
                                     f"{name}: unreadable header") from None
            if max_tokens and n > max_tokens:
                raise EntryFileError("corrupt", f"{name}: {n} token ids, more than the "
                                                f"context's {max_tokens}")
            offset = _FIXED.size + MAC_BYTES + hlen + 4 * n
            if n <= 0 or pbytes <= 0 or cbytes < 0 or size != offset + pbytes + cbytes:
                raise EntryFileError("torn", f"{name}: {size} bytes, the header says "
                                             f"{offset + pbytes + cbytes}")
            tbytes = f.read(4 * n)
    except OSError as e:
        raise EntryFileError("unreadable", f"{name}: {e}") from None
    if h.get("fingerprint") != fingerprint:
        raise EntryFileError("foreign", f"{name}: another model or context "
                                        f"(fingerprint {str(h.get('fingerprint'))[:12]})")
    if not hmac.compare_digest(mac, _head_mac(mac_key, fixed, raw, tbytes)):
        raise EntryFileError("corrupt", f"{name}: header and token ids do not match their "
                                        f"MAC (damaged, forged, or written with another key)")
    tokens = np.frombuffer(tbytes, dtype="<i4").astype(np.int32)
    scope = str(h.get("scope", ""))
    key = entry_key(scope, tokens)
    if name != key + SUFFIX:
        raise EntryFileError("corrupt", f"{name}: its name is not its contents' key")
    if any(not 0 < c <= n for c in ctokens):
        raise EntryFileError("corrupt", f"{name}: a checkpoint outside its {n} tokens")
    return FileHeader(key, fingerprint, scope, tokens, int(h.get("pos_min", 0)), pbytes,
                      str(h.get("payload_mac")), offset, size, st.st_mtime, cbytes,
                      str(h.get("checkpoints_mac", "")), ctokens)


def read_payload(dir_fd: int, name: str, header: FileHeader, mac_key: bytes) -> memoryview:
    """The payload of entry ``name`` (folder ``dir_fd``) whose header was
    read, verified against its MAC: a read-only view of
    ``header.payload_bytes`` over a shared, prefaulted mapping of the file
    (the page cache's own pages: no copy and no fresh memory to fault in,
    which cost more than the read itself; bench/RESULTS.md "KV tiers:
    restore"). Entry files are only ever replaced by a rename, never
    rewritten in place, so the mapping stays whole. Raises
    :class:`EntryFileError` (changed or shortened since, corrupt, forged,
    gone, not a regular file)."""
    fd = _open(dir_fd, name)
    try:
        size = os.fstat(fd).st_size
        mm = None if size != header.file_bytes else mmap.mmap(fd, header.file_bytes,
                       flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                       prot=mmap.PROT_READ)
    except (OSError, ValueError) as e:
        raise EntryFileError("unreadable", f"{name}: {e}") from None
    finally:
        os.close(fd)
    if mm is None:
        raise EntryFileError("torn", f"{name}: its size changed")
    view = memoryview(mm)[header.data_offset:header.data_offset + header.payload_bytes]
    if not hmac.compare_digest(payload_mac(mac_key, view), header.payload_mac):
        raise EntryFileError("corrupt", f"{name}: payload does not match its MAC")
    return view


def read_checkpoints(dir_fd: int, name: str, header: FileHeader, mac_key: bytes) -> bytes:
    """The checkpoints section of entry ``name`` (folder ``dir_fd``) whose
    header was read (b"" for none), verified against its MAC (bound to the
    entry's key). Raises :class:`EntryFileError` (changed since, corrupt,
    forged, moved from another entry, gone, not a regular file)."""
    if not header.ckpt_bytes:
        return b""
    fd = _open(dir_fd, name)
    try:
        with os.fdopen(fd, "rb", buffering=0) as f:
            if os.fstat(f.fileno()).st_size != header.file_bytes:
                raise EntryFileError("torn", f"{name}: its size changed")
            f.seek(header.data_offset + header.payload_bytes)
            blob = f.read(header.ckpt_bytes)
    except OSError as e:
        raise EntryFileError("unreadable", f"{name}: {e}") from None
    if len(blob) != header.ckpt_bytes or not hmac.compare_digest(
            checkpoints_mac(mac_key, header.key, blob), header.ckpt_mac):
        raise EntryFileError("corrupt", f"{name}: checkpoints do not match their MAC")
    return blob


__all__ = ["EntryFileError", "FileHeader", "SaveTimeout", "checkpoints_mac", "entry_key",
           "payload_mac", "read_checkpoints", "read_header", "read_payload", "write_entry"]
