"""Tool calls written as JSON objects (``{"name": ..., "arguments": {...}}``),
read from text that may still be growing: the shape most formats share
(Hermes' ``<tool_call>`` body, Llama 3's ``parameters``, the generic
format's ``tool_calls`` items, Mistral's list, Granite's list).

A call is taken once its name is complete; its arguments are the raw text
of the arguments value (a prefix of it while the text grows; a JSON string
value is decoded), so what a stream sends of them is always a prefix of the
final arguments.
"""

from __future__ import annotations

import json

from .base import Tail, ToolCall
from .jsonscan import Incomplete, object_items, partial_string, value_end, ws

NAME_KEYS = ("name", "function")
ARG_KEYS = ("arguments", "parameters")


def read_call(text: str, i: int, name_keys=NAME_KEYS, arg_keys=ARG_KEYS, id_keys=("id",)
              ) -> tuple[ToolCall | None, int | None]:
    """The call object at ``ws(text, i)``: ``(call, end)``; ``end`` None when
    the text ends inside it (``call`` then holds what is there: None until
    the name is complete; its ``tail`` set when the text ends inside the
    arguments). Raises ValueError for what is not such an object."""
    name: str | None = None
    args: str | None = None
    tail: Tail | None = None  # the arguments are still growing
    cid = ""
    items = object_items(text, i)
    try:
        key, start = next(items)
        while True:
            if key in name_keys and start < len(text) and text[start] == '"':
                s, end = partial_string(text, start)
                if end is None:
                    raise Incomplete
                name = s
            elif key in arg_keys:
                if start < len(text) and text[start] == '"':
                    s, end = partial_string(text, start)
                    args = s
                    if end is None:
                        tail = Tail("arguments", start, "string")
                        raise Incomplete
                else:
                    try:
                        end = value_end(text, start)
                    except Incomplete:
                        args = text[start:].rstrip()
                        tail = Tail("arguments", start, "json")
                        raise
                    args = text[start:end]
            elif key in id_keys and start < len(text) and text[start] == '"':
                s, end = partial_string(text, start)
                if end is None:
                    raise Incomplete
                cid = s
            else:
                end = value_end(text, start)
            key, start = items.send(end)
    except StopIteration as stop:
        if name is None:
            raise ValueError("a tool call without a name") from None
        return ToolCall(name, args if args is not None else "{}", cid), stop.value
    except Incomplete:
        if name is None:
            return None, None
        return ToolCall(name, args or "", cid, tail), None


def read_call_list(text: str, i: int, partial: bool, name_keys=NAME_KEYS, arg_keys=ARG_KEYS,
                   id_keys=("id",)) -> tuple[list[ToolCall], int | None]:
    """A JSON list of call objects at ``ws(text, i)``: ``(calls, end)``, end
    None when the text ends inside the list (the last call's ``tail`` says
    whether it ends inside its arguments)."""
    i = ws(text, i)
    calls: list[ToolCall] = []
    if i >= len(text):
        return calls, None
    if text[i] != "[":
        raise ValueError(f"expected a list of tool calls at {i}")
    i = ws(text, i + 1)
    if i < len(text) and text[i] == "]":
        return calls, i + 1
    while i < len(text):
        call, end = read_call(text, i, name_keys, arg_keys, id_keys)
        if call is not None:
            calls.append(call)
        if end is None:
            return calls, None
        i = ws(text, end)
        if i >= len(text):
            return calls, None
        if text[i] == "]":
            return calls, i + 1
        if text[i] != ",":
            raise ValueError(f"expected ',' or ']' at {i}")
        i = ws(text, i + 1)
    return calls, None


def code_arguments(code: str, partial: bool) -> str:
    """``{"code": CODE}`` as JSON text; while the code still grows, without
    its closing ``"}`` (so what streams is a prefix of the final text)."""
    text = json.dumps({"code": code}, ensure_ascii=False)
    return text[:-2] if partial else text


def open_tail(calls: list[ToolCall]):
    """The :class:`~.base.Tail` of a parse that stopped inside the last of
    ``calls``' arguments, or None."""
    return calls[-1].tail if calls else None
