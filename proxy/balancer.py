"""Replica selection for one request (issue 6): pure functions, no I/O.

A model may have several ready replicas. Per request the proxy builds one
:class:`Candidate` per ready replica from shared memory
(:func:`candidates_from_shm`) and asks :func:`choose` for one:

1. *Priority tiers.* Candidates are grouped by ``priority``, lowest first;
   the next tier serves only when no replica of a better tier is eligible
   (a local GPU replica before a remote fallback upstream).
2. *Eligibility.* A replica is dropped while its circuit is open (this
   proxy saw it fail, :class:`CircuitBreaker`), while it is at its
   ``max_concurrency``, and when it is in ``exclude`` (already tried for
   this request, so a retry goes elsewhere).
3. *Session affinity.* A request with a session key (:func:`session_key`)
   goes to the replica chosen by weighted rendezvous hashing over the
   eligible replicas of the tier, so every proxy process picks the same one
   (its KV cache holds the conversation's prefix) without a shared map, and
   losing a replica moves only that replica's sessions.
4. *Score.* Otherwise the best of ::

       weight / ((in_flight + 1) * (a * ttft / baseline + (1 - a)))

   wins, where ``ttft`` is the replica's TTFT EWMA, ``baseline`` the
   smallest known EWMA among the tier's eligible replicas (an unknown EWMA
   counts as the baseline, so a fresh replica is tried), and ``a`` is
   :attr:`BalancerConfig.ttft_share`. ``(in_flight + 1) * ttft`` estimates
   a new request's wait at a replica that serves one request at a time
   (``llama-server --parallel 1``); ``in_flight`` counts relative to the
   replica's ``slots`` (requests it batches at once, issue 12), so a replica
   with free slots beats one whose slots are all busy and two replicas of a
   model fill evenly; ``a < 1`` softens the latency term because the EWMA
   lags and already contains queueing.
   Near-ties (within :attr:`BalancerConfig.tie_tolerance`) are broken at
   random, and with more than :attr:`BalancerConfig.p2c_above` of them by
   the power of two choices, so proxies sharing one view do not herd onto
   the same replica.
5. *Prefix* (issue 20, mode ``prefix``, the default): with ``share``, the
   fraction ``f`` of the request's prompt each replica holds in its cache
   (:mod:`ggmux.proxy.prefix`), the score is divided by ``1 - w * f``
   (``w`` = :attr:`BalancerConfig.prefix_weight`): a new request's TTFT on
   a replica is its queueing factor times the prefill of the part it does
   not hold, so the expected prefill saved is weighed against the queueing
   cost, as llm-d weighs its prefix scorer against its load scorer; and
   ``ttft`` above is the replica's prefill time per uncached prompt token
   (``Candidate.prefill_ns``) once a replica of the tier has measured one
   (it read at least ``MIN_PREFILL_TOKENS`` of a prompt), not its TTFT,
   which in this mode mostly tells which replica had the prompt cached (a replica that just read a
   long prompt would look slow and every new prefix herd onto the other). A
   replica whose in-flight requests per slot reach
   :attr:`BalancerConfig.prefix_load_threshold` gets no cache bonus, so a
   hot replica sheds even the prefixes it holds (SGLang's cache-aware
   router's balance threshold). With ``disk`` (issue 29), the fraction
   of the prompt the node's disk tier holds for the model (the same for
   every local replica: any of them restores it from there), a replica's
   bonus is the larger of ``w * f`` and ``wd * f_disk``
   (``wd`` = :attr:`BalancerConfig.prefix_disk_weight`, below ``w``): a RAM
   hit, then a disk hit, over a prefill. Mode ``load`` ignores prefixes (the rules
   above), mode ``round-robin`` takes the tier's replicas in turn (a
   baseline for benchmarks); session keys win in every mode.

The proxy owns the I/O around it: reading the tables, ``allow`` before
forwarding, ``record`` on the outcome, counting in-flight requests.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from hashlib import blake2b

import numpy as np

from ..shm import layout as L
from ..http1.verdict import GATEWAY_FAULTS, REPLICA_HEADER, replica_fault  # noqa: F401 (moved there)

log = logging.getLogger("ggmux.proxy.balancer")

CLOSED = L.CircuitState.CLOSED
OPEN = L.CircuitState.OPEN
HALF_OPEN = L.CircuitState.HALF_OPEN

NS = 1_000_000_000

SESSION_HEADERS = (b"x-session-id", b"session_id")
"""Request headers that carry a session key, in order of precedence."""


@dataclass(slots=True, frozen=True)
class BalancerConfig:
    """Named options of the balancer and the circuit breaker, with defaults.

    ``failure_threshold``: consecutive failures (connect error, 5xx, timeout
    before the first byte) that open a replica's circuit; 3, as in common
    client-side breakers (Envoy's ``consecutive_5xx`` outlier detection
    defaults to 5; a local replica that fails 3 times in a row is gone).
    ``cooldown_s``: seconds an open circuit refuses traffic before one probe
    may pass (half-open); doubled for every further failure since the
    circuit was last closed, capped at ``cooldown_max_s``, so a replica that
    stays broken costs one failed request a minute, not one every 5 s.
    ``probes_to_close``: good probes in a row that close a half-open circuit.
    ``probe_timeout_s``: a half-open circuit admits one probe at a time; a
    probe that got no verdict (``record``/``release`` never called, e.g. the
    proxy lost the request) stops holding the slot after this many seconds.
    ``ttft_share``: ``a`` in the score, the share of the TTFT term against
    the pure in-flight term (0 = least in-flight, 1 = full expected wait).
    ``tie_tolerance``: scores within this fraction of the best count as tied.
    ``p2c_above``: with more tied replicas than this, pick the better of two
    random ones (power of two choices) instead of a uniform one.
    ``ttft_forget_s``: a replica unused this long has its TTFT estimate
    ignored (:func:`candidates_from_shm`), so it is tried again.
    ``mode``: ``prefix`` (load, latency and the cached prefix), ``load``
    (load and latency, no prefix index), ``round-robin`` (:data:`MODES`).
    ``prefix_weight``: ``w`` of the prefix rule, the share of a replica's
    TTFT taken to be prefill that a cached prefix saves (0: none; below 1).
    ``prefix_load_threshold``: in-flight requests per slot at which a
    replica's cache bonus is dropped.
    ``prefix_disk_weight``: ``wd``, the share of a replica's TTFT a prefix
    on the node's disk saves (issue 29): below ``prefix_weight``, since
    the replica reads it back first (the issue's target: at most 2x reading
    the bytes, next to a prefill that takes minutes on a CPU); 0.8 until
    bench/swap_cache.py gives a figure.
    """

    failure_threshold: int = 3
    cooldown_s: float = 5.0
    cooldown_max_s: float = 60.0
    probes_to_close: int = 2
    probe_timeout_s: float = 30.0
    ttft_share: float = 0.7
    tie_tolerance: float = 0.01
    p2c_above: int = 2
    ttft_forget_s: float = 10.0
    mode: str = "prefix"
    prefix_weight: float = 0.9
    prefix_load_threshold: float = 1.0
    prefix_disk_weight: float = 0.8


MODES = ("prefix", "load", "round-robin")
"""``--balance`` values (:attr:`BalancerConfig.mode`)."""

DEFAULT_CONFIG = BalancerConfig()

_RNG = random.Random()


@dataclass(slots=True)
class Candidate:
    """One ready replica as this proxy sees it at the start of a request.

    ``slot``: row in the replicas table; ``port``: its local port;
    ``incarnation``: spawn id (counters of another incarnation are stale);
    ``weight``: relative share within its tier (``R_WEIGHT / 1000``, > 0);
    ``priority``: tier, lower serves first; ``max_concurrency``: requests in
    flight it accepts, 0 = unlimited; ``slots``: requests it serves at once
    (``R_SLOTS``, at least 1); ``in_flight``: requests forwarded to it
    and not finished, summed over all proxies; ``ttft_ewma_us``: TTFT EWMA in
    microseconds combined over proxies, 0 = unknown; ``prefill_ns``: its
    TTFT per prompt token it had to read (not cached), ns, combined alike
    (``C_PREFILL_NS``, 0 = unknown), the latency that mode ``prefix`` weighs
    instead, since a cache hit's TTFT says nothing of a replica's speed; ``circuit``:
    :class:`~ggmux.shm.layout.CircuitState` in this proxy's counters row;
    ``circuit_until_ns``: while not closed, no traffic before this
    ``time.monotonic_ns()`` (open: cool-down end; half-open: probe slot busy).
    """

    slot: int
    port: int
    incarnation: int
    weight: float = 1.0
    priority: int = 0
    max_concurrency: int = 0
    in_flight: int = 0
    ttft_ewma_us: float = 0.0
    circuit: int = CLOSED
    circuit_until_ns: int = 0
    slots: int = 1
    prefill_ns: float = 0.0


# ---- circuit breaker ---------------------------------------------------------


class CircuitBreaker:
    """Per-proxy breaker of one replica, kept in this proxy's counters row.

    ``row`` is the 1-D int64 view ``counters[proxy, slot]`` (``C_WORDS``
    words), written only by this proxy; the breaker uses ``C_CONSEC_FAILURES``,
    ``C_CIRCUIT``, ``C_CIRCUIT_UNTIL_NS`` and ``C_PROBES_OK``. State lives in
    shared memory rather than in this object, so the object is disposable and
    the supervisor's ``/metrics`` can show every proxy's view. Zeroing the row
    (as the proxy does for a new incarnation) closes the circuit: a respawned
    replica starts with a clean record.

    Transitions (times are ``time.monotonic_ns()`` nanoseconds):

    * closed: every request passes; ``failure_threshold`` failures in a row
      open the circuit for ``cooldown_s``.
    * open: nothing passes until ``C_CIRCUIT_UNTIL_NS``; the first
      :meth:`allow` after it turns the circuit half-open.
    * half-open: one probe at a time passes (the slot is held until its
      verdict, or ``probe_timeout_s``); ``probes_to_close`` good probes in a
      row close it, a failure reopens it with the cool-down doubled.

    Verdicts that arrive while open (requests sent before it opened) are
    ignored: they say nothing about the replica after the failures.
    """

    __slots__ = ("config", "row")

    def __init__(self, row: np.ndarray, config: BalancerConfig = DEFAULT_CONFIG) -> None:
        self.row = row
        self.config = config

    @property
    def state(self) -> int:
        """The :class:`~ggmux.shm.layout.CircuitState` in the row."""
        return int(self.row[L.C_CIRCUIT])

    def cooldown_ns(self, failures: int) -> int:
        """Cool-down after ``failures`` failures since the circuit last closed:
        ``cooldown_s * 2 ** (failures - failure_threshold)``, at most
        ``cooldown_max_s``; nanoseconds."""
        cfg = self.config
        doublings = min(max(failures - cfg.failure_threshold, 0), 32)
        return int(min(cfg.cooldown_s * (1 << doublings), cfg.cooldown_max_s) * NS)

    def allow(self, now_ns: int) -> bool:
        """Whether a request may go to the replica now; call it right before
        forwarding. In half-open it reserves the single probe slot, so call
        it once per forwarded request and follow it with :meth:`record` or
        :meth:`release`."""
        row = self.row
        st = row[L.C_CIRCUIT]
        if st == CLOSED:
            return True
        if now_ns < row[L.C_CIRCUIT_UNTIL_NS]:
            return False
        if st == OPEN:
            row[L.C_CIRCUIT] = HALF_OPEN
            row[L.C_PROBES_OK] = 0
            log.info("circuit half-open (replica incarnation %d)", int(row[L.C_INCARNATION]))
        row[L.C_CIRCUIT_UNTIL_NS] = now_ns + int(self.config.probe_timeout_s * NS)
        return True

    def record(self, ok: bool, now_ns: int) -> None:
        """The verdict of one forwarded request: false on a replica fault
        (a connect error, a replica that died with the request or went
        silent, a 5xx that :func:`~.http.verdict.replica_fault` counts), else ``ok``.
        Client-side outcomes (4xx, 501, a 500 the request caused, the
        client leaving) are a success or :meth:`release`, never a failure."""
        row = self.row
        cfg = self.config
        st = row[L.C_CIRCUIT]
        if st == OPEN:
            return
        if ok:
            if st == CLOSED:
                row[L.C_CONSEC_FAILURES] = 0
                return
            n = int(row[L.C_PROBES_OK]) + 1
            if n >= cfg.probes_to_close:
                row[L.C_CIRCUIT] = CLOSED
                row[L.C_CONSEC_FAILURES] = 0
                row[L.C_PROBES_OK] = 0
                row[L.C_CIRCUIT_UNTIL_NS] = 0
                log.info("circuit closed (replica incarnation %d)", int(row[L.C_INCARNATION]))
            else:
                row[L.C_PROBES_OK] = n
                row[L.C_CIRCUIT_UNTIL_NS] = 0  # free the probe slot for the next probe
            return
        failures = int(row[L.C_CONSEC_FAILURES]) + 1
        row[L.C_CONSEC_FAILURES] = failures
        if st == HALF_OPEN or failures >= cfg.failure_threshold:
            cool = self.cooldown_ns(failures)
            row[L.C_CIRCUIT] = OPEN
            row[L.C_PROBES_OK] = 0
            row[L.C_CIRCUIT_UNTIL_NS] = now_ns + cool
            log.warning(
                "circuit open for %.1f s after %d failures (replica incarnation %d)",
                cool / NS,
                failures,
                int(row[L.C_INCARNATION]),
            )

    def release(self) -> None:
        """A request ended without a verdict (client left before the first
        byte): free the half-open probe slot for the next request."""
        row = self.row
        if row[L.C_CIRCUIT] == HALF_OPEN:
            row[L.C_CIRCUIT_UNTIL_NS] = 0


# ---- choice ------------------------------------------------------------------


def _hrw(key: bytes, c: Candidate) -> float:
    """Weighted rendezvous score of ``c`` for ``key``: ``weight / -ln(u)``
    with ``u`` uniform in (0, 1) from a stable hash of (slot, incarnation,
    key); the maximum over replicas is weight-proportional (Schindelhauer &
    Schomaker's weighted distributed hash tables). blake2b, not ``hash()``:
    it must agree across proxy processes (``PYTHONHASHSEED``) and restarts."""
    h = int.from_bytes(
        blake2b(b"%d:%d:" % (c.slot, c.incarnation) + key, digest_size=8).digest(), "little"
    )
    # top 52 bits + 0.5, times 2**-52: exactly representable, strictly inside (0, 1)
    return c.weight / -math.log(((h >> 12) + 0.5) * 2.220446049250313e-16)


def choose(
    candidates: Iterable[Candidate],
    exclude: Collection[int] = (),
    session_key: str | None = None,
    rng: random.Random | None = None,
    *,
    now_ns: int | None = None,
    config: BalancerConfig = DEFAULT_CONFIG,
    share: dict[int, float] | None = None,
    turn: int = 0,
    disk: dict[int, float] | None = None,
) -> Candidate | None:
    """The replica for one request, or None when no candidate is eligible.

    ``candidates``: the model's ready replicas (:func:`candidates_from_shm`);
    ``exclude``: slots already tried for this request; ``session_key``: see
    :func:`session_key`; ``rng``: source of tie-breaking randomness (a
    per-process ``random.Random``); ``now_ns``: ``time.monotonic_ns()``
    (read when None), against which circuit deadlines are compared;
    ``share``: slot -> fraction (0-1) of the request's prompt that replica
    holds in its cache (:class:`~ggmux.proxy.prefix.Prediction`), used in
    mode ``prefix``; ``turn``: this proxy's count of choices, which mode
    ``round-robin`` takes modulo the tier; ``disk``: slot -> fraction (0-1)
    of the prompt the node's disk tier holds for that replica's model
    (issue 29), mode ``prefix`` too.

    A candidate whose circuit is not closed is eligible only once its
    ``circuit_until_ns`` has passed, mirroring :meth:`CircuitBreaker.allow`,
    which the caller must still call (it moves the circuit to half-open and
    holds the probe slot). Rules and their reasons: module docstring. None
    with a non-empty ``candidates`` means every replica is open, full or
    excluded; the caller decides between waiting and a 503.
    """
    if now_ns is None:
        now_ns = time.monotonic_ns()
    tier: list[Candidate] = []
    prio = 0
    for c in candidates:
        if c.slot in exclude:
            continue
        if c.circuit != CLOSED and now_ns < c.circuit_until_ns:
            continue
        mc = c.max_concurrency
        if mc > 0 and c.in_flight >= mc:
            continue
        if not tier or c.priority < prio:
            prio = c.priority
            tier = [c]
        elif c.priority == prio:
            tier.append(c)
    n = len(tier)
    if n <= 1:
        return tier[0] if n else None

    if session_key is not None:
        key = session_key.encode("utf-8", "surrogatepass")
        best = tier[0]
        best_s = _hrw(key, best)
        for c in tier[1:]:
            s = _hrw(key, c)
            if s > best_s:
                best, best_s = c, s
        return best
    if config.mode == "round-robin":
        return tier[turn % n]

    # the latency measure: TTFT, or in mode prefix the prefill time per
    # uncached token once the tier has one (TTFT there mostly says who had
    # the prompt cached); short prompts never measure it, and keep TTFT
    speed = config.mode == "prefix" and any(c.prefill_ns > 0 for c in tier)
    base = 0.0
    for c in tier:
        t = c.prefill_ns if speed else c.ttft_ewma_us
        if t > 0 and (base == 0.0 or t < base):
            base = t
    a = config.ttft_share
    w = config.prefix_weight if (share or disk) and config.mode == "prefix" else 0.0
    wd = config.prefix_disk_weight
    hot = config.prefix_load_threshold
    scores = []
    for c in tier:
        t = c.prefill_ns if speed else c.ttft_ewma_us
        lat = a * t / base + (1.0 - a) if t > 0 else 1.0
        load = c.in_flight / c.slots
        cost = (load + 1) * lat
        if w and load < hot:
            f = share.get(c.slot) if share else None
            bonus = w * f if f else 0.0
            if disk:
                f = disk.get(c.slot)
                if f and wd * f > bonus:
                    bonus = wd * f
            if bonus:
                cost *= 1.0 - bonus
        scores.append(c.weight / cost)
    top = max(scores)
    cut = top * (1.0 - config.tie_tolerance)
    near = [i for i in range(n) if scores[i] >= cut]
    k = len(near)
    if k == 1:
        return tier[near[0]]
    r = rng if rng is not None else _RNG
    if k <= config.p2c_above:
        return tier[near[int(r.random() * k)]]
    i = near[int(r.random() * k)]
    j = near[int(r.random() * (k - 1))]
    if j == i:  # sample two distinct: index k-1 stands in for the drawn one
        j = near[k - 1]
    return tier[i] if scores[i] >= scores[j] else tier[j]


def open_until(candidates: Iterable[Candidate], now_ns: int) -> int:
    """When none of ``candidates`` can be chosen only because circuits are
    open (not half-open with a probe out, not at max concurrency): the
    earliest ``time.monotonic_ns()`` at which one turns half-open; else 0.

    The proxy answers such a request at once with 503 and Retry-After
    instead of queueing it (issue 11: an open circuit is not a busy
    replica, and waiting out the queue timeout helps nobody)."""
    soonest = 0
    for c in candidates:
        if c.circuit != OPEN or now_ns >= c.circuit_until_ns:
            return 0
        if not soonest or c.circuit_until_ns < soonest:
            soonest = c.circuit_until_ns
    return soonest


# ---- inputs ------------------------------------------------------------------


def _key(v: object) -> str | None:
    if isinstance(v, str):
        return v or None
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    return None


def session_key(headers: Iterable[tuple[bytes, bytes]], body: dict) -> str | None:
    """The request's session key, or None.

    Sources, first found wins: header ``x-session-id``, header
    ``session_id`` (names compared lower-case; values decoded as UTF-8),
    then the JSON body's ``prompt_cache_key`` (OpenAI's prompt-cache routing
    hint), ``metadata.session_id`` (Anthropic-style metadata) and ``user``
    (OpenAI's end-user id). Empty values and values that are not strings or
    integers are skipped.
    """
    found: dict[bytes, bytes] = {}
    for k, v in headers:
        k = k.lower()
        if k in SESSION_HEADERS and v and k not in found:
            found[k] = v
    for k in SESSION_HEADERS:
        if k in found:
            return found[k].decode("utf-8", "replace")
    v = _key(body.get("prompt_cache_key"))
    if v is not None:
        return v
    meta = body.get("metadata")
    if isinstance(meta, dict):
        v = _key(meta.get("session_id"))
        if v is not None:
            return v
    return _key(body.get("user"))


def candidates_from_shm(
    replica_rows: np.ndarray,
    counters: np.ndarray,
    model: int,
    proxy_index: int,
    now_ns: int | None = None,
    config: BalancerConfig = DEFAULT_CONFIG,
) -> list[Candidate]:
    """Candidates for ``model``: its READY replicas that are not draining,
    in slot order.

    ``replica_rows``: a consistent copy of the replicas table, 2-D int64
    ``(replicas, R_WORDS)`` (:func:`ggmux.shm.seqlock.read_table`);
    ``counters``: the live counters table, 3-D int64 ``(proxies, replicas,
    C_WORDS)``, read here once (each word is atomic, rows are not: a
    proxy's in-flight and TTFT may be one update apart, which is harmless);
    ``proxy_index``: this proxy's row.

    Per replica, counter rows of other incarnations (``C_INCARNATION`` not
    the replica's) are ignored: that proxy has not yet served the new
    process. ``in_flight`` is the sum of ``C_IN_FLIGHT`` over proxies (at
    least 0). ``ttft_ewma_us`` is the mean of the proxies' EWMAs weighted by
    their ``C_TTFT_COUNT``: every EWMA follows recent samples, and the count
    weight keeps a proxy with one or two samples from dragging the estimate
    (a sample-weighted mean, unlike the max-count EWMA, still uses every
    proxy's recent view). Circuit state comes from this proxy's row only:
    each proxy keeps its own breaker. ``weight`` is ``R_WEIGHT / 1000``; a
    row with no weight set (``<= 0``) reads as 1.0.

    ``prefill_ns`` is combined from ``C_PREFILL_NS`` / ``C_PREFILL_COUNT``
    the same way. A replica no proxy has used for
    :attr:`BalancerConfig.ttft_forget_s` (``C_LAST_USED_NS`` against
    ``now_ns``, read when None) gets an unknown TTFT (and prefill time):
    otherwise a replica that once answered slowly would never be
    chosen again by sequential requests (the faster one always scores
    better) and its estimate would never be corrected; so the idle one is
    tried again, at most once per period, like a fresh replica.
    """
    if now_ns is None:
        now_ns = time.monotonic_ns()
    forget_before = now_ns - int(config.ttft_forget_s * 1e9)
    rows = replica_rows
    slots = np.flatnonzero(
        (rows[:, L.R_MODEL] == model) & (rows[:, L.R_STATUS] == L.ReplicaStatus.READY)
        & (rows[:, L.R_DRAINING] == 0)  # a draining replica takes no new request (issue 34)
    )
    if slots.size == 0:
        return []
    # Python lists from here: a handful of replicas is faster in plain loops
    # than in numpy calls, and the counters are read once, word by word.
    sel = rows[slots].tolist()
    slot_ids = slots.tolist()
    cnt = counters[:, slots, :].tolist()  # [proxy][k][word]
    out = []
    for j, r in enumerate(sel):
        inc = r[L.R_INCARNATION]
        inflight = 0
        n_sum = 0
        t_sum = 0
        p_n = p_sum = 0
        used = 0
        for prow in cnt:
            c = prow[j]
            if c[L.C_INCARNATION] != inc:
                continue
            inflight += c[L.C_IN_FLIGHT]
            used = max(used, c[L.C_LAST_USED_NS])
            e = c[L.C_TTFT_EWMA_US]
            n = c[L.C_TTFT_COUNT]
            if e > 0 and n > 0:
                n_sum += n
                t_sum += n * e  # Python ints: no overflow
            e = c[L.C_PREFILL_NS]
            n = c[L.C_PREFILL_COUNT]
            if e > 0 and n > 0:
                p_n += n
                p_sum += n * e
        own = cnt[proxy_index][j]
        live = own[L.C_INCARNATION] == inc
        w = r[L.R_WEIGHT]
        fresh = used >= forget_before
        out.append(
            Candidate(
                slot_ids[j],
                r[L.R_PORT],
                inc,
                w / 1000 if w > 0 else 1.0,
                r[L.R_PRIORITY],
                r[L.R_MAX_CONCURRENCY],
                max(inflight, 0),
                t_sum / n_sum if n_sum and fresh else 0.0,
                own[L.C_CIRCUIT] if live else CLOSED,
                own[L.C_CIRCUIT_UNTIL_NS] if live else 0,
                max(1, r[L.R_SLOTS]),
                p_sum / p_n if p_n and fresh else 0.0,
            )
        )
    return out
