"""The supervisor's side of the log ring: every log line, its own and its children's, tagged.

:class:`RingHandler` is a ``logging.Handler`` on the ``ggmux`` logger of
the supervisor process. It turns each record into one JSON line of the log
ring (:mod:`ggmux.shm.logring`) that the proxies serve as ``GET /logs``::

    {"ts": 1733040000.123, "level": "INFO", "src": "supervisor" | CHILD_TAG,
     "model": NAME | null, "replica": SLOT | null, "msg": "..."}

A child's stderr line is logged by the supervisor with ``extra={"child":
tag, "line": text}`` (see :mod:`.children`); its tag says whose it is: ``NAME#SLOT`` an
instance (model NAME, replica SLOT), ``measure:NAME``, ``spare``,
``proxy-N`` (:func:`tag_fields`). Records logged before the ring exists
(start-up) are kept, up to :data:`EARLY_RECORDS`, and written when it is
opened.
"""

from __future__ import annotations

import logging
import re
from collections import deque

import orjson

from ..shm.logring import MAX_RECORD, LogRing, escape_controls

EARLY_RECORDS = 1000  # start-up lines kept until the ring exists
MAX_MESSAGE_CHARS = 2000  # longer lines are cut (a record is at most MAX_RECORD bytes)

_LEVEL = re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL)\b[: ]\s*")


def tag_fields(tag: str) -> tuple[str | None, int | None]:
    """``(model, replica)`` of a child's tag: ``NAME#SLOT`` an instance,
    ``measure:NAME`` a measure child; ``(None, None)`` for the others."""
    name, sep, slot = tag.rpartition("#")
    if sep and slot.isdigit() and name:
        return name, int(slot)
    if tag.startswith("measure:"):
        return tag[len("measure:"):], None
    return None, None


def child_level(line: str) -> tuple[int, str]:
    """``(level, rest)`` of a child's stderr line that starts with a level
    name (``WARNING ggmux.instance: ...``, Python logging's default shape);
    INFO and the whole line otherwise."""
    m = _LEVEL.match(line)
    if m is None:
        return logging.INFO, line
    return logging.getLevelName(m.group(1)), line[m.end():]


class RingHandler(logging.Handler):
    """Writes log records into a :class:`LogRing` once :meth:`open` gave one;
    before that, keeps the last :data:`EARLY_RECORDS` of them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.ring: LogRing | None = None
        self.early: deque[bytes] = deque(maxlen=EARLY_RECORDS)

    def open(self, name: str, capacity: int) -> LogRing:
        """Create the ring ``name`` of ``capacity`` bytes and write the
        start-up records into it."""
        self.ring = LogRing.create(name, capacity)
        while self.early:
            self.ring.append(self.early.popleft())
        return self.ring

    def close_ring(self) -> None:
        """Remove the ring (at the supervisor's exit); later records are dropped."""
        ring, self.ring = self.ring, None
        if ring is not None:
            ring.unlink()
            ring.close()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            payload = self.payload(record)
            if self.ring is not None:
                self.ring.append(payload)
            else:
                self.early.append(payload)
        except Exception:  # noqa: BLE001 - logging must never raise into the loop
            self.handleError(record)

    @staticmethod
    def payload(record: logging.LogRecord) -> bytes:
        """The JSON record of ``record``: its message (and exception) as one
        line through :func:`~ggmux.shm.logring.escape_controls`, cut to fit
        a ring record."""
        tag = getattr(record, "child", None)
        msg = record.getMessage() if tag is None else str(getattr(record, "line", ""))
        if record.exc_info and tag is None:
            msg += "\n" + logging.Formatter().formatException(record.exc_info)
        # one line, no raw control character (issue 31, item 3): a child's
        # line was escaped when it was read, the supervisor's own here
        msg = escape_controls(msg)
        tag = escape_controls(tag) if tag else tag
        if len(msg) > MAX_MESSAGE_CHARS:
            msg = msg[:MAX_MESSAGE_CHARS] + " [...]"
        model, replica = tag_fields(tag) if tag else (None, None)
        data = orjson.dumps({"ts": round(record.created, 3), "level": record.levelname,
                             "src": tag or "supervisor", "model": model, "replica": replica,
                             "msg": msg})
        if len(data) + 4 > MAX_RECORD:  # many multi-byte characters
            data = orjson.dumps({"ts": round(record.created, 3), "level": record.levelname,
                                 "src": tag or "supervisor", "model": model,
                                 "replica": replica, "msg": msg[: MAX_MESSAGE_CHARS // 4]})
        return data


_handler: RingHandler | None = None


def install() -> RingHandler:
    """The process's :class:`RingHandler` on the ``ggmux`` logger (added once)."""
    global _handler
    if _handler is None:
        _handler = RingHandler()
        logging.getLogger("ggmux").addHandler(_handler)
    return _handler
