"""GGUF file names and sizes: a file name taken apart as llama.cpp does
(:func:`gguf_name`), projector files, the parts of a multi-part model and
their summed size on disk. Used by every source of the model registry
(:mod:`ggmux.supervisor.registry`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

_SPLIT_RE = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)


@dataclass(slots=True, frozen=True)
class GgufName:
    """A GGUF file name taken apart as llama.cpp's ``get_gguf_split_info``
    does: ``prefix`` without ``.gguf`` and without ``-NNNNN-of-MMMMM``;
    ``tag`` the quantisation (``Q4_K_M``, upper case, ``""`` if none);
    ``index`` and ``count`` of the part (1 and 1 for a single file)."""

    prefix: str
    tag: str
    index: int
    count: int


def gguf_name(path: str) -> GgufName | None:
    """Parse a ``*.gguf`` path (or bare name); None when it does not end
    ``.gguf``. ``model-Q4_K_M-00001-of-00003.gguf`` gives prefix
    ``model-Q4_K_M``, tag ``Q4_K_M``, part 1 of 3."""
    if not path.endswith(".gguf"):
        return None
    prefix = path[: -len(".gguf")]
    index = count = 1
    m = _SPLIT_RE.match(prefix)
    if m:
        prefix, index, count = m.group(1), int(m.group(2)), int(m.group(3))
    t = _TAG_RE.search(prefix)
    return GgufName(prefix, t.group(1).upper() if t else "", index, count)


def is_projector(filename: str) -> bool:
    """A multimodal projector file: llama.cpp matches ``mmproj`` anywhere in
    the name (its README says "must start with"; the code is looser)."""
    return "mmproj" in filename and filename.endswith(".gguf")


def gguf_parts(path: str | Path) -> list[Path]:
    """All files of the model whose (first) file is ``path``: the file itself,
    or for ``name-00001-of-0000N.gguf`` every ``name-0000k-of-0000N.gguf``
    that exists next to it, in order."""
    p = Path(path)
    g = gguf_name(p.name)
    if g is None or g.count <= 1:
        return [p]
    parts = [
        p.with_name(f"{g.prefix}-{i:05d}-of-{g.count:05d}.gguf") for i in range(1, g.count + 1)
    ]
    return [q for q in parts if q.exists()]


def size_of(path: str | Path) -> int:
    """Bytes on disk of a model, all parts summed (symlinks followed); 0 if
    it cannot be read."""
    total = 0
    for q in gguf_parts(path):
        try:
            total += q.stat().st_size
        except OSError:
            pass
    return total
