"""Which hot-path modules run compiled, and the switch to pure Python.

The request path's modules (:data:`HOT_MODULES`: the HTTP core's request
reading and validation after httptools, its response writer, the upstream
relay with its chunked and SSE handling, the forward path's header rewrite and its accounting,
the balancer's choice and the seqlocked shm row reads) are plain Python
sources that ``setup.py`` also compiles with Cython (pure-Python mode: the
``.py`` file is the source, no ``.pyx``) when Cython and a C compiler are
present. An editable install (``pip install -e .``) puts each compiled
module (``NAME.cpython-*.so``) next to its ``.py``.

:class:`HotFinder` (installed by ``ggmux/__init__.py``) decides, for each
hot module, which of the two files is imported:

* the ``.py`` when ``GGMUX_PURE_PYTHON=1`` (the same checkout then runs
  pure Python, as the CI's second test run does);
* the ``.py`` when the compiled file is older than its source by more than
  :data:`STALE_AFTER_S` (an edit or a ``git`` checkout after the build:
  running the stale build would run code that is no longer in the tree);
  rebuild with ``pip install -e .``;
* else the compiled file, when there is one.

:func:`status` tells per module what was imported and why;
:func:`log_status` writes the one log line a process states it with at its
start (the proxy and the instance call it), a warning when any hot module
is pure Python. Standard library only: ``setup.py`` reads
:data:`HOT_MODULES` from this file before anything is installed.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import os
import sys

HOT_MODULES = (
    "ggmux.http1.request",
    "ggmux.http1.state",
    "ggmux.http1.reading",
    "ggmux.http1.response",
    "ggmux.http1.connection",
    "ggmux.http1.exchange",
    "ggmux.http1.upstream_state",
    "ggmux.http1.upstream_failure",
    "ggmux.http1.upstream",
    "ggmux.http1.heads",
    "ggmux.http1.pool",
    "ggmux.proxy.forward",
    "ggmux.proxy.accounting",
    "ggmux.proxy.balancer",
    "ggmux.proxy.passthrough",
    "ggmux.proxy.activity",
    "ggmux.http1.usage",
    "ggmux.shm.requestring",
    "ggmux.shm.seqlock",
)
"""Modules compiled by the build, by import name (``ggmux.`` is the
repository root: ``ggmux.proxy.forward`` is ``proxy/forward.py``)."""

PURE_ENV = "GGMUX_PURE_PYTHON"
"""Environment variable: ``1`` imports every hot module from its ``.py``."""

STALE_AFTER_S = 2.0
"""A compiled file counts as stale when its source is this many seconds
newer (a wheel install writes both within moments, in any order)."""

COMPILED = "compiled"


class CythonShadow:
    """What the hot modules use of Cython's pure-Python mode, for a run with no
    Cython installed (the build installs it, a run need not): the modules
    import ``cython`` and fall back on :data:`cython`, where
    ``@cython.locals(name=Type)`` (a local's C type in the compiled build)
    leaves the function as it is."""

    compiled = False

    class _CType:
        """A C type's name (``cython.longlong``), and its memoryview's
        (``cython.long[:]``: numpy's int64 rows have C long's format)."""

        def __getitem__(self, _shape):
            return self

    long = longlong = Py_ssize_t = _CType()

    @staticmethod
    def locals(**_types):
        def keep(func):
            return func
        return keep


cython = CythonShadow()
"""Stands for the ``cython`` module where Cython is not installed."""
_status: dict[str, str] = {}  # what this finder chose (also on each spec's loader_state)


def pure_requested() -> bool:
    """Whether ``GGMUX_PURE_PYTHON=1`` asks for pure Python."""
    return os.environ.get(PURE_ENV, "") == "1"


class HotFinder(importlib.abc.MetaPathFinder):
    """A meta-path finder for :data:`HOT_MODULES` only: chooses the compiled
    file or the source as the module docstring says, and records why in
    :func:`status`. Any other module is left to the normal finders."""

    def find_spec(self, fullname: str, path, target=None):
        if fullname not in HOT_MODULES or not path:
            return None
        base = fullname.rpartition(".")[2]
        for d in path:
            src = os.path.join(d, base + ".py")
            if os.path.exists(src):
                break
        else:
            return None
        ext = None
        for suffix in importlib.machinery.EXTENSION_SUFFIXES:
            p = os.path.join(d, base + suffix)
            if os.path.exists(p):
                ext = p
                break
        if ext is None:
            why = "not compiled (no build with Cython and a C compiler)"
        elif pure_requested():
            why = f"{PURE_ENV}=1"
        elif os.stat(src).st_mtime - os.stat(ext).st_mtime > STALE_AFTER_S:
            why = f"compiled file older than {base}.py (stale build: pip install -e .)"
        else:
            _status[fullname] = COMPILED
            loader = importlib.machinery.ExtensionFileLoader(fullname, ext)
            spec = importlib.machinery.ModuleSpec(fullname, loader, origin=ext)
            spec.loader_state = COMPILED
            return spec
        _status[fullname] = why
        loader = importlib.machinery.SourceFileLoader(fullname, src)
        spec = importlib.machinery.ModuleSpec(fullname, loader, origin=src)
        spec.has_location = True
        spec.loader_state = why
        return spec


def install() -> None:
    """Put :class:`HotFinder` first on ``sys.meta_path`` (once, even when
    the package is imported under a second name, as pytest may)."""
    if not any(type(f).__name__ == "HotFinder" for f in sys.meta_path):
        sys.meta_path.insert(0, HotFinder())


def is_compiled(module: object) -> bool:
    """Whether ``module`` was loaded from a compiled extension file."""
    return isinstance(getattr(module, "__loader__", None),
                      importlib.machinery.ExtensionFileLoader)


def status(names: tuple[str, ...] = HOT_MODULES) -> dict[str, str]:
    """Per hot module of ``names`` (default: all of them): ``"compiled"`` or
    why it is pure Python. Imports each first, so the answer is whole."""
    import importlib

    out = {}
    for name in names:
        spec = importlib.import_module(name).__spec__
        state = getattr(spec, "loader_state", None)
        out[name] = state if isinstance(state, str) else "imported before the finder"
    return out


def log_status(log: logging.Logger, names: tuple[str, ...] = HOT_MODULES) -> None:
    """One line saying how the hot path of ``names`` (a process passes the
    hot modules it runs; default all) runs: INFO when each is compiled, or
    naming the pure-Python ones and why (INFO; a WARNING when a build is
    stale, which a rebuild mends)."""
    st = status(names)
    pure = {n: why for n, why in st.items() if why != COMPILED}
    if not pure:
        log.info("hot path compiled (Cython): %d modules", len(st))
        return
    whys = sorted(set(pure.values()))
    level = logging.WARNING if any("stale" in w for w in whys) else logging.INFO
    log.log(level, "hot path runs pure Python for %d of %d modules (%s): %s", len(pure), len(st),
                "; ".join(whys), ", ".join(n.removeprefix("ggmux.") for n in pure))
