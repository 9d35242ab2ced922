"""Spare instances: processes started and imported ahead of a load.

A spare is ``python -m ggmux.instance --spare`` with its listening socket;
a load hands it the model with one ``load {json}`` line instead of
starting a process (the imports take about half a second of CPU). A
spare starts at the loads' lower CPU priority (``--load-nice``: its imports
are load work done ahead), and keeps it until the load it takes is ready.
"""

from __future__ import annotations

import logging
import os
import time

import orjson

from ..shm import layout as L
from .children import Child, ChildSet, OnLine
from .registry import ModelEntry
from .state import NS, State

log = logging.getLogger(__name__)


class Spares:
    """The spare pool: ``pool`` holds ``(child, port)`` pairs waiting for a
    ``load``. Their stdout lines go to ``on_line`` (the replicas' handler,
    which ignores a spare until it is a replica). ``load_nice``: how much a
    spare's nice value is raised at its start (0: not); ``nice``: pid ->
    the nice value to give a spare back once the load it took is ready."""

    def __init__(self, state: State, children: ChildSet, on_line: OnLine) -> None:
        self.state = state
        self.children = children
        self.on_line = on_line
        self.pool: list[tuple[Child, int]] = []
        self.load_nice = 0
        self.nice: dict[int, int] = {}

    def take(self, entry: ModelEntry, tag: str, slot: int,
             secret: str = "") -> tuple[Child, int] | None:
        """A spare told to load ``entry`` into replica ``slot``, retagged
        ``tag``, with its port; ``None`` when no spare fits or none is left
        alive. ``secret``: the instance's, in the ``load`` line (its stdin
        is private)."""
        # a spare was started before its model was known: a model with its own
        # `env` needs a process started with it
        while self.pool and entry.kind in ("llama", "fake") and not entry.env:
            spare, port = self.pool.pop(0)
            line = orjson.dumps({
                "model": entry.path, "name": entry.name, "ctx_size": entry.ctx_size,
                "threads": entry.threads, "n_gpu_layers": entry.n_gpu_layers,
                "kv_size": entry.kv_size, "stop_timeout": entry.stop_timeout,
                "fake": entry.kind == "fake", "mmproj": entry.mmproj,
                "llama_args": entry.extra_args, "instance_args": entry.instance_args,
                "slot": slot, "secret": secret,
            })
            if spare.proc.poll() is None and spare.send(b"load " + line + b"\n"):
                spare.tag = tag
                return spare, port
        return None

    def step(self) -> None:
        """Keep ``spares`` instance processes started and imported, but start
        one only while nothing loads: on a small machine a spare's imports
        would slow the load it is meant to speed up."""
        st = self.state
        if len(self.pool) >= st.cfg.spares or st.stopping_all:
            return
        if any(r.status == L.ReplicaStatus.LOADING for r in st.replicas.values()):
            return
        # nor right after a load while requests are served (the one that caused
        # the load among them): a spare's imports (~0.5 s of CPU) would delay
        # their first tokens
        since = time.monotonic_ns() - max((m.last_ready_ns for m in st.models), default=0)
        busy = bool(st.in_flight().any())
        if since < st.cfg.spare_delay * NS and (busy or since < NS // 4):
            return
        if not any(e.kind in ("llama", "fake") for e in st.registry.entries):
            return
        argv = [st.python, "-m", "ggmux.instance", "--spare", "--fd", "-1"]
        child, port = self.children.start_with_socket(argv, "spare", on_line=self.on_line,
                                                      nice=self.load_nice)
        self.pool.append((child, port))
        if self.load_nice:
            self.nice[child.pid] = os.getpriority(os.PRIO_PROCESS, 0)  # ours: its before

    def reap(self) -> None:
        """Forget spares that exited."""
        for spare in list(self.pool):
            code = self.children.reap(spare[0])
            if code is not None:
                self.pool.remove(spare)
                self.nice.pop(spare[0].pid, None)
                if not self.state.stopping_all:
                    log.warning("spare instance exited with code %s", code)

    def close(self) -> None:
        """EOF to every spare: they exit (reaped by :meth:`reap`)."""
        for c, _ in self.pool:
            c.close_stdin()
