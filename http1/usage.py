"""The token counts of an answer, as the proxy learns them without reading it.

The built-in instance states each answer's usage in one line,
:data:`USAGE_HEADER`: ``PROMPT CACHED GENERATED`` (decimal token counts),
then, when the cached tokens came from a KV tier (issue 29), that tier's
name (:data:`TIERS`: ``slot``, ``ram``, ``disk``, its answer's
``timings.cache_tier``), a
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

import orjson

USAGE_HEADER = b"x-ggmux-usage"
MAX_COUNT = (1 << 62) - 1
"""The largest token count taken from a replica: a record holds signed
64-bit words (the request ring's, the compiled record's ``long long``), and
a replica's usage is any JSON integer (issue 31 item 4: 2**64 - 1 raised in
the ring's record, and the request vanished from ``/requests``)."""

TIERS = ("slot", "ram", "disk")
"""Where an answer's cached tokens came from (``timings.cache_tier``)."""


def cache_tier(answer: dict) -> str | None:
    """``timings.cache_tier`` of an answer or chunk when it is one of
    :data:`TIERS`, else None."""
    t = answer.get("timings")
    tier = t.get("cache_tier") if type(t) is dict else None
    return tier if tier in TIERS else None


def usage_counts(usage: object) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` of an OpenAI ``usage`` object
    (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``,
    ``completion_tokens``); None for anything else."""
    if not isinstance(usage, dict):
        return None
    prompt, gen = usage.get("prompt_tokens"), usage.get("completion_tokens", 0)
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens", 0) if isinstance(details, dict) else 0
    if not all(type(v) is int and 0 <= v <= MAX_COUNT for v in (prompt, gen, cached)):
        return None
    return prompt, cached, gen


def usage_line(usage: object, tier: str | None = None) -> bytes:
    """The :data:`USAGE_HEADER` value of an OpenAI ``usage`` object
    (``b"12 0 8"``; ``b"12 10 8 ram"`` with the ``tier`` of :data:`TIERS`
    its cached tokens came from), or ``b""`` when it is not one."""
    counts = usage_counts(usage)
    if counts is None:
        return b""
    line = b"%d %d %d" % counts
    return line + b" " + tier.encode() if tier in TIERS else line


def usage_trailer(usage: object, tier: str | None = None) -> bytes:
    """The chunked trailer line (``b"x-ggmux-usage: 12 0 8\\r\\n"``) of a
    stream whose usage is ``usage`` (and ``tier``, as :func:`usage_line`);
    ``b""`` when it is not a usage object."""
    line = usage_line(usage, tier)
    return USAGE_HEADER + b": " + line + b"\r\n" if line else b""


def parse_usage(value: bytes | None) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` of a :data:`USAGE_HEADER` value;
    None for none or a malformed one (a tier after the counts is allowed:
    :func:`parse_tier`)."""
    try:
        parts = value.split()
        if len(parts) == 4 and parts[3].decode("latin-1") in TIERS:
            parts.pop()
        prompt, cached, gen = parts
        counts = int(prompt), int(cached), int(gen)
    except (AttributeError, ValueError):  # none, not three fields, not numbers
        return None
    return counts if min(counts) >= 0 and max(counts) <= MAX_COUNT else None


def parse_tier(value: bytes | None) -> str | None:
    """The KV tier named after the counts of a :data:`USAGE_HEADER` value
    (one of :data:`TIERS`), or None."""
    if not value:
        return None
    parts = value.split()
    tier = parts[3].decode("latin-1") if len(parts) == 4 else None
    return tier if tier in TIERS else None


def _object_after(tail: bytes, key: bytes) -> dict | None:
    """The JSON object that is the value of the last ``key`` (``b'"usage"'``)
    in ``tail`` whose object is whole there; None when there is none.

    By ``rfind`` and brace counting, then ``orjson``: once per answer on the
    forwarding path, where the regular expressions this replaced cost
    several times as much (a usage object nests one level at most)."""
    n = len(key)
    i = tail.rfind(key)
    while i >= 0:
        start = tail.find(b"{", i + n)
        if start > 0 and not tail[i + n:start].strip(b" \t\r\n:"):
            end = start
            while (end := tail.find(b"}", end + 1)) > 0:
                obj = tail[start:end + 1]
                if obj.count(b"{") == obj.count(b"}"):
                    try:
                        doc = orjson.loads(obj)
                    except orjson.JSONDecodeError:
                        break
                    if type(doc) is dict:
                        return doc
                    break
        i = tail.rfind(key, 0, i)
    return None


def _timings_counts(timings: object) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` of llama-server's ``timings``; None
    for anything else."""
    if type(timings) is not dict:
        return None
    prompt, cached, gen = (timings.get("prompt_n"), timings.get("cache_n", 0),
                           timings.get("predicted_n", 0))
    if not all(type(v) is int and 0 <= v <= MAX_COUNT for v in (prompt, cached, gen)):
        return None
    # llama-server's prompt_n counts the tokens it evaluated, cache_n those it reused
    return prompt + cached, cached, gen


def usage_from_tail(tail: bytes) -> tuple[int, int, int] | None:
    """``(prompt, cached, generated)`` from the end of an answer's body
    (its last read, or two): the last OpenAI ``usage`` object in it, else
    llama-server's last ``timings``; None when neither is whole there."""
    counts = usage_counts(_object_after(tail, b'"usage"'))
    if counts is not None:
        return counts
    return _timings_counts(_object_after(tail, b'"timings"'))
