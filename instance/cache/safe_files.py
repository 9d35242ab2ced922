"""Opening the disk tier's files so that a local user cannot steer them
(issue 37, items 4 and 12): no symbolic link is followed, only regular
files are read, and a folder or a secret that another user owns or may
write is refused, as ssh's ``StrictModes`` refuses a ``~/.ssh`` others can
write. The rules:

* folders are opened ``O_DIRECTORY | O_NOFOLLOW`` and every file in them
  through ``openat`` from that verified descriptor (``dir_fd``), so a
  folder swapped for a link after the check moves nothing;
* files are opened ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO named ``x.kv`` or
  ``tenant.key`` opens at once instead of blocking until a writer comes)
  and refused unless ``fstat`` says regular file;
* new files are created ``O_CREAT | O_EXCL | O_NOFOLLOW``, mode 0600 (a
  planted link at the name makes the create fail, never writes through);
* a folder must be owned by this user (or root) and writable by no one
  else; a secret (``kv.key``, ``tenant.key``) must be owned by this user
  and readable by no one else. Anything else raises :class:`UnsafeFile`,
  whose message says what to change. Refusing, not warning: a folder others
  can write lets them plant entries and links, and a secret others can
  read lets them forge entries or tenants.

The entries' MAC key (:func:`mac_key`) lives outside every disk-tier
folder, in ``$XDG_STATE_HOME/ggmux/kv.key`` (``~/.local/state/ggmux``), so
that whoever can write a folder still cannot forge its entries.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import secrets
import stat

log = logging.getLogger(__name__)

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
SECRET_MAX = 4096
"""Largest secret file read (bytes): a longer one is not ours."""
MAC_KEY_BYTES = 32
MAC_KEY_FILE = "kv.key"


class UnsafeFile(OSError):
    """A link, a non-regular file, or a folder or secret that another user
    owns, may write or (a secret) may read; the message says which and
    what to change."""


def _owned(st: os.stat_result, path: str, what: str, allow_root: bool) -> None:
    uid = os.geteuid()
    if st.st_uid != uid and not (allow_root and st.st_uid == 0):
        raise UnsafeFile(errno.EPERM, f"{what} {path} is owned by uid {st.st_uid}, not by this "
                                      f"user (uid {uid}): refused (chown it, or use another)")


def check_folder(st: os.stat_result, path: str) -> None:
    """Raise :class:`UnsafeFile` unless ``st`` is a folder owned by this
    user (or root) that no one else may write."""
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFile(errno.ENOTDIR, f"{path} is not a folder: refused")
    _owned(st, path, "folder", allow_root=True)
    if st.st_mode & 0o022:
        raise UnsafeFile(errno.EPERM, f"folder {path} is writable by others (mode "
                                      f"{stat.S_IMODE(st.st_mode):o}): refused "
                                      f"(chmod go-w {path})")


def open_folder(path: str, dir_fd: int | None = None, make: bool = False) -> int:
    """A descriptor of folder ``path`` (relative to ``dir_fd`` when given),
    checked by :func:`check_folder`; ``make``: create it (0700) when
    missing. The last component is never followed; pass a resolved path
    (``os.path.realpath``) for a folder given by the operator. Raises
    :class:`UnsafeFile` (a link, not a folder, another's, writable by
    others) or OSError."""
    if make:
        try:
            os.mkdir(path, 0o700, dir_fd=dir_fd)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFile(e.errno, f"{path} is a symbolic link or not a folder: "
                                      f"refused") from None
        raise
    try:
        check_folder(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_root(path: str) -> int:
    """The operator's folder ``path`` (``--cache-disk``), made (0700) when
    missing, resolved (links in the path the operator wrote are theirs),
    checked by :func:`check_folder`. Raises :class:`UnsafeFile` or OSError."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    return open_folder(os.path.realpath(path))


def open_regular(name: str, dir_fd: int | None = None) -> int:
    """A read-only descriptor of regular file ``name`` (in ``dir_fd``),
    opened without following a link or blocking on a FIFO; blocking again
    once open. Raises :class:`UnsafeFile` (a link, a FIFO, a device, a
    folder) or OSError (FileNotFoundError when it is gone)."""
    try:
        fd = os.open(name, READ_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeFile(e.errno, f"{name} is a symbolic link: refused") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeFile(errno.EINVAL, f"{name} is not a regular file: refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_new(name: str, dir_fd: int | None = None) -> int:
    """A write descriptor of a new file ``name`` (mode 0600, in ``dir_fd``).
    Something already there (a planted link included) is removed once
    (the name itself, never what it points to) and the create tried again.
    Raises OSError."""
    try:
        return os.open(name, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    except FileExistsError:
        os.unlink(name, dir_fd=dir_fd)
        return os.open(name, CREATE_FLAGS, 0o600, dir_fd=dir_fd)


def read_secret(name: str, dir_fd: int | None = None) -> bytes:
    """The bytes of secret file ``name``: a regular file (no link, no FIFO)
    owned by this user that no one else may read or write. Raises
    :class:`UnsafeFile` or OSError."""
    fd = open_regular(name, dir_fd)
    try:
        st = os.fstat(fd)
        _owned(st, name, "secret", allow_root=False)
        if st.st_mode & 0o077:
            raise UnsafeFile(errno.EPERM, f"secret {name} may be read by others (mode "
                                          f"{stat.S_IMODE(st.st_mode):o}): refused "
                                          f"(chmod 600 it)")
        return os.read(fd, SECRET_MAX)
    finally:
        os.close(fd)


def make_secret(name: str, body: bytes, dir_fd: int | None = None) -> bytes:
    """Create secret file ``name`` (0600) holding ``body``, unless another
    process made it first; returns what the file holds then. Written under
    a temporary name and linked into place, so a reader never sees it half
    written. Raises :class:`UnsafeFile` or OSError."""
    tmp = f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    fd = os.open(tmp, CREATE_FLAGS, 0o600, dir_fd=dir_fd)
    try:
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        try:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            return read_secret(name, dir_fd)
        return body
    finally:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass


def state_dir() -> str:
    """``$XDG_STATE_HOME/ggmux`` (default ``~/.local/state/ggmux``)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "ggmux")


def mac_key(folder: str | None = None) -> bytes:
    """The key the disk tier's entries are authenticated with
    (:data:`MAC_KEY_BYTES` random bytes), kept in ``folder/kv.key``
    (default :func:`state_dir`, outside every disk-tier folder), made on
    first use; every server of this user shares it, so servers sharing a
    folder read each other's entries. Raises :class:`UnsafeFile` (the
    folder or the file fails the rules above) or OSError."""
    folder = folder or state_dir()
    fd = open_root(folder)
    try:
        try:
            key = read_secret(MAC_KEY_FILE, fd)
        except FileNotFoundError:
            key = make_secret(MAC_KEY_FILE, secrets.token_bytes(MAC_KEY_BYTES), fd)
    finally:
        os.close(fd)
    if len(key) != MAC_KEY_BYTES:
        raise UnsafeFile(errno.EINVAL, f"{os.path.join(folder, MAC_KEY_FILE)} is not a "
                                       f"{MAC_KEY_BYTES}-byte key: refused (remove it)")
    return key


__all__ = ["UnsafeFile", "check_folder", "create_new", "mac_key", "make_secret",
           "open_folder", "open_regular", "open_root", "read_secret", "state_dir"]
