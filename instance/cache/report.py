"""The shape of an instance's ``GET /cache`` answer without tiers (no numpy
here: the fake instance and a tier-less backend answer it too)."""

from __future__ import annotations


def empty_report() -> dict:
    """:meth:`~ggmux.instance.cache.tiers.KVTiers.report` of an instance
    without tiers: every size, limit and counter 0."""
    return {"ram": {"entries": 0, "bytes": 0, "limit_bytes": 0, "tokens": 0},
            "disk": {"entries": 0, "bytes": 0, "limit_bytes": 0, "dir": None},
            "hits": {"slot": 0, "ram": 0, "disk": 0}, "misses": 0, "restored_tokens": 0,
            "restore_seconds": 0.0, "restore_seconds_by_tier": {"ram": 0.0, "disk": 0.0},
            "saved": 0, "dropped": 0, "rejected": 0}


__all__ = ["empty_report"]
