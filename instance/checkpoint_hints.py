"""Where a chat's user messages start, in tokens: the engine makes a
context checkpoint at the last one (issue 35), as llama-server does from
its ``message_spans`` ("break at the last user message"), so a request
whose last message was edited or regenerated rolls a sliding-window or
recurrent model back to it instead of reading the whole prompt again; and
at earlier ones spaced by ``--checkpoint-min-step``, so an edit further
back (an agent that rewrites an earlier turn, a client that trims its
history) rolls back to the nearest one before it.

Two ways to find them: llama-server's own (:func:`user_start_marker`, the
user turn's start marker that its template analyser finds, then every
place the prompt's tokens hold it: :func:`delimiter_starts`), which cuts
the prompt's batches exactly where llama-server cuts them, so both read a
prompt in the same batch shapes and a greedy answer comes out the same;
and, for the templates llama-server parses with its own code
(:func:`specialized`, where it finds no spans) or whose marker the probe
cannot find, the message texts' places (:func:`user_starts`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

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


# ---- llama-server's message spans: the user turn's start marker, in tokens ----------------
USER_MSG = "U_USER_MSG Hello END_U"
USER_MSG_TWO = "V_USER_MSG Hello END_V"
ASSISTANT_MSG = "A_ASST_MSG I can help END_A"
"""The probe messages llama.cpp's template analyser renders
(common/chat-diff-analyzer.cpp)."""

SPECIALIZED = (  # (substrings of a template's source): llama.cpp's own parsers, no spans
    ("[SYSTEM_PROMPT]", "[TOOL_CALLS]", "[ARGS]"), ("<|channel|>",),
    ("<atem:function_calls>", "<|eom|>"), (">>>all", ">>>${recipient}"),
    ("<|tool_calls_section_begin|>", "<|tool_call_begin|>"),
    ("<|open|>", "<|close|>", "<|end_of_msg|>"), ("<role>ASSISTANT</role>", "<arg_key>"),
    ("<|START_TEXT|>", "<|START_ACTION|>"))
"""Template families llama-server renders with a parser of its own
(``common_chat_try_specialized_template``): it finds no message spans in
their prompts (ggmux then keeps :func:`user_starts`)."""


def specialized(source: str) -> bool:
    """Whether llama-server gives ``source``'s template a parser of its own
    (:data:`SPECIALIZED`; Ministral 3's needs no ``[CALL_ID]``)."""
    if "[SYSTEM_PROMPT]" in source and "[CALL_ID]" in source:
        return any(all(w in source for w in ws) for ws in SPECIALIZED[1:])
    return any(all(w in source for w in ws) for ws in SPECIALIZED)


def _segments(text: str) -> list[tuple[bool, str]]:
    """``text`` cut into ``(is_marker, piece)``: a marker runs from ``<`` to
    ``>`` or ``[`` to ``]`` (llama.cpp's ``segmentize_markers``)."""
    out, start, opener = [], 0, ""
    for i, c in enumerate(text):
        if not opener and c in "<[":
            if start < i:
                out.append((False, text[start:i]))
            start, opener = i, c
        elif opener and c == (">" if opener == "<" else "]"):
            out.append((True, text[start:i + 1]))
            start, opener = i + 1, ""
    if start < len(text):
        out.append((False, text[start:]))
    return out


def _diff_right(left: str, right: str) -> str:
    """What ``right`` has beside ``left``'s common first and last segments
    (llama.cpp's ``calculate_diff_split``, its ``right``)."""
    a, b = _segments(left), _segments(right)
    if not a:
        return right
    if not b:
        return ""
    i = 0
    while i < min(len(a), len(b)) - 1 and a[i] == b[i]:
        i += 1
    j = 0
    while j < min(len(a), len(b)) - 1 - i and a[-1 - j] == b[-1 - j]:
        j += 1
    return "".join(p for _, p in b[i:len(b) - j])


def user_start_marker(render: Callable[[list[dict]], str]) -> str:
    """The text that starts a user turn in a template, as llama-server's
    template analyser finds it (``detect_user_start_marker``): the template
    rendered without messages and with one user message (``render``, no
    generation prompt), and of what the user message added, its markers
    before the message text (leading end markers and blanks dropped). ""
    when the template does not render so."""
    user = {"role": "user", "content": USER_MSG}
    try:
        right = _diff_right(render([]), render([user]))
    except Exception:  # noqa: BLE001 - no empty conversation: llama.cpp's second probe
        before = [{"role": "user", "content": USER_MSG_TWO},
                  {"role": "assistant", "content": ASSISTANT_MSG}]
        try:
            right = _diff_right(render(before), render([*before, user]))
        except Exception:  # noqa: BLE001 - a template that refuses both has no marker
            return ""
    if ASSISTANT_MSG in right:
        right = right[right.index(ASSISTANT_MSG) + len(ASSISTANT_MSG):]
    at = right.find(USER_MSG)
    if at < 0:
        return ""
    out, seen_marker = [], False
    for is_marker, piece in _segments(right[:at]):
        low = piece.lower()
        if is_marker and not seen_marker and ("end" in low or "close" in low):
            continue
        if not is_marker and not seen_marker and not piece.strip():
            continue
        seen_marker |= is_marker
        out.append(piece)
    return "".join(out).strip()


def delimiter_starts(prompt: list[int], marker: list[int]) -> tuple[int, ...]:
    """Token positions of ``prompt`` where ``marker`` (the user turn's
    start, in tokens) begins: llama-server's user message spans
    (``common_chat_msg_delimiters::split``; a media span's placeholders
    never match, as llama-server skips media chunks)."""
    k = len(marker)
    if not k or len(prompt) < k:
        return ()
    a = np.asarray(prompt, np.int64)
    hit = a[:len(a) - k + 1] == marker[0]
    for j in range(1, k):
        hit &= a[j:len(a) - k + 1 + j] == marker[j]
    return tuple(int(i) for i in np.flatnonzero(hit))


__all__ = ["MAX_HINTS", "delimiter_starts", "last_user_start", "specialized",
           "user_start_marker", "user_starts"]
