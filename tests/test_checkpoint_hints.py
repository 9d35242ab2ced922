"""Where a chat's last user message starts (instance/checkpoint_hints.py):
the engine's context checkpoint there lets an edited or regenerated last
message roll a sliding-window model back to it (issue 35)."""

from __future__ import annotations

from ggmux.instance.checkpoint_hints import MARGIN, MAX_HINTS, last_user_start, user_starts


def count(text: str) -> int:
    return len(text.split())  # a word a token


def test_the_last_user_message_start_is_found_from_the_end_less_a_margin():
    text = "sys: be brief. user: hello there. bot: hi. user: hello there. bot:"
    messages = [{"role": "system", "content": "be brief."},
                {"role": "user", "content": "hello there."},
                {"role": "assistant", "content": "hi."},
                {"role": "user", "content": "hello there."}]
    (n,) = last_user_start(messages, text, count)
    assert n == count(text[:text.rfind("hello there.")]) - MARGIN == 9 - MARGIN


def test_parts_are_read_and_a_message_the_template_rewrote_gives_no_hint():
    text = "a b c d e f user: look at this"
    parts = [{"role": "user", "content": [{"type": "text", "text": "look at this"}]}]
    assert last_user_start(parts, text, count) == (count("a b c d e f user:") - MARGIN,)
    assert last_user_start([{"role": "user", "content": "LOOK"}], text, count) == ()
    assert last_user_start([{"role": "assistant", "content": "x"}], text, count) == ()
    assert last_user_start([{"role": "user", "content": "a b"}], text, count) == ()  # at 0


def test_earlier_user_messages_are_given_spaced_by_min_step_characters():
    """Besides the last user message, earlier ones at least ``min_step``
    characters before the next one given (a token is at least a character,
    so none ``min_step`` tokens apart is skipped); the engine spaces them by
    tokens. Without ``min_step`` only the last."""
    pad = " ".join(["w"] * 20)  # 40 characters, 20 tokens
    msgs, parts = [], ["the system prompt of this chat"]
    for i in range(5):
        msgs += [{"role": "user", "content": f"q{i} {pad}"}, {"role": "assistant", "content": "a"}]
        parts += [f"user: q{i} {pad}", "bot: a"]
    msgs.pop()
    text = " ".join(parts[:-1]) + " bot:"
    starts = [text.find(f"q{i} ") for i in range(5)]
    want = [count(text[:at]) - MARGIN for at in starts]
    assert user_starts(msgs, text, count) == (want[-1],) == last_user_start(msgs, text, count)
    assert user_starts(msgs, text, count, min_step=1) == tuple(want)
    # 100 characters: every other message (each is ~50 characters after the one before)
    assert user_starts(msgs, text, count, min_step=100) == (want[0], want[2], want[4])
    # a message the template rewrote is skipped; the others are still found in order
    msgs[2] = {"role": "user", "content": "REWRITTEN"}
    assert user_starts(msgs, text, count, min_step=1) == (want[0], *want[2:])


def test_at_most_max_hints_earlier_starts_newest_first():
    msgs = []
    for i in range(MAX_HINTS + 5):
        msgs += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]
    msgs.pop()
    text = "sys " + " ".join(f"user: q{i} bot: a" for i in range(MAX_HINTS + 5))[:-2]
    got = user_starts(msgs, text, count, min_step=1)
    assert len(got) == MAX_HINTS + 1
    assert got[-1] == count(text[:text.rfind(f"q{MAX_HINTS + 4}")]) - MARGIN
