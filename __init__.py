"""ggmux: many local GGUF models behind one OpenAI-compatible port.

The repository root is this package; its four subpackages are the parts of
the server (see DESIGN.md): ``supervisor`` (the parent, sole decision
maker), ``proxy`` (SO_REUSEPORT HTTP workers), ``instance`` (one process per
loaded model replica) and ``shm`` (the shared-memory state plane).
"""

__version__ = "0.1.0"
