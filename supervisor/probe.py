"""Non-blocking HTTP readiness probes for the supervisor's poll loop.

A ``cmd`` instance (llama-server, vLLM, ...) is ready when its check
endpoint answers 200 (llama-swap's ``checkEndpoint``; llama-server answers
503 while loading); an ``upstream`` replica is healthy while it does. The
supervisor has no threads, so a probe is a small state machine whose socket
sits in the same ``poll()`` set as the children's pipes: connect, send one
``GET``, read the status line. Intervals start at 10 ms and double to
500 ms while a load is awaited (llama-swap polls every 250 ms; starting
faster shaves the wait after a quick load).

An upstream's host name is resolved here, in the loop (:func:`resolve`):
a numeric address costs nothing, a name one ``getaddrinfo`` per
``DNS_CACHE_S`` (blocking the loop as long as the resolver takes); a name
that does not resolve fails the probe with the resolver's reason (the
replica is unhealthy and the failure logged), never the loop (issue 11,
finding 12: it was a traceback that stopped the server).
"""

from __future__ import annotations

import errno
import socket

FIRST_INTERVAL_S = 0.010
MAX_INTERVAL_S = 0.500
TIMEOUT_S = 2.0
DNS_CACHE_S = 30.0
"""Seconds a resolved upstream address is reused before it is looked up again."""
DNS_FAILURE_CACHE_S = 5.0
"""Seconds a name that did not resolve is not looked up again (its probe fails)."""

Address = tuple[int, tuple]  # (address family, socket address)
_resolved: dict[tuple[str, int], tuple[int, Address | str]] = {}  # -> (expires ns, result)


def resolve(host: str, port: int, now_ns: int) -> Address | str:
    """``(family, sockaddr)`` to connect to ``host:port``, or the reason it
    cannot be resolved. Numeric addresses are parsed; names are looked up
    with ``getaddrinfo`` and the answer (or failure) is cached for
    :data:`DNS_CACHE_S` (:data:`DNS_FAILURE_CACHE_S`) seconds."""
    for fam in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(fam, host)
        except OSError:
            continue
        return (fam, (host, port) if fam == socket.AF_INET else (host, port, 0, 0))
    hit = _resolved.get((host, port))
    if hit is not None and hit[0] > now_ns:
        return hit[1]
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        result: Address | str = (infos[0][0], infos[0][4])
        ttl = DNS_CACHE_S
    except (OSError, IndexError, UnicodeError) as e:
        result = f"cannot resolve host {host!r}: {getattr(e, 'strerror', None) or e}"
        ttl = DNS_FAILURE_CACHE_S
    _resolved[(host, port)] = (now_ns + int(ttl * 1e9), result)
    return result


class Probe:
    """One ``GET path`` to ``host:port``; ``done`` / ``ok`` when finished.

    ``path == ""`` means "ready when the port accepts a connection".
    """

    __slots__ = (
        "buf",
        "deadline_ns",
        "done",
        "host",
        "ok",
        "path",
        "port",
        "sock",
        "state",
        "why",
    )

    def __init__(self, host: str, port: int, path: str, now_ns: int) -> None:
        self.host = host
        self.port = port
        self.path = path
        self.buf = b""
        self.done = False
        self.ok = False
        self.why = ""
        self.deadline_ns = now_ns + int(TIMEOUT_S * 1e9)
        self.sock: socket.socket | None = None
        addr = resolve(host, port, now_ns)
        if isinstance(addr, str):
            self._finish(False, addr)
            return
        try:
            self.sock = socket.socket(addr[0], socket.SOCK_STREAM)
            self.sock.setblocking(False)
            err = self.sock.connect_ex(addr[1])
        except OSError as e:
            self._finish(False, f"connect: {e}")
            return
        if err not in (0, errno.EINPROGRESS):
            self._finish(False, f"connect: {errno.errorcode.get(err, err)}")
            self.state = "done"
        else:
            self.state = "connecting"

    def fileno(self) -> int:
        return self.sock.fileno()

    def events(self) -> int:
        import select

        return select.POLLOUT if self.state == "connecting" else select.POLLIN

    def on_event(self) -> None:
        """Advance on a poll event; sets ``done``."""
        if self.done:
            return
        if self.state == "connecting":
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self._finish(False, f"connect: {errno.errorcode.get(err, err)}")
                return
            if not self.path:
                self._finish(True)
                return
            host = f"[{self.host}]" if ":" in self.host else self.host
            req = f"GET {self.path} HTTP/1.1\r\nhost: {host}:{self.port}\r\nconnection: close\r\n\r\n"
            try:
                self.sock.send(req.encode())
            except OSError as e:
                self._finish(False, str(e))
                return
            self.state = "reading"
            return
        try:
            data = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError as e:
            self._finish(False, str(e))
            return
        self.buf += data
        if b"\r\n" in self.buf or not data:
            line = self.buf.split(b"\r\n", 1)[0].split()
            ok = len(line) >= 2 and line[1] == b"200"
            self._finish(ok, "" if ok else f"answered {line[1:2] or 'nothing'}")

    def expired(self, now_ns: int) -> bool:
        if not self.done and now_ns > self.deadline_ns:
            self._finish(False, "timed out")
        return self.done

    def _finish(self, ok: bool, why: str = "") -> None:
        self.done = True
        self.ok = ok
        self.why = why
        self.state = "done"
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass


def next_interval(current: float) -> float:
    """The wait before the next readiness probe after one failed."""
    return min(MAX_INTERVAL_S, max(FIRST_INTERVAL_S, current * 2))


class ProbeSet:
    """The probes in flight, their sockets in the supervisor's poll set.

    ``poller`` is the loop's ``select.poll()`` object; ``owner`` (the
    replica or remote a probe is for) is kept beside each probe.
    """

    def __init__(self, poller) -> None:
        self.poller = poller
        self.probes: dict[int, tuple[Probe, object]] = {}  # fd -> (probe, owner)

    def start(self, host: str, port: int, path: str, owner, now: int) -> Probe:
        """Start a probe of ``host:port`` (``now`` in monotonic ns); one that
        failed at once comes back ``done``, outside the poll set."""
        pr = Probe(host, port, path, now)
        if not pr.done:
            self.probes[pr.fileno()] = (pr, owner)
            self.poller.register(pr.fileno(), pr.events())
        return pr

    def drop(self, fd: int) -> None:
        """Take the probe on ``fd`` out of the poll set (no-op if none)."""
        if self.probes.pop(fd, None) is not None:
            try:
                self.poller.unregister(fd)
            except (KeyError, ValueError):
                pass

    def on_event(self, fd: int) -> bool:
        """Advance the probe on ``fd``; False if ``fd`` is not a probe's."""
        pr = self.probes.get(fd)
        if pr is None:
            return False
        pr[0].on_event()
        if pr[0].done:
            self.drop(fd)
        return True

    def step(self, now: int) -> None:
        """Expire probes past their timeout; poll a connected one for input."""
        for fd, (pr, _) in list(self.probes.items()):
            if pr.expired(now):
                self.drop(fd)
            elif pr.state == "reading":
                self.poller.modify(fd, pr.events())
