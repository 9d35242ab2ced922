"""What an instance tells of its KV tiers: the ``GET /cache`` answer's
shape without tiers, its Prometheus lines and the ``cache`` state line.
No numpy here: the fake instance and a tier-less backend answer too."""

from __future__ import annotations

import logging
import threading

from .. import protocol

log = logging.getLogger(__name__)


def empty_report() -> dict:
    """:meth:`~ggmux.instance.cache.tiers.KVTiers.report` of an instance
    without tiers: every size, limit and counter 0."""
    return {"ram": {"entries": 0, "bytes": 0, "limit_bytes": 0, "tokens": 0},
            "disk": {"entries": 0, "bytes": 0, "limit_bytes": 0, "dir": None},
            "hits": {"slot": 0, "ram": 0, "disk": 0}, "misses": 0, "restored_tokens": 0,
            "restore_seconds": 0.0, "restore_seconds_by_tier": {"ram": 0.0, "disk": 0.0},
            "saved": 0, "dropped": 0, "rejected": 0, "rejected_checkpoints": 0}


CACHE_REPORT_S = 1.0
"""Least time between two ``cache`` state lines."""


def report_cache(backend, stop: threading.Event) -> None:
    """Emit ``state:{"state": "cache", "ram_bytes", "disk_bytes",
    "ram_entries", "disk_entries"}`` when the KV tiers' sizes change, at
    most once per :data:`CACHE_REPORT_S` (the supervisor shows them; issue
    29). Runs on its own thread until ``stop``."""
    last = None
    while not stop.wait(CACHE_REPORT_S):
        try:
            r = backend.cache_report()
        except Exception:  # a report never stops the instance
            log.exception("cache report failed")
            continue
        now = (r["ram"]["bytes"], r["disk"]["bytes"], r["ram"]["entries"], r["disk"]["entries"])
        if now != last and (last is not None or any(now)):
            protocol.emit("cache", ram_bytes=now[0], disk_bytes=now[1], ram_entries=now[2],
                          disk_entries=now[3])
        last = now


def cache_metrics(r: dict) -> list[str]:
    """Prometheus lines of the KV tiers (a ``GET /cache`` answer ``r``):
    entries, bytes and limits per tier, hits per tier (``slot``, ``ram``,
    ``disk``), misses, restored tokens, restore seconds per tier, saves and
    rejected files."""
    out = []

    def family(name: str, kind: str, what: str, values: list[tuple[str, float]]) -> None:
        out.extend((f"# HELP ggmux_kv_cache_{name} {what}",
                    f"# TYPE ggmux_kv_cache_{name} {kind}"))
        out.extend(f"ggmux_kv_cache_{name}{labels} {v:g}" for labels, v in values)

    tiers = ("ram", "disk")
    family("entries", "gauge", "Entries kept per KV tier",
           [(f'{{tier="{t}"}}', r[t]["entries"]) for t in tiers])
    family("bytes", "gauge", "Bytes of sequence state kept per KV tier",
           [(f'{{tier="{t}"}}', r[t]["bytes"]) for t in tiers])
    family("limit_bytes", "gauge", "Byte limit per KV tier (0: off or none)",
           [(f'{{tier="{t}"}}', r[t]["limit_bytes"] or 0) for t in tiers])
    family("hits_total", "counter", "Requests whose cached prefix came from each tier",
           [(f'{{tier="{t}"}}', v) for t, v in r["hits"].items()])
    family("misses_total", "counter", "Requests that reused no cached prefix",
           [("", r["misses"])])
    family("restored_tokens_total", "counter", "Prompt tokens restored from RAM or disk",
           [("", r["restored_tokens"])])
    family("restore_seconds_total", "counter", "Seconds spent restoring states per tier",
           [(f'{{tier="{t}"}}', v) for t, v in r["restore_seconds_by_tier"].items()])
    family("saved_total", "counter", "Slot states saved into the tiers", [("", r["saved"])])
    family("rejected_total", "counter", "Disk entries refused (torn, corrupt, foreign)",
           [("", r["rejected"])])
    return out


__all__ = ["CACHE_REPORT_S", "cache_metrics", "empty_report", "report_cache"]
