"""The serve options of routing between replicas (issue 20) and what they become.

``--balance`` picks the balancer's mode (:data:`MODES`),
``--prefix-weight``, ``--prefix-disk-weight`` and ``--prefix-load-threshold``
its prefix rule
(:func:`~ggmux.proxy.balancer.choose`); the proxies get them on their
command line (:func:`routing_argv`). ``--prefix-block-bytes`` and
``--prefix-index-entries`` size the prefix index in the shared-memory
segment (:func:`prefix_sizes`), where every proxy reads them, so all hash
alike. Defaults and their reasons: docs/replicas.md "Prefix-aware routing" and
bench/RESULTS.md (the routing-mode comparison they were chosen from).
"""

from __future__ import annotations

import argparse

from ..shm.prefixtable import WAYS

# the proxy's BalancerConfig defaults (supervisor/ may use only http1 and
# proxy/auth of proxy/: DESIGN.md "Processes"; a test keeps the two equal)
MODES = ("prefix", "load", "round-robin")
DEFAULT_MODE = "prefix"
DEFAULT_PREFIX_WEIGHT = 0.9
DEFAULT_LOAD_THRESHOLD = 1.0
DEFAULT_DISK_WEIGHT = 0.8

PREFIX_WAYS = 4
"""Ways of a bucket of the prefix index (entries one bucket keeps, LRU)."""

DEFAULT_BLOCK_BYTES = 256
DEFAULT_INDEX_ENTRIES = 8192


def add_routing_options(parser: argparse.ArgumentParser) -> None:
    """``--balance``, ``--prefix-weight``, ``--prefix-load-threshold``,
    ``--prefix-block-bytes``, ``--prefix-index-entries`` on ``parser``."""
    parser.add_argument(
        "--balance", choices=MODES, default=DEFAULT_MODE,
        help="how a request picks among a model's replicas: prefix (the one whose cache holds "
             "most of its prompt, weighed against load), load (in flight and TTFT only), "
             "round-robin; a session key sticks to one replica in every mode")
    parser.add_argument(
        "--prefix-weight", type=float, default=DEFAULT_PREFIX_WEIGHT, metavar="W",
        help="share of a replica's TTFT that a cached prefix saves, 0 to below 1: a replica "
             "holding the fraction f of a prompt scores as if its queue were 1 - W x f as long "
             "(0: prefixes ignored)")
    parser.add_argument(
        "--prefix-disk-weight", type=float, default=DEFAULT_DISK_WEIGHT, metavar="W",
        help="the same for a prefix on this node's disk tier (any replica of the model "
             "restores it from there), below --prefix-weight: the replica reads it back first")
    parser.add_argument(
        "--prefix-load-threshold", type=float, default=DEFAULT_LOAD_THRESHOLD,
        metavar="X",
        help="a replica with this many requests in flight per slot loses its cache bonus, so "
             "new requests go to a less loaded one even for a prefix it holds (no hot spot on "
             "a warm replica)")
    parser.add_argument(
        "--prefix-block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, metavar="N",
        help="bytes of the canonical prompt hashed per block of the prefix index (a multiple "
             "of 8, at least 64); a prompt shorter than one block is routed by load alone")
    parser.add_argument(
        "--prefix-index-entries", type=int, default=DEFAULT_INDEX_ENTRIES, metavar="N",
        help="prefix index entries (blocks of prompts served) each proxy keeps in shared "
             "memory, 32 bytes each (8192: 256 KiB a proxy, 2 MiB of distinct prompt text in "
             "256-byte blocks); the least recently used go first")


def check(args: argparse.Namespace) -> str | None:
    """Why the routing options cannot run, or None."""
    if not 0 <= args.prefix_weight < 1:
        return "--prefix-weight must be at least 0 and below 1"
    if not 0 <= args.prefix_disk_weight < 1:
        return "--prefix-disk-weight must be at least 0 and below 1"
    if args.prefix_load_threshold <= 0:
        return "--prefix-load-threshold must be above 0"
    if args.prefix_block_bytes < 64 or args.prefix_block_bytes % 8:
        return "--prefix-block-bytes must be a multiple of 8, at least 64"
    if not PREFIX_WAYS <= args.prefix_index_entries <= 1 << 24:
        return f"--prefix-index-entries must be {PREFIX_WAYS} to {1 << 24}"
    return None


def routing_argv(args: argparse.Namespace, cache_scope: str) -> list[str]:
    """The proxies' options for routing: the mode, the prefix rule and the
    default cache scope (which the index keeps, as the instances do)."""
    return ["--balance", args.balance, "--prefix-weight", repr(args.prefix_weight),
            "--prefix-disk-weight", repr(args.prefix_disk_weight),
            "--prefix-load-threshold", repr(args.prefix_load_threshold),
            "--cache-scope", cache_scope]


def prefix_sizes(args: argparse.Namespace) -> dict[str, int]:
    """The segment's prefix index sizes (``Sizes`` fields): buckets, the
    power of two that gives at least ``--prefix-index-entries`` entries at
    :data:`PREFIX_WAYS` ways; ways; block bytes."""
    assert PREFIX_WAYS in WAYS
    buckets = 1
    while buckets * PREFIX_WAYS < args.prefix_index_entries:
        buckets *= 2
    return {"prefix_buckets": buckets, "prefix_ways": PREFIX_WAYS,
            "prefix_block": args.prefix_block_bytes}
