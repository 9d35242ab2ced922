"""The Responses API's output items, its ``response`` object and its
streaming events, out of a replica's chat completion.

Output items, in the order their content arrives: ``reasoning`` (``content``
``[{"type": "reasoning_text", "text"}]``, ``summary`` empty), ``message``
(one ``output_text`` part), ``function_call`` (``call_id``, ``name``,
``arguments``, and ``namespace`` for a namespaced function) or
``custom_tool_call`` (``input``). Streamed (OpenAI's "Streaming events"
reference): ``response.created``, ``response.in_progress``, then per item
``response.output_item.added``, its deltas (``response.reasoning_text.delta``;
``response.content_part.added`` + ``response.output_text.delta``;
``response.function_call_arguments.delta``), their ``.done`` events and
``response.output_item.done``, one item at a time; finally
``response.completed`` (or ``response.incomplete``); every event carries
its ``sequence_number``. A failure mid-stream is an ``error`` event.

llama-server's telemetry, when the request asks (``return_progress``,
``timings_per_token``, passed to the replica): each ``prompt_progress`` of
the prompt being read is a ``response.in_progress`` event carrying it, and
the ``timings`` so far ride on each delta event and on the final one.
"""

from __future__ import annotations

import orjson

from .common import BadReply, StreamState, Translated, Usage, new_id, now_s, sse
from .tools import Calls, ToolCall, arguments_object, check_arguments, cut_by_limit, delta


def usage_object(u: Usage) -> dict:
    """The Responses API's ``usage`` of these counts."""
    return {"input_tokens": u.prompt,
            "input_tokens_details": {"cached_tokens": u.cached, "cache_write_tokens": 0},
            "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt + u.completion}


def reasoning_item(item_id: str, text: str, status: str) -> dict:
    """A ``reasoning`` output item."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress"
            else []}


def message_item(item_id: str, text: str, status: str) -> dict:
    """A ``message`` output item."""
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content if status != "in_progress" else []}


def call_item(item_id: str, call: ToolCall, kind: dict, status: str) -> dict:
    """A ``function_call`` item (named as the client named it: ``kind``'s
    ``name`` and ``namespace`` when the model saw a qualified name), or a
    ``custom_tool_call`` when ``kind`` says ``custom`` (its ``input`` from
    the arguments' ``input``; empty while in progress)."""
    if kind.get("custom"):
        inp = ""
        if status != "in_progress":
            try:
                inp = arguments_object(call.arguments, call.name).get("input", "")
            except BadReply:  # not the object asked for: the text as it came
                inp = call.arguments
            if not isinstance(inp, str):
                inp = orjson.dumps(inp).decode()
        return {"id": item_id, "type": "custom_tool_call", "status": status,
                "call_id": call.id, "name": call.name, "input": inp}
    item = {"id": item_id, "type": "function_call", "status": status, "call_id": call.id,
            "name": kind.get("name", call.name),  # the client's, when the model saw another
            "arguments": call.arguments if status != "in_progress" else ""}
    if kind.get("namespace"):
        item["namespace"] = kind["namespace"]
    return item


def output_items(reasoning: str, text: str, calls: list[ToolCall], kinds: dict,
                 status: str) -> list[dict]:
    """The ``output`` of a whole answer: reasoning, the message (also when
    empty, unless there are tool calls), the calls (a call the client's
    limit cut is ``incomplete``: :func:`~.tools.cut_by_limit`). Raises
    :class:`BadReply` for a function call whose arguments are not a JSON
    object (a custom tool's input is free-form: the text as it came)."""
    if status != "incomplete":  # cut at max_output_tokens: the arguments may be cut too
        check_arguments([c for c in calls if not kinds.get(c.name, {}).get("custom")])
    out = []
    if reasoning:
        out.append(reasoning_item(new_id("rs_"), reasoning, "completed"))
    if text or not calls:
        out.append(message_item(new_id("msg_"), text, status))
    finish = "length" if status == "incomplete" else None
    out += [call_item(new_id("fc_"), c, kinds.get(c.name, {}),
                      "incomplete" if cut_by_limit(c, finish) else "completed") for c in calls]
    return out


def response_object(rid: str, created: int, req: Translated, status: str, output: list, usage,
                    finish: str | None = None) -> dict:
    """The ``response`` object (the parts of OpenAI's that apply here)."""
    echo = req.echo
    ptc = echo.get("parallel_tool_calls")
    text = echo.get("text") if isinstance(echo.get("text"), dict) else {}
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
        "instructions": echo.get("instructions"),
        "max_output_tokens": echo.get("max_output_tokens"),
        "model": req.body.get("model"),
        "output": output,
        "parallel_tool_calls": ptc if isinstance(ptc, bool) else True,
        "previous_response_id": echo.get("previous_response_id"),
        "store": False,
        "temperature": echo.get("temperature"),
        "text": {"format": text.get("format") or {"type": "text"}},
        "tool_choice": echo.get("tool_choice") or "auto",
        "tools": echo.get("tools") or [],
        "top_p": echo.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "metadata": echo.get("metadata") or {},
    }


class ResponsesStream(StreamState):
    """Chat-completion chunks -> the Responses stream events (module
    docstring). ``item`` is the open item's kind (``"reasoning"``,
    ``"message"``, ``"call"`` or None), ``index`` its output index;
    ``output`` the items done so far."""

    def __init__(self, req: Translated) -> None:
        self.req = req
        self.kinds: dict = req.echo.get("kinds") or {}
        self.id = new_id("resp_")
        self.created = now_s()
        self.seq = 0
        self.started = False
        self.finish: str | None = None
        self.usage = Usage()
        self.item: str | None = None
        self.item_id = ""
        self.index = -1
        self.text: list[str] = []
        self.call: ToolCall | None = None
        self.calls = Calls()
        self.output: list[dict] = []
        self.timings: dict | None = None

    def _ev(self, kind: str, **fields) -> bytes:
        obj = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return sse(kind, obj)

    def _start(self, progress: dict | None = None) -> bytes:
        self.started = True
        resp = response_object(self.id, self.created, self.req, "in_progress", [], None)
        return (self._ev("response.created", response=resp)
                + self._in_progress(progress, resp))

    def _in_progress(self, progress: dict | None, resp: dict | None = None) -> bytes:
        """``response.in_progress``; with ``progress`` it carries llama-server's
        ``prompt_progress`` (``return_progress``: one event per prompt batch
        read, ``server-task.cpp``'s ``to_json_oaicompat_resp``)."""
        if resp is None:
            resp = {"id": self.id, "object": "response", "status": "in_progress"}
        shown = progress is not None and self.req.echo.get("progress", True)
        extra = {"prompt_progress": progress} if shown else {}
        return self._ev("response.in_progress", response=resp, **extra)

    def keepalive(self) -> bytes:
        """``response.created`` and ``response.in_progress`` if they did not
        go out yet, else ``response.in_progress`` again (the Responses API's
        only event for "still working"); nothing once an item opened."""
        if not self.started:
            return self._start()
        return self._in_progress(None) if self.index < 0 else b""

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def _close(self) -> bytes:
        """The open item's closing events."""
        kind, at, iid = self.item, self.index, self.item_id
        if kind is None:
            return b""
        self.item = None
        text = "".join(self.text)
        self.text = []
        if kind == "reasoning":
            item = reasoning_item(iid, text, "completed")
            out = self._ev("response.reasoning_text.done", item_id=iid, output_index=at,
                           content_index=0, text=text)
        elif kind == "message":
            item = message_item(iid, text, self._status())
            part = item["content"][0]
            out = (self._ev("response.output_text.done", item_id=iid, output_index=at,
                            content_index=0, text=text, logprobs=[])
                   + self._ev("response.content_part.done", item_id=iid, output_index=at,
                              content_index=0, part=part))
        else:
            call, self.call = self.call, None
            item = call_item(iid, call, self.kinds.get(call.name, {}),
                             "incomplete" if cut_by_limit(call, self.finish) else "completed")
            if item["type"] == "custom_tool_call":
                out = (self._ev("response.custom_tool_call_input.delta", item_id=iid,
                                output_index=at, delta=item["input"])
                       + self._ev("response.custom_tool_call_input.done", item_id=iid,
                                  output_index=at, input=item["input"]))
            else:
                out = self._ev("response.function_call_arguments.done", item_id=iid,
                               output_index=at, name=item["name"], arguments=call.arguments)
        self.output.append(item)
        return out + self._ev("response.output_item.done", output_index=at, item=item)

    def _open(self, kind: str, call: ToolCall | None = None) -> bytes:
        out = self._close()
        self.index += 1
        self.item = kind
        at = self.index
        if kind == "reasoning":
            self.item_id = new_id("rs_")
            return out + self._ev("response.output_item.added", output_index=at,
                                  item=reasoning_item(self.item_id, "", "in_progress"))
        if kind == "message":
            self.item_id = new_id("msg_")
            return (out + self._ev("response.output_item.added", output_index=at,
                                   item=message_item(self.item_id, "", "in_progress"))
                    + self._ev("response.content_part.added", item_id=self.item_id,
                               output_index=at, content_index=0,
                               part={"type": "output_text", "text": "", "annotations": []}))
        self.call = call
        self.item_id = new_id("fc_")
        return out + self._ev("response.output_item.added", output_index=at,
                              item=call_item(self.item_id, call,
                                             self.kinds.get(call.name, {}), "in_progress"))

    def chunk(self, chunk: dict) -> bytes:
        if "usage" in chunk:
            self.usage.take(chunk["usage"])
        d = delta(chunk)
        if d.finish:
            self.finish = d.finish
        progress = chunk.get("prompt_progress")
        if not self.started:
            out = self._start(progress)
        elif progress is not None and self.req.echo.get("progress", True):
            out = self._in_progress(progress)
        else:
            out = b""
        # llama-server's timings_per_token: the timings so far on each delta event
        timed = {}
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
            timed = {"timings": self.timings}
        if d.reasoning:
            if self.item != "reasoning":
                out += self._open("reasoning")
            self.text.append(d.reasoning)
            out += self._ev("response.reasoning_text.delta", item_id=self.item_id,
                            output_index=self.index, content_index=0, delta=d.reasoning,
                            **timed)
        if d.text:
            if self.item != "message":
                out += self._open("message")
            self.text.append(d.text)
            out += self._ev("response.output_text.delta", item_id=self.item_id,
                            output_index=self.index, content_index=0, delta=d.text,
                            logprobs=[], **timed)
        for cd in d.calls:
            call, new = self.calls.add(cd)
            if new:
                out += self._open("call", call)
            if cd.arguments and call is self.call and not self.kinds.get(
                    call.name, {}).get("custom"):
                out += self._ev("response.function_call_arguments.delta", item_id=self.item_id,
                                output_index=self.index, delta=cd.arguments, **timed)
        if d.text or d.reasoning or d.calls:
            self.usage.counted()
        return out

    def end(self) -> bytes:
        """The closing events; the API's error event instead when a function
        call's arguments are not a JSON object (as a whole answer's 502),
        but for an answer cut at its limit (``incomplete`` says so)."""
        out = b"" if self.started else self._start()
        try:
            if self.finish != "length":
                check_arguments([c for c in self.calls.calls
                                 if not self.kinds.get(c.name, {}).get("custom")])
        except BadReply as e:
            return out + self.untranslatable(e)
        if self.index < 0:
            out += self._open("message")
        out += self._close()
        status = self._status()
        resp = response_object(self.id, self.created, self.req, status, self.output,
                               usage_object(self.usage), self.finish)
        timed = {"timings": self.timings} if self.timings is not None else {}
        return out + self._ev("response." + status, response=resp, **timed)

    def error(self, status: int, message: str) -> bytes:
        code = "server_error" if status >= 500 else "invalid_request_error"
        return self._ev("error", code=code, message=message, param=None)
