"""Stop strings (instance/engine/stops.py): llama-server's semantics (the stop
string is not sent, text that may become one is held back, the earliest
match wins), and a cost per token that does not grow with the number of
stop strings (issue 18, finding 2: 10,000 stops cost 22 ms a token on the
decode thread every client shares). No process, no model."""

from __future__ import annotations

import random

from ggmux.instance.engine.stops import StopStrings, StopText
from hypothesis import given, settings
from hypothesis import strategies as st


class ReferenceStops:
    """The matcher this module replaced (every stop string tried at every
    token): the semantics to keep."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self.held = ""
            return buf[:first], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def run(matcher, pieces: list[str]) -> list[tuple[str, bool]]:
    out = []
    for p in pieces:
        sent, matched = matcher.feed(p)
        out.append((sent, matched))
        if matched:
            return out
    out.append((matcher.flush(), False))
    return out


def test_a_stop_string_ends_the_text_and_is_not_sent():
    t = StopText(["</answer>"])
    assert t.feed("The sum is 4.") == ("The sum is 4.", False)
    assert t.feed(" </ans") == (" ", False)  # held: it may become the stop string
    assert t.feed("wer> and more") == ("", True)


def test_held_text_that_does_not_become_a_stop_is_sent_later():
    t = StopText(["\nUser:"])
    assert t.feed("line one\nUs") == ("line one", False)
    assert t.feed("ually fine") == ("\nUsually fine", False)
    assert t.feed("\n") == ("", False)
    assert t.flush() == "\n"


def test_the_earliest_match_wins_when_several_complete_at_once():
    # "bc" completes first while reading, but "abcd" starts earlier
    assert StopText(["bc", "abcd"]).feed("xabcd") == ("x", True)
    assert StopText(["abcd", "bc"]).feed("xabcz") == ("xa", True)
    # a stop that is a prefix of another one matches as soon as it is complete
    assert StopText(["ab", "abc"]).feed("zab") == ("z", True)


def test_no_stop_strings_pass_text_through():
    t = StopText(["", ""])
    assert not t.auto
    assert t.feed("anything") == ("anything", False) and t.work == 0


@settings(max_examples=300, deadline=None)
@given(stops=st.lists(st.text(alphabet="abc\n", min_size=0, max_size=5), max_size=6),
       pieces=st.lists(st.text(alphabet="abc\n", max_size=6), max_size=12))
def test_the_automaton_sends_what_the_reference_matcher_sends(stops, pieces):
    assert run(StopText(stops), pieces) == run(ReferenceStops(stops), pieces)


def stream(seed: int, chars: int) -> list[str]:
    """Generated text in token-sized pieces (1 to 6 characters)."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < chars:
        k = rng.randint(1, 6)
        out.append("".join(rng.choice("ab ") for _ in range(k)))
        n += k
    return out


def test_work_per_token_does_not_grow_with_the_number_of_stop_strings():
    """The same generated text against 1 stop string and against 10,000
    (none of which occurs, all sharing prefixes with the text: the matcher
    keeps walking into them): the automaton's steps stay within twice the
    characters fed in both cases, where the reference matcher tried every
    stop string at every token."""
    rng = random.Random(7)
    many: set[str] = set()
    while len(many) < 10_000:
        many.add("".join(rng.choice("ab ") for _ in range(rng.randint(6, 12))) + "!")
    pieces = stream(1, 20_000)
    chars = sum(map(len, pieces))
    works = {}
    for name, stops in (("one", ["zz!"]), ("many", sorted(many))):
        auto = StopStrings(stops)
        t = StopText(auto)
        for p in pieces:
            before = t.work
            _, matched = t.feed(p)
            assert not matched
            # per token: the piece, plus failure steps bounded by what was held
            assert t.work - before <= 2 * len(p) + auto.max_len
            assert len(t.held) < auto.max_len
        works[name] = t.work
    assert works["one"] <= 2 * chars and works["many"] <= 2 * chars, (works, chars)
