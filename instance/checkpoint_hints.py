"""Where a chat's last user message starts, in tokens: the engine makes a
context checkpoint there (issue 35), as llama-server does from its
``message_spans`` ("break at the last user message"), so a request whose
last message was edited or regenerated rolls a sliding-window or
recurrent model back to it instead of reading the whole prompt again."""

from __future__ import annotations

from collections.abc import Callable

MARGIN = 2
"""Tokens before the message's text where the checkpoint goes: the text
and the template's header before it may merge into one token at their
boundary; the engine uses a checkpoint only where both prompts still agree."""


def last_user_start(messages: list[dict], text: str,
                    count: Callable[[str], int]) -> tuple[int, ...]:
    """``(token count,)`` of the rendered prompt ``text`` before the last
    user message's text (found from its end), or ``()`` when there is no
    such message or its text is not in ``text`` as given (a template that
    rewrites it). ``count``: the tokens of a prefix of ``text``, as the
    prompt is tokenized (BOS included)."""
    for m in reversed(messages):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, list):  # parts: the first text part
            content = next((p.get("text") for p in content if isinstance(p, dict)
                            and p.get("type") == "text" and p.get("text")), None)
        if not isinstance(content, str) or not content.strip():
            return ()
        at = text.rfind(content.strip())
        if at <= 0:
            return ()
        n = count(text[:at]) - MARGIN
        return (n,) if n > 0 else ()
    return ()


__all__ = ["last_user_start"]
