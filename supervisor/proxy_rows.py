"""The supervisor's reading of the rows the proxies write (issue 37, item 14).

A proxy is the single writer of its own rows of ``counters`` and
``waiters`` (DESIGN.md "Shared memory"); the supervisor only sums and maxes
them. Anything in those rows came from another process, so the supervisor
trusts no value of them as an index or a bound: a bug in a proxy, or a
local user scribbling over the segment, must not stop the server (random
bytes over the segment made :mod:`.reconcile` index past its models and
raise ``IndexError``). Every reader here:

* reads only the part of a table that names something the supervisor
  knows (``n_models`` registered models; the replica axis is the
  supervisor's own size), never an index taken from a row;
* treats a value outside its range (a negative or absurd count, a time
  before boot or after now) as a bad cell: that cell counts as zero (no
  waiter, nothing in flight, never used) and the first bad cell of each
  kind is logged, then at most once per :data:`LOG_EVERY_S`.

Shapes: ``counters`` [proxies, replicas, C_WORDS], ``waiters``
[proxies, models, W_WORDS], int64. Times are monotonic ns.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..shm import layout as L

log = logging.getLogger(__name__)

MAX_COUNT = 1 << 24
"""The largest waiter or in-flight count one proxy's cell may hold; more
requests than this in one process is a corrupt row, not load."""

CLOCK_SLACK_NS = 1_000_000_000
"""How far past the supervisor's ``now`` a proxy-written time may be (the
clock is shared: any later value is corrupt; a second of slack)."""

LOG_EVERY_S = 60.0
"""At most one log line per kind of bad cell this often (seconds)."""

_last_logged: dict[str, float] = {}


def _report(what: str, bad: np.ndarray, values: np.ndarray) -> None:
    """Log (rate-limited per ``what``) that ``bad`` cells of ``values``
    were ignored."""
    now = time.monotonic()
    if now - _last_logged.get(what, -LOG_EVERY_S) < LOG_EVERY_S:
        return
    _last_logged[what] = now
    where = np.argwhere(bad)[0]
    log.warning("ignoring %d bad %s cell(s) in the proxies' shared-memory rows "
                "(first: proxy %d, index %d, value %d); a proxy bug or a corrupt segment",
                int(bad.sum()), what, int(where[0]), int(where[1]), int(values[tuple(where)]))


def _counts(values: np.ndarray, what: str) -> np.ndarray:
    """``values`` with cells outside 0..MAX_COUNT set to 0."""
    bad = (values < 0) | (values > MAX_COUNT)
    if bad.any():
        _report(what, bad, values)
        return np.where(bad, 0, values)
    return values


def _times(values: np.ndarray, now_ns: int, what: str) -> np.ndarray:
    """``values`` with times below 0 or after ``now_ns`` + slack set to 0."""
    bad = (values < 0) | (values > now_ns + CLOCK_SLACK_NS)
    if bad.any():
        _report(what, bad, values)
        return np.where(bad, 0, values)
    return values


def demand(waiters: np.ndarray, n_models: int, now_ns: int | None = None
           ) -> tuple[np.ndarray, np.ndarray]:
    """Waiting requests per model (summed over proxies) and the earliest
    wait start per model (int64 max when none), both of length ``n_models``
    (models beyond the registered ones are not read). A cell with a bad
    count or time counts as no waiter."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    w = waiters[:, :n_models]
    raw_counts = w[:, :, L.W_COUNT]
    raw_first = w[:, :, L.W_FIRST_NS]
    counts = _counts(raw_counts, "waiter count")
    first = _times(raw_first, now, "waiter time")
    ok = (counts == raw_counts) & (first == raw_first)
    counts = np.where(ok, counts, 0)
    big = np.iinfo(np.int64).max
    first = np.where(ok & (first > 0), first, big).min(axis=0)
    out = np.zeros(n_models, dtype=np.int64)
    out[:counts.shape[1]] = counts.sum(axis=0)
    earliest = np.full(n_models, big, dtype=np.int64)
    earliest[:first.shape[0]] = first
    return out, earliest


def in_flight(counters: np.ndarray) -> np.ndarray:
    """Requests in flight per replica slot, summed over proxies (bad cells:
    0); shape [replicas]."""
    return _counts(counters[:, :, L.C_IN_FLIGHT], "in-flight count").sum(axis=0)


def last_used(counters: np.ndarray, now_ns: int | None = None) -> np.ndarray:
    """When each replica slot last began or ended a request (max over
    proxies; bad cells: 0, never used), monotonic ns; shape [replicas]."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    return _times(counters[:, :, L.C_LAST_USED_NS], now, "last-used time").max(axis=0)
