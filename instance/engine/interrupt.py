"""Stopping a ``llama_decode`` in progress (issue 37, item 17).

One step's decode of a long prompt chunk takes seconds on a busy CPU; a
stopping instance's save (``persist``) and a cache clear are done by the
decode thread between two steps, so they waited for the whole chunk, and a
save window of 2 s passed with nothing written (the slots that had
finished were lost). llama.cpp checks an abort callback between the
graph's nodes (``ggml_graph_compute_thread``, CPU backend) and then
returns 2 from ``llama_decode``, having removed that ubatch's cells (earlier
ubatches of the call stay); the engine undoes the whole step's cells and
plans it again after the save or the clear.

The callback must not be Python: thread 0 of the compute pool calls it at
every node (~1,000 per ubatch), and a Python callback takes the GIL each
time, waiting behind the HTTP threads. It is libc's ``strlen`` over a
two-byte flag: ``"\\0"`` gives 0 (go on), ``"\\1"`` gives 1 (stop); ``bool``
is read from the low byte of the return register, which is this 0 or 1.
"""

from __future__ import annotations

import ctypes
import ctypes.util


class Interrupt:
    """The flag a decode thread's ``llama_decode`` reads. :meth:`arm` after
    each context is made; :meth:`set` from any thread; :meth:`clear` by the
    decode thread once it served what asked for the stop."""

    def __init__(self) -> None:
        self._flag = ctypes.create_string_buffer(2)  # b"\0\0": strlen 0
        self._cb = None

    def arm(self, llama_cpp, ctx) -> bool:
        """Give context ``ctx`` the abort callback; False (nothing set) when
        libc's ``strlen`` cannot be found (decodes then run to their end)."""
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
            self._cb = ctypes.cast(libc.strlen, llama_cpp.ggml_abort_callback)
        except (OSError, AttributeError):
            return False
        llama_cpp.llama_set_abort_callback(ctx, self._cb,
                                           ctypes.cast(self._flag, ctypes.c_void_p))
        return True

    def set(self) -> None:
        """Stop the decode in progress (and every later one until :meth:`clear`)."""
        self._flag[0] = b"\x01"

    def clear(self) -> None:
        self._flag[0] = b"\x00"

    @property
    def is_set(self) -> bool:
        return self._flag[0] != b"\x00"


__all__ = ["Interrupt"]
