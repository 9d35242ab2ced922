"""What a request constrains its output with: a GBNF ``grammar``, a JSON
schema (``json_schema``, ``response_format``) or a forced tool call, checked
and bounded before llama.cpp sees it (part of :mod:`ggmux.instance.validate`'s
rules, in a module of its own for size).

A grammar is checked by :func:`ggmux.instance.grammar.gbnf.check_gbnf` (llama.cpp's
syntax, nesting and repetition bounds); a JSON schema is walked without
recursion for its depth, repetition counts, ``pattern`` sizes and ``$ref``
targets before :mod:`ggmux.instance.grammar.json_grammar` turns it into a grammar (a
``minLength`` of 10**8 took 3.2 GB and 13 s to convert and parse), and the
grammar it gives is checked again. Every failure is a
:class:`~ggmux.instance.validate.BadRequest` naming the field.
"""

from __future__ import annotations

import re

import orjson

from ..validate import BadRequest, RequestLimits, is_int, shown
from .gbnf import GrammarError, check_gbnf
from .gbnf_rules import MAX_REPETITION_THRESHOLD
from .json_grammar import SchemaError, schema_to_gbnf

# ---- grammars and JSON schemas ---------------------------------------------

def grammar_text(text, limits: RequestLimits, field: str = "grammar") -> str:
    """A client's GBNF grammar, checked against ``limits`` and llama.cpp's
    syntax (:func:`~ggmux.instance.grammar.gbnf.check_gbnf`)."""
    if not isinstance(text, str):
        raise BadRequest(f"'{field}' must be a GBNF grammar (a string), not {shown(text)}", field)
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_grammar_bytes:
        raise BadRequest(f"'{field}' is {size} bytes, over the limit of "
                         f"{limits.max_grammar_bytes} (--max-grammar-bytes)", field)
    try:
        check_gbnf(text, limits.max_grammar_depth, limits.max_grammar_repetitions)
    except GrammarError as e:
        raise BadRequest(f"'{field}' is not a grammar this server accepts: {e}", field) from None
    return text


# schema keywords whose value is one subschema / a list of them / a map of them
_SUB = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
        "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords that become that many copies of a rule in the grammar; a maximum
# above llama.cpp's threshold becomes no maximum instead (gbnf_rules.repetition)
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_MAX_COUNTS = frozenset(k for k in _COUNTS if k.startswith("max"))


def _pattern_size(pattern: str) -> int:
    """Characters a regex ``pattern`` is written out to in a grammar: each
    ``{m,n}`` multiplies what it applies to by max(m, n), nested ones
    multiply (``(a{10}){10}`` is 100); ``*``, ``+``, ``?`` cost nothing
    extra (they become recursive rules), nor does an ``n`` above
    llama.cpp's threshold (it is written as no maximum)."""
    stack = [0]  # written size of each open group's content
    last = 0  # size of the last item of the innermost group
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            stack[-1] += 1
            last = 1
            continue
        if c == "[":
            j = i + 1
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            i = j + 1
            stack[-1] += 1
            last = 1
            continue
        if c == "(":
            stack.append(0)
            i += 1
            continue
        if c == ")" and len(stack) > 1:
            last = stack.pop()
            stack[-1] += last
            i += 1
            continue
        m = re.match(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}", pattern[i:])
        if m:
            hi = int(m.group(2) or 0)
            times = max(int(m.group(1)), hi if hi <= MAX_REPETITION_THRESHOLD else 0)
            stack[-1] += last * (times - 1)
            last *= times
            i += m.end()
            continue
        stack[-1] += 1
        last = 1
        i += 1
    return sum(stack)


def _check_schema(schema, limits: RequestLimits, field: str) -> None:
    """Walk a JSON schema (no recursion: a deep one is refused, not a
    RecursionError) checking its depth, repetition counts, patterns and
    ``$ref`` targets."""
    todo = [(schema, 1, field)]
    while todo:
        node, depth, path = todo.pop()
        if isinstance(node, bool):
            continue  # true / false schemas
        if not isinstance(node, dict):
            raise BadRequest(f"{path} must be a JSON schema (an object), not {shown(node)}", path)
        if depth > limits.max_schema_depth:
            raise BadRequest(f"{field} nests subschemas deeper than {limits.max_schema_depth} "
                             "(--max-schema-depth)", path)
        for k in _COUNTS:
            if k in node:
                v = node[k]
                if not is_int(v) or v < 0:
                    raise BadRequest(f"{path}.{k} must be an integer >= 0, not {shown(v)}",
                                     f"{path}.{k}")
                if v > limits.max_grammar_repetitions and not (
                        k in _MAX_COUNTS and v > MAX_REPETITION_THRESHOLD):
                    raise BadRequest(f"{path}.{k} is {v}, over the limit of "
                                     f"{limits.max_grammar_repetitions} "
                                     "(--max-grammar-repetitions)", f"{path}.{k}")
        if "pattern" in node:
            p = node["pattern"]
            if not isinstance(p, str):
                raise BadRequest(f"{path}.pattern must be a string", f"{path}.pattern")
            if _pattern_size(p) > limits.max_grammar_repetitions:
                raise BadRequest(f"{path}.pattern repeats more than "
                                 f"{limits.max_grammar_repetitions} characters "
                                 "(--max-grammar-repetitions)", f"{path}.pattern")
        ref = node.get("$ref")
        if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
            raise BadRequest(f"{path}.$ref: only references inside the schema (#/...) are "
                             "supported", f"{path}.$ref")
        for k in _SUB:
            if k in node:  # a list: the old tuple form of items
                sub = node[k] if isinstance(node[k], list) else [node[k]]
                todo += [(s, depth + 1, f"{path}.{k}") for s in sub]
        for k in _SUB_LISTS:
            if k in node:
                if not isinstance(node[k], list):
                    raise BadRequest(f"{path}.{k} must be a list of schemas", f"{path}.{k}")
                todo += [(s, depth + 1, f"{path}.{k}[{i}]") for i, s in enumerate(node[k])]
        for k in _SUB_MAPS:
            if k in node:
                if not isinstance(node[k], dict):
                    raise BadRequest(f"{path}.{k} must be an object of schemas", f"{path}.{k}")
                todo += [(s, depth + 1, f"{path}.{k}.{name}") for name, s in node[k].items()]


def schema_grammar(schema, limits: RequestLimits, field: str) -> str:
    """The GBNF grammar for JSON ``schema`` (:mod:`ggmux.instance.grammar.json_grammar`,
    llama.cpp's current converter rules), after checking the schema's size,
    depth and repetition counts against ``limits`` (a ``minLength`` of
    10**8 took 3.2 GB and 13 s to convert and parse), and the grammar it
    gives against the grammar limits. Raises :class:`BadRequest`."""
    if not isinstance(schema, dict):
        raise BadRequest(f"'{field}' must be a JSON schema (an object), not {shown(schema)}",
                         field)
    raw = orjson.dumps(schema)
    if len(raw) > limits.max_grammar_bytes:
        raise BadRequest(f"'{field}' is {len(raw)} bytes as JSON, over the limit of "
                         f"{limits.max_grammar_bytes} (--max-grammar-bytes)", field)
    _check_schema(schema, limits, field)
    try:
        gbnf = schema_to_gbnf(schema)
    except RecursionError:
        raise BadRequest(f"'{field}' is nested too deeply to convert", field) from None
    except (SchemaError, TypeError, ValueError) as e:
        reason = str(e) or type(e).__name__
        raise BadRequest(f"'{field}' cannot be turned into a grammar: {reason[:200]}",
                         field) from None
    size = len(gbnf.encode())
    if size > limits.max_grammar_bytes:
        raise BadRequest(f"'{field}' becomes a grammar of {size} bytes, over the limit of "
                         f"{limits.max_grammar_bytes} (--max-grammar-bytes)", field)
    try:
        check_gbnf(gbnf, limits.max_grammar_depth, limits.max_grammar_repetitions)
    except GrammarError as e:
        raise BadRequest(f"'{field}' becomes a grammar this server does not accept: {e}",
                         field) from None
    return gbnf


def json_grammar() -> str:
    """GBNF for any JSON object (``response_format: {"type": "json_object"}``
    without a schema: the converter's ``{"type": "object"}``)."""
    return schema_to_gbnf({"type": "object"})


def structured_output(body: dict, limits: RequestLimits) -> str | None:
    """The GBNF grammar a request constrains its output with, or None.

    From one of: ``grammar`` (llama.cpp: GBNF text), ``json_schema``
    (llama.cpp: a schema object), ``response_format`` (OpenAI:
    ``{"type": "text"}``, ``{"type": "json_object"}`` optionally with
    llama.cpp's ``schema``, ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}``). Another ``response_format`` type, or
    more than one of the three, is a :class:`BadRequest`."""
    given = [k for k in ("grammar", "json_schema") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
            raise BadRequest("'response_format' must be an object with a 'type' (text, "
                             f"json_object or json_schema), not {shown(rf)}", "response_format")
        if rf["type"] not in ("text", "json_object", "json_schema"):
            raise BadRequest(f"response_format.type {shown(rf['type'])} is not supported "
                             "(text, json_object, json_schema)", "response_format.type")
        if rf["type"] != "text":
            given.append("response_format")
    if len(given) > 1:
        raise BadRequest(f"give one of {', '.join(given)}, not several", given[1])
    if not given:
        return None
    if given[0] == "grammar":
        return grammar_text(body["grammar"], limits)
    if given[0] == "json_schema":
        return schema_grammar(body["json_schema"], limits, "json_schema")
    if rf["type"] == "json_object":
        if rf.get("schema") is not None:
            return schema_grammar(rf["schema"], limits, "response_format.schema")
        return json_grammar()
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise BadRequest("response_format.json_schema must be an object with a 'schema'",
                         "response_format.json_schema")
    if js.get("schema") is None:
        return json_grammar()
    return schema_grammar(js["schema"], limits, "response_format.json_schema.schema")



def _function(f, field: str) -> dict:
    if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
        raise BadRequest(f"{field} must be an object with a non-empty string 'name'", field)
    if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
        raise BadRequest(f"{field}.parameters must be a JSON schema object", f"{field}.parameters")
    if f.get("description") is not None and not isinstance(f["description"], str):
        raise BadRequest(f"{field}.description must be a string", f"{field}.description")
    return f


def forced_tool(body: dict, limits: RequestLimits) -> dict | None:
    """The tool a chat request forces, as ``{"name", "parameters"}``, or None:
    the rule for a model whose GGUF has no Jinja chat template (llama-cpp-python's
    chat handlers; a model with one calls tools through
    :mod:`ggmux.instance.tools`).

    ``tools`` (and the older ``functions``) are checked for shape. The
    instance can honour ``tool_choice: "none"`` (the tools are not
    offered) and a ``tool_choice`` (or ``function_call``) naming one
    function, whose arguments are then generated under its parameters'
    schema (llama-cpp-python's chat handler). It cannot let the model pick
    a tool itself (``auto``, ``required``, or no choice with tools given):
    it has no parser for tool calls in a template's output, so such a
    request is refused rather than answered as if no tools were given.
    Raises :class:`BadRequest`."""
    tools, functions = body.get("tools"), body.get("functions")
    declared: list[dict] = []
    if tools is not None:
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be a list of tools", "tools")
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or t.get("type") != "function":
                raise BadRequest(f"tools[{i}] must be an object with type 'function'",
                                 f"tools[{i}]")
            declared.append(_function(t.get("function"), f"tools[{i}].function"))
    if functions is not None:
        if not isinstance(functions, list):
            raise BadRequest("'functions' must be a list of functions", "functions")
        if declared:
            raise BadRequest("give 'tools' or 'functions', not both", "functions")
        declared = [_function(f, f"functions[{i}]") for i, f in enumerate(functions)]
    choice, field = body.get("tool_choice"), "tool_choice"
    if choice is None and body.get("function_call") is not None:
        choice, field = body["function_call"], "function_call"
        if isinstance(choice, dict):
            choice = {"type": "function", "function": choice}
    if isinstance(choice, dict):
        f = choice.get("function")
        if choice.get("type") != "function" or not isinstance(f, dict) or not isinstance(
                f.get("name"), str):
            raise BadRequest(f"'{field}' must be \"none\", \"auto\", \"required\" or "
                             '{"type": "function", "function": {"name": ...}}', field)
        tool = next((t for t in declared if t["name"] == f["name"]), None)
        if tool is None:
            raise BadRequest(f"'{field}' names {shown(f['name'])}, which is not in the "
                             "request's tools", field)
        params = tool.get("parameters") or {"type": "object"}
        schema_grammar(params, limits, f"tools[{declared.index(tool)}].function.parameters")
        return {"name": tool["name"], "parameters": params}
    if choice not in (None, "none", "auto", "required"):
        raise BadRequest(f"'{field}' must be \"none\", \"auto\", \"required\" or "
                         '{"type": "function", "function": {"name": ...}}', field)
    if choice == "required" and not declared:
        raise BadRequest(f"'{field}' is \"required\" but the request gives no tools", field)
    if declared and choice != "none":
        raise BadRequest("this instance cannot let the model choose among 'tools' (it has no "
                         "tool-call parser for the chat template): give 'tool_choice' "
                         '{"type": "function", "function": {"name": ...}} to force one, or '
                         '"none"', "tools" if tools is not None else "functions")
    return None


def response_schema(body: dict) -> dict | None:
    """The JSON schema of a request's structured output (``json_schema``,
    ``response_format``'s ``schema`` or ``json_schema.schema``; ``{"type":
    "object"}`` for a bare ``json_object``), or None (a GBNF ``grammar``,
    plain text). For a body :func:`structured_output` accepted."""
    if isinstance(body.get("json_schema"), dict):
        return body["json_schema"]
    rf = body.get("response_format")
    if not isinstance(rf, dict):
        return None
    if rf.get("type") == "json_object":
        return rf.get("schema") if isinstance(rf.get("schema"), dict) else {"type": "object"}
    if rf.get("type") == "json_schema":
        js = rf.get("json_schema") or {}
        return js.get("schema") if isinstance(js.get("schema"), dict) else {"type": "object"}
    return None
