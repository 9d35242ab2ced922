"""Small GBNF building blocks shared by the JSON-schema converter
(:mod:`ggmux.instance.grammar.json_grammar`) and its ``pattern`` translation
(:mod:`ggmux.instance.grammar.pattern_grammar`): literals, repetitions and integer
ranges, written as llama.cpp's ``common/json-schema-to-grammar.cpp`` writes
them (``format_literal``, ``build_repetition``, ``build_min_max_int``)."""

from __future__ import annotations

import json
import re

_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
_HEX = frozenset("0123456789abcdefABCDEF")

# llama.cpp's grammar parser (src/llama-grammar.cpp MAX_REPETITION_THRESHOLD)
# refuses a {m,n} whose m is above this and reads an n above it as no maximum
MAX_REPETITION_THRESHOLD = 2000


class RangeError(ValueError):
    """An integer range with neither bound."""


def format_literal(text: str) -> str:
    """``text`` as a GBNF literal (``"..."``, with ``\\r \\n " \\\\`` escaped)."""
    return '"' + _LITERAL_ESCAPE_RE.sub(lambda m: _LITERAL_ESCAPES[m.group()], text) + '"'


def json_text(value) -> str:
    """``value`` as nlohmann's ``dump()`` writes it: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def repetition(item: str, lo: int, hi: int | None, sep: str = "") -> str:
    """GBNF for ``lo`` to ``hi`` (None: unbounded) ``item``\\ s separated by
    ``sep`` (llama.cpp ``build_repetition``). A ``hi`` above
    :data:`MAX_REPETITION_THRESHOLD` is written as no maximum, which is what
    llama.cpp's grammar parser makes of it (Claude Code's ``Workflow`` tool
    has a ``maxLength`` of 524288): the grammar says what is enforced."""
    if hi is not None and hi > MAX_REPETITION_THRESHOLD:
        hi = None
    if hi == 0:
        return ""
    if lo == 0 and hi == 1:
        return item + "?"
    if not sep:
        if lo == 1 and hi is None:
            return item + "+"
        if lo == 0 and hi is None:
            return item + "*"
        return f"{item}{{{lo},{'' if hi is None else hi}}}"
    rest = repetition(f"({sep} {item})", max(0, lo - 1), None if hi is None else hi - 1)
    out = f"{item} {rest}"
    return f"({out})?" if lo == 0 else out


def _digits(lo: int, hi: int | None) -> str:
    """``[0-9]`` repeated lo..hi times (llama.cpp ``more_digits``)."""
    if lo == hi == 1:
        return "[0-9]"
    if lo == hi:
        return f"[0-9]{{{lo}}}"
    return f"[0-9]{{{lo},{'' if hi is None else hi}}}"


def _digit_range(a: str, b: str) -> str:
    return f"[{a}]" if a == b else f"[{a}-{b}]"


def _uniform_range(frm: str, to: str, out: list[str]) -> None:
    i = 0
    while i < len(frm) and i < len(to) and frm[i] == to[i]:
        i += 1
    if i > 0:
        out.append(f'"{frm[:i]}"')
    if i < len(frm) and i < len(to):
        if i > 0:
            out.append(" ")
        sub_len = len(frm) - i - 1
        if sub_len > 0:
            frm_sub, to_sub = frm[i + 1:], to[i + 1:]
            zeros, nines = "0" * sub_len, "9" * sub_len
            to_reached = False
            out.append("(")
            if frm_sub == zeros:
                out.append(_digit_range(frm[i], chr(ord(to[i]) - 1)) + " " +
                           _digits(sub_len, sub_len))
            else:
                out.append(f"[{frm[i]}] (")
                _uniform_range(frm_sub, nines, out)
                out.append(")")
                if ord(frm[i]) < ord(to[i]) - 1:
                    out.append(" | ")
                    if to_sub == nines:
                        out.append(_digit_range(chr(ord(frm[i]) + 1), to[i]))
                        to_reached = True
                    else:
                        out.append(_digit_range(chr(ord(frm[i]) + 1), chr(ord(to[i]) - 1)))
                    out.append(" " + _digits(sub_len, sub_len))
            if not to_reached:
                out.append(" | " + _digit_range(to[i], to[i]) + " ")
                _uniform_range(zeros, to_sub, out)
            out.append(")")
        else:
            out.append(f"[{frm[i]}-{to[i]}]")


def int_range(lo: int | None, hi: int | None, out: list[str], decimals: int = 16,
              top: bool = True) -> None:
    """Append GBNF for the integers from ``lo`` to ``hi`` (None: unbounded)
    to ``out`` (llama.cpp ``build_min_max_int``)."""
    if lo is not None and hi is not None:
        if lo < 0 and hi < 0:
            out.append('"-" (')
            int_range(-hi, -lo, out, decimals, True)
            out.append(")")
            return
        if lo < 0:
            out.append('"-" (')
            int_range(0, -lo, out, decimals, True)
            out.append(") | ")
            lo = 0
        lo_s, hi_s = str(lo), str(hi)
        for digits in range(len(lo_s), len(hi_s)):
            _uniform_range(lo_s, "9" * digits, out)
            lo_s = "1" + "0" * digits
            out.append(" | ")
        _uniform_range(lo_s, hi_s, out)
        return
    less = max(decimals - 1, 1)
    if lo is not None:
        if lo < 0:
            out.append('"-" (')
            int_range(None, -lo, out, decimals, False)
            out.append(") | [0] | [1-9] " + _digits(0, decimals - 1))
        elif lo == 0:
            out.append("[0] | [1-9] " + _digits(0, less) if top else _digits(1, decimals))
        elif lo <= 9:
            c = str(lo)
            start = "1" if top else "0"
            if c > start:
                out.append(_digit_range(start, chr(ord(c) - 1)) + " " + _digits(1, less) + " | ")
            out.append(_digit_range(c, "9") + " " + _digits(0, less))
        else:
            s = str(lo)
            c = s[0]
            if c > "1":
                out.append(_digit_range("1" if top else "0", chr(ord(c) - 1)) + " " +
                           _digits(len(s), less) + " | ")
            out.append(_digit_range(c, c) + " (")
            int_range(int(s[1:]), None, out, less, False)
            out.append(")")
            if c < "9":
                out.append(" | " + _digit_range(chr(ord(c) + 1), "9") + " " +
                           _digits(len(s) - 1, less))
        return
    if hi is not None:
        if hi >= 0:
            if top:
                out.append('"-" [1-9] ' + _digits(0, less) + " | ")
            int_range(0, hi, out, decimals, True)
        else:
            out.append('"-" (')
            int_range(-hi, None, out, decimals, False)
            out.append(")")
        return
    raise RangeError("an integer range needs a minimum or a maximum")


def escape_length(p: str, i: int) -> int:
    """Length of the GBNF escape at ``p[i]`` (0: none llama.cpp reads).
    ``\\-`` is left out: older llama.cpp builds do not read it."""
    if i + 1 >= len(p) or p[i] != "\\":
        return 0
    e = p[i + 1]
    if e in 'trn\\"[]':
        return 2
    n = {"x": 2, "u": 4, "U": 8}.get(e)
    if n is None or i + 2 + n > len(p) or not all(h in _HEX for h in p[i + 2:i + 2 + n]):
        return 0
    return 2 + n
