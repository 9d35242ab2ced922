"""Why a model's requests wait (issue 34): the ``queue`` object that
``/v1/models``, ``ps``, the page and ``/metrics`` show, built from the
model's row of the models table (written by the supervisor's scheduler,
:class:`~ggmux.shm.layout.WaitReason`) and this proxy's clock. Pure
functions; no proxy state.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from ..shm import layout as L

NS = 1_000_000_000

OTHER_MODEL = "another model"
"""The holder's name as a keys-file key reads it when the key may not use
the holder: which other tenant's model holds the capacity, and when it
drains, is that tenant's business (:class:`~.keyed.KeyScope`)."""


def reason_text(reason: int, holder: str, eta_s: float | None) -> str:
    """The operator's sentence for a wait: ``reason`` a
    :class:`~ggmux.shm.layout.WaitReason`, ``holder`` the model holding the
    capacity ("" when none), ``eta_s`` seconds until it frees (None:
    unknown). "" when nothing holds the model back (it loads)."""
    R = L.WaitReason
    if reason == R.SLICE:
        if eta_s is None:
            return f"waiting for capacity held by {holder}, until it is idle (no max-wait)"
        if eta_s <= 0:
            return f"waiting for capacity held by {holder}, which drains now"
        return f"waiting for capacity held by {holder}, which drains in {eta_s:.0f} s"
    if reason == R.DRAINING:
        return (f"waiting for capacity held by {holder}, which drains: it stops once its "
                "requests in flight finish")
    if reason == R.STOPPING:
        return f"waiting for {holder or 'a stopping model'} to exit and free its memory"
    if reason == R.PINNED:
        who = ("another pinned model" if holder == OTHER_MODEL
               else f"pinned model {holder or '(all pinned)'}")
        return f"capacity held by {who}, never evicted: unload it or raise --models-max"
    if reason == R.QUEUED:
        return f"queued behind {holder}, which loads first" if holder else "queued"
    return ""


def queue_status(row, name_of: Callable[[int], str], now_ns: int | None = None) -> dict | None:
    """The ``queue`` object of a model from its models-table ``row``:
    ``waiters`` (requests waiting, all proxies), ``oldest_wait_s``,
    ``reason`` (:class:`~ggmux.shm.layout.WaitReason` name), ``holder``
    (the model holding the capacity, or None), ``eta_s`` (seconds until it
    frees, or None) and ``why`` (:func:`reason_text`); None when nobody
    waits. ``name_of(i)``: model ``i``'s name."""
    waiters = int(row[L.M_WAITERS])
    first = int(row[L.M_WAIT_FIRST_NS])
    if waiters <= 0 and not first:
        return None
    now = time.monotonic_ns() if now_ns is None else now_ns
    reason = int(row[L.M_WAIT_REASON])
    h = int(row[L.M_WAIT_HOLDER]) - 1
    holder = name_of(h) if h >= 0 else ""
    eta_ns = int(row[L.M_WAIT_ETA_NS])
    eta = round((eta_ns - now) / NS, 1) if eta_ns else None
    names = L.WaitReason.NAMES
    return {
        "waiters": waiters,
        "oldest_wait_s": round(max(0, now - first) / NS, 1) if first else 0.0,
        "reason": names[reason] if 0 <= reason < len(names) else "none",
        "holder": holder or None,
        "eta_s": eta,
        "why": reason_text(reason, holder, eta),
    }
