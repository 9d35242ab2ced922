"""The engine's model lock: shared by the calls that read the model,
exclusive for those that load or free it (issue 37, item 1).

One mutex served both before, so a long ``llama_tokenize`` (a hostile
prompt: 124 s, item 1) held every ``submit`` behind it: no new request of
any tenant reached the engine. Readers (tokenizing, counting, submitting)
now share it; only a load, a wake, a sleep and the shutdown, which free or
replace the weights, wait for the readers to leave. A waiting writer keeps
new readers out (it is never starved), and the readers' own work is
bounded (:mod:`.tokenizing`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class ModelLock:
    """A readers-writer lock (module docstring): :meth:`shared` and
    :meth:`exclusive` are context managers; neither is re-entrant."""

    __slots__ = ("_cond", "_readers", "_waiting", "_writer")

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._waiting = 0

    @contextmanager
    def shared(self) -> Iterator[None]:
        """Held by any number of readers at once, never beside a writer."""
        with self._cond:
            while self._writer or self._waiting:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if not self._readers:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        """Held alone: waits for the readers in, keeps new ones out."""
        with self._cond:
            self._waiting += 1
            try:
                while self._writer or self._readers:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


__all__ = ["ModelLock"]
