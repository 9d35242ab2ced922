"""JSON schemas to GBNF grammars, by the rules of llama.cpp's current
converter (``common/json-schema-to-grammar.cpp`` and ``common/json-schema.cpp``).

One converter serves ``response_format``/``json_schema`` and the arguments of
tool calls (:mod:`ggmux.instance.tools`), so every JSON the model is made to
write follows the same rules:

* a string's ``char`` excludes ``"``, ``\\``, the control characters
  ``\\x00-\\x1F`` and ``\\x7F`` and allows JSON's escapes (``\\n``,
  ``\\uXXXX``...): a raw newline inside a string is not JSON (issue 18,
  finding 3: llama-cpp-python's older converter admitted control characters,
  and 2 of 8 answers had raw newlines in a string);
* whitespace between tokens is ``space ::= | " " | "\\n"{1,2} [ \\t]{0,20}``;
* numbers have at most 16 digits in each part; integers with ``minimum`` /
  ``maximum`` (or the exclusive ones) get a digit-wise range rule;
* ``minLength``/``maxLength``/``minItems``/``maxItems`` become ``{m,n}``
  repetitions (never nested groups);
* objects list their ``properties`` in the schema's order, required ones
  first; ``additionalProperties`` defaults to none when ``properties`` are
  given and to any value for a bare ``{"type": "object"}``;
* ``$ref`` only inside the document (``#/...``), recursion allowed;
  ``anyOf``/``oneOf``, ``allOf`` (objects merged, enums intersected), type
  lists, ``const``, ``enum``, ``prefixItems`` tuples, string ``format``
  ``date``/``time``/``date-time``/``uuid``; ``pattern`` when anchored with
  ``^...$`` (an unsupported one accepts any string, as llama.cpp warns).

:class:`GrammarBuilder` is llama.cpp's ``build_grammar`` builder
(``add_rule``, ``add_schema``); :func:`schema_to_gbnf` converts one schema.
Both raise :class:`SchemaError` for schemas llama.cpp refuses.
"""

from __future__ import annotations

import json
import logging
import re

log = logging.getLogger(__name__)

SPACE_RULE = '| " " | "\\n"{1,2} [ \\t]{0,20}'

# name -> (rule, rules it uses)
PRIMITIVE_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "boolean": ('("true" | "false")', ()),
    "decimal-part": ("[0-9]{1,16}", ()),
    "integral-part": ("[0] | [1-9] [0-9]{0,15}", ()),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?',
               ("integral-part", "decimal-part")),
    "integer": ('("-"? integral-part)', ("integral-part",)),
    "value": ("object | array | string | number | boolean | null",
              ("object", "array", "string", "number", "boolean", "null")),
    "object": (('"{" space ( string ":" space value ("," space string ":" space value)* )? '
               'space "}"'), ("string", "value")),
    "array": ('"[" space ( value ("," space value)* )? space "]"', ("value",)),
    "uuid": (('"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" '
             '[0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\""'), ()),
    "char": ('[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', ()),
    "string": ('"\\"" char* "\\""', ("char",)),
    "null": ('"null"', ()),
}

STRING_FORMAT_RULES: dict[str, tuple[str, tuple[str, ...]]] = {
    "date": ('[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [1-2] [0-9] | "3" [0-1] )',
             ()),
    "time": (('([01] [0-9] | "2" [0-3]) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{3} )? '
             '( "Z" | ( "+" | "-" ) ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'), ()),
    "date-time": ('date "T" time', ("date", "time")),
    "date-string": ('"\\"" date "\\""', ("date",)),
    "time-string": ('"\\"" time "\\""', ("time",)),
    "date-time-string": ('"\\"" date-time "\\""', ("date-time",)),
}

RESERVED_NAMES = frozenset({"root", *PRIMITIVE_RULES, *STRING_FORMAT_RULES})
_INVALID_RULE_CHARS = re.compile(r"[^a-zA-Z0-9-]+")
_LITERAL_ESCAPES = {"\r": "\\r", "\n": "\\n", '"': '\\"', "\\": "\\\\"}
_LITERAL_ESCAPE_RE = re.compile(r'[\r\n"\\]')
_NON_LITERAL = frozenset("|.()[]{}*+?^$")
_ESCAPED_IN_REGEX_ONLY = frozenset("^$.[]()|{}*+?")
_MAX_PATTERN_DEPTH = 100
_HEX = frozenset("0123456789abcdefABCDEF")


class SchemaError(ValueError):
    """A schema llama.cpp's converter refuses (an unknown type, a ``$ref``
    outside the document, a bad count); ``str()`` says where."""


class _UnsupportedPattern(Exception):
    pass


def format_literal(text: str) -> str:
    """``text`` as a GBNF literal (``"..."``, with ``\\r \\n " \\\\`` escaped)."""
    return '"' + _LITERAL_ESCAPE_RE.sub(lambda m: _LITERAL_ESCAPES[m.group()], text) + '"'


def json_text(value) -> str:
    """``value`` as nlohmann's ``dump()`` writes it: compact, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def repetition(item: str, lo: int, hi: int | None, sep: str = "") -> str:
    """GBNF for ``lo`` to ``hi`` (None: unbounded) ``item``\\ s separated by
    ``sep`` (llama.cpp ``build_repetition``)."""
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
    raise SchemaError("an integer range needs a minimum or a maximum")


def _escape_length(p: str, i: int) -> int:
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


class GrammarBuilder:
    """Rules of one grammar being built (llama.cpp's ``common_grammar_builder``).

    ``add_rule(name, rule)`` -> the rule's name (made unique);
    ``add_schema(name, schema)`` -> the name of the rule matching JSON values
    of ``schema`` (``name`` ``""`` or ``"root"``: the root rule);
    ``format()`` -> the grammar's text. ``dotall``: ``.`` in patterns matches
    newlines too."""

    def __init__(self, dotall: bool = False) -> None:
        self.dotall = dotall
        self.rules: dict[str, str] = {"space": SPACE_RULE}
        self._root: object = None
        self._resolving: set[str] = set()
        self.warnings: list[str] = []

    # ---- rules --------------------------------------------------------------
    def add_rule(self, name: str, rule: str) -> str:
        esc = _INVALID_RULE_CHARS.sub("-", name)
        if esc not in self.rules or self.rules[esc] == rule:
            self.rules[esc] = rule
            return esc
        i = 0
        while f"{esc}{i}" in self.rules and self.rules[f"{esc}{i}"] != rule:
            i += 1
        key = f"{esc}{i}"
        self.rules[key] = rule
        return key

    def add_primitive(self, name: str, spec: tuple[str, tuple[str, ...]]) -> str:
        n = self.add_rule(name, spec[0])
        for dep in spec[1]:
            dep_spec = PRIMITIVE_RULES.get(dep) or STRING_FORMAT_RULES.get(dep)
            if dep_spec is None:
                raise SchemaError(f"rule {dep} not known")
            if dep not in self.rules:
                self.add_primitive(dep, dep_spec)
        return n

    def add_schema(self, name: str, schema) -> str:
        if self._root is None:
            self._root = schema
        return self.visit(schema, "" if name == "root" else name, "#")

    def format(self) -> str:
        return "".join(f"{k} ::= {v}\n" for k, v in sorted(self.rules.items()))

    # ---- schemas ------------------------------------------------------------
    def visit(self, schema, name: str, path: str = "#") -> str:
        rule_name = name + "-" if name in RESERVED_NAMES else (name or "root")
        sub = name + "-" if name else ""
        if schema is True or schema == {}:
            return self.add_rule(rule_name, self.add_primitive("value", PRIMITIVE_RULES["value"]))
        if not isinstance(schema, dict):
            raise SchemaError(f"JSON schema error at {path}: schema must be an object")
        if "$ref" in schema:
            return self.add_rule(rule_name, self._ref(schema["$ref"], path))
        for key in ("oneOf", "anyOf"):
            if key in schema:
                alts = self._alternatives(schema[key], f"{path}/{key}")
                return self.add_rule(rule_name, self._union(name, alts, f"{path}/{key}"))
        typ = schema.get("type")
        if isinstance(typ, list):
            if not typ:
                raise SchemaError(f"JSON schema error at {path}: type must not be empty")
            alts = [{**schema, "type": t} for t in typ]
            return self.add_rule(rule_name, self._union(name, alts, f"{path}/type"))
        if "const" in schema:
            return self.add_rule(rule_name, format_literal(json_text(schema["const"])))
        if "enum" in schema:
            values = schema["enum"]
            if not isinstance(values, list) or not values:
                raise SchemaError(f"JSON schema error at {path}: enum must be a non-empty array")
            return self.add_rule(rule_name, "(" + " | ".join(
                format_literal(json_text(v)) for v in values) + ")")
        if typ is not None and not isinstance(typ, str):
            raise SchemaError(f"JSON schema error at {path}: type must be a string or an array "
                              "of strings")
        addl = schema.get("additionalProperties", True)
        has_props = "properties" in schema or addl is not True
        if typ is None:
            if has_props:
                return self._object(schema, name, rule_name, path)
            if "allOf" in schema:
                return self._all_of(schema["allOf"], name, rule_name, path)
            if "items" in schema or "prefixItems" in schema:
                return self._array(schema, sub, rule_name, path)
            if any(k in schema for k in ("pattern", "minLength", "maxLength")) or \
                    self._format(schema, path):
                return self._string(schema, rule_name, path)
            return self.add_rule(rule_name, self.add_primitive("value", PRIMITIVE_RULES["value"]))
        if typ == "object":
            if not has_props and "allOf" in schema:
                return self._all_of(schema["allOf"], name, rule_name, path)
            return self._object(schema, name, rule_name, path)
        if typ == "string":
            if "allOf" in schema:
                return self._all_of(schema["allOf"], name, rule_name, path)
            return self._string(schema, rule_name, path)
        if typ == "array":
            return self._array(schema, sub, rule_name, path)
        if typ == "integer":
            return self._integer(schema, rule_name, path)
        if typ in ("number", "boolean", "null"):
            return self._primitive(rule_name, typ)
        raise SchemaError(f"JSON schema error at {path}: unrecognized type {typ}")

    def _primitive(self, rule_name: str, typ: str) -> str:
        return self.add_primitive("root" if rule_name == "root" else typ, PRIMITIVE_RULES[typ])

    def _alternatives(self, alts, path: str) -> list:
        if not isinstance(alts, list):
            raise SchemaError(f"JSON schema error at {path}: must be an array of schemas")
        if not alts:
            raise SchemaError(f"JSON schema error at {path}: must not be empty")
        return alts

    def _union(self, name: str, alts: list, path: str) -> str:
        return " | ".join(self.visit(a, name + ("-" if name else "alternative-") + str(i),
                                     f"{path}/{i}") for i, a in enumerate(alts))

    def _target(self, ref, path: str):
        if not isinstance(ref, str):
            raise SchemaError(f"JSON schema error at {path}: $ref must be a string")
        if not ref.startswith("#/") and ref != "#":
            raise SchemaError(f"JSON schema error at {path}: unsupported $ref {ref}, only "
                              "references into the same document are supported")
        target = self._root
        for sel in ref[2:].split("/") if ref != "#" else []:
            sel = sel.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and sel in target:
                target = target[sel]
            elif isinstance(target, list) and sel.isdigit() and int(sel) < len(target):
                target = target[int(sel)]
            else:
                raise SchemaError(f"JSON schema error at {path}: cannot resolve $ref {ref}, "
                                  f"{sel} not found")
        return target

    def _ref(self, ref, path: str) -> str:
        target = self._target(ref, path)
        frag = ref.split("#", 1)[1] if "#" in ref else ref
        ref_name = "ref" + _INVALID_RULE_CHARS.sub("-", frag)
        if ref_name not in self.rules and ref not in self._resolving:
            self._resolving.add(ref)
            ref_name = self.visit(target, ref_name, ref)
            self._resolving.discard(ref)
        return ref_name

    @staticmethod
    def _format(schema: dict, path: str) -> str:
        f = schema.get("format")
        if f is None:
            return ""
        if not isinstance(f, str):
            raise SchemaError(f"JSON schema error at {path}: format must be a string")
        if f in ("date", "time", "date-time"):
            return f
        if f == "uuid" or re.fullmatch(r"uuid[1-5]", f):
            return "uuid"
        return ""

    @staticmethod
    def _count(schema: dict, key: str, path: str, default: int | None) -> int | None:
        if key not in schema:
            return default
        v = schema[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SchemaError(f"JSON schema error at {path}: {key} must be a non-negative "
                              "integer")
        return v

    def _string(self, schema: dict, rule_name: str, path: str) -> str:
        if "pattern" in schema:
            p = schema["pattern"]
            if not isinstance(p, str):
                raise SchemaError(f"JSON schema error at {path}: pattern must be a string")
            return self._pattern(p, rule_name)
        fmt = self._format(schema, path)
        if fmt == "uuid":
            return self._primitive(rule_name, "uuid")
        if fmt:
            prim = fmt + "-string"
            return self.add_rule(rule_name, self.add_primitive(prim, STRING_FORMAT_RULES[prim]))
        lo = self._count(schema, "minLength", path, 0)
        hi = self._count(schema, "maxLength", path, None)
        if lo or hi is not None:
            char = self.add_primitive("char", PRIMITIVE_RULES["char"])
            return self.add_rule(rule_name, f'"\\"" {repetition(char, lo, hi)} "\\""')
        return self._primitive(rule_name, "string")

    def _integer(self, schema: dict, rule_name: str, path: str) -> str:
        def bound(key: str, up: bool) -> int:
            v = schema[key]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SchemaError(f"JSON schema error at {path}: {key} must be a number")
            if isinstance(v, int):
                return v
            import math

            return math.ceil(v) if up else math.floor(v)

        lo = hi = None
        if "minimum" in schema:
            lo = bound("minimum", True)
        elif "exclusiveMinimum" in schema:
            lo = bound("exclusiveMinimum", False) + 1
        if "maximum" in schema:
            hi = bound("maximum", False)
        elif "exclusiveMaximum" in schema:
            hi = bound("exclusiveMaximum", True) - 1
        if lo is None and hi is None:
            return self._primitive(rule_name, "integer")
        if lo is not None and hi is not None and lo > hi:
            raise SchemaError(f"JSON schema error at {path}: minimum is above maximum")
        out = ["("]
        int_range(lo, hi, out)
        out.append(")")
        return self.add_rule(rule_name, "".join(out))

    def _array(self, schema: dict, sub: str, rule_name: str, path: str) -> str:
        key = "items" if "items" in schema else "prefixItems" if "prefixItems" in schema else None
        items = schema.get(key, True) if key else True
        if isinstance(items, list):
            parts = [self.visit(it, f"{sub}tuple-{i}", f"{path}/{key}/{i}")
                     for i, it in enumerate(items)]
            return self.add_rule(rule_name, '"[" space ' + ' "," space '.join(parts) +
                                 ' space "]"')
        lo = self._count(schema, "minItems", path, 0)
        hi = self._count(schema, "maxItems", path, None)
        if (items is True or items == {}) and lo == 0 and hi is None:
            return self._primitive(rule_name, "array")
        item = self.visit(items, f"{sub}item", f"{path}/{key or 'items'}")
        return self.add_rule(rule_name, '"[" space ' + repetition(item, lo, hi, '"," space') +
                             ' space "]"')

    def _object(self, schema: dict, name: str, rule_name: str, path: str) -> str:
        props = schema.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"JSON schema error at {path}: properties must be an object")
        req = schema.get("required")
        required = {r for r in req if isinstance(r, str)} if isinstance(req, list) else set()
        if "additionalProperties" in schema:
            addl = schema["additionalProperties"]
            if addl is False:
                addl = None
            elif addl is not True and not isinstance(addl, dict):
                raise SchemaError(f"JSON schema error at {path}: additionalProperties must be "
                                  "a boolean or a schema")
        else:
            addl = None if "properties" in schema else True
        if not props and (addl is True or addl == {}):
            return self.add_rule(rule_name, self.add_primitive("object", PRIMITIVE_RULES["object"]))
        return self.add_rule(rule_name, self._object_rule(
            [(k, v, f"{path}/properties/{k}") for k, v in props.items()], required, name, addl))

    def _all_of(self, children, name: str, rule_name: str, path: str) -> str:
        children = self._alternatives(children, f"{path}/allOf")
        required: set[str] = set()
        props: list[tuple[str, object, str]] = []
        enums: dict[str, int] = {}

        def add(comp, is_required: bool, where: str) -> None:
            if isinstance(comp, dict) and "$ref" in comp:
                comp = self._target(comp["$ref"], where)
            if not isinstance(comp, dict):
                return
            if "enum" in comp and isinstance(comp["enum"], list):
                for v in comp["enum"]:
                    lit = format_literal(json_text(v))
                    enums[lit] = enums.get(lit, 0) + 1
            elif "properties" in comp or comp.get("type") == "object":
                for k, v in (comp.get("properties") or {}).items():
                    props.append((k, v, f"{where}/properties/{k}"))
                    if is_required:
                        required.add(k)

        for i, child in enumerate(children):
            where = f"{path}/allOf/{i}"
            alts = child.get("anyOf") or child.get("oneOf") if isinstance(child, dict) else None
            if alts:
                for a in alts:
                    add(a, False, where)
            else:
                add(child, True, where)
        if enums:
            common = [lit for lit, n in enums.items() if n == len(children)]
            if common:
                return self.add_rule(rule_name, "(" + " | ".join(common) + ")")
        return self.add_rule(rule_name, self._object_rule(props, required, name, None))

    def _not_strings(self, strings: list[str]) -> str:
        """A JSON string that is none of ``strings`` (llama.cpp ``_not_strings``)."""
        trie: dict = {}
        for s in strings:
            node = trie
            for ch in s:
                node = node.setdefault(ch, {})
            node[""] = {}  # end of a word
        char = self.add_primitive("char", PRIMITIVE_RULES["char"])
        out = ['["] ( ']

        def esc(c: str) -> str:
            return {"\\": "\\\\", "]": "\\]", '"': '\\"', "\n": "\\n", "\r": "\\r",
                    "-": "\\x2D", "^": "\\x5E"}.get(c, c)

        def visit(node: dict) -> None:
            kids = [(c, n) for c, n in node.items() if c]
            for j, (c, child) in enumerate(kids):
                if j:
                    out.append(" | ")
                out.append(f"[{esc(c)}]")
                if any(k for k in child):
                    out.append(" (")
                    visit(child)
                    out.append(")")
                else:
                    out.append(f" {char}+")
            if kids:
                out.append(' | [^"' + "".join(esc(c) for c, _ in kids) + f"] {char}*")

        visit(trie)
        out.append(" )")
        if "" not in trie:
            out.append("?")
        out.append(' ["]')
        return "".join(out)

    def _object_rule(self, props: list[tuple[str, object, str]], required: set[str],
                     name: str, addl) -> str:
        kv: dict[str, str] = {}
        req_names: list[str] = []
        opt_names: list[str] = []
        prefix = name + "-" if name else ""
        for pname, pschema, where in props:
            prule = self.visit(pschema, prefix + pname, where)
            kv[pname] = self.add_rule(f"{prefix}{pname}-kv",
                                      f'{format_literal(json_text(pname))} space ":" space {prule}')
            (req_names if pname in required else opt_names).append(pname)
        if addl is not None:
            sub = prefix + "additional"
            value = (self.add_primitive("value", PRIMITIVE_RULES["value"])
                     if addl is True or addl == {} else self.visit(addl, sub + "-value"))
            key = (self.add_primitive("string", PRIMITIVE_RULES["string"]) if not props else
                   self.add_rule(sub + "-k", self._not_strings([p for p, _, _ in props])))
            kv["*"] = self.add_rule(sub + "-kv", f'{key} ":" space {value}')
            opt_names.append("*")
        if not req_names and not opt_names:
            return '"{" space "}"'
        rule = '"{" space ' + ' "," space '.join(kv[k] for k in req_names)
        if opt_names:
            rule += " ("
            if req_names:
                rule += ' "," space ( '

            def chain(ks: list[str], first_optional: bool) -> str:
                if not ks:
                    return ""
                k = ks[0]
                comma = f'( "," space {kv[k]} )'
                if first_optional:
                    res = comma + ("*" if k == "*" else "?")
                else:
                    res = kv[k] + (f" {comma}*" if k == "*" else "")
                if len(ks) > 1:
                    res += " " + self.add_rule(f"{prefix}{k}-rest", chain(ks[1:], True))
                return res

            rule += " | ".join(chain(opt_names[i:], False) for i in range(len(opt_names)))
            if req_names:
                rule += " )"
            rule += " )?"
        return rule + ' space "}"'

    # ---- patterns -----------------------------------------------------------
    def _pattern(self, pattern: str, name: str) -> str:
        saved = dict(self.rules)
        try:
            return self._pattern_rule(pattern, name)
        except _UnsupportedPattern as e:
            self.rules = saved
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            log.info("JSON schema: %s", self.warnings[-1])
            return self.add_rule(name, self.add_primitive("string", PRIMITIVE_RULES["string"]))

    def _pattern_rule(self, pattern: str, name: str) -> str:
        if len(pattern) < 2 or pattern[0] != "^" or pattern[-1] != "$":
            raise _UnsupportedPattern("not anchored with '^' and '$'")
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
                    dot = "[\\U00000000-\\U0010FFFF]" if self.dotall else "[^\\x0A\\x0D]"
                    seq.append([self.add_rule("dot", dot), False])
                    pos += 1
                elif c == "(":
                    pos += 1
                    if pos < n and p[pos] == "?":
                        if pos + 1 < n and p[pos + 1] == ":":
                            pos += 2
                        else:
                            raise _UnsupportedPattern("unsupported group syntax")
                    depth += 1
                    if depth > _MAX_PATTERN_DEPTH:
                        raise _UnsupportedPattern("pattern nesting too deep")
                    seq.append(["(" + to_rule(transform()) + ")", False])
                elif c == ")":
                    pos += 1
                    if depth == 0:
                        raise SchemaError(f"Invalid pattern {pattern}: unbalanced parentheses")
                    depth -= 1
                    return join()
                elif c in "^$":
                    raise _UnsupportedPattern("anchor inside the pattern")
                elif c == "[":
                    cls = "["
                    pos += 1
                    while pos < n and p[pos] != "]":
                        if p[pos] == "\\":
                            if pos + 1 < n and p[pos + 1] == "-":
                                cls += "\\x2D"
                                pos += 2
                                continue
                            k = _escape_length(p, pos)
                            if k == 0:
                                raise _UnsupportedPattern("unsupported escape in character "
                                                          "class: " + p[pos:pos + 2])
                            cls += p[pos:pos + k]
                            pos += k
                        else:
                            cls += p[pos]
                            pos += 1
                    if pos >= n:
                        raise SchemaError(f"Invalid pattern {pattern}: unterminated character "
                                          "class")
                    seq.append([cls + "]", False])
                    pos += 1
                elif c == "|":
                    seq.append(["|", False])
                    pos += 1
                elif c in "*+?":
                    if not seq:
                        raise SchemaError(f"Invalid pattern {pattern}: nothing to repeat")
                    seq[-1] = [to_rule(tuple(seq[-1])) + c, False]
                    pos += 1
                elif c == "{":
                    j = p.find("}", pos)
                    if j < 0:
                        raise _UnsupportedPattern("unterminated curly brackets")
                    nums = p[pos + 1:j].split(",")
                    pos = j + 1
                    try:
                        if len(nums) == 1:
                            lo = hi = int(nums[0])
                        elif len(nums) == 2:
                            lo = int(nums[0]) if nums[0] else 0
                            hi = int(nums[1]) if nums[1] else None
                        else:
                            raise _UnsupportedPattern("wrong number of values in curly "
                                                      "brackets")
                    except ValueError:
                        raise _UnsupportedPattern("invalid number in curly brackets") from None
                    if not seq:
                        raise SchemaError(f"Invalid pattern {pattern}: nothing to repeat")
                    text, is_lit = seq[-1]
                    if not is_lit:
                        if text not in sub_ids:
                            sub_ids[text] = self.add_rule(f"{name}-{len(sub_ids) + 1}", text)
                        text = sub_ids[text]
                    seq[-1] = [repetition(f'"{text}"' if is_lit else text, lo, hi), False]
                else:
                    lit = ""
                    while pos < n:
                        ch = p[pos]
                        if ch == "\\":
                            if pos == n - 1:
                                raise SchemaError(f"Invalid pattern {pattern}: trailing backslash")
                            nxt = p[pos + 1]
                            if nxt in _ESCAPED_IN_REGEX_ONLY or nxt == "-":
                                lit += nxt
                                pos += 2
                            else:
                                k = _escape_length(p, pos)
                                if k == 0:
                                    raise _UnsupportedPattern("unsupported escape: " +
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
                        raise _UnsupportedPattern(f"unsupported character: {c}")
                    seq.append([lit, True])
            return join()

        rule = to_rule(transform())
        if depth != 0:
            raise SchemaError(f"Invalid pattern {pattern}: unbalanced parentheses")
        return self.add_rule(name, f'"\\"" ({rule}) "\\""')


def schema_to_gbnf(schema) -> str:
    """GBNF text whose ``root`` matches the JSON values of ``schema`` (a
    dict or ``True``). Raises :class:`SchemaError`."""
    b = GrammarBuilder()
    b.add_schema("root", schema)
    return b.format()
