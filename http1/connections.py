"""The open connections of one HTTP server: their count, their count per
client address, and which of them may be closed under pressure.

Idle connections must not lock clients out (issue 11, finding 10: 8,800
connections that sent nothing filled both proxies' 4,096 slots, and a
normal client got 503 on 123 of 136 requests for 75 s). So a connection is
*sheddable* while closing it loses nothing: it is idle between keep-alive
requests, it has not sent a whole request head yet (a new connection
included), or it lingers after an error answer. Above
``HttpLimits.shed_idle_at`` x ``max_connections`` open connections, each
new one closes one sheddable connection, lingering ones first, then the
one idle longest (nginx's ``reusable connections`` drained when
``worker_connections`` run short, here before they do). A connection that
is receiving a body or being answered is never shed.

The per-address cap (``max_connections_per_ip``) sheds the same way
within one address (issue 18, finding 11: one local client's 10,000 idle
connections locked every other client behind the same address, a reverse
proxy or a container bridge, out until they timed out): a new connection
from an address at its cap closes that address's oldest sheddable
connection, and gets 429 only when it has none.

Connections that are receiving a body must not lock clients out either
(issue 31, item 7: 14 connections that each announced a 10^6-byte body and
sent 10 bytes made every other client of 127.0.0.1 get 429). A body that
stalls is timed out (``HttpLimits.body_read_timeout``), and before a new
connection is refused at either cap, the connection receiving a body that
has waited longest since its last bytes is closed with 408 (it *stalled*
longest: a body arriving at pace keeps moving to the end). The receiving
set is kept like the sheddable one: ``receiving`` in the order of each
body's last progress, a connection's ``receiving`` flag clear when its
entry is stale.

Every operation is O(1) (amortized for shedding): the sheddable set is an
``OrderedDict`` in the order connections became sheddable, which
:class:`~.connection.HttpConnection` updates itself: a connection whose head is
complete only clears its ``sheddable`` flag (one store per request; it is
dropped from the set when shedding meets it), and one whose response
finished moves to the end (one ``move_to_end``). Proxies are separate
processes: each one's registry holds its own connections.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Protocol

log = logging.getLogger(__name__)

ADMITTED = 0
""":meth:`ConnectionRegistry.admit`'s answer for a connection that may be served."""


class Sheddable(Protocol):
    """What the registry needs of a connection: ``sheddable`` says closing
    it loses nothing now, ``receiving`` that it is receiving a request body
    and not being answered (an entry whose flag is clear is stale)."""

    sheddable: bool
    receiving: bool

    def shed(self) -> None:
        """Close now, the registry having forgotten it already."""


class ConnectionRegistry:
    """Counts of one server's open connections and its sheddable ones.

    ``count``: connections counted (admitted or being refused, until they
    close or are shed); ``per_ip``: the same per client address, for the
    connections that carry one; ``sheddable``: connection -> None, oldest
    first (see the module docstring); ``sheddable_of``: the same per client
    address, for the addresses with connections; ``shed``: connections
    closed under pressure so far; ``receiving`` and ``receiving_of``:
    connections receiving a body, the one whose body progressed least
    recently first (:meth:`progress`). An entry of ``sheddable`` (or of
    ``sheddable_of``) whose connection's flag is clear is stale (it became
    busy) and is dropped when met; the same for ``receiving`` and its
    connection's ``receiving`` flag."""

    __slots__ = ("count", "per_ip", "receiving", "receiving_of", "shed", "sheddable",
                 "sheddable_of")

    def __init__(self) -> None:
        self.count = 0
        self.per_ip: dict[str, int] = {}
        self.sheddable: OrderedDict[Sheddable, None] = OrderedDict()
        self.sheddable_of: dict[str, OrderedDict[Sheddable, None]] = {}
        self.receiving: OrderedDict[Sheddable, None] = OrderedDict()
        self.receiving_of: dict[str, OrderedDict[Sheddable, None]] = {}
        self.shed = 0

    def admit(self, ip: str | None, max_connections: int, per_ip: int,
              shed_above: float) -> int:
        """Count a new connection from client address ``ip`` (None: no
        address, not capped). Returns :data:`ADMITTED`, or the status to
        refuse it with: 429 when ``ip`` has more than ``per_ip`` connections
        (0: no cap) and none of them was sheddable nor receiving a body,
        503 when more than ``max_connections`` are open and none was
        sheddable nor receiving a body. Above ``shed_above`` open
        connections, one sheddable connection is closed first; at a cap, when
        none is sheddable, the one whose body stalled longest (issue 31,
        item 7). A refused connection stays counted until it closes (its
        descriptor is still open)."""
        self.count += 1
        if ip is not None and per_ip:
            n = self.per_ip.get(ip, 0) + 1
            self.per_ip[ip] = n
            if n == 1:
                self.sheddable_of[ip] = OrderedDict()
                self.receiving_of[ip] = OrderedDict()
            elif (n > per_ip and not self._shed_first(self.sheddable_of[ip])
                    and not self._shed_stalled(self.receiving_of[ip])):
                return 429
        if ((self.count > shed_above or self.count > max_connections)
                and not self.shed_one() and self.count > max_connections):
            self._shed_stalled(self.receiving)
        if self.count > max_connections:
            return 503
        return ADMITTED

    def progress(self, conn: Sheddable, ip: str | None) -> None:
        """``conn`` (from ``ip``, as given to :meth:`admit`; its
        ``receiving`` flag set) received bytes of a body it is still
        receiving: it becomes the last to be shed for a stalled body."""
        _to_end(self.receiving, conn)
        if ip is not None:
            of_ip = self.receiving_of.get(ip)
            if of_ip is not None:
                _to_end(of_ip, conn)

    def leave(self, conn: Sheddable, ip: str | None) -> None:
        """Forget ``conn`` (from ``ip``, as given to :meth:`admit`)."""
        self.count -= 1
        self.sheddable.pop(conn, None)
        self.receiving.pop(conn, None)
        if ip is not None:
            n = self.per_ip.get(ip, 0) - 1
            if n > 0:
                self.per_ip[ip] = n
                self.sheddable_of[ip].pop(conn, None)
                self.receiving_of[ip].pop(conn, None)
            else:
                self.per_ip.pop(ip, None)
                self.sheddable_of.pop(ip, None)
                self.receiving_of.pop(ip, None)

    def unsettled(self) -> int:
        """Open connections that would lose bytes if the process ended now:
        all counted ones but those idle between requests (``sheddable``)
        with nothing left in their transport's write buffer. A stopping
        server exits only at 0 (issue 37, item 8: the proxy stopped its loop
        once its requests no longer counted in flight, which happens before
        a stream's last bytes leave, and cut them). O(connections)."""
        settled = 0
        for conn in self.sheddable:
            if conn.sheddable:
                t = getattr(conn, "transport", None)
                if t is None or not t.get_write_buffer_size():
                    settled += 1
        return self.count - settled

    def shed_one(self) -> bool:
        """Close the first sheddable connection; False when there is none.
        Stale entries met on the way are dropped (each once per busy
        period: amortized O(1))."""
        return self._shed_first(self.sheddable)

    def _shed_first(self, sheddable: OrderedDict[Sheddable, None]) -> bool:
        """Close the oldest connection of ``sheddable`` that is still idle."""
        return self._shed_oldest(sheddable, "sheddable")

    def _shed_stalled(self, receiving: OrderedDict[Sheddable, None]) -> bool:
        """Close the connection of ``receiving`` whose body progressed least
        recently; False when none is receiving one."""
        return self._shed_oldest(receiving, "receiving")

    def _shed_oldest(self, entries: OrderedDict[Sheddable, None], still: str) -> bool:
        """Close the first connection of ``entries`` whose flag ``still``
        (``sheddable`` or ``receiving``) holds; stale entries met on the way
        are dropped. False when there is none."""
        pop = entries.popitem
        while entries:
            conn, _ = pop(last=False)
            if getattr(conn, still):
                self.shed += 1
                conn.shed()  # leave() drops it from the other set
                return True
        return False


def _to_end(entries: OrderedDict[Sheddable, None], conn: Sheddable) -> None:
    try:
        entries.move_to_end(conn)
    except KeyError:
        entries[conn] = None
