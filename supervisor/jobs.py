"""Short blocking jobs off the supervisor's poll loop (issue 29).

A few things the supervisor does for the KV tiers block on I/O it does not
control: asking a ``cmd`` llama-server to save or restore its slots over
HTTP, scanning or emptying a disk tier's directory. Each runs on a
short-lived daemon thread of its own; its result is handed back to the loop
(:meth:`Jobs.step`, called every turn) and applied there, so the loop's
state is still changed only on the loop's thread. Every job that talks to a
process is bounded by a timeout of its own (``cache-save-timeout``), and
the loop never waits for a job: it goes on with its turns and, where a
job gates a step (a stop, a readiness), it has its own deadline too
(:meth:`~ggmux.supervisor.replicas.Replicas.escalate`).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Jobs:
    """Run ``fn()`` on a thread, hand ``done(result)`` back to the loop.

    ``done`` gets the function's return value, or the exception it raised
    (an ``Exception`` instance: a job's failure is its result, logged by
    whoever reads it)."""

    def __init__(self) -> None:
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.running = 0

    def start(self, name: str, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Start job ``name`` (the thread's name, for a stack dump)."""

        def run() -> None:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - handed to `done`, on the loop
                result = e
            self._done.put((done, result))

        self.running += 1
        threading.Thread(target=run, name=f"job:{name}"[:60], daemon=True).start()

    def step(self) -> None:
        """Apply the results of the jobs that finished (on the loop's thread)."""
        while True:
            try:
                done, result = self._done.get_nowait()
            except queue.Empty:
                return
            self.running -= 1
            try:
                done(result)
            except Exception:  # a bug in a callback must not end the supervisor
                log.exception("applying a job's result failed")
