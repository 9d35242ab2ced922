"""Reading JSON that may still be being generated.

A model writes a tool call's JSON a token at a time; a stream's parser
reads what has come so far. These helpers read one JSON value at a
position and say whether the text ended inside it (:class:`Incomplete`),
so a format module can take the complete parts, keep a partial string's
decoded prefix, and wait for the rest. They never evaluate more than the
value asked for. Invalid JSON is a ``ValueError``.
"""

from __future__ import annotations

import json
import re

_WS = re.compile(r"[ \t\n\r]*")
_PLAIN = re.compile(r'[^"\\]*')  # a run of string characters with no quote or escape
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}


class Incomplete(Exception):
    """The text ends inside the value being read."""


def ws(text: str, i: int) -> int:
    """Index of the first non-whitespace character at or after ``i``."""
    return _WS.match(text, i).end()


def partial_string(text: str, i: int) -> tuple[str, int | None]:
    """Decode the JSON string whose opening quote is at ``text[i]``:
    ``(decoded, index after the closing quote)``, or ``(decoded prefix,
    None)`` when the text ends inside it (a partial escape is left out).
    Raises ValueError when ``text[i]`` is not a quote or an escape is bad."""
    if i >= len(text) or text[i] != '"':
        raise ValueError(f"expected a string at {i}")
    out: list[str] = []
    j, n = i + 1, len(text)
    while j < n:
        k = _PLAIN.match(text, j).end()
        out.append(text[j:k])
        if k >= n:
            return "".join(out), None
        if text[k] == '"':
            return "".join(out), k + 1
        got = escape_at(text, k)
        if got is None:
            return "".join(out), None
        out.append(got[0])
        j = got[1]
    return "".join(out), None


def escape_at(text: str, k: int) -> tuple[str, int] | None:
    """The escape whose backslash is at ``text[k]``: ``(decoded, index after
    it)``, None when the text ends inside it (a high surrogate waits for
    the six characters after it, where its low half may be). Raises
    ValueError for a bad escape."""
    n = len(text)
    if k + 1 >= n:
        return None
    e = text[k + 1]
    if e == "u":
        hexa = text[k + 2:k + 6]
        if len(hexa) < 4:
            return None
        code = int(hexa, 16)
        j = k + 6
        if 0xD800 <= code < 0xDC00:  # a surrogate pair
            if n < j + 6:
                return None
            if text[j:j + 2] == "\\u":
                low = int(text[j + 2:j + 6], 16)
                if 0xDC00 <= low < 0xE000:
                    code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                    j += 6
        return (chr(code) if code < 0xD800 or code >= 0xE000 or code > 0xFFFF
                else "\ufffd"), j
    if e not in _ESCAPES:
        raise ValueError(f"bad escape \\{e} at {k}")
    return _ESCAPES[e], k + 2


def string_at(text: str, i: int) -> tuple[str, int]:
    """A complete JSON string at ``i``: ``(decoded, end)``; :class:`Incomplete`
    when the text ends inside it."""
    s, end = partial_string(text, i)
    if end is None:
        raise Incomplete
    return s, end


def value_end(text: str, i: int) -> int:
    """End index of the JSON value starting at ``i`` (after whitespace).
    Raises :class:`Incomplete` when the text ends inside it, ValueError when
    it is not JSON. Iterative: any depth."""
    i = ws(text, i)
    n = len(text)
    stack: list[str] = []
    while True:
        if i >= n:
            raise Incomplete
        c = text[i]
        if c == '"':
            _, i = string_at(text, i)
        elif c in "{[":
            stack.append("}" if c == "{" else "]")
            i = ws(text, i + 1)
            if i >= n:
                raise Incomplete
            if text[i] == stack[-1]:
                stack.pop()
                i += 1
            else:
                if stack[-1] == "}":
                    i = _key(text, i)
                continue
        elif c in "-0123456789":
            m = _NUMBER.match(text, i)
            if not m:
                raise ValueError(f"bad number at {i}")
            if m.end() >= n:  # a number may go on
                raise Incomplete
            i = m.end()
        else:
            for word in ("true", "false", "null"):
                if text.startswith(word, i):
                    i += len(word)
                    break
                if word.startswith(text[i:i + len(word)]) and i + len(word) > n:
                    raise Incomplete
            else:
                raise ValueError(f"unexpected {c!r} at {i}")
        # after a value: close containers or go on with the next item
        while True:
            if not stack:
                return i
            i = ws(text, i)
            if i >= n:
                raise Incomplete
            if text[i] == stack[-1]:
                stack.pop()
                i += 1
                continue
            if text[i] != ",":
                raise ValueError(f"expected ',' at {i}")
            i = ws(text, i + 1)
            if stack[-1] == "}":
                i = _key(text, i)
            break


def _key(text: str, i: int) -> int:
    """Past ``"key" :`` and the whitespace after it."""
    i = ws(text, i)
    if i >= len(text):
        raise Incomplete
    _, i = string_at(text, i)
    i = ws(text, i)
    if i >= len(text):
        raise Incomplete
    if text[i] != ":":
        raise ValueError(f"expected ':' at {i}")
    return ws(text, i + 1)


def object_items(text: str, i: int):
    """Walk the object whose ``{`` is at ``ws(text, i)``: yields ``(key,
    value_start)`` for each member, the caller reading each value and
    sending back its end (``gen.send(end)``). Ends with StopIteration whose
    value is the index after ``}``. Raises :class:`Incomplete` or
    ValueError."""
    i = ws(text, i)
    if i >= len(text):
        raise Incomplete
    if text[i] != "{":
        raise ValueError(f"expected an object at {i}")
    i = ws(text, i + 1)
    if i >= len(text):
        raise Incomplete
    if text[i] == "}":
        return i + 1
    while True:
        key, j = string_at(text, i) if i < len(text) else (None, None)
        if key is None:
            raise Incomplete
        j = ws(text, j)
        if j >= len(text):
            raise Incomplete
        if text[j] != ":":
            raise ValueError(f"expected ':' at {j}")
        start = ws(text, j + 1)
        end = yield key, start
        i = ws(text, end)
        if i >= len(text):
            raise Incomplete
        if text[i] == "}":
            return i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or '}}' at {i}")
        i = ws(text, i + 1)


def loads_prefix(text: str, i: int = 0):
    """``(value, end)`` of the complete JSON value at ``i``."""
    end = value_end(text, i)
    return json.loads(text[ws(text, i):end]), end


# ---- resumed scanning (issue 31, item 8) -------------------------------------------------
OPEN, DONE, ERROR = "open", "done", "error"

# the states of _NUMBER as a machine: start, minus, zero, integer, dot, fraction,
# e, exponent sign, exponent; the accepting ones end a number _NUMBER matches
_NUM_NEXT = {
    ("s", "-"): "m", ("s", "0"): "z", ("s", "d"): "i",
    ("m", "0"): "z", ("m", "d"): "i",
    ("z", "."): "p", ("z", "e"): "e",
    ("i", "0"): "i", ("i", "d"): "i", ("i", "."): "p", ("i", "e"): "e",
    ("p", "0"): "f", ("p", "d"): "f",
    ("f", "0"): "f", ("f", "d"): "f", ("f", "e"): "e",
    ("e", "-"): "x", ("e", "+"): "x", ("e", "0"): "y", ("e", "d"): "y",
    ("x", "0"): "y", ("x", "d"): "y",
    ("y", "0"): "y", ("y", "d"): "y",
}
_NUM_ACCEPT = frozenset("zify")
_NUM_CLASS = {**{c: "d" for c in "123456789"}, "0": "0", "-": "-", "+": "+", ".": ".",
              "e": "e", "E": "e"}
_LITERALS = ("true", "false", "null")
_WS_CHARS = " \t\n\r"
# scanner modes
_VALUE, _OBJ_FIRST, _ARR_FIRST, _KEY, _COLON, _AFTER, _STR, _NUM, _LIT = range(9)


class ValueScanner:
    """:func:`value_end` resumed: the JSON value that starts at the first
    piece is fed a piece at a time, and each :meth:`feed` reads only the new
    piece (plus at most the twelve characters of an unfinished escape), so
    a stream's parse of a growing tool call costs the same per token at its
    start and after 100k characters (issue 31, item 8: the whole answer was
    read again per token).

    :meth:`feed` answers what :func:`value_end` would say of all the text
    fed so far: ``OPEN`` (it raises :class:`Incomplete`), ``DONE`` (it
    returns an end: the value is complete, or complete unless a number goes
    on) or ``ERROR`` (it raises ValueError; ``failed`` once no more text can
    mend it). ``decode``: the decoded text of a top-level string is
    collected in ``out`` as it is read (:func:`partial_string`'s prefix).
    ``scanned``: characters fed (what the tests count)."""

    __slots__ = ("accepted", "buf", "decode", "done", "failed", "key", "mode", "num",
                 "out", "scanned", "stack")

    def __init__(self, decode: bool = False) -> None:
        self.stack: list[str] = []
        self.mode = _VALUE
        self.key = False  # the string being read is an object's key
        self.buf = ""  # an unfinished escape, a number's characters after its last match, a literal
        self.num = "s"
        self.accepted = False
        self.decode = decode
        self.out: list[str] = []
        self.done = False
        self.failed = False
        self.scanned = 0

    def feed(self, piece: str) -> str:
        self.scanned += len(piece)
        if not self.failed and not self.done:
            try:
                self._run(piece)
            except ValueError:
                self.failed = True
        if self.failed:
            return ERROR
        if self.done:
            return DONE
        if self.mode == _NUM:
            if not self.accepted:
                return ERROR  # "-" alone: _NUMBER does not match
            if self.buf:  # "1." : the number ends before the dot, then what follows
                return DONE if not self.stack else ERROR
        return OPEN

    def _value_done(self) -> None:
        if self.stack:
            self.mode = _AFTER
        else:
            self.done = True

    def _run(self, s: str) -> None:
        i, n = 0, len(s)
        while i < n and not self.done:
            mode = self.mode
            if mode == _STR:
                if self.buf:  # inside an escape
                    self.buf += s[i]
                    i += 1
                    got = escape_at(self.buf, 0)
                    if got is None:
                        continue
                    rest = self.buf[got[1]:]
                    self.buf = ""
                    if self.decode and not self.stack:
                        self.out.append(got[0])
                    if rest:
                        self._run(rest)
                    continue
                k = _PLAIN.match(s, i).end()
                if self.decode and not self.stack and k > i:
                    self.out.append(s[i:k])
                if k >= n:
                    return
                i = k + 1
                if s[k] == '"':
                    if self.key:
                        self.key = False
                        self.mode = _COLON
                    else:
                        self._value_done()
                else:
                    self.buf = "\\"
                continue
            c = s[i]
            if mode == _NUM:
                nxt = _NUM_NEXT.get((self.num, _NUM_CLASS.get(c, "")))
                if nxt is not None:
                    self.num = nxt
                    i += 1
                    if nxt in _NUM_ACCEPT:
                        self.accepted, self.buf = True, ""
                    else:
                        self.buf += c
                    continue
                if not self.accepted:
                    raise ValueError("bad number")
                rest, self.buf = self.buf, ""
                self._value_done()
                if rest:
                    self._run(rest)
                continue  # c again, after the number
            if mode == _LIT:
                self.buf += c
                i += 1
                if self.buf in _LITERALS:
                    self.buf = ""
                    self._value_done()
                elif not any(w.startswith(self.buf) for w in _LITERALS):
                    raise ValueError(f"unexpected {self.buf[0]!r}")
                continue
            if c in _WS_CHARS:
                i += 1
                continue
            if mode == _VALUE:
                i += 1
                if c == '"':
                    self.mode = _STR
                elif c == "{":
                    self.stack.append("}")
                    self.mode = _OBJ_FIRST
                elif c == "[":
                    self.stack.append("]")
                    self.mode = _ARR_FIRST
                elif c in "-0123456789":
                    self.mode, self.num, self.accepted, self.buf = _NUM, "s", False, ""
                    i -= 1
                else:
                    self.mode, self.buf = _LIT, ""
                    i -= 1
            elif mode in (_OBJ_FIRST, _ARR_FIRST):
                if c == self.stack[-1]:
                    self.stack.pop()
                    i += 1
                    self._value_done()
                else:
                    self.mode = _KEY if mode == _OBJ_FIRST else _VALUE
            elif mode == _KEY:
                if c != '"':
                    raise ValueError("expected a string")
                i += 1
                self.mode, self.key = _STR, True
            elif mode == _COLON:
                if c != ":":
                    raise ValueError("expected ':'")
                i += 1
                self.mode = _VALUE
            else:  # _AFTER
                i += 1
                if c == self.stack[-1]:
                    self.stack.pop()
                    self._value_done()
                elif c == ",":
                    self.mode = _KEY if self.stack[-1] == "}" else _VALUE
                else:
                    raise ValueError("expected ','")
