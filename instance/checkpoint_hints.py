"""Where a chat's user messages start, in tokens: the engine makes a
context checkpoint at the last one (issue 35), as llama-server does from
its ``message_spans`` ("break at the last user message"), so a request
whose last message was edited or regenerated rolls a sliding-window or
recurrent model back to it instead of reading the whole prompt again; and
at earlier ones spaced by ``--checkpoint-min-step``, so an edit further
back (an agent that rewrites an earlier turn, a client that trims its
history) rolls back to the nearest one before it."""

from __future__ import annotations

from collections.abc import Callable

MARGIN = 2
"""Tokens before the message's text where the checkpoint goes: the text
and the template's header before it may merge into one token at their
boundary; the engine uses a checkpoint only where both prompts still agree."""

MAX_HINTS = 8
"""User-message starts given besides the last one, newest first: each
costs a tokenization of the prompt up to it, and the engine keeps at most
``--ctx-checkpoints`` checkpoints a slot anyway."""


def _text(m: dict) -> str | None:
    """A message's text as the template renders it (its first text part)."""
    content = m.get("content")
    if isinstance(content, list):  # parts: the first text part
        content = next((p.get("text") for p in content if isinstance(p, dict)
                        and p.get("type") == "text" and p.get("text")), None)
    if not isinstance(content, str) or not content.strip():
        return None
    return content.strip()


def user_starts(messages: list[dict], text: str, count: Callable[[str], int],
                min_step: int = 0) -> tuple[int, ...]:
    """Token counts of the rendered prompt ``text`` before user messages'
    texts, ascending: the last user message's (found from the end), and
    when ``min_step`` > 0 up to :data:`MAX_HINTS` earlier ones, each at
    least ``min_step`` characters before the one after it (a token is at
    least a character, so no start ``min_step`` tokens apart is skipped
    for a closer one; the engine spaces them by tokens). ``()`` when the
    last user message is not in ``text`` as given (a template that rewrites
    it) or there is none. ``count``: the tokens of a prefix of ``text``, as
    the prompt is tokenized (BOS included)."""
    users = [t for t in (_text(m) for m in messages if m.get("role") == "user")]
    if not users or users[-1] is None:
        return ()
    at = text.rfind(users[-1])
    if at <= 0:
        return ()
    chosen = [at]
    if min_step > 0 and len(users) > 1:
        found, pos = [], 0  # where each earlier message's text is, in order
        for u in users[:-1]:
            i = text.find(u, pos) if u is not None else -1
            if 0 < i < at:
                found.append(i)
                pos = i + len(u)
        for i in reversed(found):
            if len(chosen) > MAX_HINTS:
                break
            if i <= chosen[-1] - min_step:
                chosen.append(i)
    out = sorted({n for n in (count(text[:i]) - MARGIN for i in chosen) if n > 0})
    return tuple(out)


def last_user_start(messages: list[dict], text: str,
                    count: Callable[[str], int]) -> tuple[int, ...]:
    """``(token count,)`` of ``text`` before the last user message's text
    (:func:`user_starts` without the earlier ones)."""
    return user_starts(messages, text, count)


__all__ = ["MAX_HINTS", "last_user_start", "user_starts"]
