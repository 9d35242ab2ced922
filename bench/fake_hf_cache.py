"""A Hugging Face hub cache whose repos are the demo models under other names.

llama.cpp's server tests name small models on the Hub
(``ggml-org/test-model-stories260K`` ...) and download them. The
conformance run (:mod:`bench.conformance`) never downloads a model: it
builds a cache in the layout that both llama-server (``common/hf-cache.cpp``)
and ggmux (``supervisor/hf_cache.py``) read offline, in which every repo
the suite needs holds one of the demo GGUF files::

    ROOT/models--ORG--REPO/refs/main                 the commit, 40 hex digits
    ROOT/models--ORG--REPO/blobs/BLOB                the file (a hard link)
    ROOT/models--ORG--REPO/snapshots/COMMIT/FILE     -> ../../blobs/BLOB

Each repo gets its own blob (a hard link to the demo file, or a copy
across file systems), so two repos never resolve to the same real path:
llama.cpp's ``dedup-cache-models`` compares resolved files.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True, frozen=True)
class CachedFile:
    """One file of the fake cache: ``repo`` (``ORG/REPO``), ``file`` its
    path inside the repo (may hold ``/``), ``demo`` the demo model it is
    (``"smollm2"`` or ``"gemma3"``)."""

    repo: str
    file: str
    demo: str


# The repos llama.cpp's tools/server/tests name (utils.py ServerPreset and
# the unit files), mapped to a demo model of the same role: SmolLM2-135M-
# Instruct (a chat template) for chat and instruct models, Gemma 3 270M (no
# chat template: a base model) where a base model fits. The suite's
# embedding and rerank models (BERT bge-small, jina-reranker) and its
# infill model have no demo equivalent: the first two get SmolLM2 (a
# causal model: the embedding tests measure what a causal model gives),
# the infill one Gemma 3 (no FIM tokens: infill tests fail on both
# servers and do not count). Repos left out on purpose: the Hub-only ones
# (ggml-org/test-preset-ci, the router's download test) and the
# multi-gigabyte models of the slow tests (bartowski/...).
SUITE_FILES: tuple[CachedFile, ...] = (
    CachedFile("ggml-org/test-model-stories260K", "stories260K-F32.gguf", "smollm2"),
    CachedFile("ggml-org/test-model-stories260K-infill", "stories260K-infill-F32.gguf", "gemma3"),
    CachedFile("ggml-org/tinygemma3-GGUF", "tinygemma3-Q8_0.gguf", "smollm2"),
    CachedFile("ggml-org/models", "tinyllamas/stories260K.gguf", "smollm2"),
    CachedFile("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf", "smollm2"),
    CachedFile("ggml-org/models", "jina-reranker-v1-tiny-en/ggml-model-f16.gguf", "smollm2"),
    CachedFile("ggml-org/stories15M_MOE", "stories15M_MOE-F16.gguf", "smollm2"),
)


def repo_folder(repo: str) -> str:
    """``ORG/REPO`` -> ``models--ORG--REPO`` (huggingface_hub's folder name)."""
    return "models--" + repo.replace("/", "--")


def commit_of(repo: str) -> str:
    """A fixed 40-hex-digit commit for ``repo`` (the same on every run)."""
    return hashlib.sha1(repo.encode()).hexdigest()


def blob_of(f: CachedFile) -> str:
    """A fixed blob name for one file (64 hex digits, as a SHA-256 is)."""
    return hashlib.sha256(f"{f.repo}/{f.file}".encode()).hexdigest()


def layout(f: CachedFile) -> dict[str, str]:
    """The paths of ``f`` relative to the cache root: ``ref`` (the file that
    holds the commit), ``blob``, ``snapshot`` (the symlink) and ``target``
    (what the symlink holds, relative to its folder)."""
    root = repo_folder(f.repo)
    snapshot = f"{root}/snapshots/{commit_of(f.repo)}/{f.file}"
    blob = f"{root}/blobs/{blob_of(f)}"
    depth = f.file.count("/") + 2  # snapshots/COMMIT/[dirs/]FILE -> the repo folder
    return {"ref": f"{root}/refs/main", "blob": blob, "snapshot": snapshot,
            "target": "../" * depth + f"blobs/{blob_of(f)}"}


def build(root: Path, demos: dict[str, Path],
          files: tuple[CachedFile, ...] = SUITE_FILES) -> list[CachedFile]:
    """Write the fake cache under ``root`` (kept if already there: a second
    call only adds what is missing) from ``demos`` (``"smollm2"`` ->
    path of its GGUF, ...). Files whose demo is missing are skipped; returns
    those written or found."""
    done: list[CachedFile] = []
    for f in files:
        src = demos.get(f.demo)
        if src is None:
            continue
        paths = {k: root / v for k, v in layout(f).items() if k != "target"}
        paths["ref"].parent.mkdir(parents=True, exist_ok=True)
        paths["ref"].write_text(commit_of(f.repo))
        if not paths["blob"].exists():
            paths["blob"].parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, paths["blob"])
            except OSError:  # another file system: a copy
                shutil.copyfile(src, paths["blob"])
        link = paths["snapshot"]
        if not link.is_symlink():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(layout(f)["target"])
        done.append(f)
    return done


def demo_files() -> dict[str, Path]:
    """The installed demo models' GGUF files (``pip install 'ggmux[demo]'``)."""
    from ggmux.supervisor.demo import demo_models

    names = {"smollm2-135m": "smollm2", "gemma3-270m": "gemma3"}
    return {names[e.name]: Path(e.path) for e in demo_models() if e.name in names}
