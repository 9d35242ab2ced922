"""llama.cpp's built-in chat templates (``--chat-template llama3``,
``command-r``, ``chatml``, ...), rendered by llama.cpp itself.

llama-server takes a name of ``llama_chat_builtin_templates()`` as
``--chat-template`` and renders it with ``llama_chat_apply_template``
(``src/llama-chat.cpp``: the "legacy" route of ``common/chat.cpp``); the
llama.cpp library that llama-cpp-python loads has both, so a prompt here
is byte for byte llama-server's.
"""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def builtin_names() -> frozenset[str]:
    """The template names this llama.cpp build knows."""
    import llama_cpp

    n = llama_cpp.llama_chat_builtin_templates(None, 0)
    arr = (ctypes.c_char_p * n)()
    llama_cpp.llama_chat_builtin_templates(arr, n)
    return frozenset(a.decode() for a in arr if a)


def render_builtin(name: str, messages: list[dict], add_assistant: bool = True) -> str:
    """The prompt text of ``messages`` (``role`` and string ``content``;
    None is empty) in template ``name``, with the assistant's turn opened
    when ``add_assistant``. Raises ValueError for a name llama.cpp does not
    know."""
    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(*[
        llama_cpp.llama_chat_message(role=str(m["role"]).encode(),
                                     content=str(m.get("content") or "").encode())
        for m in messages])
    size = 2 * sum(len(str(m.get("content") or "")) + 16 for m in messages) + 256
    for _ in range(2):
        buf = ctypes.create_string_buffer(size)
        n = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages),
                                                add_assistant, buf, size)
        if n < 0:
            raise ValueError(f"llama.cpp has no chat template {name!r}")
        if n <= size:
            return buf.raw[:n].decode("utf-8", "replace")
        size = n
    raise ValueError(f"template {name!r} rendered past its buffer")
