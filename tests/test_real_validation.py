"""Bad and heavy requests against a real llama-cpp-python instance (issue 11,
findings 1, 3, 4 and 5, the instance's part; issue 18, findings 2 and 10:
the limits of stop strings and of generation; issue 23: llama-server's
answer fields and input forms, as its own test suite asserts them): one
``ggmux serve`` with smollm2 serves every check; each test ends by checking
that the replica that served it is the one loaded at the start (no crash,
no reload)."""

from __future__ import annotations

import json
import re
import socket
import threading

import pytest
from conftest import Server, children_of, free_port, wait_for

pytestmark = pytest.mark.slow  # the demo models end to end

SMOL = "smollm2-135m"
MAX_INPUTS = 2000  # not the default, so the test sees it reach the instance
CTX = 128  # ctx-size of the server (llama.cpp may round it up): long inputs stay cheap
# not the defaults, so the tests see them reach the instance
MAX_STOPS, MAX_STOP_BYTES, MAX_TOKENS, N_PREDICT = 8, 64, 48, 3
INTERNALS = re.compile(r"object has no attribute|NoneType|Traceback|not subscriptable|"
                       r"can only concatenate|invalid literal|not callable|KeyError|TypeError")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    d = tmp_path_factory.mktemp("validation")
    s = Server(["--proxies", "1", "--threads", "1", "--ctx-size", str(CTX),
                "--max-embedding-inputs", str(MAX_INPUTS), "--max-stops", str(MAX_STOPS),
                "--max-stop-bytes", str(MAX_STOP_BYTES), "--max-tokens-limit", str(MAX_TOKENS),
                "--n-predict", str(N_PREDICT)], free_port(), d / "server.log")
    try:
        s.wait_ready()
        # the model loads into the spare: its limits come with the load line
        wait_for(lambda: len(children_of(s.proc.pid)) == 2, 30, 0.05, "proxy and spare")
        status, _ = s.json("POST", "/v1/completions", {"model": SMOL, "prompt": "Hi",
                                                        "max_tokens": 1})
        assert status == 200
        s.n_ctx = s.json("GET", f"/props?model={SMOL}")[1]["n_ctx"]
        yield s
    finally:
        s.stop()


def served_once(s: Server) -> None:
    """The replica loaded at the start still serves: one load, no failure."""
    assert s.logs().count(f"loading {SMOL} in slot") == 1, s.logs()[-3000:]
    status = s.models()[SMOL]["status"]
    assert status["value"] == "loaded" and "failed" not in status
    assert s.json("POST", "/detokenize", {"model": SMOL, "tokens": [6004]}) == (
        200, {"content": "hi"})


def rejected(s: Server, path: str, body: dict) -> dict:
    """POST ``body`` (for SMOL); assert a 400 in OpenAI's envelope; the error."""
    status, doc = s.json("POST", path, {"model": SMOL, **body}, timeout=60)
    assert status == 400, (path, body, status, doc)
    err = doc["error"]
    assert err["type"] == "invalid_request_error", err
    assert not INTERNALS.search(err["message"]), err
    return err


def chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}


def test_token_ids_outside_the_vocabulary_are_400_naming_the_id_and_the_replica_lives(smol):
    # finding 1: /detokenize [999999999] or [-1] aborted the instance in
    # llama.cpp (std::out_of_range), and every route taking token ids could
    for path, body, param in [
        ("/detokenize", {"tokens": [999999999]}, "tokens[0]"),
        ("/detokenize", {"tokens": [6004, -1]}, "tokens[1]"),
        ("/v1/completions", {"prompt": [1, 999999999], "max_tokens": 2}, "prompt[1]"),
        ("/completion", {"prompt": [-1], "n_predict": 2}, "prompt[0]"),
        ("/v1/embeddings", {"input": [5, 999999999]}, "input[1]"),
        ("/v1/embeddings", {"input": [[5], [1, 999999999]]}, "input[1][1]"),
        ("/v1/completions", {"prompt": "Hi", "logit_bias": {"999999999": 1}},
         "logit_bias[999999999]"),
        ("/v1/chat/completions", chat(logit_bias={"-1": 5}), "logit_bias[-1]"),
    ]:
        err = rejected(smol, path, body)
        assert err["param"] == param, err
        bad = re.search(r"-?\d+(?= is not)", err["message"]).group()
        assert f"{bad} is not a token id of this model (vocabulary size 49152)" in err["message"]
    assert rejected(smol, "/detokenize", {"tokens": [999999999]})["message"] == (
        "tokens[0]: 999999999 is not a token id of this model (vocabulary size 49152)")
    served_once(smol)


def test_malformed_fields_are_400_naming_the_field_never_500(smol):
    # finding 3: each of these was a 500 with Python internals, or ignored,
    # or (the nested and long schemas) crashed or swelled the replica
    deep = {"type": "object"}
    node = deep
    for _ in range(100):
        node["properties"] = {"a": {"type": "object"}}
        node = node["properties"]["a"]
    big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 90}
                                            for i in range(3000)}}
    nested_groups = "root ::= " + "(" * 20000 + '"a"' + ")" * 20000
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ("/v1/completions", {"prompt": "Hi", "logit_bias": [1]}, "logit_bias"),
        ("/v1/completions", {"prompt": [-5]}, "prompt[0]"),
        ("/v1/completions", {"prompt": "Hi", "suffix": 5}, "suffix"),
        ("/v1/completions", {"prompt": "Hi", "grammar": 5}, "grammar"),
        ("/v1/completions", {"prompt": "Hi", "grammar": 'root ::= ("a"'}, "grammar"),
        ("/v1/completions", {"prompt": "Hi", "grammar": nested_groups}, "grammar"),
        ("/completion", {"prompt": "Hi", "grammar": 'root ::= "a"{3,2}'}, "grammar"),
        ("/v1/chat/completions", chat(response_format={"type": "json_object", "schema": deep}),
         "response_format.schema.properties.a" + ".properties.a" * 63),
        ("/v1/chat/completions", chat(json_schema=big), "json_schema"),
        # (a maxLength of 100,000, which llama-cpp-python wrote as 100,000 nested
        # groups, a segfault, is now no maximum, as llama.cpp's grammar parser
        # reads a bound over its threshold: tests/test_agent_schemas.py)
        ("/v1/chat/completions", chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "minLength": 10**6}}}),
         "response_format.json_schema.schema.minLength"),
        # ([1, "a"] is one input of llama-server's mixed form: token ids and text)
        ("/v1/embeddings", {"input": [1.5, "a"]}, "input[0]"),
        ("/v1/embeddings", {"input": [None]}, "input[0]"),
        ("/v1/embeddings", {"input": [[1, 999999999]]}, "input[0][1]"),
        ("/v1/embeddings", {"input": [""]}, "input[0]"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
         "messages[0].content"),
        ("/v1/chat/completions", chat(response_format="json"), "response_format"),
        ("/v1/chat/completions", chat(mirostat_tau="x"), "mirostat_tau"),
        ("/v1/chat/completions", chat(functions=[5], function_call={"name": "f"}),
         "functions[0]"),
        ("/v1/chat/completions", chat(tools=[{"type": "function"}]), "tools[0].function"),
        ("/v1/chat/completions", chat(tools=[tool], tool_choice={"type": "function"}),
         "tool_choice"),
        ("/v1/chat/completions", chat(tool_choice="required"), "tool_choice"),
        ("/v1/chat/completions", chat(tools=[tool], parallel_tool_calls=1),
         "parallel_tool_calls"),
        ("/v1/chat/completions", chat(tools=[tool], grammar='root ::= "a"'), "grammar"),
        ("/v1/chat/completions", chat(response_format={"type": "xml"}), "response_format.type"),
        ("/v1/chat/completions", chat(stream="yes"), "stream"),
        ("/v1/completions", {"prompt": "Hi", "stream": 1}, "stream"),
        ("/v1/chat/completions", chat(logprobs=3), "logprobs"),
        ("/v1/chat/completions", chat(n=9), "n"),
        ("/completion", {"prompt": "Hi", "mirostat": 5}, "mirostat"),
        ("/completion", {"prompt": "Hi", "n_predict": "x"}, "n_predict"),
    ]
    for path, body, param in cases:
        assert rejected(smol, path, body)["param"] == param, (path, body)
    # what is well formed works (short answers: grammar sampling is slow)
    status, doc = smol.json("POST", "/v1/chat/completions", {"model": SMOL, **chat(
        max_tokens=4, temperature=0, grammar='root ::= "yes" | "no"')})
    assert status == 200 and doc["choices"][0]["message"]["content"] in ("yes", "no"), doc
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    # (room for llama.cpp's whitespace rule: up to two newlines and 20 blanks between tokens)
    status, doc = smol.json("POST", "/v1/chat/completions", {"model": SMOL, **chat(
        max_tokens=48, temperature=0, response_format={
            "type": "json_schema", "json_schema": {"name": "ok", "schema": schema}})})
    assert status == 200, doc
    assert isinstance(json.loads(doc["choices"][0]["message"]["content"])["ok"], bool), doc
    # a forced tool call (its prompt lists the tool: longer than this server's ctx-size)
    # is tested in test_tools_real.py
    served_once(smol)


def greedy_first(s: Server, **extra) -> str:
    status, doc = s.json("POST", "/v1/completions", {
        "model": SMOL, "prompt": "The capital of France is", "max_tokens": 1,
        "temperature": 0, **extra})
    assert status == 200, doc
    return doc["choices"][0]["text"]


def token_of(s: Server, text: str) -> int:
    status, doc = s.json("POST", "/tokenize", {"model": SMOL, "content": text})
    assert status == 200 and len(doc["tokens"]) == 1, (text, doc)
    return doc["tokens"][0]


def test_logit_bias_moves_the_greedy_first_token(smol):
    # finding 4: llama-cpp-python dropped logit_bias (its processor list
    # was replaced by list.extend's None)
    first = greedy_first(smol)
    banned = token_of(smol, first)
    assert greedy_first(smol, logit_bias={str(banned): -100}) != first
    other = token_of(smol, " London")
    assert other != banned
    assert greedy_first(smol, logit_bias={str(other): 100}) == " London"
    # llama.cpp's [[id, bias]] form, and the chat route
    assert greedy_first(smol, logit_bias=[[other, 100]]) == " London"
    status, doc = smol.json("POST", "/v1/chat/completions", {"model": SMOL, **chat(
        max_tokens=1, temperature=0, logit_bias={str(other): 100})})
    assert status == 200 and doc["choices"][0]["message"]["content"] == " London", doc
    served_once(smol)


def test_embedding_inputs_are_bounded_in_number_and_length(smol):
    # finding 5: any number of inputs was computed; a long input was cut
    # silently to the batch size
    err = rejected(smol, "/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)})
    assert err["param"] == "input" and err["message"].endswith(
        f"over the limit of {MAX_INPUTS} per request (--max-embedding-inputs)"), err
    n_ctx = smol.n_ctx
    long = "one two three four five six seven eight nine ten " * (n_ctx // 5)
    err = rejected(smol, "/v1/embeddings", {"input": ["hi", long]})
    assert err["param"] == "input[1]" and "truncate" in err["message"], err
    err = rejected(smol, "/v1/embeddings", {"input": [6004] * (n_ctx + 1)})
    assert err["param"] == "input", err
    status, doc = smol.json("POST", "/v1/embeddings", {"model": SMOL, "input": [long, "hi"],
                                                       "truncate": True})
    assert status == 200, doc
    assert doc["usage"]["prompt_tokens"] == n_ctx + len(smol.json("POST", "/tokenize", {
        "model": SMOL, "content": "hi", "add_special": True})[1]["tokens"]), doc
    assert [d["index"] for d in doc["data"]] == [0, 1]
    served_once(smol)


def busy(s: Server) -> bool:
    status, doc = s.json("GET", f"/slots?model={SMOL}")
    assert status == 200, doc
    return any(slot["is_processing"] for slot in doc)


def post_and_leave(s: Server, path: str, body: dict) -> None:
    """Send ``body``, wait until the instance works on it, then disconnect."""
    data = json.dumps({"model": SMOL, **body}).encode()
    sock = socket.create_connection(("127.0.0.1", s.port))
    try:
        sock.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        wait_for(lambda: busy(s), 30, 0.05, "the instance to start on the request")
    finally:
        sock.close()


def test_a_long_embedding_batch_stops_when_its_client_leaves(smol):
    # finding 5: 10,000 inputs ran 11 CPU-minutes after the client left;
    # these 2,000 take minutes, one of them well under a second
    post_and_leave(smol, "/v1/embeddings",
                   {"input": ["The quick brown fox jumps over the lazy dog"] * MAX_INPUTS})
    wait_for(lambda: not busy(smol), 20, 0.1, "the instance to drop the abandoned batch")
    status, doc = smol.json("POST", "/v1/embeddings", {"model": SMOL, "input": "hello"})
    assert status == 200 and len(doc["data"]) == 1
    served_once(smol)


def test_a_client_leaving_a_grammar_constrained_generation_does_not_abort_the_replica(smol):
    # forcing end-of-sequence by making every other token -inf, as the
    # cancellation does without a grammar, aborts llama.cpp when the grammar
    # does not allow the end yet ("Unexpected empty grammar stack")
    post_and_leave(smol, "/v1/completions", {"prompt": "Say a", "max_tokens": 30,
                                             "temperature": 0, "grammar": 'root ::= "a"{1000}'})
    wait_for(lambda: not busy(smol), 60, 0.1, "the instance to finish the abandoned request")
    served_once(smol)


# ---- issue 18: limits of the work one request asks of the decode thread -------------

def api_error(s: Server, path: str, body: dict) -> tuple[int, str]:
    """POST ``body`` for SMOL; ``(status, message)`` read from the API's
    own envelope (OpenAI's, Anthropic's, Ollama's)."""
    status, doc = s.json("POST", path, {"model": SMOL, **body}, timeout=60)
    if path == "/v1/messages":
        assert doc["type"] == "error" and doc["error"]["type"] == "invalid_request_error", doc
        return status, doc["error"]["message"]
    if path.startswith("/api/"):
        assert isinstance(doc["error"], str), doc
        return status, doc["error"]
    assert doc["error"]["type"] == "invalid_request_error", doc
    return status, doc["error"]["message"]


MESSAGES = [{"role": "user", "content": "Hi"}]


def test_stop_strings_over_the_limits_are_400_in_every_apis_envelope(smol):
    many = [f"stop{i}" for i in range(MAX_STOPS + 1)]
    long = ["x" * (MAX_STOP_BYTES - 1) + "é"]  # one character, two bytes, past the limit
    for stops, why in ((many, f"over the limit of {MAX_STOPS} per request (--max-stops)"),
                       (long, (f"is {MAX_STOP_BYTES + 1} bytes, over the limit of "
                               f"{MAX_STOP_BYTES} bytes per stop string (--max-stop-bytes)"))):
        for path, body in [
            ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "stop": stops}),
            ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": stops}),
            ("/completion", {"prompt": "Hi", "n_predict": 2, "stop": stops}),
            ("/v1/messages", {"messages": MESSAGES, "max_tokens": 2, "stop_sequences": stops}),
            ("/api/chat", {"messages": MESSAGES, "stream": False,
                           "options": {"num_predict": 2, "stop": stops}}),
        ]:
            status, message = api_error(smol, path, body)
            assert status == 400, (path, message)
            assert why in message and "stop_sequences" in message and \
                "options.stop" in message, (path, message)
    # at the limits: served
    at = [f"never{i}" for i in range(MAX_STOPS - 1)] + ["y" * MAX_STOP_BYTES]
    status, doc = smol.json("POST", "/v1/completions", {"model": SMOL, "prompt": "Hi",
                                                         "max_tokens": 2, "stop": at})
    assert status == 200, doc
    served_once(smol)


def test_generation_limits_over_max_tokens_limit_are_400_in_every_apis_envelope(smol):
    over = MAX_TOKENS + 1
    for path, body, field in [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": over}, "max_tokens"),
        ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": over},
         "max_completion_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": over}, "max_tokens"),
        ("/completion", {"prompt": "Hi", "n_predict": over, "max_tokens": 2}, "n_predict"),
        ("/v1/messages", {"messages": MESSAGES, "max_tokens": over}, "max_tokens"),
        ("/api/generate", {"prompt": "Hi", "stream": False, "options": {"num_predict": over}},
         "max_tokens"),
    ]:
        status, message = api_error(smol, path, body)
        assert status == 400, (path, message)
        assert f"'{field}' is {over}, over this server's limit of {MAX_TOKENS} generated " \
               "tokens per request (--max-tokens-limit" in message, (path, message)
    # at the limit: served (a grammar of one token keeps it short)
    status, doc = smol.json("POST", "/v1/completions", {
        "model": SMOL, "prompt": "Hi", "max_tokens": MAX_TOKENS, "grammar": 'root ::= "a"'})
    assert status == 200 and doc["choices"][0]["text"] == "a", doc
    served_once(smol)


def test_a_request_that_gives_no_limit_generates_n_predict_tokens(smol):
    """llama-server's -n: a /completion without n_predict ran up to the
    context (256 tokens where llama-server stopped at 64)."""
    status, doc = smol.json("POST", "/completion", {"model": SMOL, "prompt": "Once upon a time",
                                                     "ignore_eos": True})
    assert status == 200 and doc["tokens_predicted"] == N_PREDICT, doc
    for body in ({"n_predict": -1}, {"n_predict": 0}):  # llama-server: the server's default
        status, doc = smol.json("POST", "/completion", {
            "model": SMOL, "prompt": "Once upon a time", "ignore_eos": True, **body})
        assert status == 200 and doc["tokens_predicted"] == N_PREDICT, (body, doc)
    for path, body in [("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 0})]:
        status, doc = smol.json("POST", path, {"model": SMOL, "ignore_eos": True, **body})
        assert status == 200 and doc["usage"]["completion_tokens"] == N_PREDICT, (path, doc)
    served_once(smol)


def test_the_worst_stop_request_the_limits_allow_beside_a_normal_stream(smol):
    """Issue 18, finding 2: the most and longest stop strings the limits
    allow, none of which the text completes (all share the text's
    beginnings, so the matcher walks into them at every token), beside an
    ordinary greedy request: both answers are what each gives alone."""
    prompt = "The capital of France is Paris. The capital of Italy is"
    plain = {"model": SMOL, "prompt": prompt, "max_tokens": 12, "temperature": 0,
             "ignore_eos": True}
    words = ["The", " capital", " of", " France", " is", " Paris", ".", " Rome", " the"]
    stops = [("".join(words[i:] + words[:i]) * 40)[:MAX_STOP_BYTES - 1] + "#"
             for i in range(MAX_STOPS)]
    assert all(len(x.encode()) == MAX_STOP_BYTES for x in stops)
    alone = {}
    for name, body in (("normal", plain), ("stops", {**plain, "stop": stops})):
        status, doc = smol.json("POST", "/v1/completions", body)
        assert status == 200, doc
        alone[name] = doc["choices"][0]["text"]
    assert alone["stops"] == alone["normal"]  # no stop string matched
    together: dict[str, str] = {}

    def ask(name: str, body: dict) -> None:
        status, doc = smol.json("POST", "/v1/completions", body)
        assert status == 200, doc
        together[name] = doc["choices"][0]["text"]

    threads = [threading.Thread(target=ask, args=("stops", {**plain, "stop": stops})),
               threading.Thread(target=ask, args=("normal", plain))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert together == alone
    # and a stop string that the text does complete ends it there, unsent
    cut = alone["normal"][len(alone["normal"]) // 2:][:6]
    status, doc = smol.json("POST", "/v1/completions", {**plain, "stop": [*stops[:-1], cut]})
    assert status == 200 and doc["choices"][0]["finish_reason"] == "stop", doc
    assert doc["choices"][0]["text"] == alone["normal"][:alone["normal"].index(cut)]
    served_once(smol)


# ---- llama-server's answers and inputs (issue 23) --------------------------

def events(s: Server, path: str, body: dict) -> list[dict]:
    """The JSON events of a streamed answer (``data: [DONE]`` left out)."""
    status, _, data = s.request("POST", path, {"model": SMOL, "stream": True, **body})
    assert status == 200, data[:500]
    return [json.loads(line[6:]) for line in data.decode().split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def test_answers_carry_timings_fingerprint_and_llama_servers_first_and_last_chunks(smol):
    # test_chat_completion.py's checks: system_fingerprint "b...", timings on a
    # whole answer; a stream's first chunk is the role alone (content null),
    # no later chunk names the role, the finish reason comes in an empty
    # delta, and timings_per_token/include_usage put timings where it does
    status, doc = smol.json("POST", "/v1/chat/completions", {"model": SMOL, **chat()})
    assert status == 200 and doc["system_fingerprint"].startswith("b"), doc
    t = doc["timings"]
    assert t["predicted_n"] == doc["usage"]["completion_tokens"] and t["prompt_n"] > 0, t
    assert {"prompt_per_second", "predicted_per_second", "cache_n"} <= set(t), t
    evs = events(smol, "/v1/chat/completions", chat(
        timings_per_token=True, stream_options={"include_usage": True}))
    assert evs[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}, evs[0]
    assert "timings" not in evs[0]
    body = [e for e in evs[1:] if e["choices"]]
    assert all("role" not in e["choices"][0]["delta"] for e in body), evs
    assert body[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                      "finish_reason": "length"}, body[-1]
    assert all("timings" in e for e in body[:-1]), body  # per token
    last = evs[-1]
    assert last["choices"] == [] and last["timings"]["predicted_n"] <= 4, last
    served_once(smol)


def test_verbose_answers_hold_llama_cpps_own_answer_with_the_prompt(smol):
    # test_verbose_debug: "__verbose" only when asked, its prompt the template's text
    msgs = [{"role": "system", "content": "Book"}, {"role": "user", "content": "Best book?"}]
    for verbose in (True, False):
        status, doc = smol.json("POST", "/v1/chat/completions", {
            "model": SMOL, "messages": msgs, "max_tokens": 2, "verbose": verbose})
        assert status == 200, doc
        assert ("__verbose" in doc) is verbose, doc
    v = smol.json("POST", "/v1/chat/completions", {"model": SMOL, "messages": msgs,
                                                    "max_tokens": 2, "verbose": True})[1]
    assert "Book" in v["__verbose"]["prompt"] and v["__verbose"]["stop"] is True, v
    assert v["__verbose"]["generation_settings"]["n_predict"] == 2, v
    served_once(smol)


def test_a_prompt_over_the_context_is_exceed_context_size_error(smol):
    # test_context_size_exceeded(_stream): llama-server's own error type, with the counts
    msgs = [{"role": "user", "content": "What is the best book " * 40}]
    for stream in (False, True):
        status, doc = smol.json("POST", "/v1/chat/completions", {
            "model": SMOL, "messages": msgs, "stream": stream})
        assert status == 400, doc
        err = doc["error"]
        assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == smol.n_ctx, err
        assert err["n_prompt_tokens"] > smol.n_ctx, err
        # and how to raise it (issue 37, the first hour)
        assert "ctx-size = N" in err["message"] and "--ctx-size N" in err["message"], err
    served_once(smol)


def test_a_chat_of_many_tiny_messages_is_refused_beside_another_tenants_request(smol):
    """Issue 37, item 1: 30,000 ``hi`` messages (1 MB) took 124 s to get their
    400 while another tenant's small request timed out: the engine tokenized
    the whole rendered chat (a quadratic partition) under the lock every
    request needs. Now the tokenization stops once past the context, and
    shares that lock: both answers come, in any order."""
    big = {"model": SMOL, "messages": [{"role": "user", "content": "hi"}] * 30000}
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(big=smol.json(
        "POST", "/v1/chat/completions", big, timeout=100)))
    t.start()
    status, doc = smol.json("POST", "/v1/chat/completions", {
        "model": SMOL, "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=100)
    t.join(110)
    assert status == 200, doc
    status, doc = out["big"]
    assert status == 400 and doc["error"]["type"] == "exceed_context_size_error", doc
    assert doc["error"]["n_prompt_tokens"] > smol.n_ctx
    served_once(smol)


def test_an_assistant_message_at_the_end_is_continued_as_llama_server_does(smol):
    # test_chat_template_assistant_prefill, ..._continue_final_message_*,
    # test_invalid_chat_completion_req[messages7]
    user = {"role": "user", "content": "What is the best book"}
    for prefill, shown_ in (("Whill", "Whill"),
                            ([{"type": "text", "text": "Wh"}, {"type": "text", "text": "ill"}],
                             "Wh\n\nill")):
        status, doc = smol.json("POST", "/v1/chat/completions", {
            "model": SMOL, "max_tokens": 2, "verbose": True,
            "messages": [user, {"role": "assistant", "content": prefill}]})
        assert status == 200, doc
        prompt = doc["__verbose"]["prompt"]
        assert prompt.endswith("What is the best book<|im_end|>\n<|im_start|>assistant\n"
                               + shown_), prompt[-200:]
    ok = smol.json("POST", "/v1/chat/completions", {
        "model": SMOL, "max_tokens": 2, "verbose": True, "add_generation_prompt": False,
        "continue_final_message": True, "messages": [user, {"role": "assistant",
                                                            "content": "Whill"}]})[1]
    assert ok["__verbose"]["prompt"].endswith("assistant\nWhill"), ok
    for body in ({"add_generation_prompt": True, "continue_final_message": True,
                  "messages": [user, {"role": "assistant", "content": "Hi"}]},
                 {"messages": [user, {"role": "assistant", "content": "a"},
                               {"role": "assistant", "content": "b"}]}):
        rejected(smol, "/v1/chat/completions", body)
    served_once(smol)


def test_native_completion_answers_and_prompt_forms(smol):
    # test_completion.py: generation_settings, timings, n_probs'
    # completion_probabilities, object prompts, token ids mixed with text,
    # several prompts answered as a list
    base = {"model": SMOL, "n_predict": 2, "temperature": 0}
    status, doc = smol.json("POST", "/completion", {**base, "prompt": "Hi", "n_probs": 3})
    assert status == 200 and doc["stop"] is True and doc["stop_type"] == "limit", doc
    assert doc["generation_settings"]["n_predict"] == 2 and doc["timings"]["predicted_n"] == 2
    probs = doc["completion_probabilities"]
    assert len(probs) == 2 and all(len(p["top_logprobs"]) == 3 for p in probs), probs
    hi = smol.json("POST", "/tokenize", {"model": SMOL, "content": "Hi"})[1]["tokens"]
    same = [smol.json("POST", "/completion", {**base, "prompt": p})[1]["content"]
            for p in ("Hi", {"prompt_string": "Hi"}, hi)]
    assert same[0] == same[1] == same[2], same
    status, many = smol.json("POST", "/completion", {**base, "prompt": [hi, "Hi",
                                                                        {"prompt_string": "Hi"}]})
    assert status == 200 and [d["content"] for d in many] == same and [
        d["index"] for d in many] == [0, 1, 2], many
    status, doc = smol.json("POST", "/completion", {**base, "prompt": [*hi, " there", *hi]})
    assert status == 200 and doc["tokens_evaluated"] > 2 * len(hi), doc
    rejected(smol, "/completion", {"prompt": {"prompt_string": "Hi", "multimodal_data": ["x"]}})
    evs = events(smol, "/completion", {**base, "prompt": "Hi", "n_probs": 2})
    assert [e["stop"] for e in evs] == [False, False, True], evs
    assert all(len(e["completion_probabilities"]) == 1 for e in evs[:-1]), evs
    assert evs[-1]["timings"]["predicted_n"] == 2 and "generation_settings" in evs[-1]
    served_once(smol)


def test_a_logit_bias_key_that_is_text_biases_its_tokens(smol):
    # llama-server tokenizes a key that is no token id (test_logit_bias of
    # test_completion.py); ggmux answered 400
    first = greedy_first(smol)
    assert greedy_first(smol, logit_bias={first: -100}) != first
    assert greedy_first(smol, logit_bias=[[first, False]]) != first
    assert greedy_first(smol, logit_bias={" London": 100}) == " London"
    served_once(smol)


def test_embedding_inputs_take_llama_servers_forms(smol):
    # test_embedding_content_text_same_as_string, test_embedding_mixed_input,
    # test_embedding_invalid_input
    status, doc = smol.json("POST", "/v1/embeddings", {"model": SMOL, "input": [
        "hello world", {"content": [{"type": "text", "text": "hello "},
                                    {"type": "text", "text": "world"}]},
        {"prompt_string": "hello world"}]})
    assert status == 200, doc
    vecs = [d["embedding"] for d in doc["data"]]
    assert vecs[0] == vecs[1] == vecs[2]
    status, doc = smol.json("POST", "/v1/embeddings", {"model": SMOL,
                                                       "input": [12, 34, "string", 56]})
    assert status == 200 and len(doc["data"]) == 1, doc
    for bad in ({"content": "string"}, {"content": [{"type": "unknown"}]},
                {"content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}):
        rejected(smol, "/v1/embeddings", {"input": bad})
    served_once(smol)


def test_timings_count_decode_steps_and_ride_on_progress_and_post_sampling_probs(smol):
    # test_metrics.py: the generation's rate is over predicted_n - 1 decode
    # steps (the first token is free) and 0 for one token; progress chunks
    # carry timings (timings_per_token), the first with nothing read yet and
    # prompt_ms never going back. test_completion.py: post_sampling_probs
    # answers prob/top_probs of the chain's candidates
    for n in (1, 8):
        st, doc = smol.json("POST", "/completion", {"model": SMOL, "prompt": "I believe",
                                                    "n_predict": n, "ignore_eos": True})
        t = doc["timings"]
        assert st == 200 and t["predicted_n"] == n, doc
        steps = n - 1
        assert t["predicted_per_token_ms"] == (t["predicted_ms"] / steps if steps else 0.0), t
        assert t["predicted_per_second"] == pytest.approx(
            1e3 * steps / t["predicted_ms"] if steps else 0.0)
    evs = events(smol, "/completion", {"prompt": "the quick brown fox " * 8, "n_predict": 2,
                                       "timings_per_token": True, "return_progress": True})
    prog = [e["timings"] for e in evs if "prompt_progress" in e]
    assert len(prog) >= 2, evs
    assert (prog[0]["prompt_n"], prog[0]["prompt_ms"], prog[0]["predicted_n"]) == (0, 0.0, 0)
    assert [p["prompt_ms"] for p in prog] == sorted(p["prompt_ms"] for p in prog)
    assert prog[-1]["prompt_ms"] > 0 and prog[-1]["prompt_n"] > 0
    st, doc = smol.json("POST", "/completion", {
        "model": SMOL, "prompt": "Today I would finally become a", "n_probs": 5,
        "temperature": 1.0, "n_predict": 2, "post_sampling_probs": True})
    assert st == 200 and len(doc["completion_probabilities"]) == 2, doc
    for tok in doc["completion_probabilities"]:
        assert 0.0 < tok["prob"] <= 1.0 and "logprob" not in tok, tok
        assert 0 < len(tok["top_probs"]) <= 5 and all(0.0 < c["prob"] <= 1.0
                                                      for c in tok["top_probs"]), tok
    # test_metrics_prometheus_format: the router's start in llama-server's
    # header; the replica's llama-server families, each with HELP and TYPE
    st, hs, _ = smol.request("GET", "/metrics")
    assert st == 200 and int(hs["process-start-time-unix"]) > 0, hs
    st, _, text = smol.request("GET", f"/metrics?model={SMOL}")
    assert st == 200, text
    for name, kind in (("prompt_tokens_total", "counter"), ("prompt_tokens_cached_total",
                                                             "counter"),
                       ("n_tokens_max", "counter"), ("spec_decode_num_drafts_total", "counter"),
                       ("n_busy_slots_per_decode", "gauge"), ("prompt_tokens_seconds", "gauge")):
        assert b"# HELP llamacpp:%s " % name.encode() in text, name
        assert b"# TYPE llamacpp:%s %s\n" % (name.encode(), kind.encode()) in text, name
    served_once(smol)


def test_return_progress_streams_the_prompts_evaluation(smol):
    # test_return_progress: prompt_progress chunks, the first with cache ==
    # processed, the last with every prompt token processed
    body = chat(max_tokens=2, return_progress=True,
                messages=[{"role": "user", "content": "This is a test " * 8}])
    for _ in range(2):  # the second reuses the first's cache
        prog = [e["prompt_progress"] for e in events(smol, "/v1/chat/completions", body)
                if "prompt_progress" in e]
        assert prog and prog[0]["cache"] == prog[0]["processed"], prog
        assert prog[-1]["processed"] == prog[-1]["total"] > 0, prog
    assert prog[0]["cache"] > 0, prog
    served_once(smol)
