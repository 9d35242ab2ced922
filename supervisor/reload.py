"""The merge of a rescanned registry into the running one (a reload), as a
plan computed without touching the supervisor's books.

A reload (SIGHUP, ``GET /models?reload=1``, ``--watch-config``, a cluster
view) used to change the model table step by step and only then build the
new :class:`~.registry.Registry`; when that raised (an alias of a removed
model given to a new one, issue 23), the model table had grown while the
registry had not, and the next measure step died with ``IndexError``. Here
the whole result is computed first, and the supervisor commits it only
when nothing raised: a failed reload changes nothing.

Rows are never reused: a model keeps its row (its shm index) for the
server's life, a removed one stays in the registry, marked removed, so its
replicas can finish and its row can come back when a source lists it
again. A removed model neither holds its aliases nor keeps another model
from taking its name as an alias (llama.cpp's router erases it from its
mapping on reload, ``server_models::load_models``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from .registry import ModelEntry, Registry

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReloadPlan:
    """What a reload changes. ``registry`` the new registry (old rows first,
    in their places, then the added ones); ``removed`` the rows no source
    lists any more (every such row, not only the new ones); ``changed`` the
    rows whose configuration changed (their replicas are stale, their
    measurement is redone); ``gone`` the rows removed by this reload;
    ``new_rows`` how many rows were appended; ``added``, ``edited``,
    ``dropped`` names for the log line; ``skipped`` names that found no free
    row (the segment's model table is full)."""

    registry: Registry
    removed: set[int]
    changed: set[int] = field(default_factory=set)
    gone: set[int] = field(default_factory=set)
    new_rows: int = 0
    added: list[str] = field(default_factory=list)
    edited: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def plan_reload(old: Registry, removed: set[int], new: Registry, rows: int) -> ReloadPlan:
    """Merge registry ``new`` (every model the sources list now) into
    ``old`` (the running registry, whose rows in ``removed`` are models
    already gone) for a segment of ``rows`` model rows.

    A model of ``new`` takes its old row when ``old`` has its name (a
    removed one comes back), else a new row at the end; an old model that
    ``new`` lacks is removed (its row kept). Entries equal but for their
    ``source`` are not a change. Raises ``ValueError`` when the merged
    registry is not valid (two live models claiming one alias); ``old``,
    ``removed`` and ``new`` are never modified.
    """
    entries: list[ModelEntry] = list(old.entries)
    plan = ReloadPlan(registry=old, removed=set(removed))
    seen: set[int] = set()
    for e in new.entries:
        i = old.by_name.get(e.name)
        if i is None:
            if len(entries) >= rows:
                plan.skipped.append(e.name)
                continue
            entries.append(e)
            plan.new_rows += 1
            plan.added.append(e.name)
            seen.add(len(entries) - 1)
            continue
        seen.add(i)
        if i in plan.removed:
            plan.removed.discard(i)
            plan.added.append(e.name)
        if not same_config(e, entries[i]):
            entries[i] = e
            plan.changed.add(i)
            plan.edited.append(e.name)
    for i, e in enumerate(entries):
        if i not in seen and i not in plan.removed:
            plan.removed.add(i)
            plan.gone.add(i)
            plan.dropped.append(e.name)
    plan.registry = Registry(entries, removed=plan.removed)
    return plan


def same_config(a: ModelEntry, b: ModelEntry) -> bool:
    """Entries equal but for where they were read (a preset edit shifts the
    line numbers of every later section)."""
    return dataclasses.replace(a, source="") == dataclasses.replace(b, source="")
