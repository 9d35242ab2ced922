"""A server that died without its stop (``kill -9``, an OOM kill, a power
cut of the process, not the machine) leaves its request ring in
``/dev/shm``; the next server of the same name reads it before it makes its
own, so the answered requests whose rows had not reached the store yet
(the ring is read every 0.1 s, rows are written every 0.5 s) are written
now, and the keys' day, week and month windows, seeded from the ledger,
count them.

What it reads, all before any of it is replaced: every record the old
ring still holds (up to ``--requests-kept`` per proxy), and the names its
records' numbers stood for in the old server: the models and remotes of
its state segment's registry blob and the keys of its key table (a reload
may have renumbered them since; a record whose number none of them names
takes the new server's name, as a row of a live server would). A record
already in the store (the same request id, arrival time and node) is not
written twice: :meth:`~.ledger.UsageLedger.recover`.

What this cannot give back (README, "Usage ledger"): requests that were
still being answered when the server died (no record was written: their
clients got a cut answer), records the ring lapped before the crash, a
record a proxy was writing as it died, and everything when ``/dev/shm`` was
emptied meanwhile (a reboot, a new container).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import numpy as np
import posix_ipc

from ..shm.keytable import KeyTable, key_table_name
from ..shm.requestring import F_FORWARDED, Q_FLAGS, Q_WALL_NS, RequestRing, request_ring_name
from ..shm.segment import Segment
from .records import RowContext, UsageRow

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Leftover:
    """A dead server's request records (``Q_WORDS`` int64 rows, by
    arrival) and what their numbers named there: model index -> name,
    replica slot -> name (an upstream's ``host:port``, another node's
    name), key row -> name."""

    records: list[np.ndarray]
    models: dict[int, str] = field(default_factory=dict)
    replicas: dict[int, str] = field(default_factory=dict)
    keys: dict[int, str] = field(default_factory=dict)

    def rows(self, ctx: RowContext) -> list[UsageRow]:
        """The records as usage rows: names from the dead server where it
        had them, else ``ctx``'s (this server's), this node's name and
        prices. A request another node forwarded is left out, as
        :meth:`~.ledger.UsageLedger.read` leaves it out."""
        old = dataclasses.replace(
            ctx,
            model_name=lambda m: self.models.get(m) or ctx.model_name(m),
            replica_name=lambda s: self.replicas.get(s) or ctx.replica_name(s),
            key_name=lambda r: self.keys.get(r) or ctx.key_name(r))
        return [old.row(rec) for rec in self.records if not int(rec[Q_FLAGS]) & F_FORWARDED]


def read_leftover(shm_name: str) -> Leftover | None:
    """What the server of segment ``shm_name`` that died left (module
    docstring), or None when it left no request ring (it stopped cleanly,
    or never ran) or one this version cannot read (logged). Call it after
    checking that no live server owns the name and before any segment of
    the name is made again. Never raises."""
    try:
        ring = RequestRing.attach(request_ring_name(shm_name))
    except posix_ipc.ExistentialError:
        return None
    except (OSError, ValueError, posix_ipc.Error) as e:
        log.warning("usage ledger: the request ring a stopped server left (%s) cannot be "
                    "read (%s): its last requests may be missing from the ledger",
                    request_ring_name(shm_name), e)
        return None
    try:
        found, _ = ring.read()
    finally:
        ring.close()
    records = sorted((rec for _, rec, _, _ in found), key=lambda r: int(r[Q_WALL_NS]))
    out = Leftover(records)
    try:
        seg = Segment.attach(shm_name)
        try:
            _, doc = seg.read_registry()
        finally:
            seg.close()
        out.models = {i: m["name"] for i, m in enumerate(doc.get("models") or ())
                      if isinstance(m, dict) and isinstance(m.get("name"), str)}
        for slot, rm in (doc.get("remotes") or {}).items():
            if isinstance(rm, dict):
                out.replicas[int(slot)] = rm.get("node") or f"{rm.get('host')}:{rm.get('port')}"
    except (OSError, ValueError, KeyError, RuntimeError, posix_ipc.Error) as e:
        log.info("usage ledger: the stopped server's registry is unreadable (%s): its "
                 "requests take this server's model names", e)
    try:
        table = KeyTable.attach(key_table_name(shm_name))
        try:
            _, pol = table.policies()
        finally:
            table.close()
        out.keys = {int(k["row"]): k["name"] for k in pol.get("keys") or ()
                    if isinstance(k, dict) and "row" in k and "name" in k}
    except (OSError, ValueError, KeyError, RuntimeError, posix_ipc.Error) as e:
        log.info("usage ledger: the stopped server's key table is unreadable (%s): its "
                 "requests take this server's key names", e)
    return out


__all__ = ["Leftover", "read_leftover"]
