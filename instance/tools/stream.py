"""One choice's answer parsed as it streams: text in, OpenAI deltas out.

:class:`ChatStream` keeps the text generated so far, parses it with the
format (``partial``) and hands out what is new since the last parse, as
llama.cpp's ``common_chat_msg_diff`` does: ``{"reasoning_content": ...}``,
``{"content": ...}``, a tool call's first delta ``{"tool_calls":
[{"index", "id", "type": "function", "function": {"name", "arguments":
""}}]}`` (once, when its name is complete) and then ``{"tool_calls":
[{"index", "function": {"arguments": piece}}]}``. A partial parse holds
back what may still become a marker, so the deltas only ever append;
:meth:`ChatStream.finish` parses the whole text once more as final and
sends the rest.

Work per piece is bounded (issue 31, item 8: one Hermes call of 16k tokens
cost 2.5 s of parse CPU, 32k 11.4 s, when each piece parsed the whole answer
again). A parse that stops inside one growing field says where (the
message's :class:`~.base.Tail`: a call's unfinished JSON arguments, an
unfinished JSON string, plain content or reasoning); the next pieces are
then read alone: a :class:`~.jsonscan.ValueScanner` resumed where it stopped
for JSON, the held-back end and the markers for text. The whole answer is
parsed again only when that field may end (the JSON value completes, a
marker or guard appears), so a call costs a few whole parses, not one per
token; the deltas are the same as those of parsing the whole text each time
(``incremental=False``, kept as the reference the tests and bench/ compare
with).
"""

from __future__ import annotations

import logging
import os

from .base import ChatMsg, ChatPlan, Tail, ToolCall, ToolFormat, held_prefix
from .jsonscan import DONE, ERROR, ValueScanner

log = logging.getLogger(__name__)


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return "call_" + os.urandom(12).hex()


class _Open:
    """The growing field of the last partial parse, and how to read on."""

    __slots__ = ("emitted", "field", "grown", "index", "kind", "markers", "pending", "scanner",
                 "strip", "watch", "window")

    def __init__(self, tail: Tail, index: int) -> None:
        self.field = tail.field
        self.index = index  # the call, for arguments
        self.kind = tail.kind
        self.markers = tail.markers
        self.strip = tail.strip
        self.watch = tail.markers + tail.guards
        self.window = max((len(m) for m in self.watch), default=1) - 1
        self.scanner: ValueScanner | None = None
        self.pending = ""  # read, not yet in the field: trailing whitespace, a held-back end
        self.emitted = False  # text: the stripped field is not empty
        self.grown: list[str] = []  # sent since the field was last written to ``sent``


class ChatStream:
    """The parse state of one choice (see the module docstring).

    ``parses``: whole-text parses so far (what the tests count: a few per
    call, not one per piece)."""

    __slots__ = ("_ids", "_open", "_parts", "_recent", "fmt", "incremental", "parses", "plan",
                 "sent")

    def __init__(self, fmt: ToolFormat, plan: ChatPlan, incremental: bool = True) -> None:
        self.fmt = fmt
        self.plan = plan
        self.incremental = incremental
        self._parts: list[str] = []
        self._recent = ""  # the last characters of the text, where a marker may begin
        self.sent = ChatMsg()
        self._ids: list[str] = []
        self._open: _Open | None = None
        self.parses = 0

    @property
    def text(self) -> str:
        """The answer so far (settable: a whole answer parsed only at
        :meth:`finish`, as a request that does not stream does)."""
        if len(self._parts) > 1:
            self._parts[:] = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @text.setter
    def text(self, value: str) -> None:
        self._close_open()  # the text is replaced: read the next piece as a whole parse
        self._parts[:] = [value]

    def feed(self, piece: str) -> list[dict]:
        """Deltas for ``piece``, more of the answer."""
        if not piece:
            return []
        if self._open is not None:
            out = self._read_on(self._open, piece)
            if out is not None:
                return out
            self._close_open()
        self._parts.append(piece)
        text = self.text
        self.parses += 1
        try:
            msg = self.fmt.parse(text, True, self.plan)
        except ValueError:  # not parsable yet: wait for more (the final parse decides)
            return []
        out = self._diff(msg)
        if self.incremental and msg.tail is not None:
            self._open = self._opened(msg, text)
        return out

    def finish(self) -> tuple[ChatMsg, list[dict]]:
        """The final message (ids filled in) and the deltas not yet sent."""
        self._close_open()
        msg = self.final()
        return msg, self._diff(msg)

    def final(self) -> ChatMsg:
        """The whole text parsed as final; an answer cut short (``length``)
        is what its partial parse found; text that does not parse as the
        format expects is content (llama.cpp keeps it too)."""
        text = self.text
        try:
            msg = self.fmt.parse(text, False, self.plan)
        except ValueError as e:
            try:  # cut short (max_tokens): what the partial parse found
                msg = self.fmt.parse(text, True, self.plan)
            except ValueError:
                log.info("answer did not parse as %s (%s): kept as content", self.fmt.name, e)
                msg = ChatMsg(content=text)
        msg.tail = None
        for i, call in enumerate(msg.tool_calls):
            call.id = self.call_id(i, call)
            call.tail = None
        return msg

    def call_id(self, i: int, call: ToolCall) -> str:
        while len(self._ids) <= i:
            self._ids.append("")
        if not self._ids[i]:
            self._ids[i] = call.id or new_call_id()
        return self._ids[i]

    # ---- reading on inside the growing field ---------------------------------------------
    def _opened(self, msg: ChatMsg, text: str) -> _Open | None:
        """The state to read on from, for a partial parse of ``text`` whose
        tail is in step with what was sent; None when it is not (the next
        piece parses the whole text)."""
        tail = msg.tail
        if tail.start >= len(text):  # where it begins may move with more text (whitespace)
            return None
        if tail.field == "arguments":
            index = len(msg.tool_calls) - 1
            if index < 0 or index >= len(self.sent.tool_calls):
                return None
            have = msg.tool_calls[index].arguments
            if self.sent.tool_calls[index].arguments != have:
                return None
        else:
            index = -1
            have = getattr(msg, tail.field)
            if getattr(self.sent, tail.field) != have:
                return None
        st = _Open(tail, index)
        body = text[tail.start:]
        if tail.kind == "text":
            cut = body[:len(body) - _held(body, st.markers)]
            if tail.strip:
                value = cut.strip()
                st.emitted = bool(value)
                st.pending = body[len(cut.rstrip()):] if value else body
                ok = have == value
            else:
                value = cut
                st.pending = body[len(cut):]
                ok = have.endswith(value)
        else:
            st.scanner = ValueScanner(decode=tail.kind == "string")
            ok = st.scanner.feed(body) not in (DONE, ERROR)
            if tail.kind == "string":
                value = "".join(st.scanner.out)
                st.scanner.out.clear()
            else:
                value = body.rstrip()
                st.pending = body[len(value):]
            ok = ok and have == value
        if not ok:  # a format's tail that does not say what its parse did: parse on
            log.debug("%s: tail %s does not match the parse; parsing the whole text",
                      self.fmt.name, tail)
            return None
        self._recent = text[-st.window:] if st.window else ""
        return st

    def _read_on(self, st: _Open, piece: str) -> list[dict] | None:
        """The deltas for ``piece`` read alone, or None when it may end the
        growing field (the caller parses the whole text)."""
        if st.watch:
            seen = self._recent + piece
            if any(m in seen for m in st.watch):
                return None
        if st.scanner is not None:
            status = st.scanner.feed(piece)
            if status == DONE:
                return None
            self._add(piece, st)
            if status == ERROR:  # the whole parse raises ValueError here too: nothing sent
                if st.kind == "json":
                    st.pending += piece
                st.scanner.out.clear()
                return []
            if st.kind == "string":
                delta = "".join(st.scanner.out)
                st.scanner.out.clear()
            else:
                s = st.pending + piece
                delta = s.rstrip()
                st.pending = s[len(delta):]
        else:
            self._add(piece, st)
            s = st.pending + piece
            held = _held(s, st.markers)
            cut = s[:len(s) - held]
            if st.strip:
                delta = cut.rstrip() if st.emitted else cut.strip()
                if delta:
                    st.pending = s[len(cut.rstrip()):]
                    st.emitted = True
                else:
                    st.pending = s if st.emitted else s.lstrip()
            else:
                delta = cut
                st.pending = s[len(cut):]
        if not delta:
            return []
        st.grown.append(delta)
        if st.field == "arguments":
            return [{"tool_calls": [{"index": st.index, "function": {"arguments": delta}}]}]
        return [{st.field: delta}]

    def _add(self, piece: str, st: _Open) -> None:
        self._parts.append(piece)
        if st.window:
            self._recent = (self._recent + piece)[-st.window:]

    def _close_open(self) -> None:
        """Write what was sent from the growing field into ``sent``."""
        st, self._open = self._open, None
        if st is None or not st.grown:
            return
        grown = "".join(st.grown)
        if st.field == "arguments":
            self.sent.tool_calls[st.index].arguments += grown
        else:
            setattr(self.sent, st.field, getattr(self.sent, st.field) + grown)

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


def _held(text: str, markers: tuple[str, ...]) -> int:
    return held_prefix(text, markers) if markers else 0
