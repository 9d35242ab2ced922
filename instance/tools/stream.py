"""One choice's answer parsed as it streams: text in, OpenAI deltas out.

:class:`ChatStream` keeps the text generated so far, parses it again with
the format after each piece (``partial``), and hands out what is new
since the last parse, as llama.cpp's ``common_chat_msg_diff`` does:
``{"reasoning_content": ...}``, ``{"content": ...}``, a tool call's first
delta ``{"tool_calls": [{"index", "id", "type": "function", "function":
{"name", "arguments": ""}}]}`` (once, when its name is complete) and then
``{"tool_calls": [{"index", "function": {"arguments": piece}}]}``. A
partial parse holds back what may still become a marker, so the deltas
only ever append; :meth:`ChatStream.finish` parses the whole text once
more as final and sends the rest.

Each parse reads the whole text (a few kB for a tool call; the formats scan
with ``str.find`` and regexes, no backtracking over the text).
"""

from __future__ import annotations

import logging
import os

from .base import ChatMsg, ChatPlan, ToolCall, ToolFormat

log = logging.getLogger(__name__)


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return "call_" + os.urandom(12).hex()


class ChatStream:
    """The parse state of one choice (see the module docstring)."""

    __slots__ = ("_ids", "fmt", "plan", "sent", "text")

    def __init__(self, fmt: ToolFormat, plan: ChatPlan) -> None:
        self.fmt = fmt
        self.plan = plan
        self.text = ""
        self.sent = ChatMsg()
        self._ids: list[str] = []

    def feed(self, piece: str) -> list[dict]:
        """Deltas for ``piece``, more of the answer."""
        self.text += piece
        if not piece:
            return []
        try:
            msg = self.fmt.parse(self.text, True, self.plan)
        except ValueError:  # not parsable yet: wait for more (the final parse decides)
            return []
        return self._diff(msg)

    def finish(self) -> tuple[ChatMsg, list[dict]]:
        """The final message (ids filled in) and the deltas not yet sent."""
        msg = self.final()
        return msg, self._diff(msg)

    def final(self) -> ChatMsg:
        """The whole text parsed as final; an answer cut short (``length``)
        is what its partial parse found; text that does not parse as the
        format expects is content (llama.cpp keeps it too)."""
        try:
            msg = self.fmt.parse(self.text, False, self.plan)
        except ValueError as e:
            try:  # cut short (max_tokens): what the partial parse found
                msg = self.fmt.parse(self.text, True, self.plan)
            except ValueError:
                log.info("answer did not parse as %s (%s): kept as content", self.fmt.name, e)
                msg = ChatMsg(content=self.text)
        for i, call in enumerate(msg.tool_calls):
            call.id = self.call_id(i, call)
        return msg

    def call_id(self, i: int, call: ToolCall) -> str:
        while len(self._ids) <= i:
            self._ids.append("")
        if not self._ids[i]:
            self._ids[i] = call.id or new_call_id()
        return self._ids[i]

    def _diff(self, msg: ChatMsg) -> list[dict]:
        out: list[dict] = []
        sent = self.sent
        for key in ("reasoning_content", "content"):
            old, new = getattr(sent, key), getattr(msg, key)
            if new.startswith(old):
                if len(new) > len(old):
                    out.append({key: new[len(old):]})
                    setattr(sent, key, new)
            else:
                log.debug("%s changed under a stream; the new part is not sent", key)
        for i, call in enumerate(msg.tool_calls):
            if i < len(sent.tool_calls):
                old = sent.tool_calls[i]
                if call.arguments.startswith(old.arguments):
                    piece = call.arguments[len(old.arguments):]
                    if piece:
                        out.append({"tool_calls": [{"index": i,
                                                    "function": {"arguments": piece}}]})
                        old.arguments = call.arguments
                continue
            cid = self.call_id(i, call)
            out.append({"tool_calls": [{"index": i, "id": cid, "type": "function",
                                        "function": {"name": call.name, "arguments": ""}}]})
            sent.tool_calls.append(ToolCall(call.name, "", cid))
            if call.arguments:
                out.append({"tool_calls": [{"index": i,
                                            "function": {"arguments": call.arguments}}]})
                sent.tool_calls[i].arguments = call.arguments
        return out
