"""Measuring models: a ``measure`` child per model reports the memory a
load needs (``state:{"state": "measured", "min": {...}, "max": {...},
"chat_template": bool}``, bytes per device; whether the model has a chat
template) before the model is first loaded.

Each GGUF is measured once: reports are cached by :func:`measure_key` (the
files' path, size and mtime, and the options that change what a load
takes), so many preset sections on one file, or an edit of an option that
does not change memory (``ttl``, ``alias``, ...), cost one measure child,
not one each. The cache lives in the :class:`Measurer`, which a reload
keeps; a reload measures again a model whose file was touched since
(:meth:`Measurer.recheck`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from .children import Child, ChildSet, state_line
from .gguf_files import gguf_parts
from .memory import Amounts, fmt
from .registry import ModelEntry, env_for_instance, instance_argv
from .state import ModelRuntime, State

log = logging.getLogger(__name__)

MeasureKey = tuple  # see measure_key


def measure_key(entry: ModelEntry) -> MeasureKey:
    """What a measure of ``entry`` depends on: each file it reads (every
    part of a split GGUF, the projector) as ``(path, size, mtime_ns)``
    (``None`` for one that cannot be stat'ed), and the options that change
    a load's memory: kind, ``ctx-size``, ``kv-size``, ``n-gpu-layers``, the
    llama.cpp options (``parallel``, cache types, ... come there) and the
    instance's environment (``CUDA_VISIBLE_DEVICES``). Name, aliases,
    ``threads``, ``ttl`` and the other scheduling keys are left out."""
    files = [*gguf_parts(entry.path), *([entry.mmproj] if entry.mmproj else [])]
    stats = []
    for f in files:
        try:
            s = os.stat(f)
            stats.append((os.path.abspath(f), s.st_size, s.st_mtime_ns))
        except OSError:
            stats.append((os.path.abspath(f), None))
    return (entry.kind, tuple(stats), entry.ctx_size, entry.kv_size, entry.n_gpu_layers,
            tuple(entry.extra_args), tuple(sorted(entry.env.items())))


@dataclass(slots=True)
class Measured:
    """One cached report: bytes per device and whether the GGUF has a chat
    template (``None``: not reported), or ``failed`` (the measure child
    exited without one) with both amounts ``None``."""

    min: Amounts | None
    max: Amounts | None
    source: str  # the model whose measure child reported it
    chat_template: bool | None = None
    modalities: dict | None = None  # its projector reads: {"vision": bool, "audio": bool}

    @property
    def failed(self) -> bool:
        return self.min is None


class Measurer:
    """Runs up to ``measure_concurrency`` measure children (``measuring``:
    model -> child) and records their reports in ``state.models``;
    ``cache``: :func:`measure_key` -> :class:`Measured`, ``key_of``: model
    -> the key its figures (or its running child) came from."""

    def __init__(self, state: State, children: ChildSet) -> None:
        self.state = state
        self.children = children
        self.measuring: dict[int, Child] = {}  # model -> measure child
        self.cache: dict[MeasureKey, Measured] = {}
        self.key_of: dict[int, MeasureKey] = {}

    def step(self) -> None:
        """Settle pending models from the cache; keep up to
        ``measure_concurrency`` measure children running for the others,
        wanted models first and one child per key (a model whose key is
        being measured waits for that report)."""
        st = self.state
        # a model whose child still runs (a reload reset it meanwhile) waits for it
        pending = [i for i, m in enumerate(st.models) if m.measure == "pending"
                   and i not in st.removed and i not in self.measuring
                   and st.registry.entries[i].kind in ("llama", "fake")]
        if not pending:
            return
        running = {self.key_of[m] for m in self.measuring}
        fresh: dict[MeasureKey, list[int]] = {}
        for i in pending:
            key = measure_key(st.registry.entries[i])
            if key in self.cache:
                self._settle(i, key, self.cache[key])
            elif key not in running:
                fresh.setdefault(key, []).append(i)
        room = st.cfg.measure_concurrency - len(self.measuring)
        if room <= 0 or not fresh:
            return
        counts, _ = st.demand()

        def rank(i: int) -> tuple:
            return (-int(counts[i]) - (st.models[i].requested_ns > 0), i)

        firsts = sorted((min(ms, key=rank) for ms in fresh.values()), key=rank)
        for i in firsts[:room]:
            self._spawn(i, measure_key(st.registry.entries[i]))

    def recheck(self) -> None:
        """After a reload: a measured model whose key changed (its file
        touched or replaced, an option that changes memory edited) is
        measured again (from the cache when that key is there); cached
        reports no current model can use are dropped."""
        st = self.state
        live: set[MeasureKey] = {self.key_of[m] for m in self.measuring}
        for i, e in enumerate(st.registry.entries):
            if i in st.removed or e.kind not in ("llama", "fake"):
                continue
            key = measure_key(e)
            live.add(key)
            rt = st.models[i]
            if rt.measure in ("done", "failed") and self.key_of.get(i) != key:
                rt.measure = "pending"
                rt.mem_min = rt.mem_max = None
                st.dirty = True
        self.cache = {k: v for k, v in self.cache.items() if k in live}

    def _settle(self, model: int, key: MeasureKey, got: Measured) -> None:
        """Give ``model`` the cached report ``got``."""
        st = self.state
        rt = st.models[model]
        self.key_of[model] = key
        st.dirty = True
        if got.failed:
            rt.measure = "failed"
            log.warning("could not measure %s (the same files and options as %s, whose "
                        "measure failed): its loads skip the memory check", st.name(model),
                        got.source)
            return
        self._record(rt, got)
        log.info("measured %s: min %s, max %s (the same files and options as %s)",
                 st.name(model), fmt(rt.mem_min), fmt(rt.mem_max), got.source)

    def _record(self, rt: ModelRuntime, got: Measured) -> None:
        """``got``'s figures into model runtime ``rt``: measured."""
        rt.mem_min, rt.mem_max = dict(got.min), dict(got.max or {})
        if got.chat_template is not None:
            rt.chat_template = got.chat_template
            self.state.errors_dirty = True  # the registry blob says it (/v1/models)
        if got.modalities is not None:
            rt.modalities = got.modalities
            self.state.errors_dirty = True
        rt.measure = "done"

    def _spawn(self, model: int, key: MeasureKey) -> None:
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
        self.key_of[model] = key
        st.models[model].measure = "running"

    def _on_line(self, child: Child, line: bytes) -> None:
        msg = state_line(child, line)
        if msg is None:
            return
        m = next((i for i, c in self.measuring.items() if c is child), None)
        if m is None or msg.get("state") != "measured":
            return
        tmpl = msg.get("chat_template")
        mods = msg.get("modalities")
        got = Measured({k: int(v) for k, v in (msg.get("min") or {}).items()},
                       {k: int(v) for k, v in (msg.get("max") or {}).items()},
                       self.state.name(m), tmpl if isinstance(tmpl, bool) else None,
                       {k: bool(mods.get(k)) for k in ("vision", "audio")}
                       if isinstance(mods, dict) else None)
        self.cache[self.key_of[m]] = got
        rt = self.state.models[m]
        if rt.measure != "running":
            return  # a reload reset the model meanwhile: step() looks at its key again
        self._record(rt, got)
        log.info("measured %s: min %s, max %s", self.state.name(m), fmt(rt.mem_min),
                 fmt(rt.mem_max))
        self.state.dirty = True

    def reap(self) -> None:
        """Forget measure children that exited; one that exited without a
        report marks its model (and every model with its key) unmeasurable:
        their loads skip the memory check."""
        for m, child in list(self.measuring.items()):
            code = self.children.reap(child)
            if code is None:
                continue
            del self.measuring[m]
            rt = self.state.models[m]
            key = self.key_of[m]
            if key in self.cache:
                continue  # it reported
            if self.state.stopping_all:
                if rt.measure == "running":
                    rt.measure = "pending"  # ended by the stop, not a failure
                continue
            self.cache[key] = Measured(None, None, self.state.name(m))
            if rt.measure == "running":
                rt.measure = "failed"
                self.state.dirty = True
                log.warning("could not measure %s (exit code %s): its loads skip the memory "
                            "check", self.state.name(m), code)

    def close(self) -> None:
        """EOF to every measure child: they exit (reaped by :meth:`reap`)."""
        for c in self.measuring.values():
            c.close_stdin()
