"""The compiled hot path (issue 21): which build runs, and the switch.

``compiled.py`` decides per hot module whether its Cython build or its
``.py`` is imported. In CI (``GGMUX_EXPECT_COMPILED=1``, set by
``.ci/run`` after README's install, which compiles) every hot module must
be the compiled one, so a build that silently fell back to pure Python
fails here; ``GGMUX_PURE_PYTHON=1`` must give pure Python and say so.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import subprocess
import sys
import time

import pytest
from ggmux import compiled

EXPECT = os.environ.get("GGMUX_EXPECT_COMPILED", "") == "1"


def _ext_file(name: str) -> str | None:
    mod = importlib.import_module(name)
    base = os.path.splitext(os.path.basename(mod.__file__))[0].split(".")[0]
    d = os.path.dirname(mod.__file__)
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = os.path.join(d, base + suffix)
        if os.path.exists(p):
            return p
    return None


def test_hot_modules_run_compiled_where_built():
    """Every hot module with a build next to its source runs that build
    (unless pure Python was asked for); with GGMUX_EXPECT_COMPILED=1 every
    hot module must have one: a build that fell back silently fails."""
    st = compiled.status()
    built = {n: _ext_file(n) for n in compiled.HOT_MODULES}
    if EXPECT:
        assert not compiled.pure_requested()
        missing = [n for n, p in built.items() if p is None]
        assert not missing, f"no compiled build of {missing}"
    elif not any(built.values()):
        pytest.skip("no compiled build in this checkout (pip install -e . with Cython and cc)")
    for name, path in built.items():
        mod = importlib.import_module(name)
        if path is None or compiled.pure_requested():
            assert not compiled.is_compiled(mod), name
            continue
        if "stale" in st[name]:
            assert not EXPECT, f"{name}: {st[name]}"
            continue
        assert st[name] == compiled.COMPILED, f"{name}: {st[name]}"
        assert compiled.is_compiled(mod) and mod.__file__ == path, name


def test_pure_python_switch_imports_sources_and_logs_it():
    """GGMUX_PURE_PYTHON=1: every hot module is its .py, and the line the
    proxy and the instance log at their start says so and why."""
    code = (
        "import logging, sys\n"
        "logging.basicConfig(stream=sys.stderr, level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from ggmux import compiled\n"
        "compiled.log_status(logging.getLogger('t'))\n"
        "import importlib\n"
        "mods = [importlib.import_module(n) for n in compiled.HOT_MODULES]\n"
        "print(sum(compiled.is_compiled(m) for m in mods), "
        "all(m.__file__.endswith('.py') for m in mods))\n"
    )
    env = {**os.environ, "GGMUX_PURE_PYTHON": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.split() == ["0", "True"]
    n = len(compiled.HOT_MODULES)
    assert f"INFO hot path runs pure Python for {n} of {n} modules (GGMUX_PURE_PYTHON=1)" \
        in out.stderr


@pytest.fixture
def hot_dir(tmp_path, monkeypatch):
    """A folder holding a hot module's source (``seqlock.py``) and a finder
    whose choices are forgotten afterwards."""
    monkeypatch.delenv(compiled.PURE_ENV, raising=False)
    saved = dict(compiled._status)
    (tmp_path / "seqlock.py").write_text("X = 1\n")
    yield tmp_path, compiled.HotFinder()
    compiled._status.clear()
    compiled._status.update(saved)


def _ext(d, age_s: float):
    p = d / ("seqlock" + importlib.machinery.EXTENSION_SUFFIXES[0])
    p.write_bytes(b"")
    t = time.time() + age_s
    os.utime(p, (t, t))
    return p


def test_finder_takes_a_current_build(hot_dir):
    d, finder = hot_dir
    ext = _ext(d, 10)
    spec = finder.find_spec("ggmux.shm.seqlock", [str(d)])
    assert isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)
    assert spec.origin == str(ext)
    assert compiled._status["ggmux.shm.seqlock"] == compiled.COMPILED


def test_finder_runs_the_source_when_the_build_is_stale_or_absent(hot_dir):
    """A build older than its source (an edit or checkout after it) is
    never run: the source is, and the reason names the rebuild."""
    d, finder = hot_dir
    spec = finder.find_spec("ggmux.shm.seqlock", [str(d)])
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    assert "not compiled" in compiled._status["ggmux.shm.seqlock"]
    _ext(d, -10)
    spec = finder.find_spec("ggmux.shm.seqlock", [str(d)])
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    assert spec.origin == str(d / "seqlock.py")
    assert "stale build" in compiled._status["ggmux.shm.seqlock"]


def test_finder_honours_the_pure_python_switch(hot_dir, monkeypatch):
    d, finder = hot_dir
    _ext(d, 10)
    monkeypatch.setenv(compiled.PURE_ENV, "1")
    spec = finder.find_spec("ggmux.shm.seqlock", [str(d)])
    assert isinstance(spec.loader, importlib.machinery.SourceFileLoader)
    assert compiled._status["ggmux.shm.seqlock"] == "GGMUX_PURE_PYTHON=1"


def test_finder_leaves_other_modules_alone(hot_dir):
    d, finder = hot_dir
    assert finder.find_spec("ggmux.shm.layout", [str(d)]) is None
    assert finder.find_spec("json", None) is None
