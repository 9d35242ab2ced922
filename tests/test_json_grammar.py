"""JSON schemas to grammars (ggmux.instance.grammar.json_grammar), checked by
llama.cpp's own grammar engine on text (tests/grammar_probe.py): issue 18,
finding 3 (raw control characters inside strings) and llama.cpp's current
converter rules."""

from __future__ import annotations

import pytest
from ggmux.instance.grammar.gbnf import check_gbnf
from ggmux.instance.grammar.json_grammar import SchemaError, schema_to_gbnf
from grammar_probe import GrammarProbe

FINDING_3 = {"type": "object", "properties": {"n": {"type": "integer"},
                                              "s": {"type": "string", "maxLength": 5}},
             "required": ["n", "s"]}


@pytest.fixture(scope="module")
def probe():
    p = GrammarProbe()
    yield p
    p.close()


def test_strings_exclude_raw_control_characters_and_allow_json_escapes(probe):
    # issue 18 finding 3: llama-cpp-python's converter let raw newlines into strings
    g = schema_to_gbnf(FINDING_3)
    assert probe.accepts(g, '{"n": 3, "s": "ab"}')
    for raw in ("\n", "\t", "\r", "\x01", "\x1f", "\x7f"):
        assert not probe.accepts(g, '{"n": 3, "s": "a' + raw + 'b"}'), repr(raw)
    for esc in ("\\n", "\\t", "\\\"", "\\\\", "\\u00e9", "\\b"):
        assert probe.accepts(g, '{"n": 3, "s": "a' + esc + '"}'), esc
    assert not probe.accepts(g, '{"n": 3, "s": "a\\x"}')  # not a JSON escape
    # maxLength counts characters (an escape is one)
    assert probe.accepts(g, '{"n": 1, "s": "abcde"}')
    assert not probe.accepts(g, '{"n": 1, "s": "abcdef"}')
    # whitespace between tokens, as llama.cpp's space rule: newlines allowed there
    assert probe.accepts(g, '{\n  "n": -12,\n  "s": ""\n}')
    assert not probe.accepts(g, '{"s": "a", "n": 1}')  # properties in schema order
    assert not probe.accepts(g, '{"n": 1}')  # s is required


def test_any_json_object_grammar_refuses_raw_newlines_in_strings(probe):
    from ggmux.instance.grammar.structured import json_grammar

    g = json_grammar()
    assert probe.accepts(g, '{"a": [1, 2.5e3, "x", null, true, {"b": {}}]}')
    assert not probe.accepts(g, '{"a": "x\ny"}')
    assert not probe.accepts(g, '[1]')  # json_object: an object


def test_integer_ranges_accept_exactly_their_integers(probe):
    for lo, hi in [(-5, 120), (0, 9), (7, 7), (-30, -4), (95, 1005)]:
        g = schema_to_gbnf({"type": "integer", "minimum": lo, "maximum": hi})
        got = [x for x in range(lo - 15, hi + 15) if probe.accepts(g, str(x))]
        assert got == list(range(lo, hi + 1)), (lo, hi)
    g = schema_to_gbnf({"type": "integer", "exclusiveMinimum": 3})
    assert [x for x in range(-3, 40) if probe.accepts(g, str(x))] == list(range(4, 40))
    assert not probe.accepts(g, "04")
    g = schema_to_gbnf({"type": "integer", "maximum": 12})
    assert [x for x in range(-3, 40) if probe.accepts(g, str(x))] == list(range(-3, 13))


def test_enums_consts_optional_properties_and_additional_properties(probe):
    g = schema_to_gbnf({"type": "object", "properties": {
        "a": {"enum": ["x", 2, None]}, "b": {"const": "k"}, "c": {"type": "boolean"}},
        "required": ["a"]})
    for ok in ('{"a": "x"}', '{"a": 2, "c": false}', '{"a": null, "b": "k", "c": true}'):
        assert probe.accepts(g, ok), ok
    for bad in ('{"a": "y"}', '{"a": "x", "b": "j"}', '{"a": "x", "z": 1}', '{}'):
        assert not probe.accepts(g, bad), bad
    g = schema_to_gbnf({"type": "object", "properties": {"a": {"type": "string"}},
                        "additionalProperties": {"type": "integer"}})
    assert probe.accepts(g, '{"a": "s", "ab": 1, "b": 2}')
    assert not probe.accepts(g, '{"b": "s"}')
    assert probe.accepts(schema_to_gbnf({"type": "object"}), '{"any": {"thing": [1]}}')


def test_arrays_tuples_refs_unions_and_formats(probe):
    g = schema_to_gbnf({"type": "array", "items": {"type": "number"}, "minItems": 1,
                        "maxItems": 3})
    assert probe.accepts(g, "[1, -2.5, 3e10]")
    assert not probe.accepts(g, "[]") and not probe.accepts(g, "[1, 2, 3, 4]")
    g = schema_to_gbnf({"type": "array", "prefixItems": [{"type": "integer"},
                                                         {"type": "string"}]})
    assert probe.accepts(g, '[1, "a"]') and not probe.accepts(g, '["a", 1]')
    node = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/node"},
                                                     {"type": "null"}]}},
        "required": ["v", "next"]}}, "$ref": "#/$defs/node"}
    g = schema_to_gbnf(node)
    assert probe.accepts(g, '{"v": 1, "next": {"v": 2, "next": null}}')
    assert not probe.accepts(g, '{"v": 1, "next": {"v": "2", "next": null}}')
    g = schema_to_gbnf({"type": ["string", "null"]})
    assert probe.accepts(g, "null") and probe.accepts(g, '"x"') and not probe.accepts(g, "1")
    g = schema_to_gbnf({"type": "string", "format": "date"})
    assert probe.accepts(g, '"2024-02-29"') and not probe.accepts(g, '"2024-13-01"')
    g = schema_to_gbnf({"type": "string", "pattern": "^[a-z]+-[0-9]{2,4}$"})
    assert probe.accepts(g, '"ab-123"') and not probe.accepts(g, '"ab-1"')


def test_grammars_pass_the_instance_syntax_check_and_bad_schemas_are_refused():
    for schema in (FINDING_3, {"type": "object"}, {}, {"type": "string", "maxLength": 2000}):
        check_gbnf(schema_to_gbnf(schema), 64, 2000)
    for bad, what in [({"type": "color"}, "unrecognized type"),
                      ({"$ref": "http://x/y"}, "same document"),
                      ({"enum": []}, "enum"),
                      ({"type": "string", "maxLength": -1}, "maxLength")]:
        with pytest.raises(SchemaError, match=what):
            schema_to_gbnf(bad)
    # constants are written as JSON (non-ASCII kept, as nlohmann's dump())
    assert '"\\"é\\""' in schema_to_gbnf({"const": "é"})
