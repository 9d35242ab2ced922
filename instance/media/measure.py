"""What a multimodal projector adds to a load's memory, and what it reads,
from its GGUF header (the ``gguf`` package's reader: keys and tensor
infos, no weights), for the memory ledger's ``measure``.

Bytes: the file's weights, plus the encoder's compute buffer at its
largest input, estimated from the keys ``tools/mtmd/clip.cpp`` reads: a
vision tower of ``n`` patches (``(image_size / patch_size)^2``, or
``image_max_pixels / patch_size^2`` for a dynamic-resolution one) holds
per layer the attention scores (``n_head x n x n`` floats) or its
activations (``n x max(4 n_embd, 2 n_ff)`` floats), whichever is larger;
an audio tower likewise over its 1500 positions (a 30-second Whisper
window). The ready instance's ``effective`` figure corrects the estimate.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

AUDIO_POSITIONS = 1500
"""Positions of a Whisper-style audio window (30 s of 10 ms frames, halved)."""


def _scalar(reader, key: str, default=0):
    f = reader.fields.get(key)
    if f is None or not f.data:
        return default
    try:
        v = f.parts[f.data[0]]
        return v[0].item() if hasattr(v, "__len__") else v
    except (IndexError, AttributeError, ValueError):
        return default


def _tower(reader, prefix: str, positions: int) -> int:
    n_embd = int(_scalar(reader, f"clip.{prefix}.embedding_length"))
    n_ff = int(_scalar(reader, f"clip.{prefix}.feed_forward_length"))
    n_head = max(1, int(_scalar(reader, f"clip.{prefix}.attention.head_count", 1)))
    scores = n_head * positions * positions
    acts = positions * max(4 * n_embd, 2 * n_ff)
    return 4 * max(scores, acts) * 2  # two buffers of the largest op alive at once


def projector_need(path: str) -> tuple[int, dict[str, bool]]:
    """``(bytes, {"vision": bool, "audio": bool})`` of the projector at
    ``path`` (see the module docstring). A file that cannot be read gives
    its size and no modalities (logged): the load itself then says why."""
    size = os.path.getsize(path)
    try:
        from gguf import GGUFReader

        r = GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - a bad file is the load's to report
        log.warning("could not read the projector %s: %s", path, e)
        return size, {"vision": False, "audio": False}
    vision = bool(_scalar(r, "clip.has_vision_encoder", False))
    audio = bool(_scalar(r, "clip.has_audio_encoder", False))
    compute = 0
    if vision:
        patch = max(1, int(_scalar(r, "clip.vision.patch_size", 14)))
        side = int(_scalar(r, "clip.vision.image_size", 224)) // patch
        n = side * side
        max_pixels = int(_scalar(r, "clip.vision.image_max_pixels", 0))
        if max_pixels:
            n = max(n, max_pixels // (patch * patch))
        compute += _tower(r, "vision", n)
    if audio:
        compute += _tower(r, "audio", AUDIO_POSITIONS)
    return size + compute, {"vision": vision, "audio": audio}
