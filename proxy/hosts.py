"""Which ``Host`` names a server answers to: the guard against DNS rebinding.

A page the operator visits can rebind its own name (``evil.example``) to
127.0.0.1 after it loaded; its requests then reach ggmux *same-origin*,
with ``Host: evil.example:8080``: no CORS rule applies, and a server
without keys would load, unload, clear caches and read its logs for it.
The browser always sends the page's name as ``Host``, so refusing names
that are not this server's stops it (as Jupyter and Ollama do).

:class:`HostCheck` passes a request when its ``Host`` is absent (no
browser sends none), an IP literal (a rebinding page has a name), a name
of one label (``localhost``, a container's or service's short name: only
this machine's or its network's resolver gives it an address, never an
outside site's DNS), a name under ``.localhost``, ``.local`` or
``.internal`` (names no public DNS serves), ``--host``, this machine's
names, the cluster's advertised address, or a name ``--allowed-hosts``
lists (``*.example.com`` globs). Anything else gets 403 naming the option.

When it applies (``--allowed-hosts``): by default only while the server
listens on a loopback address (the default ``--host``), as Jupyter's and
Ollama's checks: a server listening on a network has its own names, and
is told to set an API key (which a rebinding page does not have); a list
of names turns the check on whatever the address; ``*`` turns it off.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket

LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
CACHE_MAX = 256
"""Distinct ``Host`` values whose verdict a proxy keeps (a client sends one)."""


def host_name(value: bytes) -> str:
    """The name (or address) of a ``Host`` header value, lower case, without
    port, brackets or a trailing dot."""
    text = value.decode("latin-1").strip().lower()
    if text.startswith("["):  # [::1]:8080
        return text[1:].split("]", 1)[0]
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return text.rstrip(".")


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_loopback(host: str) -> bool:
    """Whether listening address ``host`` is loopback (127.0.0.0/8, ::1, localhost)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HostCheck:
    """The check of one proxy (module docstring): ``listen`` its ``--host``,
    ``allowed`` ``--allowed-hosts`` (``""``: automatic, ``*``: off, else
    comma-separated names or globs)."""

    __slots__ = ("cluster_name", "names", "on", "patterns", "seen")

    def __init__(self, listen: str, allowed: str = "") -> None:
        listed = [n.strip().lower().rstrip(".") for n in allowed.split(",") if n.strip()]
        self.on = "*" not in listed and (bool(listed) or is_loopback(listen))
        names = {listen.strip("[]").lower(), socket.gethostname().lower()}
        try:
            names.add(socket.getfqdn().lower())
        except OSError:
            pass
        self.names = frozenset(n for n in names if n)
        self.patterns = tuple(listed)
        self.seen: dict[bytes, bool] = {}
        self.cluster_name = ""  # the cluster's advertised host (set by the proxy)

    def allows(self, host: bytes | None) -> bool:
        """Whether a request with this ``Host`` header value is served."""
        if host is None or not self.on:
            return True
        ok = self.seen.get(host)
        if ok is None:
            ok = self._judge(host_name(host))
            if len(self.seen) >= CACHE_MAX:
                self.seen.clear()
            self.seen[host] = ok
        return ok

    def _judge(self, name: str) -> bool:
        return (not name or is_ip(name) or "." not in name or name.endswith(LOCAL_SUFFIXES)
                or name in self.names or name == self.cluster_name
                or any(fnmatch.fnmatchcase(name, p) for p in self.patterns))

    def set_cluster(self, name: str) -> None:
        """The cluster's advertised host name (a node forwards to it by it)."""
        name = name.lower()
        if name != self.cluster_name:
            self.cluster_name = name
            self.seen.clear()

    def refusal(self, host: bytes) -> str:
        """The 403's message for a refused ``Host``."""
        shown = host.decode("latin-1")[:100]
        name = host_name(host)[:100]
        return (f"Host '{shown}' is not a name of this server, so the request may come from "
                "a web page that rebound its name to this machine (DNS rebinding): start "
                f"ggmux with --allowed-hosts {name} to serve it (a list of names or "
                "*.domain globs; * turns the check off)")


__all__ = ["HostCheck", "host_name", "is_loopback"]
