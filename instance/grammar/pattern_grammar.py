"""A JSON schema's string ``pattern`` (a regex) as a GBNF rule, as
llama.cpp's converter translates it (``_visit_pattern``): anchored
``^...$`` patterns of literals, ``.``, character classes, groups (also
``(?:...)``), alternation, ``* + ?`` and ``{m,n}``. What has no grammar
equivalent (lookarounds, ``\\d``-style classes, inner anchors) is
:class:`UnsupportedPattern` (the converter then accepts any string, as
llama.cpp warns); what is not a regex at all is :class:`PatternError`."""

from __future__ import annotations

from collections.abc import Callable

from .gbnf_rules import escape_length, repetition

_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_ESCAPED_IN_REGEX_ONLY = frozenset("^$.[]()|{}*+?")
_MAX_PATTERN_DEPTH = 100


class UnsupportedPattern(Exception):
    """A valid regex with no grammar equivalent; ``str()`` says why."""


class PatternError(ValueError):
    """Not a regex llama.cpp's converter reads (unbalanced, a bad escape...)."""


def pattern_rule(add_rule: Callable[[str, str], str], pattern: str, name: str,
                 dotall: bool = False) -> str:
    """The name of a rule (added with ``add_rule(name, rule)``, a
    :class:`~ggmux.instance.grammar.json_grammar.GrammarBuilder`'s) matching the
    JSON strings that ``pattern`` fully matches; ``dotall``: ``.`` matches
    newlines too. Raises :class:`UnsupportedPattern` or :class:`PatternError`
    (rules added before the error are the caller's to drop)."""
    if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
        raise UnsupportedPattern("not anchored with '^' and '$'")
    p = pattern[1:-1]
    n = len(p)
    sub_ids: dict[str, str] = {}
    pos = 0
    depth = 0

    def to_rule(item: tuple[str, bool]) -> str:
        return f'"{item[0]}"' if item[1] else item[0]

    def transform() -> tuple[str, bool]:
        nonlocal pos, depth
        seq: list[list] = []  # [text, is_literal]

        def join() -> tuple[str, bool]:
            out: list[tuple[str, bool]] = []
            lit = ""
            for text, is_lit in seq:
                if is_lit:
                    lit += text
                else:
                    if lit:
                        out.append((lit, True))
                        lit = ""
                    out.append((text, False))
            if lit:
                out.append((lit, True))
            return " ".join(to_rule(x) for x in out), False

        while pos < n:
            c = p[pos]
            if c == ".":
                dot = "[\\U00000000-\\U0010FFFF]" if dotall else "[^\\x0A\\x0D]"
                seq.append([add_rule("dot", dot), False])
                pos += 1
            elif c == "(":
                pos += 1
                if pos < n and p[pos] == "?":
                    if pos + 1 < n and p[pos + 1] == ":":
                        pos += 2
                    else:
                        raise UnsupportedPattern("unsupported group syntax")
                depth += 1
                if depth > _MAX_PATTERN_DEPTH:
                    raise UnsupportedPattern("pattern nesting too deep")
                seq.append(["(" + to_rule(transform()) + ")", False])
            elif c == ")":
                pos += 1
                if depth == 0:
                    raise PatternError(f"Invalid pattern {pattern}: unbalanced parentheses")
                depth -= 1
                return join()
            elif c in "^$":
                raise UnsupportedPattern("anchor inside the pattern")
            elif c == "[":
                cls = "["
                pos += 1
                while pos < n and p[pos] != "]":
                    if p[pos] == "\\":
                        if pos + 1 < n and p[pos + 1] == "-":
                            cls += "\\x2D"
                            pos += 2
                            continue
                        k = escape_length(p, pos)
                        if k == 0:
                            raise UnsupportedPattern("unsupported escape in character "
                                                      "class: " + p[pos:pos + 2])
                        cls += p[pos:pos + k]
                        pos += k
                    else:
                        cls += p[pos]
                        pos += 1
                if pos >= n:
                    raise PatternError(f"Invalid pattern {pattern}: unterminated character "
                                       "class")
                seq.append([cls + "]", False])
                pos += 1
            elif c == "|":
                seq.append(["|", False])
                pos += 1
            elif c in "*+?":
                if not seq:
                    raise PatternError(f"Invalid pattern {pattern}: nothing to repeat")
                seq[-1] = [to_rule(tuple(seq[-1])) + c, False]
                pos += 1
            elif c == "{":
                j = p.find("}", pos)
                if j < 0:
                    raise UnsupportedPattern("unterminated curly brackets")
                nums = p[pos + 1:j].split(",")
                pos = j + 1
                try:
                    if len(nums) == 1:
                        lo = hi = int(nums[0])
                    elif len(nums) == 2:
                        lo = int(nums[0]) if nums[0] else 0
                        hi = int(nums[1]) if nums[1] else None
                    else:
                        raise UnsupportedPattern("wrong number of values in curly "
                                                  "brackets")
                except ValueError:
                    raise UnsupportedPattern("invalid number in curly brackets") from None
                if not seq:
                    raise PatternError(f"Invalid pattern {pattern}: nothing to repeat")
                text, is_lit = seq[-1]
                if not is_lit:
                    if text not in sub_ids:
                        sub_ids[text] = add_rule(f"{name}-{len(sub_ids) + 1}", text)
                    text = sub_ids[text]
                seq[-1] = [repetition(f'"{text}"' if is_lit else text, lo, hi), False]
            else:
                lit = ""
                while pos < n:
                    ch = p[pos]
                    if ch == "\\":
                        if pos == n - 1:
                            raise PatternError(f"Invalid pattern {pattern}: trailing backslash")
                        nxt = p[pos + 1]
                        if nxt in _ESCAPED_IN_REGEX_ONLY or nxt == "-":
                            lit += nxt
                            pos += 2
                        else:
                            k = escape_length(p, pos)
                            if k == 0:
                                raise UnsupportedPattern("unsupported escape: " +
                                                          p[pos:pos + 2])
                            lit += p[pos:pos + k]
                            pos += k
                    elif ch == '"':
                        lit += '\\"'
                        pos += 1
                    elif ch not in _NON_LITERAL and (
                            pos == n - 1 or not lit or p[pos + 1] == "." or
                            p[pos + 1] not in _NON_LITERAL):
                        lit += ch
                        pos += 1
                    else:
                        break
                if not lit:
                    raise UnsupportedPattern(f"unsupported character: {c}")
                seq.append([lit, True])
        return join()

    rule = to_rule(transform())
    if depth != 0:
        raise PatternError(f"Invalid pattern {pattern}: unbalanced parentheses")
    return add_rule(name, f'"\\"" ({rule}) "\\""')
