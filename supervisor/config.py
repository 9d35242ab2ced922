"""The supervisor's options (:class:`Config`), filled by ``ggmux serve``."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cluster.options import ClusterOptions
from .kv_events import KVEventsOptions


@dataclass(slots=True)
class Config:
    """Options of ``ggmux serve`` the supervisor needs (seconds, counts)."""

    host: str = "127.0.0.1"
    port: int = 8080
    proxies: int = 1
    models_max: int = 4
    models_autoload: bool = True  # False: only explicit loads start a model (llama.cpp)
    model_fallback: str | None = None  # the model of requests naming an unknown one
    metrics: bool = True  # GET /metrics answered (False: 501, llama-server without --metrics)
    stop_timeout: float = 10.0
    term_timeout: float = 5.0  # SIGTERM -> SIGKILL
    load_timeout: float | None = None  # None: 5 min + 20 s per GiB, capped at 6 h
    load_wait: float = 300.0
    replica_slots: int = 0  # 0: derived from models_max
    shm_name: str = ""
    mq_name: str = ""
    proxy_args: list[str] = field(default_factory=list)
    # the prefix index's Sizes fields (prefix_buckets, prefix_ways, prefix_block): --prefix-*
    prefix_sizes: dict[str, int] = field(default_factory=dict)
    # {"api_key", "admin_key"}: proxies only, through a pipe (never argv or env)
    proxy_keys: dict[str, str] = field(default_factory=dict)
    memory_margin: int = 0  # bytes that must stay free on every device after a load
    host_memory: int | None = None  # replace the host's memory size (tests, containers)
    ttl: float | None = None  # default idle unload, seconds after the last request ended
    sleep_idle: float | None = None  # idle seconds before an instance sleeps
    measure_concurrency: int = 2
    spares: int = 1  # instance processes kept started and imported ahead of a load
    spare_delay: float = 3.0  # after a load, a new spare waits for idle, or this long
    load_nice: int = 10  # a loading replica's nice value is raised this much until ready
    models_headroom: int = 64  # model rows kept free for models a reload adds
    unload_grace: float = 0.5  # a loading replica being unloaded: exit, then SIGKILL after this
    log_ring_bytes: int = 1 << 20  # recent log lines kept for GET /logs (the log ring)
    requests_kept: int = 1000  # requests each proxy keeps in the request ring (GET /requests)
    request_excerpt: int = 0  # bytes of prompt and of answer kept per request, 0: none
    watch_paths: list[str] = field(default_factory=list)  # --watch-config: preset file, dirs
    watch_interval: float = 0.5  # seconds between two looks at watch_paths
    cluster: ClusterOptions | None = None  # --cluster: join a cluster (supervisor/cluster/)
    # contention (issue 34), seconds; None: derived from the model's measured
    # load time (supervisor/contention.py); a preset's max-wait / min-residency wins
    max_wait: float | None = None
    min_residency: float | None = None
    demand_grace: float = 2.0  # an idle model whose clients come back counts as busy this long
    drain_timeout: float = 120.0  # cluster mode: a drain stops waiting for requests after this
    log_level: str = "INFO"
    # --- usage ledger (issue 36) ---
    ledger: str = ""  # --ledger resolved: "" off, a SQLite file's path, postgresql://...
    ledger_buffer: int = 100_000  # --ledger-buffer: rows kept while the store fails
    ledger_sync: float = 2.0  # --ledger-sync: seconds between reads of other nodes' usage, 0 off
    node_name: str = ""  # --node-name (or the cluster's): the ledger's node column; "": host name
    # --- keys with limits (issue 36) ---
    keys_file: str | None = None  # --keys: the keys file (supervisor/keys.py)
    keys_max: int = 256  # --keys-max: rows of the key table
    # --- Kubernetes (issue 44) ---
    metrics_compat: str = "vllm"  # --metrics-compat: also vLLM's names in GET /metrics ("none")
    kv_events: KVEventsOptions | None = None  # --kv-events: the publisher child's options
    kv_block_size: int = 16  # tokens per KV block (events, vllm:cache_config_info)
