"""Where a chat's last user message starts (instance/checkpoint_hints.py):
the engine's context checkpoint there lets an edited or regenerated last
message roll a sliding-window model back to it (issue 35)."""

from __future__ import annotations

from ggmux.instance.checkpoint_hints import MARGIN, last_user_start


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
