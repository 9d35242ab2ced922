"""A syntax check of GBNF grammars, as llama.cpp's grammar parser reads them,
before llama.cpp sees them.

llama.cpp's parser (``src/llama-grammar.cpp``, ``llama_grammar_parser``) is
recursive descent: every ``(`` group is one C++ call deeper, so a grammar of
20,000 nested groups overflows an 8 MiB thread stack and kills the process
(10,000 still parse; llama-cpp-python's JSON-schema converter writes
``maxLength: N`` as N nested groups). On a syntax error it prints the whole
grammar to stderr and gives no reason to the caller. :func:`check_gbnf`
reads the same syntax without recursion, bounds the nesting and the
repetition counts, and says where a grammar is wrong, so a request's grammar
is refused with a 400 that names the place, and only grammars llama.cpp will
take reach it. (Left recursion, which llama.cpp also refuses, is not checked
here: llama.cpp reports it without a crash.)

Syntax (llama.cpp ``grammars/README.md``): rules ``name ::= alternatives``,
one per line (a rule continues over newlines only inside parentheses or
after ``|``); items are ``"literal"``, ``[char class]`` (``[^...]``
negated, ``a-z`` ranges), rule names (``[a-zA-Z0-9-]+``), ``(`` groups
``)``, ``.``; postfix ``*``, ``+``, ``?``, ``{m}``, ``{m,}``, ``{m,n}``;
``#`` comments to the end of the line; escapes ``\\x..``, ``\\u....``,
``\\U........``, ``\\t \\r \\n \\\\ \\" \\[ \\]``. A grammar needs a
``root`` rule and every rule it names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"[a-zA-Z0-9-]+")
_INT = re.compile(r"[0-9]+")
_HEX_LEN = {"x": 2, "u": 4, "U": 8}
_SIMPLE_ESCAPES = frozenset('trn\\"[]')


class GrammarError(ValueError):
    """A grammar llama.cpp would refuse or could not survive; ``str()`` says
    what and where (``line L, column C: ...``)."""


@dataclass(slots=True)
class GrammarStats:
    """What :func:`check_gbnf` measured: ``rules`` defined, deepest group
    ``depth``, largest repetition count ``repetitions``."""

    rules: int
    depth: int
    repetitions: int


class _Reader:
    __slots__ = ("pos", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def fail(self, what: str, at: int | None = None) -> GrammarError:
        at = self.pos if at is None else at
        line = self.text.count("\n", 0, at) + 1
        col = at - (self.text.rfind("\n", 0, at) + 1) + 1
        return GrammarError(f"line {line}, column {col}: {what}")

    def peek(self, k: int = 0) -> str:
        i = self.pos + k
        return self.text[i] if i < len(self.text) else ""

    def space(self, newline_ok: bool) -> None:
        """llama.cpp ``parse_space``: blanks and comments, newlines only
        where a rule may continue."""
        t, n = self.text, len(self.text)
        while self.pos < n:
            c = t[self.pos]
            if c in " \t" or (newline_ok and c in "\r\n"):
                self.pos += 1
            elif c == "#":
                while self.pos < n and t[self.pos] not in "\r\n":
                    self.pos += 1
            else:
                break

    def name(self) -> str:
        m = _WORD.match(self.text, self.pos)
        if not m:
            raise self.fail("expecting a rule name")
        self.pos = m.end()
        return m.group()

    def integer(self) -> int:
        m = _INT.match(self.text, self.pos)
        if not m:
            raise self.fail("expecting an integer")
        self.pos = m.end()
        return int(m.group())

    def char(self) -> None:
        """One character of a literal or class, escapes included."""
        c = self.peek()
        if c == "":
            raise self.fail("unexpected end of input")
        if c != "\\":
            self.pos += 1
            return
        e = self.peek(1)
        if e in _HEX_LEN:
            digits = self.text[self.pos + 2:self.pos + 2 + _HEX_LEN[e]]
            if len(digits) != _HEX_LEN[e] or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise self.fail(f"expecting {_HEX_LEN[e]} hex digits after \\{e}")
            self.pos += 2 + _HEX_LEN[e]
        elif e in _SIMPLE_ESCAPES:
            self.pos += 2
        else:
            raise self.fail("unknown escape")


def check_gbnf(text: str, max_depth: int, max_repetitions: int) -> GrammarStats:
    """Check ``text`` as llama.cpp would parse it.

    ``max_depth``: most nested ``(`` groups (llama.cpp recurses once per
    group); ``max_repetitions``: largest ``m``/``n`` of ``{m,n}`` (llama.cpp
    refuses more than 2000 whatever this says: ``MAX_REPETITION_THRESHOLD``).
    Returns :class:`GrammarStats`; raises :class:`GrammarError`.
    """
    r = _Reader(text)
    if "\0" in text:
        raise r.fail("a NUL character (llama.cpp would stop reading there)", text.index("\0"))
    defined: set[str] = set()
    used: dict[str, int] = {}
    deepest = biggest = 0
    r.space(True)
    while r.pos < len(text):
        defined.add(r.name())
        r.space(False)
        if text.startswith("::=", r.pos):
            r.pos += 3
        else:
            raise r.fail("expecting ::=")
        r.space(True)
        # the rule's alternatives; one entry per open group: whether its
        # current sequence has an item a postfix operator can apply to
        item = [False]
        opened: list[int] = []
        while True:
            c = r.peek()
            nested = len(item) > 1
            if c == '"':
                r.pos += 1
                while r.peek() != '"':
                    r.char()
                r.pos += 1
            elif c == "[":
                r.pos += 1
                if r.peek() == "^":
                    r.pos += 1
                while r.peek() != "]":
                    r.char()
                    if r.peek() == "-" and r.peek(1) != "]":
                        r.pos += 1
                        r.char()
                r.pos += 1
            elif c and _WORD.match(c):
                at = r.pos
                used.setdefault(r.name(), at)
            elif c == "(":
                if len(item) > max_depth:
                    raise r.fail(f"groups nested deeper than {max_depth}")
                opened.append(r.pos)
                r.pos += 1
                item.append(False)
                deepest = max(deepest, len(item) - 1)
                r.space(True)
                continue
            elif c == ")" and nested:
                item.pop()
                opened.pop()
                r.pos += 1
            elif c == ".":
                r.pos += 1
            elif c in ("*", "+", "?", "{"):
                if not item[-1]:
                    raise r.fail(f"'{c}' needs an item before it")
                r.pos += 1
                if c == "{":
                    r.space(nested)
                    counts = [r.integer()]
                    r.space(nested)
                    if r.peek() == ",":
                        r.pos += 1
                        r.space(nested)
                        if _INT.match(r.peek()):
                            counts.append(r.integer())
                            r.space(nested)
                    if r.peek() != "}":
                        raise r.fail("expecting '}'")
                    r.pos += 1
                    if len(counts) == 2 and counts[1] < counts[0]:
                        raise r.fail(f"repetition {{{counts[0]},{counts[1]}}} has max < min")
                    if max(counts) > max_repetitions:
                        raise r.fail(f"repetition count {max(counts)} is over {max_repetitions}")
                    biggest = max(biggest, *counts)
                r.space(nested)
                continue
            elif c == "|":
                r.pos += 1
                item[-1] = False
                r.space(True)
                continue
            else:
                break
            item[-1] = True
            r.space(len(item) > 1)
        if len(item) > 1:
            raise r.fail("expecting ')'" if r.pos < len(text) else
                         "unexpected end of input: '(' not closed", None)
        c = r.peek()
        if c == "\r":
            r.pos += 2 if r.peek(1) == "\n" else 1
        elif c == "\n":
            r.pos += 1
        elif c:
            raise r.fail("expecting a newline or the end")
        r.space(True)
    if "root" not in defined:
        raise GrammarError("the grammar has no 'root' rule")
    for name, at in used.items():
        if name not in defined:
            raise r.fail(f"rule '{name}' is not defined", at)
    return GrammarStats(rules=len(defined), depth=deepest, repetitions=biggest)
