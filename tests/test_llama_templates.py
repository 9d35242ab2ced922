"""llama-server's template options in the built-in instance (issue 23):
llama.cpp's built-in template names as ``--chat-template`` (rendered by
llama.cpp itself), a template's text and ``--chat-template-file``, the
assistant-prefill rules, and ``--pooling none``. No model is loaded: the
templates render text, a stand-in tokenizer keeps its bytes."""

from __future__ import annotations

import pytest
from ggmux.instance.builtin_templates import builtin_names, render_builtin
from ggmux.instance.chat import ChatTemplate
from ggmux.instance.prefill import continuation
from ggmux.instance.server import parse_args
from ggmux.instance.validate import BadRequest

MSGS = [{"role": "system", "content": "You are a test."}, {"role": "user", "content": "Hi there"}]
COMMAND_R = ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>You are a test.<|END_OF_TURN_TOKEN|>"
             "<|START_OF_TURN_TOKEN|><|USER_TOKEN|>Hi there<|END_OF_TURN_TOKEN|>"
             "<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>")  # test_apply_chat_template's


def as_bytes(raw: bytes, add_bos: bool, special: bool) -> list[int]:
    return list(raw)


def template(chat_format=None, source=None, jinja=True, meta=None) -> ChatTemplate:
    return ChatTemplate(meta or {}, "<s>", "</s>", 2, chat_format, as_bytes, source, jinja)


def test_llama_cpps_template_names_render_as_llama_server_renders_them():
    assert {"llama3", "command-r", "chatml", "mistral-v7"} <= builtin_names()
    assert render_builtin("command-r", MSGS) == COMMAND_R
    t = template("command-r")  # ggmux refused the name: the instance did not start
    assert t.builtin == "command-r" and t.jinja is None
    tokens, stops = t.prompt(MSGS)
    assert bytes(tokens).decode() == COMMAND_R and stops == []
    llama3 = template("llama3").prompt([{"role": "user", "content": "Hi"}], None, "Hel")[0]
    assert bytes(llama3).decode() == ("<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                                      "<|start_header_id|>assistant<|end_header_id|>\n\nHel")
    with pytest.raises(ValueError):
        render_builtin("no-such-template", MSGS)


def test_a_templates_text_or_file_replaces_the_ggufs():
    own = {"tokenizer.chat_template": "GGUF {{ messages[0].content }}"}
    t = template(source="FILE {{ messages[0].content }}", meta=own)  # --chat-template-file
    assert t.jinja is not None and t.template.startswith("FILE")
    assert t.jinja.render([{"role": "user", "content": "x"}]) == "FILE x"
    t = template("TEXT {{ messages[0].content }}", meta=own)  # --chat-template with a text
    assert t.jinja.render([{"role": "user", "content": "x"}]) == "TEXT x"
    # llama-cpp-python's own names still work
    assert template("chatml-function-calling").jinja is None


def test_no_jinja_renders_the_ggufs_template_as_the_built_in_one_it_resembles():
    chatml = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
              "'<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}"
              "{{'<|im_start|>assistant\\n'}}{% endif %}")
    t = template(meta={"tokenizer.chat_template": chatml}, jinja=False)
    assert t.builtin == chatml and t.jinja is None
    assert bytes(t.prompt(MSGS[1:])[0]).decode() == (
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n")


def test_prefill_rules_are_llama_servers():
    user, a = {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "He"}
    assert continuation({}, [user]) == ([user], None)
    assert continuation({}, [user, a]) == ([user], "He")
    body = {"messages": [user, {"role": "assistant",
                                "content": [{"type": "text", "text": "W"},
                                            {"type": "text", "text": "h"}]}]}
    assert continuation(body, [user, {"role": "assistant", "content": "Wh"}])[1] == "W\n\nh"
    assert continuation({"continue_final_message": True, "add_generation_prompt": False},
                        [user, a]) == ([user], "He")
    for body, msgs in (({}, [user, a, a]),
                       ({"continue_final_message": True}, [user, a]),
                       ({}, [user, {**a, "tool_calls": [{"id": "1"}]}])):
        with pytest.raises(BadRequest):
            continuation(body, msgs)


def test_pooling_none_refuses_embeddings_with_a_400():
    from ggmux.instance.llama import LlamaBackend

    b = LlamaBackend(parse_args(["--model", "x.gguf", "--llama-args", '["--pooling", "none"]']))
    with pytest.raises(BadRequest, match="Pooling type 'none' is not OAI compatible"):
        b.start("embedding", {"input": "hi"}, lambda *_: None)
