"""Stop strings: matching them in a choice's text as it is generated, in
time proportional to the new text, whatever the number of stop strings.

:class:`StopStrings` is an Aho-Corasick automaton (Aho and Corasick,
"Efficient string matching", CACM 1975) over one request's stop strings,
built once per request on the submitting thread; :class:`StopText` is one
choice's position in it, fed on the decode thread. Issue 18, finding 2:
``StopText.feed`` used to try every stop string at every token (22 ms per
token at 10,000 stops, on the thread every client's tokens share); now one
feed costs one transition per new character plus at most as many failure
steps as the text held back (bounded by the longest stop string), counted
in :attr:`StopText.work` so a test can prove it.

Semantics are llama-server's (``find_stopping_strings`` and its partial
stop rule): text that could be the start of a stop string is held back
until it cannot be; a stop string ends the choice and is not sent; when
several match, the one starting first wins.
"""

from __future__ import annotations

from collections import deque


class StopStrings:
    """The automaton of a list of stop strings (empty ones are dropped).

    State 0 is the root; ``goto[s]`` maps a character to the next state of
    the trie, ``fail[s]`` is the state of the longest proper suffix of
    ``s``'s string that is a trie state, ``depth[s]`` the length of ``s``'s
    string, ``longest[s]`` the length of the longest stop string that ends
    ``s``'s string (0 for none). Build cost and memory: one state per
    character of the stop strings (the request limits bound them:
    ``--max-stops`` x ``--max-stop-bytes``)."""

    __slots__ = ("depth", "fail", "goto", "longest", "max_len")

    def __init__(self, stops: list[str] | tuple[str, ...]) -> None:
        goto: list[dict[str, int]] = [{}]
        depth = [0]
        terminal = [False]
        for s in stops:
            if not s:
                continue
            st = 0
            for ch in s:
                nxt = goto[st].get(ch)
                if nxt is None:
                    nxt = len(goto)
                    goto[st][ch] = nxt
                    goto.append({})
                    depth.append(depth[st] + 1)
                    terminal.append(False)
                st = nxt
            terminal[st] = True
        fail = [0] * len(goto)
        longest = [0] * len(goto)
        todo: deque[int] = deque()
        for nxt in goto[0].values():
            todo.append(nxt)
            longest[nxt] = depth[nxt] if terminal[nxt] else 0
        while todo:  # breadth first: a state's failure is shallower, so already known
            st = todo.popleft()
            for ch, nxt in goto[st].items():
                f = fail[st]
                while f and ch not in goto[f]:
                    f = fail[f]
                f = goto[f].get(ch, 0)
                fail[nxt] = f
                longest[nxt] = depth[nxt] if terminal[nxt] else longest[f]
                todo.append(nxt)
        self.goto = goto
        self.fail = fail
        self.depth = depth
        self.longest = longest
        self.max_len = max(depth)

    def __bool__(self) -> bool:
        return len(self.goto) > 1


class StopText:
    """Text of one choice as it is generated, held back where it could be
    the start of a stop string (llama-server's partial-stop rule), so a
    client never sees the beginning of a stop string that then matches.

    ``feed(text)`` -> ``(text to send now, matched)``; after a match the
    text up to the stop string has been returned and the rest is dropped.
    ``flush()`` returns what was held back (the choice ended otherwise).
    ``work`` counts automaton steps (transitions tried and failure links
    followed) since creation: at most twice the characters fed, whatever
    the number of stop strings (each failure step undoes one character of
    depth, and each character adds at most one). The held text is at most
    the longest stop string less one character."""

    __slots__ = ("auto", "held", "state", "work")

    def __init__(self, stops: StopStrings | list[str] | tuple[str, ...]) -> None:
        self.auto = stops if isinstance(stops, StopStrings) else StopStrings(stops)
        self.held = ""
        self.state = 0
        self.work = 0

    def feed(self, text: str) -> tuple[str, bool]:
        a = self.auto
        if len(a.goto) == 1:
            return text, False
        goto, fail, longest = a.goto, a.fail, a.longest
        st, work, first = self.state, 0, -1
        base = len(self.held) + 1  # buf index just after text[0]
        for i, ch in enumerate(text):
            while True:
                work += 1
                nxt = goto[st].get(ch)
                if nxt is not None:
                    st = nxt
                    break
                if st == 0:
                    break
                st = fail[st]
            n = longest[st]
            if n:  # the longest stop string ending here starts earliest
                start = base + i - n
                if first < 0 or start < first:
                    first = start
        self.work += work
        buf = self.held + text
        if first >= 0:
            self.held = ""
            self.state = 0
            return buf[:first], True
        self.state = st
        hold = a.depth[st]
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held, self.state = self.held, "", 0
        return out


__all__ = ["StopStrings", "StopText"]
