"""Continuing the last message of a chat (assistant prefill).

As llama-server's ``oaicompat_chat_params_parse``
(``tools/server/server-common.cpp``) and ``common_chat_templates_apply_jinja``
(``common/chat.cpp``): a request whose last message is the assistant's
continues that message (llama-server's ``prefill_assistant``, on by
default), as does one with vLLM's ``continue_final_message`` (true,
``"content"``); the messages before it are rendered with the generation
prompt, and the last message's text follows it (its text parts joined by a
blank line, ``common_chat_msg::render_content``). The answer holds only
what the model adds.

Refused with 400, as llama-server refuses them: two assistant messages at
the end (prefill), ``continue_final_message`` with ``add_generation_prompt``
true, and continuing an assistant message that holds tool calls.
"""

from __future__ import annotations

from .validate import BadRequest


def continuation(body: dict, messages: list[dict]) -> tuple[list[dict], str | None]:
    """``(messages to render, text that follows the generation prompt)``
    for a chat ``body`` and its checked ``messages``; the text is None when
    the request continues nothing. Raises :class:`BadRequest`."""
    cfm = body.get("continue_final_message")
    agp = body.get("add_generation_prompt", True)
    cont = cfm is True or cfm in ("content", "reasoning_content")
    if not cont and messages and messages[-1]["role"] == "assistant":
        if len(messages) >= 2 and messages[-2]["role"] == "assistant":
            raise BadRequest("Cannot have 2 or more assistant messages at the end of the list.",
                             "messages")
        cont, agp = True, False
    if not cont:
        return messages, None
    if agp is not False:
        raise BadRequest("Cannot set both add_generation_prompt and continue_final_message to "
                         "true.", "continue_final_message")
    if not messages:
        return messages, None
    last = messages[-1]
    if last["role"] == "assistant" and last.get("tool_calls"):
        raise BadRequest("Cannot continue an assistant message that contains tool calls.",
                         "messages")
    raw = body["messages"][-1].get("content") if isinstance(body.get("messages"), list) else None
    if isinstance(raw, list):
        text = "\n\n".join(p.get("text") or "" for p in raw if isinstance(p, dict)
                           and isinstance(p.get("text"), str))
    else:
        text = last.get("content") or ""
    if cfm == "reasoning_content":
        text = last.get("reasoning_content") or ""
    return messages[:-1], text
