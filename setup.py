"""Build step: compile the hot-path modules with Cython when it can.

Metadata and packages are in setup.cfg. The modules named in
``compiled.py`` (``HOT_MODULES``) are compiled from their ``.py`` sources
(Cython's pure-Python mode) when Cython and a C compiler are present; an
editable install (``pip install -e .``) puts the compiled files next to
the sources. Without Cython or without a compiler the install goes on with
pure Python and says so in one line; ``GGMUX_PURE_PYTHON=1`` at build time
skips compiling on purpose.
"""

import ast
import hashlib
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def say(msg: str) -> None:
    print(f"ggmux build: {msg}", file=sys.stderr, flush=True)


def hot_modules() -> list[str]:
    """HOT_MODULES from compiled.py, read without importing the package."""
    src = (ROOT / "compiled.py").read_text()
    start = src.index("(", src.index("HOT_MODULES = ("))
    return list(ast.literal_eval(src[start:src.index(")", start) + 1]))


def source(name: str) -> str:
    """``ggmux.http1.request`` -> ``http1/request.py`` (setup.cfg
    maps the package ggmux to the repository root)."""
    return "/".join(name.split(".")[1:]) + ".py"


class OptionalBuildExt(build_ext):
    """build_ext that never fails the install: an extension that does not
    build leaves its module to run as pure Python, with one line saying so."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if self.parallel is None:  # one compiler per core: the C files are big
            self.parallel = os.cpu_count() or 1

    def run(self) -> None:
        try:
            super().run()
        except Exception as e:  # noqa: BLE001 - no compiler: pure Python
            say(f"compiling failed ({e}): the hot path runs pure Python")

    def copy_extensions_to_source(self) -> None:
        # (editable installs) only what did build: the rest stays pure Python
        inplace, self.inplace = self.inplace, 0
        try:
            built = [e for e in self.extensions if os.path.exists(self.get_ext_fullpath(e.name))]
        finally:
            self.inplace = inplace
        every, self.extensions = self.extensions, built
        try:
            super().copy_extensions_to_source()
        finally:
            self.extensions = every

    def build_extension(self, ext: Extension) -> None:
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - one module stays pure Python
            say(f"{ext.name} not compiled ({e}): it runs pure Python")


def cython_include(names: list[str]) -> Path:
    """A folder where Cython finds the hot modules' ``.pxd`` declarations
    under their import names (``ggmux/http1/request.pxd``): the
    repository root is the package ``ggmux`` only through setup.cfg's
    ``package_dir``, so its own folder name says nothing to Cython. Copies,
    not links: nothing that walks ``build/`` can loop."""
    top = ROOT / "build" / "pxd"
    dirs = {Path(*n.split(".")[1:-1]) for n in names}
    for d in dirs | {p for sub in dirs for p in sub.parents}:
        dst = top / "ggmux" / d
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "__init__.pxd").touch()
        for pxd in (ROOT / d).glob("*.pxd"):
            if not (dst / pxd.name).exists() or (dst / pxd.name).read_text() != pxd.read_text():
                (dst / pxd.name).write_text(pxd.read_text())
    return top


def declarations_changed(top: Path) -> bool:
    """Whether any ``.pxd`` changed since the last build (a stamp in
    ``top``): a C type's layout is compiled into every module that uses
    it, which Cython's own timestamps do not follow through the copies, so
    then every module is compiled again."""
    digest = hashlib.sha256()
    for pxd in sorted(top.rglob("*.pxd")):
        digest.update(str(pxd.relative_to(top)).encode() + b"\0" + pxd.read_bytes())
    stamp = top / "stamp"
    old = stamp.read_text() if stamp.exists() else ""
    stamp.write_text(digest.hexdigest())
    return old != digest.hexdigest()


def extensions() -> list[Extension]:
    if os.environ.get("GGMUX_PURE_PYTHON", "") == "1":
        say("GGMUX_PURE_PYTHON=1: not compiling; the hot path runs pure Python")
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        say("Cython is not installed: the hot path runs pure Python")
        return []
    names = hot_modules()
    include = cython_include(names)
    force = declarations_changed(include)
    # no debug info and -O2: less than half the CPU time of Python's -g -O3,
    # for code that spends its time in CPython's API calls anyway
    exts = [Extension(n, [source(n)], optional=True, extra_compile_args=["-g0", "-O2"])
            for n in names]
    return cythonize(
        exts,
        build_dir="build/cython",  # the generated C stays out of the tree
        compiler_directives={
            "language_level": "3",
            # annotations stay hints, as in CPython: an `int` or `float`
            # argument is not turned into a C type that refuses numpy's
            # integers or None
            "annotation_typing": False,
            "binding": True,
        },
        include_path=[str(include)],
        force=force,
        quiet=True,
        nthreads=os.cpu_count() or 1,
    )


setup(ext_modules=extensions(), cmdclass={"build_ext": OptionalBuildExt})
