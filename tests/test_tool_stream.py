"""The stream parser's work per token is bounded, and its deltas are those
of parsing the whole answer again at each token (issue 31, item 8), on
bytes, no process.

A stream (:class:`~ggmux.instance.tools.stream.ChatStream`) used to parse
the whole answer after every piece: a call of n tokens cost O(n^2) (one
Hermes call of 32k tokens, 11.4 s of CPU). Now a parse that stops inside a
growing field (a call's arguments, content, reasoning) is read on from
where it stopped. Here, in every format: answers (calls with arguments
full of escapes, surrogates, numbers cut between tokens, markers inside
strings, broken JSON; content and reasoning around them) are fed token by
token, and each feed's deltas are compared with the reference stream
(``incremental=False``: the whole text parsed at each piece, the old
behaviour), then the final message; the resumed JSON scanner agrees with
:func:`~ggmux.instance.tools.jsonscan.value_end` on every prefix; and a
long call is parsed a few times, its characters read a bounded number of
times each (the reference reads them once per token: the test fails on it).
The CPU figures are in bench/RESULTS.md (bench/tool_stream_parse.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from ggmux.instance.template import JinjaTemplate
from ggmux.instance.tools import format_for, jsonscan
from ggmux.instance.tools.base import ToolRequest
from ggmux.instance.tools.jsonscan import DONE, ERROR, OPEN, Incomplete, ValueScanner, value_end
from ggmux.instance.tools.stream import ChatStream

TEMPLATES = Path(__file__).parent / "templates"
TOOL = {"type": "function", "function": {"name": "special_function", "description": "d",
                                         "parameters": {"type": "object"}}}

# (template, request fields, [answer shapes]); @A@ stands for a call's arguments
CALLS = "<｜tool▁calls▁begin｜>"
FORMATS = [
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", {}, [
        '{"tool_calls": [{"name": "special_function", "arguments": @A@}]}',
        ('{"tool_calls": [{"name": "special_function", "arguments": @A@}, '
        '{"arguments": @A@, "name": "special_function", "id": "x"}]}'),
        '{"tool_call": {"name": "special_function", "arguments": "@S@"}}',
        '{"response": "@S@"}']),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", {}, [
        ('Let me see: @T@<tool_call>\n{"name": "special_function", "arguments": @A@}\n</tool_call>'
        '\n<tool_call>{"name": "special_function", "arguments": @A@}</tool_call>@T@'),
        '{"name": "special_function", "arguments": @A@}',
        '<function=special_function>@A@</function>@T@']),
    ("Qwen-Qwen3-0.6B.jinja", {}, [
        ("<think>@T@</think>\n\n<tool_call>\n"
        '{"name": "special_function", "arguments": @A@}\n</tool_call>'),
        "<think>\n@T@\n</think>@T@"]),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", {}, [
        '{"name": "special_function", "parameters": @A@}',
        ('{"type": "function", "name": "special_function", "parameters": @A@}; '
        '{"name": "special_function", "parameters": @A@}')]),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", {}, [
        '@T@[TOOL_CALLS][{"name": "special_function", "arguments": @A@, "id": "123456789"}]']),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", {}, [
        ("@T@[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]@A@[TOOL_CALLS]"
        "special_function[ARGS]@A@")]),
    ("meetkai-functionary-medium-v3.2.jinja", {}, [
        "all\n@T@>>>special_function\n@A@", "special_function\n@A@>>>all\n@T@"]),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", {}, [
        ("<|START_THINKING|>@T@<|END_THINKING|><|START_ACTION|>[\n"
        '  {"tool_call_id": "0", "tool_name": "special_function", "parameters": @A@}\n'
        "]<|END_ACTION|>"),
        "<|START_RESPONSE|>@T@<|END_RESPONSE|>", "@T@"]),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", {"reasoning_format": "none"}, [
        "<|START_THINKING|>@T@<|END_THINKING|><|START_RESPONSE|>@T@<|END_RESPONSE|>"]),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {}, [
        (f"@T@</think>@T@{CALLS}<｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
        "```json\n@A@```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")]),
    ("deepseek-ai-DeepSeek-V3.1.jinja", {"enable_thinking": False}, [
        (f"@T@{CALLS}<｜tool▁call▁begin｜>special_function<｜tool▁sep｜>@A@<｜tool▁call▁end｜>"
        "<｜tool▁call▁begin｜>special_function<｜tool▁sep｜>@A@<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>")]),
    ("openai-gpt-oss-120b.jinja", {}, [
        ("<|channel|>analysis<|message|>@T@<|end|><|start|>assistant<|channel|>commentary "
        "to=functions.special_function <|constrain|>json<|message|>@A@<|call|>"),
        ("<|channel|>analysis<|message|>@T@<|end|><|start|>assistant<|channel|>final"
        "<|message|>@T@")]),
    ("openai-gpt-oss-120b.jinja", {"reasoning_format": "none"}, [
        ("<|channel|>analysis<|message|>@T@<|end|><|start|>assistant<|channel|>final"
        "<|message|>@T@")]),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", {}, [
        '<think>@T@</think><|tool_call|>[{"name": "special_function", "arguments": @A@}]',
        "<think>@T@</think><response>@T@</response>", "@T@"]),
]

# strings with what tends to break parsers: escapes, surrogates, the markers
STRINGS = ["plain words", 'say "hi" \\ back', "line\nnext\ttab", "é ü 😀 \u2028", "",
           "</tool_call>", "<|call|> <|end|>", "<｜tool▁call▁end｜>", "```", "[TOOL_CALLS]",
           ">>>all", "<|END_ACTION|>", "</think>", "  spaced  ", "{not json]"]


def random_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.35:
        return rng.choice([rng.choice(STRINGS), rng.randint(-10**6, 10**6),
                           rng.choice([0.5, -12.25e-3, 1e21, 3.0]), True, False, None])
    if r < 0.65:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["a", "city", "k y", "é"]) + str(i): random_value(rng, depth + 1)
            for i in range(rng.randint(0, 4))}


def random_args(rng: random.Random) -> str:
    value = {"arg1": random_value(rng), "more": [random_value(rng) for _ in range(3)]}
    return json.dumps(value, ensure_ascii=rng.random() < 0.5,
                      indent=rng.choice([None, None, 1, 2]))


def random_text(rng: random.Random) -> str:
    words = ["Hello,", "world", "\n", "  ", "<", "</", "<tool", "[TOOL", ">>", "<|", "{", "`"]
    return "".join(rng.choice(words + STRINGS[:4]) + " " for _ in range(rng.randint(0, 12)))


def answer(rng: random.Random, shape: str) -> str:
    out = shape
    while "@A@" in out:
        out = out.replace("@A@", random_args(rng), 1)
    while "@S@" in out:
        out = out.replace("@S@", json.dumps(rng.choice(STRINGS) * rng.randint(1, 3))[1:-1], 1)
    while "@T@" in out:
        out = out.replace("@T@", random_text(rng), 1)
    if rng.random() < 0.15:  # broken somewhere
        k = rng.randrange(len(out) + 1)
        out = out[:k] + rng.choice(['"', "}", "\\", "x", "1.", "-", "\\ud83d", ","]) + out[k:]
    return out


def plan_for(template: str, req: dict):
    tmpl = JinjaTemplate((TEMPLATES / template).read_text(), "<s>", "</s>")
    r = ToolRequest(tools=[TOOL], **req)
    fmt = format_for(tmpl.source, r.calls_tools)
    return fmt, fmt.plan(tmpl, [{"role": "user", "content": "Hey"}], r)


def pieces(rng: random.Random, text: str) -> list[str]:
    out, i = [], 0
    while i < len(text):
        k = 1 if rng.random() < 0.3 else rng.randint(1, 7)
        out.append(text[i:i + k])
        i += k
    return out


def normalized(deltas: list[dict], ids: dict) -> str:
    """The deltas as JSON, call ids by order of appearance."""
    out = []
    for d in deltas:
        d = json.loads(json.dumps(d))
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                tc["id"] = ids.setdefault(tc["id"], f"id{len(ids)}")
        out.append(d)
    return json.dumps(out, ensure_ascii=False)


def compare(fmt, plan, text: str, rng: random.Random) -> ChatStream:
    """Feed ``text`` to both streams; every feed's deltas and the end agree."""
    new, ref = ChatStream(fmt, plan), ChatStream(fmt, plan, incremental=False)
    ids_new: dict = {}
    ids_ref: dict = {}
    for k, p in enumerate(pieces(rng, text)):
        got, want = normalized(new.feed(p), ids_new), normalized(ref.feed(p), ids_ref)
        assert got == want, (fmt.name, k, text)
    (msg, rest), (msg_ref, rest_ref) = new.finish(), ref.finish()
    assert normalized(rest, ids_new) == normalized(rest_ref, ids_ref), (fmt.name, text)
    assert (msg.content, msg.reasoning_content) == (msg_ref.content, msg_ref.reasoning_content)
    assert [(c.name, c.arguments) for c in msg.tool_calls] == \
        [(c.name, c.arguments) for c in msg_ref.tool_calls], (fmt.name, text)
    return new


@pytest.mark.parametrize("template,req,shapes", FORMATS,
                         ids=[f"{f[0].split('-')[0]}-{i}" for i, f in enumerate(FORMATS)])
def test_streamed_deltas_are_those_of_parsing_the_whole_answer_at_every_token(
        template, req, shapes):
    fmt, plan = plan_for(template, req)
    rng = random.Random(template + json.dumps(req))
    fed = 0
    for shape in shapes:
        for _ in range(8):
            s = compare(fmt, plan, answer(rng, shape), rng)
            fed += s.parses
    assert fed  # the streams parsed (the comparison ran)


def test_the_resumed_json_scanner_agrees_with_value_end_on_every_prefix():
    rng = random.Random(31)
    alphabet = list('{}[]",: \\-+.eE0123456789tfnrul\n') + ["\\u", "\\uD83D", "\\uDE00", "é"]
    for trial in range(800):
        if trial % 2:
            text = json.dumps(random_value(rng, 1))
            if rng.random() < 0.5:
                k = rng.randrange(len(text))
                text = text[:k] + rng.choice(alphabet) + text[k:]
        else:
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 25)))
        scanner = ValueScanner(decode=text.startswith('"'))
        at = 0
        for p in pieces(rng, text):
            at += len(p)
            status = scanner.feed(p)
            try:
                value_end(text[:at], 0)
                want = DONE
            except Incomplete:
                want = OPEN
            except ValueError:
                want = ERROR
            assert status == want, text[:at]
            if status == OPEN and scanner.decode:
                assert "".join(scanner.out) == jsonscan.partial_string(text[:at], 0)[0]
            if status == DONE:
                break


def test_a_whole_answer_set_as_text_is_parsed_at_finish():
    # a request that does not stream sets the text and parses it once (answers.py)
    fmt, plan = plan_for("Qwen-Qwen2.5-7B-Instruct.jinja", {})
    s = ChatStream(fmt, plan)
    s.feed("Sure: ")
    s.text += 'fine <tool_call>{"name": "special_function", "arguments": {"a": 1}}</tool_call>'
    msg, _ = s.finish()
    assert msg.content == "Sure: fine " and msg.tool_calls[0].arguments == '{"a": 1}'


def long_answer(template: str, req: dict, shapes: list[str], rows: int) -> str:
    """A long call in this format (``rows`` items in its argument list, about
    50 bytes each), or long text where the shape has no call."""
    args = json.dumps({"rows": [{"id": i, "name": f"row \"{i}\"\n", "ok": i % 2 == 0}
                                for i in range(rows)]})
    text = "a long answer " * (rows // 3)
    shape = next((s for s in shapes if "@A@" in s), shapes[-1])
    return shape.replace("@A@", args).replace("@T@", text).replace(
        "@S@", json.dumps(text)[1:-1])


# command-r7b with reasoning_format none writes the stripped reasoning into
# the content again: no tail, each piece parses the whole answer (left as is)
BOUNDED = [f for f in FORMATS if not (f[0].startswith("Cohere") and f[1])]


@pytest.mark.parametrize("template,req,shapes", BOUNDED,
                         ids=[f"{f[0].split('-')[0]}-{i}" for i, f in enumerate(BOUNDED)])
def test_a_call_twice_as_long_costs_the_same_parses_and_twice_the_reading(
        monkeypatch, template, req, shapes):
    # whole-text parses per answer, and the characters they and the resumed
    # scanner read: the parses do not grow with the call's length and the
    # reading grows with it linearly (a whole parse per 4-character token,
    # as before, gives 2x the parses and 4x the reading)
    from ggmux.instance.tools import stream

    fmt, plan = plan_for(template, req)
    read = [0]
    parse = fmt.parse

    def counted(t, partial, p):
        read[0] += len(t)
        return parse(t, partial, p)

    class Counted(ValueScanner):
        __slots__ = ()

        def feed(self, piece: str) -> str:
            read[0] += len(piece)
            return super().feed(piece)

    fmt.parse = counted
    monkeypatch.setattr(stream, "ValueScanner", Counted, raising=False)
    cost = []
    for rows in (300, 600):
        text = long_answer(template, req, shapes, rows)
        read[0] = parses = 0
        s = ChatStream(fmt, plan)
        for i in range(0, len(text), 4):
            s.feed(text[i:i + 4])
            parses = s.parses if hasattr(s, "parses") else parses + 1
        s.finish()
        cost.append((parses, read[0], len(text)))
    (p1, r1, n1), (p2, r2, n2) = cost
    assert p2 <= p1 + 2, (fmt.name, cost)
    assert r2 / n2 <= 1.2 * r1 / n1, (fmt.name, cost)
