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


# ---- llama-server's message spans: the user-turn marker -------------------------------------
def _marker(name: str) -> str:
    from pathlib import Path

    from ggmux.instance.checkpoint_hints import user_start_marker
    from ggmux.instance.template import JinjaTemplate

    src = (Path(__file__).parent / "templates" / f"{name}.jinja").read_text()
    t = JinjaTemplate(src, "<s>", "</s>")
    return user_start_marker(lambda ms: t.render(ms, None, False, {"enable_thinking": True}))


def test_the_user_turn_marker_is_what_llama_servers_template_analyser_finds():
    """Rendered without messages and with one (llama.cpp's first probe), or,
    for a template that refuses an empty conversation, after a user and an
    assistant turn (its second): the markers before the message's text."""
    from ggmux.instance.chat import CHATML_TEMPLATE
    from ggmux.instance.checkpoint_hints import user_start_marker
    from ggmux.instance.template import JinjaTemplate

    chatml = JinjaTemplate(CHATML_TEMPLATE)
    assert user_start_marker(lambda ms: chatml.render(ms, None, False)) == "<|im_start|>user"
    assert _marker("Qwen-Qwen2.5-7B-Instruct") == "<|im_start|>user"  # needs the second probe
    assert _marker("google-gemma-2-2b-it") == "<start_of_turn>user"
    assert _marker("ibm-granite-granite-3.3-2B-Instruct") == \
        "<|start_of_role|>user<|end_of_role|>"
    assert user_start_marker(lambda ms: 1 / 0) == ""  # a template that renders nothing


def test_templates_llama_server_parses_itself_are_known_and_markers_match_tokens():
    from pathlib import Path

    from ggmux.instance.checkpoint_hints import delimiter_starts, specialized

    t = Path(__file__).parent / "templates"
    assert specialized((t / "openai-gpt-oss-120b.jinja").read_text())
    assert specialized((t / "meetkai-functionary-medium-v3.2.jinja").read_text())
    assert not specialized((t / "Qwen-Qwen3-0.6B.jinja").read_text())
    # every place the marker's tokens stand; media placeholders (negative) never match
    assert delimiter_starts([1, 5, 6, 9, 5, 6, -3, -4, 5, 6], [5, 6]) == (1, 4, 8)
    assert delimiter_starts([5], [5, 6]) == () and delimiter_starts([5, 6], []) == ()
