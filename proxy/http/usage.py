"""The token counts of an answer, as the proxy learns them without reading it.

The built-in instance states each answer's usage in one line,
:data:`USAGE_HEADER`: ``PROMPT CACHED GENERATED`` (decimal token counts), a
response header on a whole (JSON) answer and a chunked trailer after the
last chunk of a stream, where the counts are known only at the end. The
proxy reads it from the replica's head or trailer (a comparison per header
line) and never relays it; so the request ring (issue 22) has exact
counts at no cost on the forwarding path, where parsing the body of every
answer would cost a JSON decode per request and a scan per chunk.

Replicas that send no such line (llama-server, remote upstreams) are read
from the last piece of their body instead (:func:`usage_from_tail`): an
OpenAI ``usage`` object, or llama-server's ``timings`` (``prompt_n``,
``cache_n``, ``predicted_n``), which end its answers and streams.
"""

from __future__ import annotations

import re

import orjson

USAGE_HEADER = b"x-ggmux-usage"


def usage_counts(usage: object) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` of an OpenAI ``usage`` object
    (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``,
    ``completion_tokens``); None for anything else."""
    if not isinstance(usage, dict):
        return None
    prompt, gen = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    if not all(type(v) is int and v >= 0 for v in (prompt, gen, cached)):
        return None
    return prompt, cached, gen


def usage_line(usage: object) -> bytes:
    """The :data:`USAGE_HEADER` value of an OpenAI ``usage`` object
    (``b"12 0 8"``), or ``b""`` when it is not one."""
    counts = usage_counts(usage)
    return b"" if counts is None else b"%d %d %d" % counts


def usage_trailer(usage: object) -> bytes:
    """The chunked trailer line (``b"x-ggmux-usage: 12 0 8\\r\\n"``) of a
    stream whose usage is ``usage``; ``b""`` when it is not a usage object."""
    line = usage_line(usage)
    return USAGE_HEADER + b": " + line + b"\r\n" if line else b""


def parse_usage(value: bytes | None) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` of a :data:`USAGE_HEADER` value;
    None for none or a malformed one."""
    try:
        prompt, cached, gen = value.split()
        counts = int(prompt), int(cached), int(gen)
    except (AttributeError, ValueError):  # none, not three fields, not numbers
        return None
    return counts if min(counts) >= 0 else None


_USAGE = re.compile(rb'"usage"\s*:\s*\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}')
_TIMINGS = re.compile(rb'"timings"\s*:\s*\{([^{}]*)\}')


_FIELD = re.compile(rb'"(\w+)"\s*:\s*(\d+)')


def _numbers(blob: bytes) -> dict[str, int]:
    """Every ``"key": N`` of the object whose inside is ``blob``, nested
    objects' included (the first of a key repeated): ``orjson`` when it is
    JSON (once per answer on the forwarding path, where a regex scan cost
    several times as much), else a scan for the pairs."""
    try:
        doc = orjson.loads(b"{" + blob + b"}")
    except orjson.JSONDecodeError:
        out: dict[str, int] = {}
        for k, v in _FIELD.findall(blob):
            out.setdefault(k.decode(), int(v))
        return out
    out = {}
    for k, v in doc.items():
        if type(v) is int:
            out.setdefault(k, v)
        elif type(v) is dict:  # (prompt_tokens_details: cached_tokens)
            for k2, v2 in v.items():
                if type(v2) is int:
                    out.setdefault(k2, v2)
    return out


def _last(pattern: re.Pattern, tail: bytes, key: bytes) -> bytes | None:
    """Group 1 of the last match of ``pattern`` in ``tail``, trying it only
    where ``key`` (its start) occurs, from the end: the answer's last read
    is scanned once by ``rfind``, not by the pattern from every position."""
    i = tail.rfind(key)
    while i >= 0:
        m = pattern.match(tail, i)
        if m is not None:
            return m.group(1)
        i = tail.rfind(key, 0, i)
    return None


def usage_from_tail(tail: bytes) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` from the end of an answer's body
    (its last read, or two): the last OpenAI ``usage`` object in it, else
    llama-server's last ``timings``; None when neither is whole there."""
    blob = _last(_USAGE, tail, b'"usage"')
    if blob is not None:
        nums = _numbers(blob)
        prompt = nums.get("prompt_tokens")
        if prompt is not None:
            return prompt, nums.get("cached_tokens", 0), nums.get("completion_tokens", 0)
    blob = _last(_TIMINGS, tail, b'"timings"')
    if blob is not None:
        nums = _numbers(blob)
        prompt, gen = nums.get("prompt_n"), nums.get("predicted_n", 0)
        if prompt is not None:
            cached = nums.get("cache_n", 0)
            # llama-server's prompt_n counts the tokens it evaluated,
            # cache_n those it reused
            return prompt + cached, cached, gen
    return None
