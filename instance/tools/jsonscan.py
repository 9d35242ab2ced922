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
        if k + 1 >= n:
            return "".join(out), None
        e = text[k + 1]
        if e == "u":
            hexa = text[k + 2:k + 6]
            if len(hexa) < 4:
                return "".join(out), None
            code = int(hexa, 16)
            j = k + 6
            if 0xD800 <= code < 0xDC00:  # a surrogate pair
                if len(text) < j + 6:
                    return "".join(out), None
                if text[j:j + 2] == "\\u":
                    low = int(text[j + 2:j + 6], 16)
                    if 0xDC00 <= low < 0xE000:
                        code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00)
                        j += 6
            out.append(chr(code) if code < 0xD800 or code >= 0xE000 or code > 0xFFFF
                       else "\ufffd")
            continue
        if e not in _ESCAPES:
            raise ValueError(f"bad escape \\{e} at {k}")
        out.append(_ESCAPES[e])
        j = k + 2
    return "".join(out), None


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
