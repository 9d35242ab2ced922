"""Layout of the shared-memory state plane: table shapes and column indices.

Every value is an aligned little-endian int64 word, so a single load or store
of one value is atomic on x86-64 and aarch64. Tables are 2-D (or 3-D) int64
arrays laid one after another after the header; their shapes follow from the
header's sizes, so a reader needs only the segment name.

Supervisor-written tables (``models``, ``replicas``, ``devices``) carry a
sequence word in column 0 (see :mod:`ggmux.shm.seqlock`). Proxy-written
tables (``counters``, ``waiters``, ``mcounters``, ``prefix_forget``) have one
writer per row and no lock; so does the prefix index (``prefix``, one part
per proxy), whose entries are named by one word (:mod:`ggmux.shm.prefixtable`).

Units: times are ``time.monotonic_ns()`` nanoseconds (CLOCK_MONOTONIC is
shared by all processes on the host), memory is bytes, TTFT is microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = 0x47474D5558534D31  # "GGMUXSM1"
VERSION = 8  # 8: drains and wait reasons (issue 34)

# ---- header: int64 words -------------------------------------------------
H_MAGIC = 0
H_VERSION = 1
H_N_MODELS = 2
H_N_REPLICAS = 3
H_N_PROXIES = 4
H_N_DEVICES = 5
H_GENERATION = 6  # bumped by the supervisor after every change a waiter could care about
H_REGISTRY_SEQ = 7  # seqlock word of the registry blob
H_REGISTRY_LEN = 8  # bytes of JSON in the blob
H_REGISTRY_CAP = 9  # blob capacity, bytes
H_SUPERVISOR_PID = 10
H_STARTED_NS = 11
H_MODELS_MAX = 12
# the prefix index (issue 20): buckets and ways of each proxy's part, and the
# bytes of one hashed block (every proxy hashes alike: they read it here)
H_PREFIX_BUCKETS = 13
H_PREFIX_WAYS = 14
H_PREFIX_BLOCK = 15
H_WORDS = 16

# ---- models: one row per registered model, written by the supervisor ------
M_SEQ = 0
M_STATUS = 1  # ModelStatus
M_REPLICAS = 2  # replicas that are ready (loaded)
M_WAITERS = 3  # waiters summed over proxies at the last tick
M_EXIT_CODE = 4  # last exit code of a crashed replica (0 if none)
M_FAILED = 5  # 1 while the last unload ended with a crash / failed load
M_FAILURES = 6  # consecutive failed loads
M_RETRY_AT_NS = 7  # no new load before this time (backoff), 0 if none
M_PROGRESS = 8  # load progress, per mille
M_ETA_MS = 9  # estimated ms to ready, -1 if unknown
M_MEM_MIN = 10
M_MEM_MAX = 11
M_MEM_EFFECTIVE = 12
M_LOADS = 13  # completed loads
M_EVICTIONS = 14
M_LOAD_NS_TOTAL = 15  # sum of load durations
M_ERROR_SEQ = 16  # bumped each time the error text (in the registry status blob) changes
M_LAST_READY_NS = 17
# KV tiers (issue 29): the model's prompt caches outside its slots, bytes: host
# RAM summed over its running replicas (their `cache` state lines), and its
# disk tier (one directory per model fingerprint, shared by its replicas on
# this node; scanned from DIR/*/model.json while no replica runs)
M_CACHE_RAM_BYTES = 18
M_CACHE_DISK_BYTES = 19
M_CACHE_FLAGS = 20  # CACHE_DISK: the model has a disk tier (--cache-disk, slot-save-path)
M_CACHE_EPOCH = 21  # bumped when its tiers are emptied (POST /cache/clear): disk rows of
# the prefix index written in an older epoch are void
# contention (issue 34): why the model's waiters wait (WaitReason), the model
# holding the capacity they need (its index + 1; 0: none), when that capacity
# is expected to free (monotonic ns; 0: unknown), the oldest waiter's arrival
# (monotonic ns; 0: none waits), the loads of this model that stopped or
# drained another to make room (swaps), and the times it was drained
M_WAIT_REASON = 24
M_WAIT_HOLDER = 25
M_WAIT_ETA_NS = 26
M_WAIT_FIRST_NS = 27
M_SWAPS = 28
M_DRAINS = 29
M_WORDS = 32
CACHE_DISK = 1  # M_CACHE_FLAGS bit

# ---- replicas: one row per instance slot, written by the supervisor -------
R_SEQ = 0
R_MODEL = 1  # model index, -1 when the slot is free
R_STATUS = 2  # ReplicaStatus
R_PORT = 3
R_PID = 4
R_INCARNATION = 5  # unique per spawn; counters for another incarnation are stale
R_STARTED_NS = 6
R_READY_NS = 7
R_WEIGHT = 8  # x1000
R_PRIORITY = 9
R_MAX_CONCURRENCY = 10  # 0 = unlimited
R_SLOTS = 11  # requests the replica serves at once (its `ready` line's slots); 0 = unknown: 1
# the instance's secret, 128 random bits the proxies send as its bearer token
# (issue 11: no way around the API key on the same host); 0, 0 = none
R_SECRET_HI = 14
R_SECRET_LO = 15
# a drain (issue 34): 1 while the replica takes no new request (every proxy
# reads it before it picks one), finishes those in flight, then stops; the
# model it makes room for, and since when (monotonic ns)
R_DRAINING = 16
R_DRAIN_FOR = 17
R_DRAIN_NS = 18
R_WORDS = 24

# ---- counters: [proxy, replica, word], each [proxy] row written by that proxy
C_IN_FLIGHT = 0  # req_count: requests forwarded and not yet finished
C_LAST_USED_NS = 1  # when a request last began or ended
C_REQUESTS = 2
C_ERRORS = 3
C_TTFT_EWMA_US = 4
C_TTFT_LAST_US = 5
C_TTFT_COUNT = 6
C_HELD_BYTES = 7
C_INCARNATION = 8  # replica incarnation these counters belong to
C_TTFT_SUM_US = 9
C_CONSEC_FAILURES = 10  # failures in a row (connect error, 5xx, timeout before first byte)
C_CIRCUIT = 11  # CircuitState as this proxy sees the replica
C_CIRCUIT_UNTIL_NS = 12  # open: no traffic before this time; then half-open
C_PROBES_OK = 13  # good probes in a row while half-open
# a hung replica (issue 11): the supervisor restarts a local instance idle
# since its last timeout with no answer after it
C_TIMEOUT_NS = 14  # when a request to it last timed out (first byte or stream idle)
C_ANSWER_NS = 15  # when it last answered a request in time
# prefill speed (issue 20): TTFT per prompt token not read from the replica's
# cache, ns, EWMA over prefix-routed requests with at least MIN_PREFILL_TOKENS
# of them (a cache hit's TTFT says nothing of the replica's speed)
C_PREFILL_NS = 16
C_PREFILL_COUNT = 17
C_WORDS = 24

# ---- model counters: [proxy, model, word], each [proxy] row written by that proxy
# Totals per model that outlive replicas (for /metrics); TTFT histogram buckets
# are cumulative-free counts per bucket, upper bounds in TTFT_BUCKETS_MS.
MC_REQUESTS = 0
MC_ERRORS = 1
MC_TTFT_COUNT = 2
MC_TTFT_SUM_US = 3
MC_BUCKET0 = 4  # MC_BUCKET0 + i counts samples <= TTFT_BUCKETS_MS[i] (and > the previous)
TTFT_BUCKETS_MS = (5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000)
MC_BUCKET_INF = MC_BUCKET0 + len(TTFT_BUCKETS_MS)
# the model's last TTFT_RECENT TTFT samples through this proxy (microseconds),
# a ring: sample k (k = 0, 1, ...) at MC_RECENT0 + k % TTFT_RECENT, and
# MC_RECENT_N the samples ever written. What ``/ps``'s TTFT p50 is taken
# from (issue 22: the histogram's interpolation gave bucket-edge figures)
MC_RECENT_N = 17
MC_RECENT0 = 18
TTFT_RECENT = 32
# prefix-aware routing (issue 20): requests whose choice weighed a prompt
# prefix, those routed to a replica the index said holds part of it, and those
# whose replica then reported (far) fewer cached tokens than predicted
MC_PREFIX_ROUTED = MC_RECENT0 + TTFT_RECENT  # 50
MC_PREFIX_PREDICTED = 51
MC_PREFIX_MISSED = 52
# contention (issue 34): requests that waited for their model's capacity or
# load and then were served (not those that gave up or left), the sum of
# their waits (microseconds), and a histogram of the waits: MC_WAIT_BUCKET0 + i
# counts waits <= WAIT_BUCKETS_S[i] (and > the previous)
MC_WAIT_COUNT = 53
MC_WAIT_SUM_US = 54
MC_WAIT_BUCKET0 = 55
WAIT_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
MC_WAIT_BUCKET_INF = MC_WAIT_BUCKET0 + len(WAIT_BUCKETS_S)
MC_WORDS = MC_WAIT_BUCKET_INF + 1  # 67

# ---- waiters: [proxy, model, word], each [proxy] row written by that proxy --
W_COUNT = 0  # requests waiting for the model in this proxy
W_FIRST_NS = 1  # arrival time of the oldest of them, 0 when none
W_WORDS = 2

# ---- prefix index: [proxy, bucket, way, word], each [proxy] part written by
# that proxy (DESIGN.md "Prefix-aware routing"; :mod:`ggmux.shm.prefixtable`)
X_KEY = 0  # a prompt prefix's chain hash mixed with the replica that served it (0: empty)
X_USED_NS = 1  # when that replica last served it
X_REPLICA = 2  # slot | incarnation << X_INC_SHIFT (for the operator and the tests)
X_BLOCKS = 3  # the prefix's length in blocks
X_WORDS = 4
X_INC_SHIFT = 16  # replica slots are < 2**16
# ---- prefix_forget: [proxy, replica], each [proxy] row written by that proxy:
# index entries of the replica last used at or before this time are not trusted
# (a predicted hit there came back a miss: its cache dropped them)
# ---- prefix_forget_disk: [proxy, model], the same for the model's disk rows
# (issue 29: X_REPLICA of a disk row is DISK_SLOT | model << X_INC_SHIFT)
DISK_SLOT = 0xFFFF  # the replica slot a disk row names: none (slots are < 2**16 - 1)

# ---- devices: one row per memory device, written by the supervisor ---------
D_SEQ = 0
D_KIND = 1  # 0 host, 1 gpu
D_INDEX = 2
D_TOTAL = 3
D_EXTERNAL = 4
D_HELD = 5
D_FREE = 6
D_CALIBRATED_NS = 7
D_WORDS = 8


class ModelStatus:
    """Model states (DESIGN.md "Model states"), as stored in ``M_STATUS``."""

    UNLOADED = 0
    LOADING = 1
    LOADED = 2
    SLEEPING = 3
    STOPPING = 4
    MEASURING = 5

    NAMES = ("unloaded", "loading", "loaded", "sleeping", "stopping", "measuring")


class WaitReason:
    """Why a model's waiters wait (``M_WAIT_REASON``; issue 34)."""

    NONE = 0  # nobody waits, or the model loads
    QUEUED = 1  # behind the head of the queue (holder), or a load under way
    SLICE = 2  # busy replicas of holder keep the capacity until the bound (eta)
    DRAINING = 3  # holder drains: no new request; it stops once its requests end
    STOPPING = 4  # victims are exiting; the load starts once their memory is free
    PINNED = 5  # only pinned models hold the capacity: nothing will free it

    NAMES = ("none", "queued", "slice", "draining", "stopping", "pinned")


class CircuitState:
    """Per-proxy circuit breaker state of a replica (``C_CIRCUIT``)."""

    CLOSED = 0
    OPEN = 1
    HALF_OPEN = 2

    NAMES = ("closed", "open", "half-open")


class ReplicaStatus:
    """Replica slot states, as stored in ``R_STATUS``."""

    FREE = 0
    LOADING = 1
    READY = 2
    SLEEPING = 3
    STOPPING = 4

    NAMES = ("free", "loading", "ready", "sleeping", "stopping")


@dataclass(slots=True, frozen=True)
class Sizes:
    """Table sizes of one segment.

    ``models`` rows, ``replicas`` slots, ``proxies`` counter rows, ``devices``
    memory devices and ``registry_cap`` bytes of registry JSON;
    ``prefix_buckets`` x ``prefix_ways`` entries of each proxy's part of the
    prefix index (buckets a power of two), which hashes blocks of
    ``prefix_block`` bytes.
    """

    models: int
    replicas: int
    proxies: int
    devices: int
    registry_cap: int = 1 << 20
    prefix_buckets: int = 2048
    prefix_ways: int = 4
    prefix_block: int = 256

    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Byte offset and int64 shape of every table, in segment order."""
        tables = {
            "header": (H_WORDS,),
            "models": (self.models, M_WORDS),
            "replicas": (self.replicas, R_WORDS),
            "counters": (self.proxies, self.replicas, C_WORDS),
            "waiters": (self.proxies, self.models, W_WORDS),
            "mcounters": (self.proxies, self.models, MC_WORDS),
            "devices": (self.devices, D_WORDS),
            "prefix": (self.proxies, self.prefix_buckets, self.prefix_ways, X_WORDS),
            "prefix_forget": (self.proxies, self.replicas),
            "prefix_forget_disk": (self.proxies, self.models),
        }
        out: dict[str, tuple[int, tuple[int, ...]]] = {}
        off = 0
        for name, shape in tables.items():
            n = 1
            for s in shape:
                n *= s
            out[name] = (off, shape)
            off += 8 * n
            off = (off + 63) & ~63  # each table on its own cache line
        out["registry"] = (off, (self.registry_cap,))
        return out

    def total_bytes(self) -> int:
        off, shape = self.offsets()["registry"]
        return off + shape[0]
