"""What the supervisor knows: the records of its replicas, remotes and
models (:class:`Replica`, :class:`Remote`, :class:`ModelRuntime`) and the
one :class:`State` its collaborators share (the loop, replicas, remotes,
measuring, reconciling, publishing). Only the supervisor process holds it;
the proxies see it through what :mod:`.publish` writes to shared memory.
"""

from __future__ import annotations

import os
import sys
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..shm import layout as L
from ..shm.segment import Segment
from . import proxy_rows
from .children import Child
from .config import Config
from .memory import Amounts, Ledger, add, rss_of
from .probe import Probe
from .registry import Registry

NS = 1_000_000_000
GiB = 1 << 30
NODE_PRIORITY = 1000  # added to a model's priority for replicas on other cluster nodes


RELOAD_IDS_KEPT = 32  # more proxies asking at once than this would be unusual

@dataclass(slots=True)
class Replica:
    """One local replica: an instance (speaks the state protocol) or a
    ``cmd`` command (probed), in replica slot ``slot`` (times: monotonic ns)."""

    slot: int
    model: int
    child: Child
    incarnation: int
    port: int
    status: int = L.ReplicaStatus.LOADING
    started_ns: int = 0
    ready_ns: int = 0
    deliberate: bool = False  # stop was asked for (eviction, unload, shutdown)
    stop_ns: int = 0  # when `exit` was sent
    stop_stage: int = 0  # 0 running, 1 exit sent, 2 SIGTERM sent, 3 SIGKILL sent
    deadline_ns: int = 0  # load deadline
    error: str = ""
    progress: float = 0.0
    held: Amounts = field(default_factory=dict)  # ledger bytes per device
    kill_after: float = 0.0  # seconds from `exit` to SIGTERM (stop-timeout)
    sleep_sent: bool = False
    wake_sent: bool = False
    kind: str = "instance"  # "instance" (speaks the state protocol) or "cmd" (probed)
    probe: Probe | None = None
    probe_interval: float = 0.0
    next_probe_ns: int = 0
    kill_at_ns: int = 0  # cmd instances: SIGKILL after this (stop-timeout after SIGTERM)
    slots: int = 0  # parallel slots, from the `ready` line (0: unknown)
    # its secret (issue 11): the proxies send it as the bearer token; 0, 0: none
    secret_hi: int = 0
    secret_lo: int = 0
    key_file: str = ""  # a cmd instance's ${API_KEY_FILE}, removed when it exits
    restart: bool = False  # killed as hung: load the model again once it is gone
    # KV tiers (issue 29): its `cache` state line's host-RAM tier bytes; a cmd
    # llama-server saving its slots before its SIGTERM, restoring them before ready
    cache_ram: int = 0
    saving: bool = False
    restoring: bool = False
    restore_until_ns: int = 0  # ready anyway after this (the restore's bound)
    # the nice value to give back once ready; None: not lowered (issue 31, item 11)
    nice: int | None = None
    # a drain (issue 34): no new request, stop once idle; for which model, since when
    draining: bool = False
    drain_for: int = -1
    drain_ns: int = 0


@dataclass(slots=True)
class Remote:
    """An ``upstream`` replica: a remote OpenAI-compatible server that is
    never loaded or evicted, only health-checked (every ``interval`` s);
    ``url`` is the one of its model's ``upstream`` URLs it serves."""

    slot: int
    model: int
    host: str
    port: int
    path: str  # health path ("" = TCP connect only)
    incarnation: int
    url: str = ""
    healthy: bool = False
    probe: Probe | None = None
    next_probe_ns: int = 0
    fails: int = 0
    reported: bool = False  # the first failure was logged
    node: str = ""  # cluster mode: the other node this replica is ("" for an upstream)


@dataclass(slots=True)
class ModelRuntime:
    """Supervisor-side state of one model (published to the models table)."""

    failures: int = 0
    retry_at_ns: int = 0
    failed: bool = False
    exit_code: int = 0
    error: str = ""
    loads: int = 0
    evictions: int = 0
    load_ns_total: int = 0
    last_ready_ns: int = 0
    mem_min: Amounts | None = None  # measured; None until measured or unmeasurable
    mem_max: Amounts | None = None
    measure: str = "pending"  # pending | running | done | failed
    chat_template: bool | None = None  # measured: the GGUF has tokenizer.chat_template
    modalities: dict | None = None  # measured: what its projector reads ({"vision", "audio"})
    requested_ns: int = 0  # an explicit load (POST /models/load, load-on-startup) pending
    # Ollama's keep_alive of the last request that gave one (the proxy's
    # "keep_alive" command): replaces the ttl until the model unloads; inf = never
    keep_alive_s: float | None = None
    # KV tiers (issue 29): bytes of its disk tier (its replicas' `cache` lines,
    # else a scan of the folder), when that figure was last reported (monotonic
    # ns: an older scan does not overwrite it), and the epoch of its tiers,
    # bumped when they are emptied (POST /cache/clear)
    cache_disk_bytes: int = 0
    cache_disk_ns: int = 0
    cache_epoch: int = 0
    # contention (issue 34): why its waiters wait (WaitReason), the model that
    # holds the capacity (-1: none), when it frees (monotonic ns, 0: unknown),
    # the oldest waiter's arrival; loads that stopped or drained another model
    # to make room (swaps), and the times it was drained
    wait_reason: int = 0
    wait_holder: int = -1
    wait_eta_ns: int = 0
    wait_first_ns: int = 0
    swaps: int = 0
    drains: int = 0


class State:
    """The supervisor's shared books, read and changed by its collaborators.

    ``registry`` is replaced on a reload (read it through this object, never
    keep a copy); ``models`` is indexed like the registry's entries and only
    grows; ``replicas`` and ``remotes`` are keyed by replica slot;
    ``proxies`` by proxy index. ``dirty`` asks for a publish of the tables,
    ``errors_dirty`` for the registry blob too.
    """

    def __init__(self, cfg: Config, registry: Registry) -> None:
        self.cfg = cfg
        self.registry = registry
        self.removed: set[int] = set()  # models gone from every source (rows are kept)
        self.stale: set[int] = set()  # replica slots running an outdated configuration
        self.models = [ModelRuntime() for _ in registry.entries]
        nslots = cfg.replica_slots or max(8, 2 * cfg.models_max + 4)
        self.ledger = Ledger(margin=cfg.memory_margin, host_total=cfg.host_memory)
        self.sizes = L.Sizes(
            models=len(registry) + cfg.models_headroom,
            replicas=nslots,
            proxies=cfg.proxies,
            devices=len(self.ledger.devices),
            **cfg.prefix_sizes,
        )
        self.replicas: dict[int, Replica] = {}  # slot -> replica
        self.remotes: dict[int, Remote] = {}  # slot -> upstream replica
        self.proxies: dict[int, Child] = {}  # proxy index -> child
        self.seg: Segment | None = None
        self.incarnations = 0
        self.stopping_all = False
        self.dirty = True
        self.errors_dirty = False
        self.cluster_doc: dict | None = None  # cluster mode: the proxies' view (registry blob)
        self.python = sys.executable
        # ids of the last reloads asked by proxies (GET /models?reload=1), published
        # in the registry so each proxy answers once its reload ran
        self.reload_ids: deque[str] = deque(maxlen=RELOAD_IDS_KEPT)
        self.reload_errors: dict[str, str] = {}  # id -> why, of those reloads that failed
        # the answers of the last cache clears asked by proxies (POST /cache/clear), by id
        self.cache_clears: dict[str, dict] = {}

    def name(self, model: int) -> str:
        """The model's name in the registry."""
        return self.registry.entries[model].name

    def next_incarnation(self) -> int:
        """A new replica incarnation number (1, 2, ...; never reused)."""
        self.incarnations += 1
        return self.incarnations

    def free_slot(self) -> int | None:
        """The lowest replica slot with no replica, no remote and no request
        still counted in flight on it; ``None`` when all are taken."""
        inflight = self.in_flight()
        for s in range(self.sizes.replicas):
            if s not in self.replicas and s not in self.remotes and inflight[s] <= 0:
                return s
        return None

    def any_waiters(self) -> bool:
        """Whether any proxy has a request waiting for a load."""
        return self.seg is not None and bool(self.demand()[0].any())

    def demand(self) -> tuple[np.ndarray, np.ndarray]:
        """Waiting requests per model, summed over the proxies, and the
        earliest wait start per model (monotonic ns; int64 max when none),
        both indexed like ``models``; the proxies' bad cells are ignored
        (:func:`.proxy_rows.demand`)."""
        return proxy_rows.demand(self.seg.waiters, len(self.models))

    def in_flight(self) -> np.ndarray:
        """Requests in flight per replica slot (:func:`.proxy_rows.in_flight`)."""
        return proxy_rows.in_flight(self.seg.counters)

    def last_used(self, now_ns: int | None = None) -> np.ndarray:
        """When each replica slot was last used, monotonic ns
        (:func:`.proxy_rows.last_used`)."""
        return proxy_rows.last_used(self.seg.counters, now_ns)

    def held(self) -> Amounts:
        """Ledger bytes per device that the replicas hold: what each reported
        at ready, and its host-RAM KV tier as its ``cache`` line says (issue
        29: up to ``--cache-ram`` MiB each, grown after ready)."""
        held: Amounts = {}
        for r in self.replicas.values():
            held = add(held, r.held)
            if r.cache_ram:
                held = add(held, {"host": r.cache_ram})
        return held

    def calibrate(self) -> None:
        """Re-read device memory after a report; log what changed."""
        own = rss_of(os.getpid()) + sum(rss_of(c.pid) for c in self.proxies.values())
        self.ledger.calibrate(self.held(), own)
        self.dirty = True
