"""OpenAI chat content parts with media, for a model with a projector.

Every client API's adapter in the proxy turns its media into OpenAI chat
parts (Anthropic ``image`` blocks, Responses ``input_image``, Ollama
``images`` become ``image_url`` parts); this module turns those parts into
what the chat template renders, as llama-server does
(``oaicompat_content_load_media`` in tools/server/server-common.cpp and
``concat_content_parts`` in common/chat.cpp): each ``image_url`` and
``input_audio`` part becomes the model's media marker, and the message's
parts are joined with newlines between text parts but none before or after
a marker. The media references come out in prompt order, checked against
the request limits (:func:`collect`).
"""

from __future__ import annotations

from ..validate import BadRequest

MEDIA_TYPES = ("image_url", "input_audio")


def _ref(part: dict, kind: str, where: str) -> str:
    if kind == "image_url":
        v = part.get("image_url")
        url = v.get("url") if isinstance(v, dict) else v
        if not isinstance(url, str) or not url:
            raise BadRequest(f"{where}: an image_url part needs 'image_url.url' (a data: URL or "
                             "base64)", f"{where}.image_url")
        return url
    v = part.get("input_audio")
    data = (v.get("data") or v.get("url")) if isinstance(v, dict) else None
    if not isinstance(data, str) or not data:
        raise BadRequest(f"{where}: an input_audio part needs 'input_audio.data' (base64)",
                         f"{where}.input_audio")
    return data


def join_parts(content: list, where: str, marker: str, refs: list[tuple[str, str, str]],
               allowed: dict[str, bool]) -> str:
    """The text of one message's content parts, each media part replaced
    by ``marker`` and its reference appended to ``refs`` as ``(kind,
    reference, field)``; ``allowed``: ``{"image_url": bool, "input_audio":
    bool}`` (what the projector reads; a part it does not is a 400 with
    llama-server's hint). Text parts are joined with ``\\n``, except next
    to a marker."""
    text = ""
    after_marker = False
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text", "output_text"):
            t = part.get("text")
            if not isinstance(t, str):
                raise BadRequest(f"{at}: a text part needs a string 'text'", at)
            if text and not after_marker:
                text += "\n"
            text += t
            after_marker = False
        elif kind in MEDIA_TYPES:
            if not allowed.get(kind):
                what = "image" if kind == "image_url" else "audio"
                raise BadRequest(f"{at}: {what} input is not supported by this model's "
                                 f"projector", at)
            refs.append((kind, _ref(part, kind, at), at))
            text += marker
            after_marker = True
        else:
            raise BadRequest(f"{at}: content parts of type {kind!r} are not supported (text, "
                             "image_url and input_audio)", at)
    return text


def has_media(messages) -> bool:
    """Whether any message's content holds an image or audio part."""
    if not isinstance(messages, list):
        return False
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for p in content:
                if isinstance(p, dict) and p.get("type") in MEDIA_TYPES:
                    return True
    return False
