"""ggmux: many local GGUF models behind one OpenAI-compatible port.

The repository root is this package; its four subpackages are the parts of
the server (see DESIGN.md): ``supervisor`` (the parent, sole decision
maker), ``proxy`` (SO_REUSEPORT HTTP workers), ``instance`` (one process per
loaded model replica) and ``shm`` (the shared-memory state plane).
"""

__version__ = "0.1.0"

# the hot-path modules load compiled when built, else (or with
# GGMUX_PURE_PYTHON=1) from their .py files: see compiled.py. Only as the
# package: pytest also imports this file as a plain module named __init__
# (the checkout's folder, whatever its name, holds the tests' package).
if __package__:
    from . import compiled as _compiled

    _compiled.install()

    # ggmux's numpy does no linear algebra (shm tables, argmax, masks): one
    # BLAS thread, or each process's import of numpy starts a pool of
    # OpenBLAS threads that spin (0.1 CPU s per process: a supervisor, its
    # proxies and each instance). Set before numpy loads; a value the user
    # set stays; children inherit it.
    import os as _os

    _os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
