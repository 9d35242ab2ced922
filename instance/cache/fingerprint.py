"""The model fingerprint: everything that changes the bytes of a sequence's
KV state, so that a disk entry is restored only into a context that reads
it the same way (issue 29: "the GGUF's identity, ctx and KV cache types,
rope settings, LoRA adapters, the llama.cpp build").

:func:`fingerprint` hashes the fields to 32 hex digits; the disk tier keeps
each fingerprint's entries in ``DIR/<hex>/`` beside a ``model.json`` that
lists the fields (the contract with the router side: ``ggmux cache``)."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import orjson

GGUF_HEAD_BYTES = 1 << 20
"""Bytes of the GGUF hashed for its identity (its header and the start of
the metadata), with its size and mtime: a changed file is another model."""


@dataclass(slots=True, frozen=True)
class Fingerprint:
    """``fields``: what was hashed (JSON-able); ``hex``: 32 hex digits."""

    fields: dict
    hex: str


def gguf_identity(path: str) -> dict:
    """``{"size", "mtime_ns", "head_sha256"}`` of a GGUF file. Raises
    OSError when it cannot be read."""
    st = os.stat(path)
    with open(path, "rb") as f:
        head = hashlib.sha256(f.read(GGUF_HEAD_BYTES)).hexdigest()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_sha256": head}


def llama_build(llama_cpp) -> str:
    """llama-cpp-python's version and llama.cpp's system info (the CPU
    features and backends compiled in)."""
    info = llama_cpp.llama_print_system_info()
    if isinstance(info, bytes):
        info = info.decode("utf-8", "replace")
    return f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}; {info.strip()}"


def fingerprint(gguf: dict, context: dict, build: str) -> Fingerprint:
    """The fingerprint of a loaded model: ``gguf`` (:func:`gguf_identity`),
    ``context`` (the KV layout: ``kv_size``, ``n_ctx_seq``, ``n_seq``,
    ``unified``, ``type_k``, ``type_v``, ``flash_attn``, rope settings,
    ``swa_full``, ``lora``, ...) and ``build`` (:func:`llama_build`)."""
    fields = {"gguf": gguf, "context": context, "build": build}
    raw = orjson.dumps(fields, option=orjson.OPT_SORT_KEYS)
    return Fingerprint(fields, hashlib.sha256(raw).hexdigest()[:32])


__all__ = ["Fingerprint", "fingerprint", "gguf_identity", "llama_build"]
