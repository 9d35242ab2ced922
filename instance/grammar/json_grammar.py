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
* ``$ref`` only inside the document (``#/...``), recursion allowed; the
  document is the schema given to :meth:`GrammarBuilder.add_schema`, or the
  innermost :class:`Document` around the reference (a tool's parameters
  wrapped inside a call's schema: issue 31, item 2), so ``$defs`` and
  ``definitions`` (draft 7) resolve against the schema that holds them; a
  cycle of references with nothing between them (``A -> B -> A``, ``#``
  to itself) matches no JSON and is a :class:`SchemaError`;
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
import math
import re

from .gbnf_rules import RangeError, format_literal, int_range, json_text, repetition
from .pattern_grammar import PatternError, UnsupportedPattern, pattern_rule

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


class SchemaError(ValueError):
    """A schema llama.cpp's converter refuses (an unknown type, a ``$ref``
    outside the document, a bad count); ``str()`` says where."""


class Document(dict):
    """A schema that is a JSON document of its own inside a larger schema:
    ``#/...`` references inside it resolve against it, not against the
    schema it is wrapped in (a tool's ``parameters`` as the ``arguments``
    of a tool call's schema, where pydantic v2 writes ``"$ref":
    "#/$defs/City"`` for a nested model: issue 31, item 2). Behaves as the
    dict it copies."""

    __slots__ = ()


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
        # (document, reference) -> its rule's name; documents by content, so
        # one tool's parameters wrapped twice share their rules
        self._refs: dict[tuple[str, str], str] = {}
        self._ref_names: set[str] = set()
        self._doc_keys: dict[int, tuple[object, str]] = {}
        self._chain: list[tuple[str, str]] = []  # references being resolved, outermost first
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

    def add_schema(self, name: str, schema, document=None) -> str:
        """The rule for ``schema``; its ``#/...`` references resolve against
        ``document`` (default: ``schema`` itself, or a :class:`Document`
        inside it)."""
        outer = self._root
        self._root = schema if document is None else document
        try:
            return self.visit(schema, "" if name == "root" else name, "#")
        finally:
            self._root = outer

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
        if isinstance(schema, Document) and schema is not self._root:
            outer = self._root
            self._root = schema
            try:
                return self.visit(schema, name, path)
            finally:
                self._root = outer
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

    def _doc_key(self) -> str:
        root = self._root
        got = self._doc_keys.get(id(root))
        if got is None or got[0] is not root:
            try:
                key = json.dumps(root, sort_keys=True, default=repr)
            except (TypeError, ValueError):
                key = f"id:{id(root)}"
            got = self._doc_keys[id(root)] = (root, key)  # holds root: its id stays its own
        return got[1]

    def _ref(self, ref, path: str) -> str:
        """The rule of the schema ``ref`` names in the current document. A
        reference met again while it is being resolved (a recursive model)
        is its rule's name; met again with only references in between, it
        is a cycle that matches nothing (llama.cpp would take the grammar
        and then refuse it as left recursion)."""
        key = (self._doc_key(), ref)
        if key in self._refs:
            if key in self._chain:
                loop = self._chain[self._chain.index(key):]
                if all(self._bare_ref(k[1], path) for k in loop):
                    raise SchemaError(
                        f"JSON schema error at {path}: $ref cycle "
                        f"{' -> '.join(r for _, r in loop)} -> {ref} with nothing between "
                        "the references: it matches no JSON value")
            return self._refs[key]
        target = self._target(ref, path)
        frag = ref.split("#", 1)[1] if "#" in ref else ref
        base = "ref" + _INVALID_RULE_CHARS.sub("-", frag)
        ref_name, i = base, 0
        while ref_name in self._ref_names or ref_name in self.rules:
            ref_name, i = f"{base}{i}", i + 1
        self._ref_names.add(ref_name)
        self._refs[key] = ref_name
        self._chain.append(key)
        try:
            got = self.visit(target, ref_name, ref)
        finally:
            self._chain.pop()
        self._refs[key] = got  # a primitive's rule has the primitive's name
        return got

    def _bare_ref(self, ref: str, path: str) -> bool:
        """Whether ``ref`` names a schema that is only a ``$ref``."""
        t = self._target(ref, path)
        return isinstance(t, dict) and "$ref" in t

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
        try:
            int_range(lo, hi, out)
        except RangeError as e:
            raise SchemaError(str(e)) from None
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
            return pattern_rule(self.add_rule, pattern, name, self.dotall)
        except UnsupportedPattern as e:
            self.rules = saved
            self.warnings.append(f"pattern {pattern} is not supported ({e}), accepting any string")
            log.info("JSON schema: %s", self.warnings[-1])
            return self.add_rule(name, self.add_primitive("string", PRIMITIVE_RULES["string"]))
        except PatternError as e:
            raise SchemaError(str(e)) from None


def schema_to_gbnf(schema) -> str:
    """GBNF text whose ``root`` matches the JSON values of ``schema`` (a
    dict or ``True``). Raises :class:`SchemaError`."""
    b = GrammarBuilder()
    b.add_schema("root", schema)
    return b.format()
