"""Replica selection (issue 6): tiers, eligibility, score, circuit breaker,
session affinity, and reading candidates from shared-memory tables.

Pure functions on hand-built candidates and numpy tables: no processes.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest
from ggmux.proxy.balancer import (
    DEFAULT_CONFIG,
    NS,
    BalancerConfig,
    Candidate,
    CircuitBreaker,
    candidates_from_shm,
    choose,
    session_key,
)
from ggmux.shm import layout as L

CLOSED, OPEN, HALF_OPEN = L.CircuitState.CLOSED, L.CircuitState.OPEN, L.CircuitState.HALF_OPEN
NOW = 1_000 * NS


def cand(slot: int, **kw) -> Candidate:
    kw.setdefault("incarnation", slot + 100)
    return Candidate(slot=slot, port=9000 + slot, **kw)


def pick(cands, exclude=(), key=None, rng=None, now_ns=NOW, **cfg):
    config = BalancerConfig(**cfg) if cfg else DEFAULT_CONFIG
    c = choose(cands, exclude, key, rng or random.Random(0), now_ns=now_ns, config=config)
    return None if c is None else c.slot


def shares(cands, n: int, seed: int = 1, **kw) -> Counter:
    rng = random.Random(seed)
    return Counter(pick(cands, rng=rng, **kw) for _ in range(n))


# ---- priority tiers and eligibility ------------------------------------------


def test_lower_priority_tier_serves_first_even_when_busier():
    cands = [cand(0, priority=1), cand(1, priority=0, in_flight=50), cand(2, priority=2)]
    assert pick(cands) == 1


def test_next_tier_serves_only_when_the_tier_has_none_eligible():
    tier0 = [
        cand(0, priority=0, circuit=OPEN, circuit_until_ns=NOW + NS),
        cand(1, priority=0, max_concurrency=2, in_flight=2),
        cand(2, priority=0),
    ]
    backup = [cand(3, priority=5), cand(4, priority=7)]
    assert pick(tier0 + backup) == 2
    assert pick(tier0 + backup, exclude={2}) == 3
    assert pick(backup[::-1], exclude=set()) == 3


def test_no_eligible_replica_gives_none():
    assert pick([]) is None
    cands = [
        cand(0, circuit=OPEN, circuit_until_ns=NOW + 1),
        cand(1, max_concurrency=1, in_flight=1),
    ]
    assert pick(cands) is None
    assert pick([cand(0), cand(1)], exclude={0, 1}) is None


def test_replica_at_max_concurrency_is_skipped_and_zero_means_unlimited():
    assert pick([cand(0, max_concurrency=4, in_flight=4), cand(1, in_flight=40)]) == 1
    assert pick([cand(0, max_concurrency=4, in_flight=3), cand(1, in_flight=40)]) == 0
    assert pick([cand(0, max_concurrency=0, in_flight=1000)]) == 0


def test_excluded_replicas_are_not_retried():
    cands = [cand(0), cand(1, in_flight=3), cand(2, in_flight=9)]
    assert pick(cands) == 0
    assert pick(cands, exclude={0}) == 1
    assert pick(cands, exclude=frozenset({0, 1})) == 2


def test_open_circuit_is_skipped_until_its_cooldown_ends():
    cands = [cand(0, circuit=OPEN, circuit_until_ns=NOW + 5 * NS), cand(1, in_flight=10)]
    assert pick(cands, now_ns=NOW) == 1
    assert pick(cands, now_ns=NOW + 5 * NS) == 0  # half-open candidate: a probe may go


def test_half_open_replica_with_a_probe_outstanding_is_skipped():
    busy = [cand(0, circuit=HALF_OPEN, circuit_until_ns=NOW + NS), cand(1, in_flight=10)]
    free = [cand(0, circuit=HALF_OPEN, circuit_until_ns=0), cand(1, in_flight=10)]
    assert pick(busy) == 1
    assert pick(free) == 0


# ---- score -------------------------------------------------------------------


def test_score_prefers_fewer_in_flight():
    assert pick([cand(0, in_flight=3), cand(1, in_flight=1), cand(2, in_flight=2)]) == 1


def test_in_flight_counts_relative_to_slots():
    """Issue 12: a replica with free slots beats one whose slots are busy,
    and a closed loop fills replicas in proportion to their slots."""
    assert pick([cand(0, in_flight=1, slots=1), cand(1, in_flight=2, slots=4)]) == 1
    cands = [cand(0, slots=4), cand(1, slots=1)]
    for _ in range(5):  # five requests that stay in flight
        c = next(c for c in cands if c.slot == pick(cands))
        c.in_flight += 1
    assert [c.in_flight for c in cands] == [4, 1]


def test_score_prefers_lower_ttft():
    cands = [
        cand(0, ttft_ewma_us=300_000.0),
        cand(1, ttft_ewma_us=35_000.0),
        cand(2, ttft_ewma_us=80_000.0),
    ]
    assert pick(cands) == 1


def test_score_trades_in_flight_against_ttft():
    # score = 1 / ((f + 1) * (0.7 * t / 35 ms + 0.3)): slow idle replica is 1 / 6.3
    slow = cand(1, ttft_ewma_us=300_000.0)
    assert pick([cand(0, ttft_ewma_us=35_000.0, in_flight=4), slow]) == 0  # 1/5 > 1/6.3
    assert pick([cand(0, ttft_ewma_us=35_000.0, in_flight=6), slow]) == 1  # 1/7 < 1/6.3
    # ttft_share=0 is least in-flight
    assert pick([cand(0, ttft_ewma_us=35_000.0, in_flight=1), slow], ttft_share=0.0) == 1


def test_unknown_ttft_counts_as_the_tier_baseline():
    # a fresh replica (no EWMA yet) competes as if it were the fastest known one
    cands = [cand(0, ttft_ewma_us=35_000.0, in_flight=1), cand(1, ttft_ewma_us=0.0)]
    assert pick(cands) == 1
    cands = [cand(0, ttft_ewma_us=35_000.0), cand(1, ttft_ewma_us=0.0, in_flight=1)]
    assert pick(cands) == 0


def test_baseline_is_taken_over_the_eligible_replicas_of_the_tier():
    # with the 10 ms replica full, 40 ms is the baseline: 40 ms idle vs 80 ms idle
    cands = [
        cand(0, ttft_ewma_us=10_000.0, max_concurrency=1, in_flight=1),
        cand(1, ttft_ewma_us=40_000.0, in_flight=1),
        cand(2, ttft_ewma_us=80_000.0),
    ]
    # 1 / (2 * 1.0) = 0.5 vs 1 / (1 * (0.7 * 2 + 0.3)) = 0.588
    assert pick(cands) == 2


def test_weight_scales_the_score():
    assert pick([cand(0, weight=1.0), cand(1, weight=2.0)]) == 1
    assert pick([cand(0, weight=1.0), cand(1, weight=3.0, in_flight=1)]) == 1  # 3/2 > 1
    assert pick([cand(0, weight=1.0), cand(1, weight=1.5, in_flight=1)]) == 0  # 0.75 < 1


def test_random_tie_breaking_spreads_load():
    cands = [cand(0), cand(1), cand(2)]
    got = shares(cands, 3000)
    assert set(got) == {0, 1, 2}
    for s in range(3):
        assert 850 < got[s] < 1150, got


def test_two_near_ties_split_evenly():
    # within tie_tolerance (1%) counts as a tie
    cands = [cand(0, weight=1.0), cand(1, weight=0.995)]
    got = shares(cands, 2000)
    assert 850 < got[0] < 1150, got


def test_many_near_ties_use_two_random_choices():
    # four replicas within 1%: the better of two random ones wins, so the
    # worst never does and the best wins half the time (3 of 6 pairs)
    cands = [
        cand(0, weight=1.0),
        cand(1, weight=0.998),
        cand(2, weight=0.996),
        cand(3, weight=0.994),
    ]
    got = shares(cands, 6000)
    assert got[3] == 0, got
    assert 2700 < got[0] < 3300, got
    assert got[1] > 1500 and got[2] > 600, got


def test_different_rngs_break_ties_differently():
    cands = [cand(i) for i in range(6)]
    firsts = {pick(cands, rng=random.Random(seed)) for seed in range(50)}
    assert len(firsts) >= 4


def closed_loop(cands, rng, depth: int, n: int = 1000) -> Counter:
    """Choices per slot over ``n`` requests with in-flight updated as in a
    proxy: ``depth`` requests kept outstanding, a random one finishing
    before each new choice (``cands`` are indexed by slot)."""
    outstanding: list[int] = []
    got = Counter()
    for _ in range(n):
        if len(outstanding) >= depth:
            done = outstanding.pop(rng.randrange(len(outstanding)))
            cands[done].in_flight -= 1
        c = choose(cands, (), None, rng, now_ns=NOW)
        c.in_flight += 1
        outstanding.append(c.slot)
        got[c.slot] += 1
    return got


def test_two_equal_replicas_share_a_closed_loop_evenly():
    got = closed_loop([cand(0), cand(1)], random.Random(7), depth=8)
    assert abs(got[0] / 1000 - 0.5) <= 0.5 * 0.15, got


def test_closed_loop_sends_more_to_the_faster_replica():
    cands = [cand(0, ttft_ewma_us=35_000.0), cand(1, ttft_ewma_us=300_000.0)]
    got = closed_loop(cands, random.Random(3), depth=6)
    assert got[0] > 3 * got[1], got


# ---- session affinity (rendezvous hashing) ----------------------------------


def keys(n: int) -> list[str]:
    return [f"session-{i}" for i in range(n)]


def test_same_session_key_picks_the_same_replica_whatever_the_load_and_rng():
    base = [cand(i) for i in range(5)]
    want = {k: pick(base, key=k) for k in keys(200)}
    rng = random.Random(42)
    for k in keys(200):
        shuffled = [
            cand(i, in_flight=rng.randrange(20), ttft_ewma_us=float(rng.randrange(1, 10**6)))
            for i in range(5)
        ]
        rng.shuffle(shuffled)
        assert pick(shuffled, key=k, rng=random.Random(rng.random())) == want[k]


def test_session_keys_spread_over_replicas():
    got = Counter(pick([cand(i) for i in range(4)], key=k) for k in keys(4000))
    for s in range(4):
        assert 850 < got[s] < 1150, got


def test_removing_a_replica_moves_only_its_sessions():
    full = [cand(i) for i in range(5)]
    without2 = [c for c in full if c.slot != 2]
    moved_to = Counter()
    for k in keys(1000):
        before, after = pick(full, key=k), pick(without2, key=k)
        if before != 2:
            assert after == before, k
        else:
            moved_to[after] += 1
    assert sum(moved_to.values()) > 120  # ~200 keys lived on slot 2
    assert len(moved_to) == 4  # and they spread over the rest


def test_excluded_replica_sends_its_sessions_to_the_same_fallback_everywhere():
    full = [cand(i) for i in range(4)]
    for k in keys(200):
        first = pick(full, key=k)
        second = pick(full, exclude={first}, key=k)
        assert second != first
        assert second == pick([c for c in full if c.slot != first], key=k)


def test_new_incarnation_reshuffles_only_that_slots_sessions():
    old = [cand(i) for i in range(4)]
    new = [cand(i, incarnation=(999 if i == 1 else i + 100)) for i in range(4)]
    for k in keys(1000):
        a, b = pick(old, key=k), pick(new, key=k)
        if a != 1 and b != 1:
            assert a == b


def test_weighted_rendezvous_respects_weights():
    cands = [cand(0, weight=1.0), cand(1, weight=2.0), cand(2, weight=1.0)]
    got = Counter(pick(cands, key=k) for k in keys(4000))
    assert 1800 < got[1] < 2200, got
    assert 800 < got[0] < 1200 and 800 < got[2] < 1200, got


def test_session_uses_the_first_tier_with_an_eligible_replica():
    cands = [cand(0, priority=1), cand(1, priority=1), cand(2, priority=0)]
    assert {pick(cands, key=k) for k in keys(100)} == {2}
    cands[2].circuit, cands[2].circuit_until_ns = OPEN, NOW + NS
    assert {pick(cands, key=k) for k in keys(100)} == {0, 1}


def test_rendezvous_hash_is_stable_across_processes():
    code = (
        "from ggmux.proxy.balancer import Candidate, choose\n"
        "cs = [Candidate(i, 9000 + i, 100 + i) for i in range(5)]\n"
        "print(','.join(str(choose(cs, (), f'session-{i}', now_ns=0).slot) for i in range(50)))\n"
    )
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        r = subprocess.run(
            [sys.executable, "-c", code],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        outs.add(r.stdout.strip())
    here = ",".join(
        str(pick([cand(i) for i in range(5)], key=f"session-{i}", now_ns=0)) for i in range(50)
    )
    assert outs == {here}


# ---- session_key ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "body", "want"),
    [
        ([(b"x-session-id", b"h1"), (b"session_id", b"h2")], {"user": "u"}, "h1"),
        ([(b"session_id", b"h2"), (b"X-Session-Id", b"h1")], {}, "h1"),
        ([(b"session_id", b"h2")], {"prompt_cache_key": "p"}, "h2"),
        ([], {"prompt_cache_key": "p", "metadata": {"session_id": "m"}, "user": "u"}, "p"),
        ([], {"metadata": {"session_id": "m"}, "user": "u"}, "m"),
        ([], {"metadata": {"session_id": 42}}, "42"),
        ([], {"user": "u"}, "u"),
        ([(b"x-session-id", b"")], {"prompt_cache_key": "", "metadata": "x", "user": "u"}, "u"),
        ([(b"content-type", b"application/json")], {"user": {"id": 1}}, None),
        ([], {"metadata": {"session_id": True}}, None),
        ([], {}, None),
    ],
)
def test_session_key_sources_in_order(headers, body, want):
    assert session_key(headers, body) == want


# ---- circuit breaker -----------------------------------------------------------


def breaker(**cfg) -> CircuitBreaker:
    return CircuitBreaker(np.zeros(L.C_WORDS, dtype=np.int64), BalancerConfig(**cfg))


def test_circuit_opens_after_three_consecutive_failures():
    b = breaker()
    t = NOW
    for _ in range(2):
        b.record(False, t)
        assert b.state == CLOSED and b.allow(t)
    b.record(True, t)  # a success resets the run
    b.record(False, t)
    b.record(False, t)
    assert b.state == CLOSED
    b.record(False, t)
    assert b.state == OPEN
    assert not b.allow(t)
    assert not b.allow(t + 5 * NS - 1)
    assert b.row[L.C_CIRCUIT_UNTIL_NS] == t + 5 * NS


def test_open_circuit_turns_half_open_and_admits_one_probe_at_a_time():
    b = breaker(probe_timeout_s=30.0)
    for _ in range(3):
        b.record(False, NOW)
    t = NOW + 5 * NS
    assert b.allow(t)
    assert b.state == HALF_OPEN
    assert not b.allow(t + NS)  # the probe is still out
    assert b.allow(t + 30 * NS)  # probe lost without a verdict: slot freed by timeout


def test_good_probes_close_the_circuit():
    b = breaker()
    for _ in range(3):
        b.record(False, NOW)
    t = NOW + 5 * NS
    assert b.allow(t)
    b.record(True, t)
    assert b.state == HALF_OPEN  # one of two
    assert b.allow(t)  # the slot was freed by the verdict
    b.record(True, t)
    assert b.state == CLOSED
    assert b.row[L.C_CONSEC_FAILURES] == 0
    assert all(b.allow(t) for _ in range(5))


def test_failed_probe_reopens_with_doubled_cooldown_capped_at_60s():
    b = breaker()
    t = NOW
    for _ in range(3):
        b.record(False, t)
    cooldowns = []
    for _ in range(6):
        until = int(b.row[L.C_CIRCUIT_UNTIL_NS])
        cooldowns.append((until - t) / NS)
        t = until
        assert b.allow(t) and b.state == HALF_OPEN
        b.record(False, t)
        assert b.state == OPEN
    assert cooldowns == [5, 10, 20, 40, 60, 60]


def test_good_probe_then_failure_keeps_doubling():
    b = breaker()
    for _ in range(3):
        b.record(False, NOW)
    t = NOW + 5 * NS
    assert b.allow(t)
    b.record(True, t)
    assert b.allow(t)
    b.record(False, t)
    assert b.state == OPEN and b.row[L.C_CIRCUIT_UNTIL_NS] == t + 10 * NS


def test_verdicts_while_open_are_ignored():
    b = breaker()
    for _ in range(3):
        b.record(False, NOW)
    until = int(b.row[L.C_CIRCUIT_UNTIL_NS])
    b.record(False, NOW + 1)  # a request sent before the circuit opened
    b.record(True, NOW + 2)
    assert b.state == OPEN and b.row[L.C_CIRCUIT_UNTIL_NS] == until


def test_release_frees_the_probe_slot():
    b = breaker()
    for _ in range(3):
        b.record(False, NOW)
    t = NOW + 5 * NS
    assert b.allow(t)
    assert not b.allow(t)
    b.release()
    assert b.allow(t) and b.state == HALF_OPEN


def test_zeroed_row_is_a_closed_circuit():
    # the proxy zeroes its counters row for a new incarnation
    b = breaker()
    for _ in range(3):
        b.record(False, NOW)
    b.row[:] = 0
    assert b.state == CLOSED and b.allow(NOW)


def test_breaker_options_are_honoured():
    b = breaker(failure_threshold=1, cooldown_s=1.0, cooldown_max_s=3.0, probes_to_close=1)
    b.record(False, NOW)
    assert b.state == OPEN and b.row[L.C_CIRCUIT_UNTIL_NS] == NOW + NS
    assert b.cooldown_ns(3) == 3 * NS  # 1 s doubled twice = 4 s, capped at 3 s
    assert b.allow(NOW + NS)
    b.record(True, NOW + NS)
    assert b.state == CLOSED


# ---- candidates_from_shm ---------------------------------------------------------

READY, LOADING = L.ReplicaStatus.READY, L.ReplicaStatus.LOADING


def tables(n_proxies: int = 3, n_replicas: int = 6):
    rows = np.zeros((n_replicas, L.R_WORDS), dtype=np.int64)
    rows[:, L.R_MODEL] = -1
    counters = np.zeros((n_proxies, n_replicas, L.C_WORDS), dtype=np.int64)
    return rows, counters


def replica(rows, slot, model, status=READY, inc=None, weight=1000, prio=0, maxc=0):
    r = rows[slot]
    r[L.R_MODEL], r[L.R_STATUS], r[L.R_PORT] = model, status, 9000 + slot
    r[L.R_INCARNATION] = slot + 100 if inc is None else inc
    r[L.R_WEIGHT], r[L.R_PRIORITY], r[L.R_MAX_CONCURRENCY] = weight, prio, maxc


def test_candidates_are_the_ready_replicas_of_the_model():
    rows, counters = tables()
    replica(rows, 0, 1, weight=2500, prio=3, maxc=4)
    replica(rows, 1, 1, status=LOADING)
    replica(rows, 2, 0)
    replica(rows, 4, 1, weight=0)
    cs = candidates_from_shm(rows, counters, 1, 0)
    assert [c.slot for c in cs] == [0, 4]
    c = cs[0]
    assert (c.port, c.incarnation, c.weight, c.priority, c.max_concurrency) == (
        9000,
        100,
        2.5,
        3,
        4,
    )
    assert cs[1].weight == 1.0  # unset weight reads as 1
    assert cs[0].slots == 1  # unknown slots read as one
    rows[4, L.R_SLOTS] = 4
    assert candidates_from_shm(rows, counters, 1, 0)[1].slots == 4
    assert candidates_from_shm(rows, counters, 7, 0) == []


def test_in_flight_sums_proxies_of_the_current_incarnation():
    rows, counters = tables()
    replica(rows, 2, 0, inc=55)
    counters[:, 2, L.C_INCARNATION] = [55, 55, 54]  # proxy 2 has not seen the respawn
    counters[:, 2, L.C_IN_FLIGHT] = [2, 3, 7]
    (c,) = candidates_from_shm(rows, counters, 0, 1)
    assert c.in_flight == 5
    counters[:, 2, L.C_IN_FLIGHT] = [-1, 0, 7]  # never below zero
    assert candidates_from_shm(rows, counters, 0, 1)[0].in_flight == 0


def test_ttft_is_the_sample_weighted_mean_of_the_proxies_ewmas():
    rows, counters = tables()
    replica(rows, 0, 0)
    counters[:, 0, L.C_INCARNATION] = 100
    counters[:, 0, L.C_TTFT_EWMA_US] = [40_000, 100_000, 0]
    counters[:, 0, L.C_TTFT_COUNT] = [30, 10, 0]
    counters[:, 0, L.C_LAST_USED_NS] = NOW
    (c,) = candidates_from_shm(rows, counters, 0, 0, NOW)
    assert c.ttft_ewma_us == pytest.approx((30 * 40_000 + 10 * 100_000) / 40)
    counters[1, 0, L.C_INCARNATION] = 99  # stale row: ignored
    assert candidates_from_shm(rows, counters, 0, 0, NOW)[0].ttft_ewma_us == pytest.approx(40_000)
    counters[:, 0, L.C_TTFT_COUNT] = 0
    assert candidates_from_shm(rows, counters, 0, 0, NOW)[0].ttft_ewma_us == 0.0


def test_ttft_of_a_replica_unused_for_ttft_forget_s_is_forgotten_so_it_is_tried_again():
    rows, counters = tables(n_proxies=2)
    for s in (0, 1):
        replica(rows, s, 0)
        counters[:, s, L.C_INCARNATION] = 100 + s
        counters[:, s, L.C_TTFT_COUNT] = 50
    counters[:, :2, L.C_TTFT_EWMA_US] = [20_000, 90_000]  # slot 1 once answered slowly
    counters[:, 0, L.C_LAST_USED_NS] = NOW  # sequential requests all go to slot 0
    counters[:, 1, L.C_LAST_USED_NS] = NOW - 9 * NS
    cs = candidates_from_shm(rows, counters, 0, 0, NOW)
    assert cs[1].ttft_ewma_us == 90_000
    assert {pick(cs, rng=random.Random(k)) for k in range(20)} == {0}
    counters[1, 1, L.C_LAST_USED_NS] = NOW - 11 * NS  # the latest use over proxies counts
    assert candidates_from_shm(rows, counters, 0, 0, NOW)[1].ttft_ewma_us == 90_000
    counters[0, 1, L.C_LAST_USED_NS] = NOW - 11 * NS
    cs = candidates_from_shm(rows, counters, 0, 0, NOW)
    assert cs[1].ttft_ewma_us == 0.0  # unknown: scores as the baseline
    assert {pick(cs, rng=random.Random(k)) for k in range(20)} == {0, 1}
    cfg = BalancerConfig(ttft_forget_s=60)
    assert candidates_from_shm(rows, counters, 0, 0, NOW, cfg)[1].ttft_ewma_us == 90_000


def test_circuit_comes_from_this_proxys_row_of_the_current_incarnation():
    rows, counters = tables()
    replica(rows, 0, 0)
    replica(rows, 1, 0)
    counters[:, :2, L.C_INCARNATION] = [100, 101]
    b = CircuitBreaker(counters[1, 0])
    for _ in range(3):
        b.record(False, NOW)
    mine = candidates_from_shm(rows, counters, 0, 1)
    assert (mine[0].circuit, mine[0].circuit_until_ns) == (OPEN, NOW + 5 * NS)
    assert mine[1].circuit == CLOSED
    assert candidates_from_shm(rows, counters, 0, 0)[0].circuit == CLOSED  # other proxy's view
    assert pick(mine) == 1
    counters[1, 0, L.C_INCARNATION] = 7  # a circuit of a previous incarnation does not count
    assert candidates_from_shm(rows, counters, 0, 1)[0].circuit == CLOSED


def test_choose_from_shm_follows_live_counters():
    rows, counters = tables(n_proxies=2)
    for s in range(3):
        replica(rows, s, 0)
        counters[:, s, L.C_INCARNATION] = 100 + s
    counters[0, :3, L.C_IN_FLIGHT] = [3, 1, 2]
    assert pick(candidates_from_shm(rows, counters, 0, 1)) == 1
    counters[1, 1, L.C_IN_FLIGHT] = 5
    assert pick(candidates_from_shm(rows, counters, 0, 1)) == 2


# ---- speed (pytest --benchmark-enable; no timing asserts, see bench/) -------------


@pytest.mark.parametrize("n", [3, 8])
def test_choose_speed(benchmark, n):
    rng = random.Random(0)
    cands = [cand(i, in_flight=i % 3, ttft_ewma_us=35_000.0 * (1 + i % 2)) for i in range(n)]
    assert benchmark(choose, cands, (), None, rng, now_ns=NOW) is not None


@pytest.mark.parametrize("n", [3, 8])
def test_choose_with_session_speed(benchmark, n):
    cands = [cand(i) for i in range(n)]
    assert benchmark(choose, cands, (), "a-session-key", None, now_ns=NOW) is not None


def test_candidates_from_shm_speed(benchmark):
    rows, counters = tables(n_proxies=2, n_replicas=16)
    for s in range(4):
        replica(rows, s, 0)
    assert len(benchmark(candidates_from_shm, rows, counters, 0, 0)) == 4
