"""A request's media, for the built-in backend (:mod:`ggmux.instance.llama`):
its references gathered from chat messages or ``/completion``'s
``multimodal_data``, fetched or decoded from base64 and checked against
the request limits (:mod:`.sources`, :mod:`.probe`), then tokenized with
the prompt text by the engine's projector. Every mistake is a
:class:`~ggmux.instance.validate.BadRequest` naming the field, before the
engine sees the request.
"""

from __future__ import annotations

from ..validate import BadRequest, RequestLimits
from .parts import has_media
from .probe import probe
from .sources import media_bytes


def collector(engine, messages):
    """A :class:`~ggmux.instance.messages.MediaParts` for ``messages`` when
    they hold media and the model has a projector; None when they hold none
    or the model has none (the messages' check then refuses the media by
    name: :func:`~ggmux.instance.messages.refuse_media`)."""
    from ..messages import MediaParts

    marker = engine.media_marker
    if marker is None or not has_media(messages):
        return None
    caps = engine.modalities()
    return MediaParts(marker, caps["vision"], caps["audio"])


def gather(refs: list[tuple[str, str, str]], limits: RequestLimits, fetch: bool) -> list:
    """``(bytes, probe, field)`` of each ``(kind, reference, field)``,
    checked against ``limits`` (count, bytes, pixels, seconds); ``fetch``:
    ``--media-fetch``."""
    if len(refs) > limits.max_media_items:
        raise BadRequest(f"the request has {len(refs)} images and audio clips; this server "
                         f"takes at most {limits.max_media_items} (--max-media-items)",
                         refs[limits.max_media_items][2])
    out = []
    for _, ref, where in refs:
        data = media_bytes(ref, where, limits.max_media_bytes, fetch)
        out.append((data, probe(data, where, limits.max_image_pixels,
                                limits.max_audio_seconds), where))
    return out


def tokens(engine, text: str, refs: list, add_special: bool, limits: RequestLimits,
           fetch: bool) -> tuple[list[int], tuple]:
    """The prompt ids and media spans of ``text`` whose markers stand for
    ``refs`` (:func:`gather`, then the engine's projector)."""
    items = gather(refs, limits, fetch)
    rate = engine.m.projector.sample_rate if engine.m.projector is not None else -1
    samples = int(limits.max_audio_seconds * rate * 1.01) if rate > 0 else 0
    return engine.tokenize_media(text, items, add_special, samples)


def native_refs(p: dict, field: str, marker: str | None) -> tuple[str, list]:
    """``/completion``'s ``{"prompt_string", "multimodal_data"}``: the
    prompt text and its references (llama-server's form: base64 items,
    one per marker in the text, the marker being ``/props``'
    ``media_marker``). Raises BadRequest (llama-server's message without a
    projector)."""
    if marker is None:
        raise BadRequest("Multimodal data provided, but model does not support multimodal "
                         "requests.", f"{field}.multimodal_data")
    s, data = p.get("prompt_string"), p.get("multimodal_data")
    if not isinstance(s, str):
        raise BadRequest(f"'{field}.prompt_string' must be a string when multimodal_data is "
                         "given", f"{field}.prompt_string")
    if not isinstance(data, list) or not all(isinstance(d, str) for d in data):
        raise BadRequest(f"'{field}.multimodal_data' must be a list of base64 strings",
                         f"{field}.multimodal_data")
    if s.count(marker) != len(data):
        raise BadRequest(f"'{field}.prompt_string' has {s.count(marker)} media markers "
                         f"({marker}, /props' media_marker) for {len(data)} multimodal_data "
                         "items", f"{field}.prompt_string")
    return s, [("media", d, f"{field}.multimodal_data[{i}]") for i, d in enumerate(data)]


def shown(engine, prompt: list[int], spans: tuple) -> str:
    """The prompt's text with each media span as the marker (llama-server's
    verbose ``prompt``)."""
    if not spans:
        return engine.detokenize(prompt, special=True)
    parts, at = [], 0
    for sp in spans:
        parts.append(engine.detokenize(prompt[at:sp.start], special=True))
        parts.append(engine.media_marker or "<__media__>")
        at = sp.end
    parts.append(engine.detokenize(prompt[at:], special=True))
    return "".join(parts)
