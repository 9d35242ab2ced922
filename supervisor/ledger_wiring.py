"""The usage ledger as the supervisor opens and closes it: the store from
``--ledger``, the record -> row lookups over the supervisor's state, and
the status blob the proxies read."""

from __future__ import annotations

import logging
import socket

from ..ledger.ledger import UsageLedger
from ..ledger.records import KeyName, PricesOf, RowContext
from ..ledger.stores import open_store
from ..ledger.sync import LedgerSync
from ..shm.requestring import RequestRing
from ..shm.usagestatus import UsageStatus, usage_status_name
from .jobs import Jobs
from .state import State

log = logging.getLogger(__name__)


def _replica_name(state: State, slot: int) -> str:
    """``local/<slot>`` for this node's replicas, an upstream's ``host:port``,
    another node's name (cluster mode)."""
    rm = state.remotes.get(slot)
    if rm is not None:
        return rm.node or f"{rm.host}:{rm.port}"
    return f"local/{slot}"


def _model_name(state: State, m: int) -> str:
    entries = state.registry.entries
    return entries[m].name if 0 <= m < len(entries) else f"#{m}"


def node_name(cfg) -> str:
    """This server's name in the ledger's ``node`` column: ``--node-name``
    (the cluster's node name with ``--cluster``), else the host name. Two
    servers that share a ledger must differ in it, or neither sees the
    other's usage as another node's (:mod:`.sync`)."""
    return cfg.node_name or socket.gethostname()


def start_windows(cfg, keys, ledger: UsageLedger, jobs: Jobs) -> LedgerSync | None:
    """At start, before the proxies serve: the keys' (a
    :class:`~..keys.KeyRegistry`) day, week and month windows seeded from
    ``ledger`` (a restart keeps them), and their sync with the other nodes
    that share it (:mod:`.sync`), returned; None without a keys file, or
    with ``--ledger-sync 0`` (then the seed takes every node's rows, once).
    With a sync, the seed takes this node's rows and the sync's first run
    adds the others', so none counts twice. The sync's store is its own."""
    sync = None
    if cfg.keys_file and cfg.ledger_sync > 0:
        sync = LedgerSync(keys, open_store(cfg.ledger, ""), node_name(cfg), jobs,
                          cfg.ledger_sync)
        log.info("keys: limits reconciled with the other nodes of %s every %g s (this "
                 "node: %s)", sync.store.where, cfg.ledger_sync, sync.node)
    keys.seed(lambda since: ledger.totals_since(since, own=sync is not None))
    if sync is not None:
        sync.now()  # the other nodes' usage before the first request
    return sync


def open_ledger(state: State, ring: RequestRing, jobs: Jobs, key_name: KeyName,
                prices_of: PricesOf) -> UsageLedger | None:
    """The ledger of ``state.cfg`` (None when ``--ledger off``), its status
    blob made. Raises ``ValueError`` for a store that cannot be used at all
    (PostgreSQL without psycopg); a store that is down is not an error here
    (its rows wait, the failure is shown)."""
    cfg = state.cfg
    if not cfg.ledger:
        return None
    store = open_store(cfg.ledger, "")
    node = node_name(cfg)
    ctx = RowContext(model_name=lambda m: _model_name(state, m),
                     replica_name=lambda slot: _replica_name(state, slot),
                     key_name=key_name, prices_of=prices_of, node=node)
    blob = UsageStatus.create(usage_status_name(cfg.shm_name))
    ledger = UsageLedger(store, ring, ctx, jobs, cfg.ledger_buffer, publish=blob.write)
    ledger.blob = blob
    blob.write(ledger.status())
    log.info("usage ledger: %s", store.where)
    jobs.start("ledger-nodes", lambda: _other_nodes(cfg.ledger, node),
               lambda got: _say_other_nodes(store.where, node, got))
    return ledger


def _other_nodes(spec: str, node: str) -> dict[str, int]:
    """The rows of nodes other than ``node`` in the ledger ``spec`` (a
    store of its own: this runs on a job's thread, beside the writer)."""
    store = open_store(spec, "")
    try:
        store.schema()
        return {n: c for n, c in store.nodes().items() if n != node}
    finally:
        store.close()


def _say_other_nodes(where: str, node: str, got) -> None:
    """Log, once at start, that the ledger holds other servers' rows: its
    usage views then show them, with a node column."""
    if isinstance(got, Exception):
        return  # a store that is down: the writer says so
    if got:
        shown = ", ".join(f"{n or '(none)'}: {c} rows" for n, c in sorted(got.items()))
        log.info("usage ledger %s also holds other servers' rows (%s; this one is %s): "
                 "GET /usage, ggmux usage and the page show them, with a node column", where,
                 shown, node)


def close_ledger(ledger: UsageLedger) -> None:
    """Write what is left (bounded), then remove the status blob."""
    try:
        ledger.close()
    finally:
        blob = ledger.blob
        if blob is not None:
            blob.unlink()
            blob.close()
            ledger.blob = None
