"""OpenAI chat messages checked for a model's Jinja chat template.

What every OpenAI client sends after a tool call is accepted: an assistant
message with ``content: null`` (or none) and ``tool_calls`` (``arguments``
as a JSON text, or an object, which becomes its JSON text as llama.cpp
does), ``role: "tool"`` results with ``tool_call_id``, content as a list of
text parts (joined with newlines, as llama.cpp joins them for templates
that take strings), ``reasoning_content`` of earlier assistant turns (the
templates that show them read it). Image and audio parts are refused by
name (:func:`refuse_media`): the built-in instance has no multimodal
projector. Every mistake is a :class:`~ggmux.instance.validate.BadRequest`
naming the message and field (llama-server answers these with its own
messages, "Missing 'role' in message" and the like).
"""

from __future__ import annotations

import json

from .media.parts import join_parts
from .validate import ROLES, BadRequest, shown

TEXT_PARTS = ("text", "input_text", "output_text")
MEDIA_PARTS = {"image_url": "images", "input_image": "images", "image": "images",
               "input_audio": "audio", "audio": "audio", "file": "files", "input_file": "files"}


def refuse_media(messages, model: str) -> None:
    """A 400 for the first image, audio or file part in ``messages``: the
    model ``model`` has no projector to read it (llama-server: "image input
    is not supported - hint: if this is unexpected, you may need to provide
    the mmproj")."""
    if not isinstance(messages, list):
        return
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list):
            continue
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in MEDIA_PARTS:
                what = {"images": "image", "audio": "audio"}.get(MEDIA_PARTS[kind], "file")
                raise BadRequest(f"messages[{i}].content[{j}]: {what} input is not supported: "
                                 f"model {model!r} cannot read {MEDIA_PARTS[kind]} (it is "
                                 "served without a multimodal projector); send text parts only",
                                 f"messages[{i}].content[{j}]")


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise BadRequest(f"{where}[{j}]: content parts of type {shown(kind)} are not "
                             "supported (text parts only)", f"{where}[{j}]")
        if not isinstance(part.get("text"), str):
            raise BadRequest(f"{where}[{j}]: a text part needs a string 'text'", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise BadRequest(f"{where} must be a list of tool calls", where)
    out = []
    for k, c in enumerate(calls):
        at = f"{where}[{k}]"
        if not isinstance(c, dict) or c.get("type", "function") != "function":
            raise BadRequest(f"{at} must be an object with type 'function'", at)
        f = c.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f"{at}.function must be an object with a string 'name'",
                             f"{at}.function")
        args = f.get("arguments", "{}")
        if isinstance(args, (dict, list)):
            args = json.dumps(args, ensure_ascii=False)
        elif not isinstance(args, str):
            raise BadRequest(f"{at}.function.arguments must be a JSON text (a string)",
                             f"{at}.function.arguments")
        if c.get("id") is not None and not isinstance(c["id"], str):
            raise BadRequest(f"{at}.id must be a string", f"{at}.id")
        call = {"type": "function", "function": {"name": f["name"], "arguments": args}}
        if c.get("id"):
            call["id"] = c["id"]
        out.append(call)
    return out


class MediaParts:
    """What a model with a projector collects from the messages: its
    ``marker``, which parts it reads (``allowed``: ``{"image_url": bool,
    "input_audio": bool}``) and the media references found, in prompt
    order (``refs``: ``(kind, reference, field)``)."""

    def __init__(self, marker: str, vision: bool, audio: bool) -> None:
        self.marker = marker
        self.allowed = {"image_url": vision, "input_audio": audio}
        self.refs: list[tuple[str, str, str]] = []


def chat_messages(messages, model: str, media: MediaParts | None = None) -> list[dict]:
    """``messages`` as the template renderer takes them (see the module
    docstring): each with a known ``role`` and string ``content``, plus
    ``tool_calls``, ``tool_call_id``, ``name``, ``reasoning_content`` where
    given. ``media``: a model with a projector's collector (media parts
    become its marker), None to refuse them. Raises :class:`BadRequest`."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    if media is None:
        refuse_media(messages, model)
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"{where} must be an object with a string 'role'", where)
        role = msg["role"]
        if role not in ROLES:
            raise BadRequest(f"{where}.role {shown(role)} is not one of "
                             f"{', '.join(sorted(ROLES))}", f"{where}.role")
        m: dict = {"role": role}
        content = msg.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise BadRequest(f"{where}.content must be a string, a list of text parts or null, "
                             f"not {shown(content)}", f"{where}.content")
        calls = msg.get("tool_calls")
        if calls is not None and role != "assistant":
            raise BadRequest(f"{where}.tool_calls: only assistant messages hold tool calls",
                             f"{where}.tool_calls")
        if calls:
            m["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
        if content is None and not calls and (role != "assistant" or "content" not in msg):
            raise BadRequest(f"{where} needs a 'content' (or, from the assistant, "
                             "'tool_calls')", f"{where}.content")
        if content is None:
            m["content"] = None
        elif media is not None and isinstance(content, list):
            m["content"] = join_parts(content, f"{where}.content", media.marker, media.refs,
                                      media.allowed)
        else:
            m["content"] = _text(content, f"{where}.content")
        for key in ("name", "tool_call_id", "reasoning_content"):
            v = msg.get(key)
            if v is not None:
                if not isinstance(v, str):
                    raise BadRequest(f"{where}.{key} must be a string", f"{where}.{key}")
                m[key] = v
        out.append(m)
    return out
