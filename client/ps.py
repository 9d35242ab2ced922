"""``ggmux ps``: what runs, as a table of the server's ``GET /ps`` (state,
node, replicas, memory, in flight, idle for, until unload; cache and
speculation when a model has them), or that document as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from .http_client import (
    Client,
    items,
    number,
)


# ---- ps ----------------------------------------------------------------------
def _bytes(n: int) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _seconds(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.0f} s"
    if s < 3600:
        return f"{s // 60:.0f} min {s % 60:.0f} s"
    return f"{s // 3600:.0f} h {s % 3600 // 60:.0f} min"


def _node_cell(m: dict) -> str:
    """The NODE cell of a model: the node that serves it, then (in
    parentheses) the other nodes holding or loading it; ``-`` for none."""
    node = m.get("node") if isinstance(m.get("node"), str) else None
    nodes = m.get("nodes") if isinstance(m.get("nodes"), list) else []
    others = [n["node"] for n in nodes if isinstance(n, dict) and isinstance(n.get("node"), str)
              and n["node"] != node]
    if node is None:
        return ", ".join(others) or "-"
    return node + (f" (+{', '.join(others)})" if others else "")


def _cache_cell(cache) -> str:
    """``RAM/DISK`` bytes of a model's KV tiers (``/ps``'s ``cache``); ``-``
    when both are 0 or the field is not an object."""
    if not isinstance(cache, dict):
        return "-"
    ram, disk = number(cache.get("ram")) or 0, number(cache.get("disk")) or 0
    return f"{_bytes(ram) if ram else 0}/{_bytes(disk) if disk else 0}" if ram or disk else "-"


def _drafts_cell(d) -> str:
    """The DRAFTS cell: the share of draft tokens accepted and how many
    were drafted (``83% of 120``), ``0 drafted`` when speculation is on and
    nothing was drafted yet, ``-`` for a model that does not draft."""
    if not isinstance(d, dict):
        return "-"
    drafted, accepted = number(d.get("drafted")) or 0, number(d.get("accepted")) or 0
    if not drafted:
        return "0 drafted"
    return f"{accepted / drafted:.0%} of {int(drafted)}"


def _memory_cell(state: str, mem: dict) -> str:
    """The MEMORY cell: what the model's replicas hold; while it loads, the
    minimum the ledger set aside for it, marked ``min``; ``-`` for a model
    that holds nothing (issue 31, item 14: an unloaded model showed its
    measured minimum, as if it held it)."""
    held = number(mem.get("effective")) or 0
    if held:
        return _bytes(held)
    low = number(mem.get("min")) or 0
    if state == "loading" and low:
        return _bytes(low) + " min"
    return "-"


def _media_cell(modalities) -> str:
    """``vision``, ``audio``, ``vision+audio`` (what a model's projector
    reads), ``-`` for none."""
    if not isinstance(modalities, dict):
        return "-"
    got = [k for k in ("vision", "audio") if modalities.get(k) is True]
    return "+".join(got) if got else "-"


def ps_table(doc: dict, every: bool = False) -> str:
    """The text of ``ggmux ps`` from a ``/ps`` document: NAME, STATE,
    (in cluster mode, when the document names this ``node``) NODE,
    REPLICAS, MEMORY (:func:`_memory_cell`), CACHE (its KV tiers: RAM/disk,
    issue 29; ``-`` for none), DRAFTS (when a model drafts:
    :func:`_drafts_cell`), MEDIA (when a model reads images or audio:
    :func:`_media_cell`), IN FLIGHT, WAITING, IDLE FOR, UNTIL UNLOAD, then
    one line per model whose requests wait saying why (issue 34);
    unloaded models only with ``every``. NODE is the node that serves the model (as
    ``ollama ps``'s PROCESSOR says where it runs), other nodes holding it
    after it. Each model has a string ``id`` and ``state`` (:func:`items`);
    another field of an unexpected type shows as ``-``. With no row to
    show, one line that says so (and that ``--all`` lists every model)."""
    cluster = isinstance(doc.get("node"), str)
    models = doc.get("models") or []
    # speculative decoding's acceptance, when a model drafts (its `drafts`)
    drafts = any(isinstance(m.get("drafts"), dict) for m in models)
    # what a model reads beside text (a projector's), when any model has one
    media = any(_media_cell(m.get("modalities")) != "-" for m in models)
    rows = [("NAME", "STATE", *(("NODE",) if cluster else ()), "REPLICAS", "MEMORY",
             "CACHE", *(("DRAFTS",) if drafts else ()), *(("MEDIA",) if media else ()),
             "IN FLIGHT", "WAITING", "IDLE FOR",
             "UNTIL UNLOAD")]
    for m in models:
        failed = bool(m.get("failed"))
        if not every and m["state"] == "unloaded" and not failed:
            continue
        state = m["state"] + (" (failed)" if failed else "")
        if any(isinstance(r, dict) and r.get("draining") is True
               for r in (m.get("replicas") if isinstance(m.get("replicas"), list) else [])):
            state += " (draining)"
        progress = number(m.get("progress"))
        if m["state"] == "loading" and progress is not None:
            state += f" {progress:.0%}"
        reps = m.get("replicas")
        reps = [r for r in reps if isinstance(r, dict)] if isinstance(reps, list) else []
        ready = sum(1 for r in reps if r.get("state") == "ready")
        mem = m.get("memory") if isinstance(m.get("memory"), dict) else {}
        idle, until = number(m.get("idle_s")), number(m.get("unload_in_s"))
        rows.append((
            m["id"], state, *((_node_cell(m),) if cluster else ()),
            f"{ready}/{len(reps)}" if reps else "-",
            _memory_cell(m["state"], mem), _cache_cell(m.get("cache")),
            *((_drafts_cell(m.get("drafts")),) if drafts else ()),
            *((_media_cell(m.get("modalities")),) if media else ()),
            str(m.get("in_flight", 0)), str(m.get("waiting", 0)), _seconds(idle),
            _seconds(until) if until is not None else ("never" if idle is not None else "-"),
        ))
    if len(rows) == 1:
        if every:
            return "the server has no models\n"
        return (f"no model is running ({len(models)} known; ggmux ps --all lists every "
                "model)\n")
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    # why requests wait (issue 34), one line per waiting model under the table
    why = [f"{m['id']}: {q['why']} ({q.get('waiters', 0)} waiting, oldest "
           f"{_seconds(number(q.get('oldest_wait_s')))})"
           for m in models if isinstance(q := m.get("queue"), dict)
           and isinstance(q.get("why"), str) and q["why"]]
    return "\n".join("   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
                     for r in rows) + "\n" + "".join(w + "\n" for w in why)


def cmd_ps(client: Client, args: argparse.Namespace) -> int:
    doc = client.object("GET", "/ps")
    items(client, "GET", "/ps", doc, "models", ("id", "state"))
    if args.json:
        try:
            text = json.dumps(doc, indent=2)
        except RecursionError:
            raise client.shape("GET", "/ps", "JSON nested too deep") from None
        print(text)
    else:
        sys.stdout.write(ps_table(doc, every=args.all))
    return 0


# ---- load / unload ---------------------------------------------------------------
