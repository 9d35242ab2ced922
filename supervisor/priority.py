"""The CPU priority of loading replicas (issue 31, item 11).

A load competes with the replicas that serve: on 2 cores a 1-token request
to a loaded model took 26 ms alone and up to 950 ms while another model
loaded (the new process's interpreter start, imports, weight reading and
repacking take whole cores, and a decode whose threads lose their core
waits at every barrier). So a replica loads at a lower priority: its nice
value is raised by ``--load-nice`` (default :data:`LOAD_NICE`) from its
start (:meth:`~.children.ChildSet.start` raises it in the child before the
exec, so what the child starts inherits it; an existing process, a spare
taking a model or a replica waking, gets :func:`lower`), and is given back
to it and to every process it started once it is ready (:func:`give_back`),
as a shell's ``nice`` would do by hand, but only for the load. Linux keeps
a nice value per thread: every thread is set.

Giving a nice value back (lowering it) needs ``CAP_SYS_NICE`` or a
``RLIMIT_NICE`` that allows it (``ulimit -e``; ``LimitNICE=`` of a systemd
unit); without either a lowered replica would serve at the lower priority
for good, so :func:`usable_nice` turns the mechanism off (logged once).
"""

from __future__ import annotations

import logging
import os
import resource

log = logging.getLogger(__name__)

LOAD_NICE = 10
"""How much a loading replica's nice value is raised by default: CFS then
gives it about a tenth of a core's share against a serving thread at 0."""

_CAP_SYS_NICE = 23  # linux/capability.h


def _tasks(pid: int) -> list[int]:
    """The thread ids of process ``pid`` (empty when it is gone)."""
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return []


def _family(pid: int) -> list[int]:
    """``pid`` and every process descended from it (a ``cmd`` line that runs
    a wrapper, whose server is its child: children inherit the value)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    data = f.read()
                parent[int(entry)] = int(data[data.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    family, grew = {pid}, True
    while grew:
        more = {p for p, pp in parent.items() if pp in family} - family
        family |= more
        grew = bool(more)
    return sorted(family)


def _has_cap_sys_nice() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        pass
    return False


def can_give_back(nice: int) -> bool:
    """Whether this process may set another process's (or its own) nice
    value back down to ``nice`` (-20..19): root, ``CAP_SYS_NICE``, or a
    ``RLIMIT_NICE`` of at least ``20 - nice`` (the soft limit is raised to
    the hard one when that is enough; children inherit it)."""
    if os.geteuid() == 0 or _has_cap_sys_nice():
        return True
    need = 20 - nice
    soft, hard = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return True
    if hard == resource.RLIM_INFINITY or hard >= need:
        try:
            resource.setrlimit(resource.RLIMIT_NICE, (need, hard))
            return True
        except (ValueError, OSError):
            return False
    return False


def usable_nice(load_nice: int) -> int:
    """``load_nice`` when loads can be lowered by it and given their
    priority back (:func:`can_give_back` for this process's own nice
    value), else 0 with one log line saying why."""
    if load_nice <= 0:
        return 0
    if can_give_back(os.getpriority(os.PRIO_PROCESS, 0)):
        return load_nice
    log.info("loads run at the serving priority (--load-nice %d unused): giving a replica "
             "its priority back needs CAP_SYS_NICE or RLIMIT_NICE (ulimit -e) of 20",
             load_nice)
    return 0


def lower(pid: int, by: int) -> int | None:
    """Raise the nice value of every thread of process ``pid`` by ``by``
    (capped at 19). Returns the nice value to give back with
    :func:`give_back` (the process's main thread's before), or None when
    nothing was changed (``by`` 0, the process gone, or refused)."""
    if by <= 0:
        return None
    try:
        before = os.getpriority(os.PRIO_PROCESS, pid)
    except OSError:
        return None
    to = min(19, before + by)
    if to == before:
        return None
    for _ in range(2):  # a thread started while the first pass ran inherits either value
        for tid in _tasks(pid):
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) < to:
                    os.setpriority(os.PRIO_PROCESS, tid, to)
            except OSError:  # the thread ended meanwhile
                pass
    return before


def give_back(pid: int, nice: int) -> None:
    """Set every thread of process ``pid`` and of its descendants whose nice
    value is above ``nice`` (what :func:`lower` returned) back to ``nice``;
    a process gone is no error, a refusal is logged."""
    for _ in range(3):  # until no thread started meanwhile kept the lowered value
        changed = False
        for proc in _family(pid):
            for tid in _tasks(proc):
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) > nice:
                        os.setpriority(os.PRIO_PROCESS, tid, nice)
                        changed = True
                except ProcessLookupError:
                    pass
                except PermissionError as e:
                    log.warning("cannot give pid %d its CPU priority back (nice %d): %s",
                                pid, nice, e)
                    return
        if not changed:
            return
