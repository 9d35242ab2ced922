"""The instance's request checks, without a model (ggmux.instance.validate,
.structured, .gbnf); end to end with the real models in
test_real_validation.py."""

from __future__ import annotations

import pytest
from ggmux.instance import validate as V
from ggmux.instance.grammar.gbnf import GrammarError, check_gbnf
from ggmux.instance.grammar.structured import forced_tool, schema_grammar, structured_output

LIMITS = V.RequestLimits()
N_VOCAB = 49152


def param_of(fn, *args) -> str | None:
    with pytest.raises(V.BadRequest) as e:
        fn(*args)
    return e.value.param


def test_llama_cpps_own_grammars_pass_the_syntax_check():
    from llama_cpp import llama_grammar

    shipped = [getattr(llama_grammar, n) for n in dir(llama_grammar) if n.endswith("_GBNF")]
    assert len(shipped) >= 5
    for text in shipped:
        check_gbnf(text, 64, 2000)
    stats = check_gbnf('root ::= ("a" | [b-d]+ x){2,5} # c\nx ::= "\\u00e9"?', 8, 10)
    assert (stats.rules, stats.depth, stats.repetitions) == (2, 1, 5)


@pytest.mark.parametrize("text, where", [
    ('root ::= ("a"', "'(' not closed"),
    ('root ::= "a")', "line 1, column 13: expecting a newline"),
    ('root ::= "a"\n "b"', "line 2, column 2: expecting a rule name"),
    ('root ::= x', "rule 'x' is not defined"),
    ('x ::= "a"', "no 'root' rule"),
    ('root ::= *', "'*' needs an item"),
    ('root ::= "\\q"', "unknown escape"),
    ('root ::= "a"{3,2}', "max < min"),  # llama.cpp: unbounded rule generation, OOM
    ('root ::= "a"{2001}', "over 2000"),
    ("root ::= " + "(" * 3000 + '"a"' + ")" * 3000, "nested deeper than 2048"),  # a segfault
    ('root ::= "a\0"', "NUL"),
])
def test_grammars_llama_cpp_refuses_or_cannot_survive_are_named(text, where):
    with pytest.raises(GrammarError, match=r"(?s).*" + __import__("re").escape(where)):
        check_gbnf(text, 2048, 2000)


def test_sampling_fields_need_their_types_and_ranges():
    V.check_sampling({"temperature": 0.7, "max_tokens": 8, "seed": -1, "stop": ["x"],
                      "stream": True, "mirostat_tau": 5, "top_p": None, "dry_multiplier": 0.8,
                      "dry_penalty_last_n": -1, "dry_sequence_breakers": ["\n", ":"]})
    for body, param in [({"mirostat_tau": "x"}, "mirostat_tau"), ({"stream": "yes"}, "stream"),
                        ({"echo": 1}, "echo"), ({"suffix": 5}, "suffix"),
                        ({"mirostat_mode": 3}, "mirostat_mode"), ({"top_k": 2**40}, "top_k"),
                        ({"logprobs": "x"}, "logprobs"),
                        ({"dry_multiplier": -1}, "dry_multiplier"),
                        ({"dry_penalty_last_n": -2}, "dry_penalty_last_n"),
                        ({"dry_sequence_breakers": []}, "dry_sequence_breakers"),
                        ({"dry_sequence_breakers": ["\n", 5]}, "dry_sequence_breakers"),
                        ({"dry_sequence_breakers": ["x"] * 65}, "dry_sequence_breakers"),
                        ({"stream_options": {"include_usage": "y"}}, "stream_options")]:
        assert param_of(V.check_sampling, body) == param
    # llama.cpp's /completion names, as the instance maps them
    from ggmux.instance.server import native_request

    out = native_request({"n_predict": -1, "max_tokens": 9, "mirostat": 2})
    assert out["n_predict"] == 0 and "max_tokens" not in out  # n_predict wins, as in llama-server
    for body, param in [({"n_predict": "x"}, "n_predict"), ({"mirostat": 3}, "mirostat")]:
        assert param_of(V.check_sampling, native_request(body)) == param


def test_token_ids_are_checked_against_the_vocabulary():
    assert V.token_ids([0, 49151], N_VOCAB, "tokens") == [0, 49151]
    with pytest.raises(V.BadRequest, match=r"^tokens\[1\]: 49152 is not a token id of this "
                                           r"model \(vocabulary size 49152\)$"):
        V.token_ids([0, 49152], N_VOCAB, "tokens")
    assert param_of(V.token_ids, [True], N_VOCAB, "tokens") == "tokens[0]"
    assert V.completion_prompt({"prompt": ["hi"]}, N_VOCAB) == "hi"
    assert param_of(V.completion_prompt, {"prompt": [[1, -1]]}, N_VOCAB) == "prompt[0][1]"
    assert param_of(V.completion_prompt, {"prompt": []}, N_VOCAB) == "prompt"


def test_logit_bias_takes_openais_object_and_llama_cpps_pairs():
    assert V.logit_bias({"logit_bias": {"5": -100, "7": 2.5}}, N_VOCAB) == {5: -100.0, 7: 2.5}
    assert V.logit_bias({"logit_bias": [[5, 1]]}, N_VOCAB) == {5: 1.0}
    assert V.logit_bias({}, N_VOCAB) is None
    for lb, param in [([1], "logit_bias"), ({"abc": 1}, "logit_bias"),
                      ({"5": 101}, "logit_bias[5]"), ({"5": True}, "logit_bias[5]"),
                      ({"99999999": 1}, "logit_bias[99999999]")]:
        assert param_of(V.logit_bias, {"logit_bias": lb}, N_VOCAB) == param


def test_chat_messages_need_a_known_role_and_text_content():
    assert V.chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                         {"type": "text", "text": "b"}]}]) == [
        {"role": "user", "content": "ab"}]
    for msgs, param in [([{"role": "user", "content": None}], "messages[0].content"),
                        ([{"role": "user"}], "messages[0].content"),
                        ([{"role": "bogus", "content": "x"}], "messages[0].role"),
                        ([{"role": "user", "content": "x", "name": 5}], "messages[0].name"),
                        ([], "messages")]:
        assert param_of(V.chat_messages, msgs) == param


def test_tools_are_honoured_only_when_one_is_forced_or_none_is_wanted():
    f = {"type": "function", "function": {"name": "f"}}
    assert forced_tool({}, LIMITS) is None
    assert forced_tool({"tools": [f], "tool_choice": "none"}, LIMITS) is None
    assert forced_tool({"tools": [f], "tool_choice": {"type": "function", "function": {
        "name": "f"}}}, LIMITS) == {"name": "f", "parameters": {"type": "object"}}
    assert forced_tool({"functions": [{"name": "g", "parameters": {"type": "object"}}],
                        "function_call": {"name": "g"}}, LIMITS)["name"] == "g"
    for body, param in [({"tools": [f]}, "tools"), ({"tools": [f], "tool_choice": "auto"}, "tools"),
                        ({"tools": "x"}, "tools"), ({"functions": [5]}, "functions[0]"),
                        ({"tools": [f], "tool_choice": {"type": "function", "function": {
                            "name": "g"}}}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {
                            "name": "f", "parameters": {"type": "string", "minLength": 10**8}}}],
                          "tool_choice": {"type": "function", "function": {"name": "f"}}},
                         "tools[0].function.parameters.minLength")]:
        assert param_of(forced_tool, body, LIMITS) == param


def test_structured_output_comes_from_one_field_and_schemas_are_bounded():
    assert structured_output({}, LIMITS) is None
    assert structured_output({"response_format": {"type": "text"}}, LIMITS) is None
    assert "root" in structured_output({"response_format": {"type": "json_object"}}, LIMITS)
    g = structured_output({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}}},
        LIMITS)
    assert 'a-kv ::= "\\"a\\"" space ":" space integer' in g
    assert structured_output({"grammar": 'root ::= "x"'}, LIMITS) == 'root ::= "x"'
    for body, param in [
        ({"grammar": "x", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": "json"}, "response_format"),
        ({"json_schema": {"type": "string", "minLength": 10**8}}, "json_schema.minLength"),
        ({"json_schema": {"type": "string", "pattern": "((a{20}){20}){20}"}},
         "json_schema.pattern"),
        ({"json_schema": {"items": {"$ref": "https://example.com/s.json"}}},
         "json_schema.items.$ref"),
        ({"json_schema": {"properties": {"maxLength": {"type": "string", "maxLength": -1}}}},
         "json_schema.properties.maxLength.maxLength"),
    ]:
        assert param_of(structured_output, body, LIMITS) == param
    deep: dict = {"type": "array"}
    node = deep
    for _ in range(70):
        node["items"] = {"type": "array"}
        node = node["items"]
    assert param_of(schema_grammar, deep, LIMITS, "json_schema").startswith("json_schema.items")
    # a property *named* like a keyword is a name, not a count
    schema_grammar({"type": "object", "properties": {"maxLength": {"type": "string"}}}, LIMITS,
                   "json_schema")


def test_embedding_inputs_take_the_four_openai_forms_and_refuse_the_rest():
    assert V.embedding_inputs({"input": "a"}, N_VOCAB, LIMITS) == ["a"]
    assert V.embedding_inputs({"input": ["a", "b"]}, N_VOCAB, LIMITS) == ["a", "b"]
    assert V.embedding_inputs({"input": [1, 2]}, N_VOCAB, LIMITS) == [[1, 2]]
    assert V.embedding_inputs({"input": [[1], [2]]}, N_VOCAB, LIMITS) == [[1], [2]]
    for inp, param in [([1, "a"], "input[0]"), ([None], "input[0]"), ([""], "input[0]"),
                       ([[1, 99999999]], "input[0][1]"), ([[]], "input[0]"), ([], "input"),
                       (["a"] * 2049, "input")]:
        assert param_of(V.embedding_inputs, {"input": inp}, N_VOCAB, LIMITS) == param
    small = V.RequestLimits(max_embedding_inputs=2)
    assert param_of(V.embedding_inputs, {"input": ["a"] * 3}, N_VOCAB, small) == "input"
    assert V.fit_embedding_input([1, 2, 3], 2, True, "input") == [1, 2]
    assert param_of(V.fit_embedding_input, [1, 2, 3], 2, False, "input[4]") == "input[4]"


def test_request_limits_reach_an_instance_through_ggmux_serve(tmp_path):
    from ggmux.instance.server import parse_args
    from ggmux.supervisor.cli import build_parser, build_registry
    from ggmux.supervisor.registry import instance_argv

    (tmp_path / "m.json").write_text("{}")
    args = build_parser().parse_args(["serve", "--fake-models-dir", str(tmp_path),
                                      "--no-hf-cache", "--max-embedding-inputs", "7",
                                      "--max-grammar-bytes", "1000"])
    entry = build_registry(args).entries[0]
    argv = instance_argv(entry, 3, "python")
    assert argv[-4:] == ["--max-embedding-inputs", "7", "--max-grammar-bytes", "1000"]
    limits = V.request_limits_from_args(parse_args(argv[3:]))
    assert limits == V.RequestLimits(max_embedding_inputs=7, max_grammar_bytes=1000)
    # the defaults add nothing to the command line
    args = build_parser().parse_args(["serve", "--fake-models-dir", str(tmp_path),
                                      "--no-hf-cache"])
    assert build_registry(args).entries[0].instance_args == []


def test_generation_limits_default_to_n_predict_and_stop_at_max_tokens_limit():
    """Issue 18, finding 10, and llama-server's -n (issue 23)."""
    lim = V.RequestLimits(max_tokens_limit=100)
    assert V.generation_limit({"max_tokens": 7}, lim) == 7
    assert V.generation_limit({"max_completion_tokens": 100}, lim) == 100
    assert V.generation_limit({}, lim) == 100  # no limit asked: the cap
    assert V.generation_limit({"max_tokens": 0}, lim, default=64) == 64  # -n
    assert V.generation_limit({"n_predict": -1}, lim, default=500) == 100
    assert V.generation_limit({}, V.RequestLimits(max_tokens_limit=0)) is None  # the context
    for body, field in [({"max_tokens": 101}, "max_tokens"), ({"n_predict": 10**9}, "n_predict"),
                        ({"max_completion_tokens": 101}, "max_completion_tokens")]:
        with pytest.raises(V.BadRequest, match=rf"'{field}' is \d+, over this server's limit "
                                               r"of 100 generated tokens .*--max-tokens-limit"):
            V.generation_limit(body, lim)
        assert param_of(lambda b: V.generation_limit(b, lim), body) == field


def test_stop_strings_are_bounded_in_number_and_bytes():
    lim = V.RequestLimits(max_stops=2, max_stop_bytes=4)
    assert V.stop_strings({"stop": "ab"}, lim) == ["ab"]
    assert V.stop_strings({"stop": ["ab", "éé"]}, lim) == ["ab", "éé"]
    assert V.stop_strings({}, lim) == []
    assert param_of(lambda b: V.stop_strings(b, lim), {"stop": ["a", "b", "c"]}) == "stop"
    assert param_of(lambda b: V.stop_strings(b, lim), {"stop": ["a", "ééé"]}) == "stop[1]"
    assert param_of(lambda b: V.stop_strings(b, lim), {"stop": [1]}) == "stop"
    assert V.RequestLimits().max_stops == 64 and V.RequestLimits().max_stop_bytes == 256


def test_n_probs_is_capped_as_top_logprobs_is():
    """Issue 37, item 10: ``n_probs: 100000`` on ``/completion`` sent the whole
    vocabulary per token; it is refused past the same named limit as
    ``top_logprobs``."""
    from ggmux.instance.server import native_request

    V.check_sampling(native_request({"prompt": "x", "n_probs": V.MAX_TOP_LOGPROBS}))
    for n in (V.MAX_TOP_LOGPROBS + 1, 100000, "5"):
        assert param_of(V.check_sampling, native_request({"prompt": "x", "n_probs": n})) == "n_probs"
    assert param_of(V.check_sampling, {"top_logprobs": V.MAX_TOP_LOGPROBS + 1}) == "top_logprobs"
