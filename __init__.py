"""ggmux: many local GGUF models behind one OpenAI-compatible port.

The repository root is this package; its four subpackages are the parts of
the server (see DESIGN.md): ``supervisor`` (the parent, sole decision
maker), ``proxy`` (SO_REUSEPORT HTTP workers), ``instance`` (one process per
loaded model replica) and ``shm`` (the shared-memory state plane).
"""

__version__ = "0.1.0"

from . import compiled as _compiled

# the hot-path modules load compiled when built, else (or with
# GGMUX_PURE_PYTHON=1) from their .py files: see compiled.py
_compiled.install()
