"""Facts about a model's GGUF file for the APIs that describe models
(Ollama's ``/api/tags`` and ``/api/show``): architecture, size label,
quantization, context length, chat template.

A small reader of the GGUF header (the format of ggml's docs/gguf.md:
magic, version, tensor count, key/value count, then typed key/values). It
reads the key/values only and seeks past arrays, so the tokenizer's
vocabulary costs a seek per string instead of a Python object per string
(the ``gguf`` package's reader takes seconds on a 100 MB file; this takes
milliseconds). Results are cached per path and modification time.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import BinaryIO

log = logging.getLogger(__name__)

# GGUF value types -> struct format of a scalar (8 = string, 9 = array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_STRING_BYTES = 1 << 20  # longest string value kept (a chat template); longer ones skipped

# llama.cpp's LLAMA_FTYPE_* (general.file_type) -> quantization name
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
              10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S",
              15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS",
              20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S",
              25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS",
              31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}


def _read(f: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO, keep: bool = True) -> str | None:
    n = _read(f, "<Q")
    if not keep or n > MAX_STRING_BYTES:
        f.seek(n, 1)
        return None
    return f.read(n).decode("utf-8", "replace")


def _value(f: BinaryIO, vtype: int, keep: bool):
    if vtype == _STRING:
        return _string(f, keep)
    if vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if etype == _STRING:
            for _ in range(count):
                f.seek(_read(f, "<Q"), 1)
        elif etype in _SCALARS:
            f.seek(struct.calcsize(_SCALARS[etype]) * count, 1)
        else:
            raise ValueError(f"GGUF array of type {etype}")
        return None  # arrays are not kept (vocabularies, merges)
    fmt = _SCALARS.get(vtype)
    if fmt is None:
        raise ValueError(f"GGUF value type {vtype}")
    return _read(f, fmt)


def read_metadata(path: str) -> dict:
    """The scalar and string key/values of a GGUF file (arrays left out).
    Raises ``OSError`` or ``ValueError`` for a file that is not GGUF."""
    with open(path, "rb", buffering=1 << 16) as f:
        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old")
        _read(f, "<Q")  # tensor count
        n_kv = _read(f, "<Q")
        out = {}
        for _ in range(n_kv):
            key = _string(f)
            vtype = _read(f, "<I")
            out[key] = _value(f, vtype, True)
        return {k: v for k, v in out.items() if v is not None}


def facts(meta: dict) -> dict:
    """What Ollama's answers show, from :func:`read_metadata`'s dict:
    ``family``, ``parameter_size``, ``quantization_level``, ``template``,
    ``context_length``, ``capabilities``, ``model_info``."""
    arch = meta.get("general.architecture") or ""
    ftype = meta.get("general.file_type")
    size = meta.get("general.size_label") or ""
    if not size and isinstance(meta.get("general.parameter_count"), int):
        n = meta["general.parameter_count"]
        size = f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"
    template = meta.get("tokenizer.chat_template") or ""
    info = {k: v for k, v in meta.items()
            if not k.startswith("tokenizer.chat_template") and not isinstance(v, bytes)}
    return {"family": arch, "parameter_size": size,
            "quantization_level": FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
            "template": template, "context_length": meta.get(f"{arch}.context_length"),
            "capabilities": capabilities(template),
            "model_info": info}


def capabilities(template: str) -> list[str]:
    """Ollama's ``capabilities`` of a model with this chat template:
    ``completion``; ``tools`` when it has a template (a template that knows
    no tools gets llama.cpp's generic tool format, issue 19); ``thinking``
    when the template speaks of reasoning (``<think>``, ``enable_thinking``,
    ``reasoning_content``). Clients such as Open WebUI offer tools and
    thinking only to models that list them."""
    caps = ["completion"]
    if template:
        caps.append("tools")
        if any(w in template for w in ("<think>", "enable_thinking", "reasoning_content")):
            caps.append("thinking")
    return caps


class ModelFacts:
    """:func:`facts` per GGUF path, cached by modification time; a file that
    cannot be read gives ``{}`` (logged once)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[float, dict]] = {}

    def get(self, path: str | None) -> dict:
        """:func:`facts` of the GGUF file at ``path`` (``{}`` for none)."""
        if not path:
            return {}
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return {}
        hit = self._cache.get(path)
        if hit is not None and hit[0] == mtime:
            return hit[1]
        try:
            out = facts(read_metadata(path))
        except (OSError, ValueError, struct.error) as e:
            log.info("no GGUF facts for %s: %s", path, e)
            out = {}
        self._cache[path] = (mtime, out)
        return out
