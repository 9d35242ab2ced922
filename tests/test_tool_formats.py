"""Tool-call formats on bytes, no process (issue 19, "done when" 1): each
template family's real template (tests/templates/, copied from llama.cpp's
models/templates/) renders tools, tool calls and tool results; the model
outputs of llama.cpp's tests/test-chat.cpp parse to the same tool calls,
content and reasoning, whole and streamed in random chunkings; the format's
grammar (run by llama.cpp's grammar engine, tests/grammar_probe.py) accepts
those outputs and its lazy trigger fires where the call begins."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from ggmux.instance.template import JinjaTemplate
from ggmux.instance.tools import format_for
from ggmux.instance.tools.base import ChatMsg, ToolRequest
from ggmux.instance.tools.stream import ChatStream
from grammar_probe import GrammarProbe

TEMPLATES = Path(__file__).parent / "templates"

SPECIAL = {"type": "function", "function": {
    "name": "special_function", "description": "I'm special",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer",
                                                             "description": "The arg."}},
                   "required": ["arg1"]}}}
WITH_OPT = {"type": "function", "function": {
    "name": "special_function_with_opt", "description": "I'm special but have optional stuff",
    "parameters": {"type": "object", "properties": {"arg1": {"type": "integer"},
                                                    "arg2": {"type": "integer"}},
                   "required": ["arg1"]}}}
PYTHON = {"type": "function", "function": {
    "name": "python", "description": "an ipython interpreter",
    "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                   "required": ["code"]}}}
GET_TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GET_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}

HELLO = "Hello, world!\nWhat's up?"
THINKING = "I'm\nthinking"
CALL = [("special_function", {"arg1": 1})]

# a conversation with a tool call and its result (ids as Mistral wants them)
HISTORY = [
    {"role": "system", "content": "You are a test assistant."},
    {"role": "user", "content": "Hey there!"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "123456789", "type": "function",
         "function": {"name": "special_function", "arguments": '{"arg1": 1}'}}]},
    {"role": "tool", "tool_call_id": "123456789", "name": "special_function",
     "content": "TOOL_RESULT_42"},
    {"role": "assistant", "content": "The result is 42."},
    {"role": "user", "content": "Thanks!"},
]


def load(name: str) -> JinjaTemplate:
    return JinjaTemplate((TEMPLATES / name).read_text(), "<s>", "</s>")


def plan_for(name: str, tools=(SPECIAL,), **req):
    tmpl = load(name)
    r = ToolRequest(tools=list(tools), **req)
    fmt = format_for(tmpl.source, r.calls_tools, r.json_schema is not None)
    return tmpl, fmt, fmt.plan(tmpl, [{"role": "user", "content": "Hey"}], r)


def same(msg: ChatMsg, content: str = "", reasoning: str = "", calls=()) -> None:
    """``msg`` holds these (arguments compared as JSON, texts without
    surrounding whitespace, as llama.cpp's tests compare them)."""
    assert msg.content.strip() == content.strip(), msg
    assert msg.reasoning_content.strip() == reasoning.strip(), msg
    got = [(c.name, json.loads(c.arguments)) for c in msg.tool_calls]
    assert got == list(calls), msg


def streamed(fmt, plan, text: str, seed: int) -> ChatMsg:
    """``text`` fed in random pieces: the deltas, put together, are the
    final message (ids once, names once, only appends)."""
    rng = random.Random(seed)
    s = ChatStream(fmt, plan)
    deltas: list[dict] = []
    i = 0
    while i < len(text):
        k = rng.randint(1, 6)
        deltas += s.feed(text[i:i + k])
        i += k
    final, rest = s.finish()
    deltas += rest
    got = ChatMsg()
    for d in deltas:
        got.content += d.get("content", "")
        got.reasoning_content += d.get("reasoning_content", "")
        for tc in d.get("tool_calls", []):
            if tc["index"] == len(got.tool_calls):
                assert tc["id"] and tc["function"]["name"] and tc["type"] == "function", tc
                from ggmux.instance.tools.base import ToolCall

                got.tool_calls.append(ToolCall(tc["function"]["name"], "", tc["id"]))
            else:
                assert "name" not in tc["function"] and "id" not in tc, tc
            got.tool_calls[tc["index"]].arguments += tc["function"]["arguments"]
    assert got.content == final.content and got.reasoning_content == final.reasoning_content
    assert [(c.name, c.arguments, c.id) for c in got.tool_calls] == \
        [(c.name, c.arguments, c.id) for c in final.tool_calls]
    return final


@pytest.fixture(scope="module")
def probe():
    p = GrammarProbe()
    yield p
    p.close()


# (template, expected format, output, expected content, reasoning, calls, request fields)
CASES = [
    # generic: templates that know no tools
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "generic",
     '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}', "", "", CALL, {}),
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", "generic",
     '{\n  "response": "Hello, world!\\nWhat\'s up?"\n}', HELLO, "", (), {}),
    ("google-gemma-2-2b-it.jinja", "generic",
     '{"tool_call": {"name": "special_function", "arguments": {"arg1": 1}}}', "", "", CALL, {}),
    # Hermes 2 Pro, Qwen 2.5, Qwen 3, QwQ
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes-2-pro",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}</tool_call>',
     "", "", CALL, {}),
    ("NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja", "hermes-2-pro",
     ('Hello, world!\nWhat\'s up?<tool_call>\n{"name": "special_function", "arguments": '
     '{"arg1": 1}}</tool_call>'), HELLO, "", CALL, {}),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes-2-pro",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>',
     "", "", CALL, {}),
    ("Qwen-Qwen3-0.6B.jinja", "hermes-2-pro",
     "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", HELLO, THINKING, (), {}),
    ("Qwen-Qwen3-0.6B.jinja", "hermes-2-pro",
     ("<think>I'm\nthinking</think>\n\n<tool_call>\n{\"name\": \"special_function\", "
     "\"arguments\": {\"arg1\": 1}}\n</tool_call>"), "", THINKING, CALL, {}),
    ("Qwen-QwQ-32B.jinja", "hermes-2-pro",
     "Let me think about this...\n</think>\nThe answer is 42.", "The answer is 42.",
     "Let me think about this...", (), {}),
    # Llama 3.x
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-3.x",
     '{"name": "special_function", "parameters": {"arg1": 1}}', "", "", CALL, {}),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama-3.x", HELLO, HELLO, "", (), {}),
    ("meta-llama-Llama-3.2-3B-Instruct.jinja", "llama-3.x",
     '{"type": "function", "name": "special_function", "parameters": {"arg1": 1}}',
     "", "", CALL, {}),
    # Mistral Nemo, Mistral Small 3.2
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo",
     '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
     "", "", CALL, {}),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral-nemo", HELLO, HELLO, "", (), {}),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja", "mistral-small",
     '[TOOL_CALLS]special_function[CALL_ID]123456789[ARGS]{"arg1": 1}', "", "", CALL, {}),
    # Functionary v3.2
    ("meetkai-functionary-medium-v3.2.jinja", "functionary-v3.2", "all\n" + HELLO, HELLO, "",
     (), {}),
    ("meetkai-functionary-medium-v3.2.jinja", "functionary-v3.2",
     'special_function\n{"arg1": 1}', "", "", CALL, {}),
    # Command R7B
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b",
     "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>", HELLO, "", (), {}),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b",
     ("<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_RESPONSE|>Hello, world!\n"
     "What's up?<|END_RESPONSE|>"), HELLO, THINKING, (), {}),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b",
     ("<|START_THINKING|>I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n"
     '    {"tool_call_id": "0", "tool_name": "special_function", "parameters": {"arg1": 1}}\n'
     "]<|END_ACTION|>"), "", THINKING, CALL, {}),
    # DeepSeek R1 distills (thinking forced open by the prompt)
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-r1",
     "I'm\nthinking</think>Hello, world!\nWhat's up?", HELLO, THINKING, (), {}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1",
     "I'm\nthinking</think>Hello, world!\nWhat's up?", HELLO, THINKING, (), {}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
     "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "", "", CALL,
     {"enable_thinking": False}),
    # DeepSeek V3.1
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{\"city\": "
     "\"XYZCITY\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "", "",
     [("get_time", {"city": "XYZCITY"})], {"enable_thinking": False, "tools": [GET_TIME]}),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1",
     ("REASONING</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     "{\"city\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "", "REASONING",
     [("get_time", {"city": "Tokyo"})], {"tools": [GET_TIME]}),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1",
     ("REASONING</think>CONTENT<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>"
     "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
     "{\"city\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "CONTENT", "REASONING",
     [("get_time", {"city": "Paris"}), ("get_weather", {"city": "Paris"})],
     {"tools": [GET_TIME, GET_WEATHER]}),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1", "REASONING</think>\nCONTENT",
     "CONTENT", "REASONING", (), {}),
    # GPT-OSS (harmony)
    ("openai-gpt-oss-120b.jinja", "gpt-oss", "<|channel|>final<|message|>" + HELLO, HELLO, "",
     (), {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant<|channel|>final"
     "<|message|>Hello, world!\nWhat's up?"), HELLO, THINKING, (), {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     ' to=functions.special_function<|channel|>analysis<|message|>{"arg1": 1}', "", "", CALL,
     {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     '<|channel|>commentary to=functions.special_function<|message|>{"arg1": 1}', "", "",
     CALL, {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     ("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant to=functions."
     'special_function<|channel|>analysis<|message|>{"arg1": 1}'), "", THINKING, CALL, {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     (" to=functions.special_function<|channel|>analysis <|constrain|>json<|message|>"
     '{"arg1": 1}'), "", "", CALL, {}),
    ("openai-gpt-oss-120b.jinja", "gpt-oss",
     ("<|channel|>analysis<|message|>I will execute python to say hello<|end|><|start|>"
     "assistant to=container.exec<|channel|>commentary<|message|>python3 -c 'print(\"hello\")'"),
     "", "I will execute python to say hello", (), {}),
    # Granite 3.3
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite", HELLO, HELLO, "", (), {}),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite",
     "<think>I'm\nthinking</think>Hello, world!\nWhat's up?", HELLO, THINKING, (), {}),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite",
     "<think>I'm\nthinking</think><response>Hello, world!\nWhat's up?</response>", HELLO,
     THINKING, (), {}),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite",
     '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', "", "", CALL, {}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}:{c[2][:30]!r}")
def test_model_outputs_parse_to_llama_cpps_messages_whole_and_streamed(case):
    name, family, output, content, reasoning, calls, req = case
    req = {"tools": [SPECIAL], **req}
    _, fmt, plan = plan_for(name, **req)
    assert fmt.name == family
    same(fmt.parse(output, False, plan), content, reasoning, calls)
    for seed in range(8):
        same(streamed(fmt, plan, output, seed), content, reasoning, calls)


FAMILY_TEMPLATES = sorted({(c[0], c[1]) for c in CASES})


@pytest.mark.parametrize("name,family", FAMILY_TEMPLATES)
def test_templates_render_tools_tool_calls_and_tool_results(name, family):
    tmpl = load(name)
    r = ToolRequest(tools=[SPECIAL])
    fmt = format_for(tmpl.source, True)
    assert fmt.name == family
    prompt = fmt.plan(tmpl, HISTORY, r).prompt
    assert "special_function" in prompt  # the tool and the call
    assert "TOOL_RESULT_42" in prompt and "The result is 42." in prompt
    assert "Thanks!" in prompt
    if tmpl.caps.tools:
        assert "I'm special" in prompt  # the tool's description, as the template lists it
    # tool_choice none: no tools in the prompt, the history still renders
    none = fmt.plan(tmpl, HISTORY[1:2], ToolRequest(tools=[SPECIAL], choice="none"))
    assert "I'm special" not in none.prompt and none.grammar is None


def test_reasoning_format_none_keeps_reasoning_inline():
    _, fmt, plan = plan_for("Qwen-Qwen3-0.6B.jinja", reasoning_format="none")
    msg = fmt.parse("<think>I'm\nthinking</think>Hello", False, plan)
    assert msg.reasoning_content == "" and msg.content == "<think>I'm\nthinking</think>Hello"
    _, fmt, plan = plan_for("openai-gpt-oss-120b.jinja", reasoning_format="none")
    msg = fmt.parse("<|channel|>analysis<|message|>I'm\nthinking<|end|><|start|>assistant"
                    "<|channel|>final<|message|>" + HELLO, False, plan)
    assert msg.content == "<|channel|>analysis<|message|>I'm\nthinking<|end|>" + HELLO


def test_thinking_off_closes_a_forced_open_reasoning_block():
    _, _, plan = plan_for("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")
    assert plan.thinking_open and plan.prompt.rstrip().endswith("<think>")
    _, _, plan = plan_for("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
                          enable_thinking=False)
    assert not plan.thinking_open and plan.prompt.endswith("</think>")
    # Qwen 3's template closes it itself when enable_thinking is false
    _, _, plan = plan_for("Qwen-Qwen3-0.6B.jinja", enable_thinking=False)
    assert plan.prompt.rstrip().endswith("</think>")


def test_a_cut_short_call_still_streams_a_prefix_of_its_arguments():
    _, fmt, plan = plan_for("Qwen-Qwen2.5-7B-Instruct.jinja")
    s = ChatStream(fmt, plan)
    out = []
    for piece in ["Sure.", "<tool_", "call>\n{\"name\": \"special_", "function\", \"arg",
                  "uments\": {\"arg1\": 1"]:
        out += s.feed(piece)
    assert out[0] == {"content": "Sure."}
    assert {"tool_calls": [{"index": 0, "id": out[1]["tool_calls"][0]["id"], "type": "function",
                            "function": {"name": "special_function", "arguments": ""}}]} == out[1]
    args = "".join(d["tool_calls"][0]["function"]["arguments"] for d in out[2:])
    assert args == '{"arg1": 1'


# output (the part the grammar sees, from its trigger on), template, request fields
GRAMMAR_CASES = [
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja",
     '{"tool_calls": [{"name": "special_function", "arguments": {"arg1": 1}}]}', {}),
    ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", '{"response": "Hello, world!\\nWhat\'s up?"}',
     {}),
    ("Qwen-Qwen2.5-7B-Instruct.jinja",
     '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>', {}),
    ("Qwen-Qwen2.5-7B-Instruct.jinja",
     ('<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>\n'
     '<tool_call>\n{"name": "special_function_with_opt", "arguments": {"arg1": 1, "arg2": 2}}'
     '\n</tool_call>'), {"tools": [SPECIAL, WITH_OPT]}),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja",
     '{"name": "special_function", "parameters": {"arg1": 1}}', {}),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "<|python_tag|>python.call(code=\"print('hey')\")",
     {"tools": [PYTHON]}),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "special_function", "arguments": {"arg1": 1}, "id": "123456789"}]',
     {}),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja",
     ('[TOOL_CALLS]special_function[CALL_ID]000000001[ARGS]{"arg1": 1}[TOOL_CALLS]'
     'special_function_with_opt[CALL_ID]000000002[ARGS]{"arg1": 1, "arg2": 2}'),
     {"tools": [SPECIAL, WITH_OPT]}),
    ("meetkai-functionary-medium-v3.2.jinja", 'special_function\n{"arg1": 1}', {}),
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
     ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "special_function", "parameters": '
     '{"arg1": 1}}]<|END_ACTION|>'), {}),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function\n"
     "```json\n{\"arg1\": 1}```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), {}),
    ("deepseek-ai-DeepSeek-V3.1.jinja",
     ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>special_function<｜tool▁sep｜>{\"arg1\": 1}"
     "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), {}),
    ("openai-gpt-oss-120b.jinja",
     ('<|channel|>commentary to=functions.special_function <|constrain|>json<|message|>'
     '{"arg1": 1}'), {}),
    ("openai-gpt-oss-120b.jinja", (' to=functions.special_function<|channel|>analysis'
                                  '<|message|>{"arg1": 1}'), {}),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja",
     '<|tool_call|>[{"name": "special_function", "arguments": {"arg1": 1}}]', {}),
]


@pytest.mark.parametrize("name,output,req", GRAMMAR_CASES, ids=lambda x: str(x)[:40])
def test_grammars_accept_the_calls_and_refuse_bad_arguments(probe, name, output, req):
    _, fmt, plan = plan_for(name, **{"tools": [SPECIAL], **req})
    assert plan.grammar, plan
    assert probe.accepts(plan.grammar, output), (fmt.name, plan.grammar)
    bad = output.replace('{"arg1": 1}', '{"arg1": "one"}', 1)
    if bad != output:
        assert not probe.accepts(plan.grammar, bad)
    if plan.lazy and fmt.name != "generic":
        # the trigger fires on the call (after some text), where the grammar starts
        text = LEAD.get(fmt.name, "Sure, let me see. ") + output
        starts = [m.start(1) for p in lazy_patterns(plan)
                  if (m := re.match(p, text, re.DOTALL))]
        words = [text.find(w) for w in plan.trigger_words if w in text]
        assert starts or words, (plan.trigger_patterns, plan.trigger_words)
        assert min(starts + words) == text.find(output)


# text before a call, as each format writes it (Llama 3 and Functionary calls
# start the answer)
LEAD = {"llama-3.x": "", "functionary-v3.2": "",
        "gpt-oss": "<|channel|>analysis<|message|>Let me see.<|end|><|start|>assistant"}


def lazy_patterns(plan) -> list[str]:
    """The plan's trigger patterns as the sampler gets them (chat.py's
    wrapping), in Python's regex dialect."""
    out = []
    for p in plan.trigger_patterns:
        if not (p.startswith("^") and p.endswith("$")):
            p = f"^[\\s\\S]*?({p})[\\s\\S]*$"
        out.append(p)
    return out


def test_lazy_grammars_wait_for_their_trigger_in_llama_cpp(probe):
    # llama.cpp's own lazy sampler, with the patterns as chat.py hands them over
    from ggmux.instance.chat import ChatTemplate

    for name, lead, call in [
        ("Qwen-Qwen2.5-7B-Instruct.jinja", "Let me look.\n",
         '<tool_call>\n{"name": "special_function", "arguments": {"arg1": 1}}\n</tool_call>'),
        ("openai-gpt-oss-120b.jinja", "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant",
         ' to=functions.special_function<|channel|>commentary<|message|>{"arg1": 1}'),
    ]:
        tmpl, _fmt, plan = plan_for(name)
        ct = ChatTemplate.__new__(ChatTemplate)
        ct.bos, ct.jinja, ct.jinja_tools = "", tmpl, None
        ct._tokenize = lambda raw, add, special: probe.tokens(raw.decode())
        pats = ct.chat([{"role": "user", "content": "Hey"}], ToolRequest(tools=[SPECIAL])
                       ).trigger_patterns
        assert probe.accepts(plan.grammar, lead + call, patterns=pats), name
        bad = call.replace('{"arg1": 1}', '{"arg1": "x"}')
        assert not probe.accepts(plan.grammar, lead + bad, patterns=pats), name
        assert probe.accepts(plan.grammar, lead + "no call at all", patterns=pats), name


def test_partial_json_is_read_up_to_where_the_text_ends():
    from ggmux.instance.tools.jsonscan import Incomplete, partial_string, value_end

    assert partial_string('"a\\ud83d\\ude00b\\n"', 0) == ("a\U0001f600b\n", 18)
    assert partial_string('"ab\\u00', 0) == ("ab", None)  # a partial escape waits
    for text in ('{"a": [1, 2', '{"a": tr', '{"a": "x', '[1, {"b": 2}', '{"a": 12'):
        with pytest.raises(Incomplete):
            value_end(text, 0)
    text = '{"a": [1, {"b": null}], "c": "}"} tail'
    assert value_end(text, 0) == text.index(" tail")
    for bad in ('{"a" 1}', '[1 2]', '{"a": nul!}'):
        with pytest.raises(ValueError):
            value_end(bad, 0)
