"""The KV tiers' options of the instance process (``python -m ggmux.instance``);
a preset's values arrive among the llama-server options instead
(:func:`~ggmux.instance.llama_args.llama_kwargs`) and win."""

from __future__ import annotations

import argparse


def add_cache_options(ap: argparse.ArgumentParser) -> None:
    """``--cache-ram``, ``--cache-disk``, ``--cache-disk-max``,
    ``--cache-save-timeout``, ``--cache-checkpoints``, ``--cache-checkpoint-max`` (None when not given: the defaults of
    :class:`~ggmux.instance.cache.tiers.CacheSettings`)."""
    ap.add_argument("--cache-ram", type=int, default=None, metavar="MiB",
                    help="KV tiers: slots' prompt caches kept in host RAM, as llama-server's "
                         "--cache-ram (default 8192; -1 no byte limit; 0 off); a preset's "
                         "cache-ram (in --llama-args) wins")
    ap.add_argument("--cache-disk", default=None, metavar="DIR",
                    help="KV tiers: spill RAM's entries to files in DIR/<fingerprint>/ "
                         "(default: off)")
    ap.add_argument("--cache-disk-max", type=float, default=None, metavar="GiB",
                    help="KV tiers: the most this model's files in --cache-disk hold "
                         "(default 10)")
    ap.add_argument("--cache-save-timeout", type=float, default=None, metavar="S",
                    help="KV tiers: seconds a stopping instance spends writing its slots' "
                         "caches to --cache-disk (default 2)")
    ap.add_argument("--cache-checkpoints", type=int, default=None, metavar="N",
                    help="KV tiers: the most context checkpoints (sliding-window and recurrent "
                         "models) one RAM or disk entry carries, newest first (default 4; 0 none)")
    ap.add_argument("--cache-checkpoint-max", type=int, default=None, metavar="MiB",
                    help="KV tiers: the most bytes of context checkpoints one RAM or disk "
                         "entry carries (default 1024; 0 none)")


__all__ = ["add_cache_options"]
