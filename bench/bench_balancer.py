"""Replica balancing in simulated time: round-robin vs least in-flight vs
:func:`ggmux.proxy.balancer.choose` (issue 6).

Model (a discrete-event simulation; no sockets, no real time):

* Three replicas of one model whose first-token latency when idle is 35, 80
  and 300 ms (``--latencies``). Each serves **one request at a time** and
  queues the rest in arrival order, as llama-cpp-python's server and
  ``llama-server --parallel 1`` do. A request holds its replica for its
  prefill (the first-token latency times a lognormal jitter, sigma
  ``--jitter``, mean 1) and then for ``--decode-ratio`` times the replica's
  first-token latency of generation (0: short answers, the replica is free
  at the first token). TTFT = first token - arrival, queueing included.
* ``--proxies`` proxy processes; each request lands on a random one (the
  kernel's ``SO_REUSEPORT`` spread). Proxies share the in-flight counts
  through real ``counters`` / ``replicas`` tables with the shared-memory
  layout (:mod:`ggmux.shm.layout`); each proxy keeps its own TTFT EWMA row,
  updated at the first token with the server's rule (alpha 0.2, the time
  from forwarding to the first byte, which includes the replica's queue).
  The balancer reads them with :func:`candidates_from_shm` exactly as a
  proxy would.
* ``--requests`` requests per run arrive as a Poisson process at a rate
  given as a share of the replicas' total capacity (``--loads``;
  capacity = sum of 1 / service time). Every policy sees the same arrivals
  and jitters (common random numbers), over ``--seeds`` runs.

Policies: ``round-robin`` (a cursor per proxy); ``least-in-flight`` (the
proxy's previous ``_pick``: fewest in flight over all proxies, lowest slot
on a tie); ``balancer`` (``choose`` with ``BalancerConfig(ttft_share=...)``);
``oracle`` (a greedy reference no proxy can run: the shortest expected
wait from the true latencies and queues, ``((queued + running) x (1 +
decode ratio) + 1) x latency``; not optimal for the mean, only informed). Replicas get their slots in a random order per seed, so a policy
that favours low slots gains nothing from the order of ``--latencies``;
shares are reported per latency, in ``--latencies`` order.

Run from the repository root: ``python -m bench.bench_balancer``.
"""

from __future__ import annotations

import argparse
import heapq
import math
import platform
import random
import statistics
import sys
import time
import timeit
from collections import deque

import numpy as np
from ggmux.proxy.balancer import BalancerConfig, Candidate, candidates_from_shm, choose
from ggmux.shm import layout as L

NS = 1_000_000_000
TTFT_ALPHA = 0.2  # as proxy/accounting.py

ARRIVE, FIRST, DONE = 0, 1, 2


def simulate(
    policy: str,
    latencies: list[float],
    arrivals: list[float],
    jitters: list[float],
    proxy_of: list[int],
    n_proxies: int,
    decode_ratio: float,
    config: BalancerConfig,
    seed: int,
) -> tuple[list[float], list[int]]:
    """One run: TTFT of every request (seconds) and requests per replica."""
    k = len(latencies)
    rows = np.zeros((k, L.R_WORDS), dtype=np.int64)
    rows[:, L.R_MODEL] = 0
    rows[:, L.R_STATUS] = L.ReplicaStatus.READY
    rows[:, L.R_PORT] = np.arange(k) + 9000
    rows[:, L.R_INCARNATION] = np.arange(k) + 1
    rows[:, L.R_WEIGHT] = 1000
    counters = np.zeros((n_proxies, k, L.C_WORDS), dtype=np.int64)
    counters[:, :, L.C_INCARNATION] = np.arange(k) + 1
    rngs = [random.Random(seed * 1000 + p) for p in range(n_proxies)]
    cursor = [p % k for p in range(n_proxies)]

    busy = [False] * k
    queues: list[deque[int]] = [deque() for _ in range(k)]
    sent = [0.0] * len(arrivals)
    where = [0] * len(arrivals)
    ttft = [0.0] * len(arrivals)
    served = [0] * k
    events: list[tuple[float, int, int, int]] = [(t, ARRIVE, i, -1) for i, t in enumerate(arrivals)]
    heapq.heapify(events)

    def start(r: int, now: float) -> None:
        i = queues[r].popleft()
        busy[r] = True
        prefill = latencies[r] * jitters[i]
        heapq.heappush(events, (now + prefill, FIRST, i, r))
        heapq.heappush(events, (now + prefill + decode_ratio * latencies[r], DONE, i, r))

    while events:
        now, kind, i, r = heapq.heappop(events)
        p = proxy_of[i]
        if kind == ARRIVE:
            if policy == "round-robin":
                r = cursor[p]
                cursor[p] = (r + 1) % k
            elif policy == "oracle":
                r = min(
                    range(k),
                    key=lambda s: (
                        ((len(queues[s]) + busy[s]) * (1 + decode_ratio) + 1) * latencies[s]
                    ),
                )
            elif policy == "least-in-flight":
                inflight = counters[:, :, L.C_IN_FLIGHT].sum(axis=0)
                r = min(range(k), key=lambda s: inflight[s])
            else:
                cands = candidates_from_shm(rows, counters, 0, p)
                c = choose(cands, (), None, rngs[p], now_ns=int(now * NS), config=config)
                r = c.slot
            counters[p, r, L.C_IN_FLIGHT] += 1
            sent[i] = now
            where[i] = r
            served[r] += 1
            queues[r].append(i)
            if not busy[r]:
                start(r, now)
        elif kind == FIRST:
            ttft[i] = now - arrivals[i]
            us = int((now - sent[i]) * 1e6)
            row = counters[p, r]
            old = int(row[L.C_TTFT_EWMA_US])
            row[L.C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
            row[L.C_TTFT_COUNT] += 1
        else:
            counters[p, r, L.C_IN_FLIGHT] -= 1
            busy[r] = False
            if queues[r]:
                start(r, now)
    return ttft, served


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


def speed_table() -> list[tuple[str, float]]:
    """Microseconds per call, best of 7 repeats."""
    rng = random.Random(0)
    out = []

    def best(f) -> float:
        n = 5000
        return min(timeit.repeat(f, number=n, repeat=7)) / n * 1e6

    for n in (3, 8):
        cands = [
            Candidate(i, 9000 + i, i + 1, 1.0, 0, 0, i % 3, 35_000.0 * (1 + i % 3))
            for i in range(n)
        ]
        tied = [Candidate(i, 9000 + i, i + 1) for i in range(n)]
        out.append(
            (
                f"choose, {n} candidates, scored",
                best(lambda c=cands: choose(c, (), None, rng, now_ns=1)),
            )
        )
        out.append(
            (
                f"choose, {n} candidates, all tied",
                best(lambda c=tied: choose(c, (), None, rng, now_ns=1)),
            )
        )
        out.append(
            (
                f"choose, {n} candidates, session key",
                best(lambda c=cands: choose(c, (), "sess-0123", rng, now_ns=1)),
            )
        )
    rows = np.zeros((16, L.R_WORDS), dtype=np.int64)
    rows[:, L.R_MODEL] = -1
    rows[:3, L.R_MODEL] = 0
    rows[:3, L.R_STATUS] = L.ReplicaStatus.READY
    rows[:3, L.R_INCARNATION] = [1, 2, 3]
    counters = np.zeros((2, 16, L.C_WORDS), dtype=np.int64)
    counters[:, :3, L.C_INCARNATION] = [1, 2, 3]
    out.append(
        (
            "candidates_from_shm, 3 of 16 slots, 2 proxies",
            best(lambda: candidates_from_shm(rows, counters, 0, 0)),
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m bench.bench_balancer", description=__doc__.split("\n")[0]
    )
    ap.add_argument(
        "--latencies",
        default="0.035,0.080,0.300",
        help="first-token latency of each replica when idle, seconds",
    )
    ap.add_argument(
        "--loads", default="0.1,0.2,0.4,0.6", help="arrival rates as shares of total capacity"
    )
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--proxies", type=int, default=2)
    ap.add_argument(
        "--decode-ratio",
        type=float,
        default=0.0,
        help="generation time after the first token, in first-token latencies",
    )
    ap.add_argument(
        "--jitter", type=float, default=0.2, help="sigma of the lognormal prefill jitter"
    )
    ap.add_argument("--ttft-share", type=float, default=BalancerConfig().ttft_share)
    ap.add_argument("--no-speed", action="store_true", help="skip the choose() timing")
    args = ap.parse_args(argv)

    lat = [float(x) for x in args.latencies.split(",")]
    loads = [float(x) for x in args.loads.split(",")]
    capacity = sum(1 / (x * (1 + args.decode_ratio)) for x in lat)
    config = BalancerConfig(ttft_share=args.ttft_share)
    policies = ("round-robin", "least-in-flight", "balancer", "oracle")
    print(
        f"# python -m bench.bench_balancer {' '.join(argv if argv is not None else sys.argv[1:])}"
    )
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, Python {platform.python_version()}, {platform.machine()}"
    )
    print(
        f"# replicas: first-token latency {', '.join(f'{x * 1e3:g} ms' for x in lat)}, one request at a time, "
        f"decode {args.decode_ratio:g} x latency; capacity {capacity:.1f} req/s; "
        f"{args.requests} requests x {args.seeds} seeds; {args.proxies} proxies; ttft_share {args.ttft_share:g}"
    )
    print()
    print(
        "| load | rate req/s | policy | mean TTFT ms | p50 ms | p90 ms | p99 ms | share per replica |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---|")
    ratios = []
    sigma = args.jitter
    for load in loads:
        rate = load * capacity
        res: dict[str, tuple[list[float], list[int]]] = {p: ([], [0] * len(lat)) for p in policies}
        for seed in range(args.seeds):
            g = random.Random(seed)
            t = 0.0
            arrivals = []
            for _ in range(args.requests):
                t += g.expovariate(rate)
                arrivals.append(t)
            jit = [g.lognormvariate(-sigma * sigma / 2, sigma) for _ in arrivals]
            proxy_of = [g.randrange(args.proxies) for _ in arrivals]
            perm = g.sample(range(len(lat)), len(lat))  # slot j serves latency lat[perm[j]]
            slot_lat = [lat[j] for j in perm]
            for pol in policies:
                tt, served = simulate(
                    pol,
                    slot_lat,
                    arrivals,
                    jit,
                    proxy_of,
                    args.proxies,
                    args.decode_ratio,
                    config,
                    seed,
                )
                res[pol][0].extend(tt)
                for j, n in enumerate(served):
                    res[pol][1][perm[j]] += n
        for pol in policies:
            tt, served = res[pol]
            tot = sum(served)
            share = " / ".join(f"{100 * n / tot:.0f}%" for n in served)
            print(
                f"| {load:g} | {rate:.1f} | {pol} | {1e3 * statistics.fmean(tt):.1f} | {1e3 * pct(tt, 0.5):.1f} "
                f"| {1e3 * pct(tt, 0.9):.1f} | {1e3 * pct(tt, 0.99):.1f} | {share} |"
            )
        rr, lf, bal, orc = (res[p][0] for p in policies)
        ratios.append(
            (
                load,
                rate,
                statistics.fmean(rr) / statistics.fmean(bal),
                pct(rr, 0.9) / pct(bal, 0.9),
                statistics.fmean(lf) / statistics.fmean(bal),
                pct(lf, 0.9) / pct(bal, 0.9),
                statistics.fmean(bal) / statistics.fmean(orc),
            )
        )
    print()
    print(
        "| load | rate req/s | mean RR / balancer | p90 RR / balancer "
        "| mean least-in-flight / balancer | p90 least-in-flight / balancer | mean balancer / oracle |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for load, rate, a, b, c, d, e in ratios:
        print(f"| {load:g} | {rate:.1f} | {a:.2f}x | {b:.2f}x | {c:.2f}x | {d:.2f}x | {e:.2f}x |")
    if not args.no_speed:
        print()
        print("| call | us per call (best of 7) |")
        print("|---|---:|")
        for name, us in speed_table():
            print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
