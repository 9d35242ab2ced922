"""Measuring models: a ``measure`` child per model reports the memory a
load needs (``state:{"state": "measured", "min": {...}, "max": {...},
"chat_template": bool}``, bytes per device; whether the model has a chat
template) before the model is first loaded.
"""

from __future__ import annotations

import logging

from .children import Child, ChildSet, state_line
from .memory import fmt
from .registry import env_for_instance, instance_argv
from .state import State

log = logging.getLogger(__name__)


class Measurer:
    """Runs up to ``measure_concurrency`` measure children (``measuring``:
    model -> child) and records their reports in ``state.models``."""

    def __init__(self, state: State, children: ChildSet) -> None:
        self.state = state
        self.children = children
        self.measuring: dict[int, Child] = {}  # model -> measure child

    def step(self) -> None:
        """Keep up to ``measure_concurrency`` measure children running,
        wanted models first."""
        st = self.state
        if len(self.measuring) >= st.cfg.measure_concurrency:
            return
        pending = [i for i, m in enumerate(st.models) if m.measure == "pending"
                   and st.registry.entries[i].kind in ("llama", "fake")]
        if not pending:
            return
        counts, _ = st.demand()
        pending.sort(key=lambda i: (-int(counts[i]) - (st.models[i].requested_ns > 0), i))
        for i in pending[: st.cfg.measure_concurrency - len(self.measuring)]:
            self._spawn(i)

    def _spawn(self, model: int) -> None:
        """Start a ``measure`` child: it reports the model's min/max memory."""
        st = self.state
        entry = st.registry.entries[model]
        argv = instance_argv(entry, -1, st.python)
        i = argv.index("--fd")
        del argv[i : i + 2]
        argv.append("--measure")
        self.measuring[model] = self.children.start(argv, f"measure:{entry.name}",
                                                    on_line=self._on_line,
                                                    env=env_for_instance(entry))
        st.models[model].measure = "running"

    def _on_line(self, child: Child, line: bytes) -> None:
        msg = state_line(child, line)
        if msg is None:
            return
        m = next((i for i, c in self.measuring.items() if c is child), None)
        if m is not None and msg.get("state") == "measured":
            rt = self.state.models[m]
            rt.mem_min = {k: int(v) for k, v in (msg.get("min") or {}).items()}
            rt.mem_max = {k: int(v) for k, v in (msg.get("max") or {}).items()}
            if isinstance(msg.get("chat_template"), bool):
                rt.chat_template = msg["chat_template"]
                self.state.errors_dirty = True  # the registry blob says it (/v1/models)
            rt.measure = "done"
            log.info("measured %s: min %s, max %s", self.state.name(m), fmt(rt.mem_min),
                     fmt(rt.mem_max))
            self.state.dirty = True

    def reap(self) -> None:
        """Forget measure children that exited; one that exited without a
        report marks its model unmeasurable (loads skip the memory check)."""
        for m, child in list(self.measuring.items()):
            code = self.children.reap(child)
            if code is None:
                continue
            del self.measuring[m]
            rt = self.state.models[m]
            if rt.measure != "done" and self.state.stopping_all:
                rt.measure = "pending"  # ended by the stop, not a failure (issue 15)
            elif rt.measure != "done":
                rt.measure = "failed"
                log.warning("could not measure %s (exit code %s): its loads skip the memory "
                            "check", self.state.name(m), code)

    def close(self) -> None:
        """EOF to every measure child: they exit (reaped by :meth:`reap`)."""
        for c in self.measuring.values():
            c.close_stdin()
