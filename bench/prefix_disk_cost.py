"""What the disk rows of the prefix index cost per request (issue 29).

A model with a disk tier has its node's disk rows looked up with its
replicas' entries (:meth:`ggmux.proxy.prefix.PrefixRouting.predict` with a
model): one more salt in the same numpy calls. This times ``predict`` for
one prompt against a filled index, without and with the disk lookup, side
by side in one process, alternating rounds, and reports the medians and
their ratio. No sockets, no processes: the proxy's own code on a
shared-memory-shaped table.

Run from the repository root: ``python -m bench.prefix_disk_cost``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
from ggmux.proxy.balancer import Candidate
from ggmux.proxy.prefix import PrefixRouting
from ggmux.shm import layout as L
from ggmux.shm.prefixtable import PrefixTable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-bytes", type=int, default=40_000,
                    help="canonical prompt bytes (~9.7k tokens: Codex's first request)")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--proxies", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--calls", type=int, default=200, help="predict calls per round and kind")
    args = ap.parse_args()
    buckets, ways, block = 2048, 4, 256
    table = np.zeros((args.proxies, buckets, ways, L.X_WORDS), dtype=np.int64)
    forget = np.zeros((args.proxies, 16), dtype=np.int64)
    forget_disk = np.zeros((args.proxies, 4), dtype=np.int64)
    routing = PrefixRouting(PrefixTable(table, forget, 0, forget_disk), block, b"bench")
    rng = np.random.default_rng(1)
    text = rng.integers(97, 123, size=args.prompt_bytes, dtype=np.uint8).tobytes().decode()
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "hi"}]}
    cands = [Candidate(slot=i, port=1000 + i, incarnation=i + 1) for i in range(args.replicas)]
    # a filled index: this prompt on replica 0 and on disk, and other prompts elsewhere
    pred = routing.predict(body, b"", "global", cands)
    routing.table.record(pred.chain, 0, 1, 1000)
    routing.table.record_disk(pred.chain, 0, 0, 1000)
    for k in range(200):
        other = {"messages": [{"role": "system", "content": f"{k} " + text[:8000]}]}
        p = routing.predict(other, b"", "global", cands)
        routing.table.record(p.chain, k % args.replicas, k % args.replicas + 1, 2000 + k)
    plain, disk = [], []
    for r in range(args.rounds):
        for kind in (("plain", "disk") if r % 2 == 0 else ("disk", "plain")):
            t0 = time.perf_counter_ns()
            for _ in range(args.calls):
                if kind == "plain":
                    routing.predict(body, b"", "global", cands)
                else:
                    routing.predict(body, b"", "global", cands, 0, 0, frozenset())
            us = (time.perf_counter_ns() - t0) / args.calls / 1000
            (plain if kind == "plain" else disk).append(us)
    got = routing.predict(body, b"", "global", cands, 0, 0, frozenset())
    assert got.share and got.disk, "the prompt is found on replica 0 and on disk"
    p50, d50 = statistics.median(plain), statistics.median(disk)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    print(f"prompt {args.prompt_bytes} bytes ({len(got.chain)} blocks), {args.replicas} "
          f"replicas, {args.proxies} proxies, {args.rounds} rounds x {args.calls} calls")
    print(f"predict without disk rows: median {p50:.1f} us/request")
    print(f"predict with disk rows:    median {d50:.1f} us/request  ({d50 / p50:.2f}x)")


if __name__ == "__main__":
    main()
