"""Seqlocked rows in int64 numpy tables (single writer, many readers).

Protocol (the Linux kernel's seqcount, one writer per row):

* writer: make the row's sequence word (column 0) odd, write the row, make it
  even again;
* reader: read the sequence word, copy the row, read the word again; accept
  only when both reads agree and are even, else retry.

Ordering: every value is an aligned 8-byte word, and each numpy assignment
below is a separate call, so on x86-64 (TSO: stores are seen in program
order, loads are not reordered with older loads) a reader that sees an even,
unchanged sequence word has seen a whole row. aarch64 may reorder plain
stores and loads; numpy offers no barrier, so there :func:`fence` makes a
system call between the sequence stores and the data stores (and between a
reader's loads), relying on the kernel entry being serialising. That is an
assumption, checked only by ``tests/test_seqlock_stress.py`` on whatever
machine runs the suite; a C barrier would be the proper fix on aarch64.

A reader that keeps finding the row busy gives up after ``retries`` tries and
raises :class:`SeqlockBusy`, so a writer that died mid-write (odd word left)
cannot hang a reader.
"""

from __future__ import annotations

import os
import platform

import numpy as np

NEEDS_FENCE = platform.machine().lower() in ("aarch64", "arm64")
"""Whether :func:`fence` does anything here (hot paths test it before calling)."""

DEFAULT_RETRIES = 10_000
SPIN_BEFORE_YIELD = 64


class SeqlockBusy(RuntimeError):
    """A seqlocked row stayed odd or kept changing for every retry."""


def fence() -> None:
    """Full memory barrier where plain numpy stores may be reordered."""
    if NEEDS_FENCE:
        os.sched_yield()


def write_row(table: np.ndarray, i: int, values: np.ndarray | list[int]) -> None:
    """Replace row ``i`` (all columns after the sequence word) atomically.

    ``values`` has ``table.shape[1] - 1`` int64 values.
    """
    row = table[i]
    row[0] += 1
    fence()
    row[1:] = values
    fence()
    row[0] += 1


def write_fields(table: np.ndarray, i: int, fields: dict[int, int]) -> None:
    """Set some columns of row ``i`` atomically (``{column: value}``)."""
    row = table[i]
    row[0] += 1
    fence()
    for col, val in fields.items():
        row[col] = val
    fence()
    row[0] += 1


def read_row(table: np.ndarray, i: int, retries: int = DEFAULT_RETRIES) -> np.ndarray:
    """A consistent copy of row ``i`` (1-D int64, sequence word included).

    Spins, then yields the CPU between tries (on a busy machine the writer
    may be preempted while the word is odd). Raises :class:`SeqlockBusy`
    after ``retries`` failed tries.
    """
    row = table[i]
    for n in range(retries):
        s1 = int(row[0])
        if s1 & 1:
            if n >= SPIN_BEFORE_YIELD:
                os.sched_yield()  # the writer may have been preempted mid-write
            continue
        fence()
        data = row.copy()
        fence()
        if int(row[0]) == s1 and int(data[0]) == s1:
            return data
    raise SeqlockBusy(f"row {i} stayed busy for {retries} reads")


def read_table(table: np.ndarray, retries: int = DEFAULT_RETRIES) -> np.ndarray:
    """A consistent copy of every row (each row consistent on its own).

    Vectorised: one copy of the whole table, then per-row retries only for
    rows that were being written. Raises :class:`SeqlockBusy` as
    :func:`read_row` does.
    """
    s1 = table[:, 0].copy()
    fence()
    data = table.copy()
    fence()
    s2 = table[:, 0]
    bad = ((s1 & 1) != 0) | (s1 != s2) | (data[:, 0] != s1)
    if bad.any():
        for i in np.flatnonzero(bad):
            data[i] = read_row(table, int(i), retries)
    return data
