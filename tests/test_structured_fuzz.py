"""Structured output is always valid JSON matching its schema (issue 18,
finding 3): JSON schemas sampled by hypothesis (objects of integers with
ranges, numbers, strings with maxLength, enums, booleans, arrays, nested
objects, required subsets) go through each API's structured-output field
(OpenAI ``response_format``, Responses ``text.format``, Ollama ``format``)
to the real smollm2 model behind a real ``ggmux serve``; every complete
answer parses with ``json.loads`` and validates with ``jsonschema``.

The suite runs a few examples (seconds each); the long run is opt-in:
``python -m pytest tests/test_structured_fuzz.py -m fuzz`` (or
``GGMUX_FUZZ=1``), ``GGMUX_FUZZ_EXAMPLES`` examples (default 60).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import Server, free_port

hypothesis = pytest.importorskip("hypothesis")
jsonschema = pytest.importorskip("jsonschema")
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow  # the demo model; the grammar units: test_json_grammar.py

SMOL = "smollm2-135m"
MAX_TOKENS = 192  # every sampled schema bounds its strings and arrays: answers end sooner
FINDING_3 = {"type": "object", "properties": {"n": {"type": "integer"},
                                              "s": {"type": "string", "maxLength": 5}},
             "required": ["n", "s"]}


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    s = Server(["--proxies", "1", "--threads", "1", "--ctx-size", "512"], free_port(),
               d / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


NAMES = st.sampled_from(["a", "b", "name", "count", "ok", "items", "when", "x_1"])


def leaf():
    integer = st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
                        st.integers(-50, 50), st.integers(0, 500)) | st.just({"type": "integer"})
    string = st.builds(lambda lo, hi: {"type": "string", "minLength": lo, "maxLength": lo + hi},
                       st.integers(0, 3), st.integers(0, 8))
    enum = st.lists(st.text("abcxyz ", min_size=1, max_size=5), min_size=1, max_size=4,
                    unique=True).map(lambda v: {"type": "string", "enum": v})
    return st.one_of(integer, st.just({"type": "number"}), string, enum,
                     st.just({"type": "boolean"}))


def schemas():
    def objects(children):
        return st.dictionaries(NAMES, children, min_size=1, max_size=3).flatmap(
            lambda props: st.lists(st.sampled_from(sorted(props)), unique=True).map(
                lambda req: {"type": "object", "properties": props, "required": req}))

    def arrays(children):
        return st.builds(lambda item, hi: {"type": "array", "items": item, "maxItems": hi},
                         children, st.integers(0, 3))

    tree = st.recursive(leaf(), lambda c: objects(c) | arrays(c), max_leaves=5)
    return objects(tree)


def ask(s: Server, api: str, schema: dict, seed: int) -> tuple[str, bool]:
    """(answer text, complete) through ``api``'s structured-output field."""
    prompt = "Answer with a JSON object for a small example record."
    if api == "openai":
        status, doc = s.json("POST", "/v1/chat/completions", {
            "model": SMOL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": MAX_TOKENS, "seed": seed, "temperature": 1.0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "r", "schema": schema}}}, timeout=300)
        assert status == 200, doc
        c = doc["choices"][0]
        return c["message"]["content"], c["finish_reason"] == "stop"
    if api == "responses":
        status, doc = s.json("POST", "/v1/responses", {
            "model": SMOL, "input": prompt, "max_output_tokens": MAX_TOKENS,
            "temperature": 1.0, "text": {"format": {"type": "json_schema", "name": "r",
                                                    "schema": schema}}}, timeout=300)
        assert status == 200, doc
        text = "".join(p["text"] for item in doc["output"] if item["type"] == "message"
                       for p in item["content"] if p["type"] == "output_text")
        return text, doc["status"] == "completed"
    status, doc = s.json("POST", "/api/chat", {
        "model": SMOL, "messages": [{"role": "user", "content": prompt}], "stream": False,
        "format": schema, "options": {"num_predict": MAX_TOKENS, "seed": seed,
                                      "temperature": 1.0}}, timeout=300)
    assert status == 200, doc
    return doc["message"]["content"], doc.get("done_reason") == "stop"


def check(s: Server, api: str, schema: dict, seed: int) -> None:
    text, complete = ask(s, api, schema, seed)
    if not complete:  # cut at max_tokens: not a whole value (rare; logged by hypothesis)
        hypothesis.note(f"{api}: cut short: {text!r}")
        return
    doc = json.loads(text)  # raw control characters in a string would fail here
    jsonschema.validate(doc, schema)


def fuzz_asked(config) -> bool:
    expr = config.getoption("markexpr") or ""
    return os.environ.get("GGMUX_FUZZ") == "1" or ("fuzz" in expr and "not fuzz" not in expr)


def run_property(s: Server, examples: int) -> None:
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
    @given(schemas(), st.sampled_from(["openai", "responses", "ollama"]), st.integers(0, 2**31))
    def prop(schema, api, seed):
        check(s, api, schema, seed)

    prop()


def test_sampled_schemas_give_valid_json_in_every_api(smol):
    run_property(smol, 4)


@pytest.mark.fuzz
def test_sampled_schemas_give_valid_json_in_every_api_long_run(smol, request):
    if not fuzz_asked(request.config):
        pytest.skip("the long run is opt-in: -m fuzz or GGMUX_FUZZ=1")
    run_property(smol, int(os.environ.get("GGMUX_FUZZ_EXAMPLES", "60")))


def test_eight_concurrent_answers_hold_no_raw_newlines_in_strings(smol):
    # issue 18 finding 3, as reported: 2 of 8 concurrent answers for this schema had raw
    # newlines inside the string (llama-cpp-python's converter admitted control characters)
    def one(seed: int) -> str:
        status, doc = smol.json("POST", "/v1/chat/completions", {
            "model": SMOL, "max_tokens": 64, "seed": seed, "temperature": 1.2,
            "messages": [{"role": "user", "content": "Write JSON: a number n and a poem s of "
                                                     "several short lines."}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "p", "schema": FINDING_3}}},
            timeout=300)
        assert status == 200, doc
        return doc["choices"][0]["message"]["content"]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(8)))
    for text in answers:
        jsonschema.validate(json.loads(text), FINDING_3)
