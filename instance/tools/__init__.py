"""Tool calls and reasoning in the built-in instance: one format per chat
template family, as llama.cpp's Jinja mode (``common/chat.cpp``) has them.

:func:`detect` picks a template's family from its text, in the order
llama.cpp's ``common_chat_templates_apply_jinja`` tests them (until 2025,
before its auto-parser); a template of no known family gets
:class:`~.generic.GenericFormat` when the request calls tools, and plain
content (with ``<think>`` reasoning split out when the template reasons)
otherwise. Each family's module holds its prompt rules, grammar, lazy
triggers and parser (:class:`~.base.ToolFormat`); :mod:`.stream` turns
parses into OpenAI deltas; :mod:`.request` checks the request's fields.
"""

from __future__ import annotations

from .base import ChatMsg, ChatPlan, ToolCall, ToolFormat, ToolRequest
from .command_r import CommandR7BFormat
from .deepseek import DeepSeekR1Format, DeepSeekV31Format
from .functionary import FunctionaryFormat
from .generic import GenericFormat
from .gpt_oss import GptOssFormat
from .granite import GraniteFormat
from .hermes import HermesFormat
from .llama3 import Llama3Format
from .mistral import MistralFormat

__all__ = ["ChatMsg", "ChatPlan", "ToolCall", "ToolFormat", "ToolRequest", "detect",
           "format_for"]

# families in llama.cpp's order of detection; the first whose detect() holds
FAMILIES: list[type[ToolFormat]] = [
    DeepSeekV31Format, DeepSeekR1Format, CommandR7BFormat, GraniteFormat, HermesFormat,
    GptOssFormat, FunctionaryFormat, Llama3Format,
]
# families used only when the request calls tools (llama.cpp: after "plain
# handler (no tools)")
TOOL_ONLY_FAMILIES: list[type[ToolFormat]] = [MistralFormat]


class ContentFormat(ToolFormat):
    """No tool calls: content, and ``<think>`` reasoning when the template
    writes it."""

    name = "content"

    def __init__(self, source: str = "") -> None:
        super().__init__(source)
        self.thinking = "<think>" in source


def detect(source: str, calls_tools: bool = True) -> type[ToolFormat] | None:
    """The family of a template's ``source`` text, or None (no family:
    the generic format serves its tool calls). Some families are only used
    when the request calls tools (``calls_tools``)."""
    for fam in FAMILIES + (TOOL_ONLY_FAMILIES if calls_tools else []):
        if fam.detect(source):
            return fam
    return None


def format_for(source: str, calls_tools: bool, json_schema: bool = False) -> ToolFormat:
    """The format for a request to a model whose template is ``source``:
    generic when the request calls tools and gives a ``response_format``
    schema too (llama.cpp: "use generic handler when mixing tools + JSON
    schema"), else its family's, else generic when the request calls tools,
    else plain content (reasoning split out when the template knows
    ``<think>``)."""
    if calls_tools and json_schema:
        return GenericFormat(source)
    fam = detect(source, calls_tools)
    if fam is not None:
        return fam(source)
    if calls_tools:
        return GenericFormat(source)
    return ContentFormat(source)
