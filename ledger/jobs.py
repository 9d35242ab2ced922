"""The shape of the job runner the ledger's writer and sync use (the
supervisor's :class:`ggmux.supervisor.jobs.Jobs`): a ``typing.Protocol``,
so that this package, which the proxies import too, imports nothing of the
supervisor."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol


class Jobs(Protocol):
    """Runs ``fn()`` on a thread of its own and hands ``done(result)`` (the
    return value, or the exception raised) back to the caller's loop at its
    next :meth:`step`."""

    def start(self, name: str, fn: Callable[[], Any], done: Callable[[Any], None]) -> None: ...

    def step(self) -> None: ...
