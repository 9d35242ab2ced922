"""The Hugging Face hub cache as a source of the model registry: where the
cache is (:func:`hf_cache_dir`), the models it holds, named ``ORG/REPO:QUANT``
as llama.cpp's router names them (:func:`scan_hf_cache`), and llama.cpp's
``-hf ORG/REPO[:QUANT]`` resolved against it (:func:`hf_cache_lookup`).
Read only: ggmux never downloads."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .gguf_files import gguf_name
from .registry import ModelEntry, _entry

# files next to a model that are not models (llama.cpp common_list_cached_models
# and gguf_filename_is_model)
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache folder, found as llama.cpp's
    ``hf_cache::get_cache_directory`` finds it: ``$LLAMA_CACHE``, else
    ``$HF_HUB_CACHE``, else ``$HUGGINGFACE_HUB_CACHE``, else
    ``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else
    ``~/.cache/huggingface/hub`` (empty variables are skipped)."""
    env = os.environ
    for var, sub in (
        ("LLAMA_CACHE", ()),
        ("HF_HUB_CACHE", ()),
        ("HUGGINGFACE_HUB_CACHE", ()),
        ("HF_HOME", ("hub",)),
        ("XDG_CACHE_HOME", ("huggingface", "hub")),
    ):
        if env.get(var):
            return Path(env[var], *sub)
    return Path.home() / ".cache" / "huggingface" / "hub"


_REPO_ID_RE = re.compile(r"^[A-Za-z0-9_]+(?:[./-][A-Za-z0-9_]+)*$")
_COMMIT_RE = re.compile(r"^[0-9a-fA-F]{40}$")


def _valid_repo_id(repo: str) -> bool:
    """llama.cpp ``is_valid_repo_id``: base chars ``[A-Za-z0-9_]``, ``/ . -``
    only between base chars, exactly one ``/``, at most 256 chars."""
    return 0 < len(repo) <= 256 and repo.count("/") == 1 and bool(_REPO_ID_RE.match(repo))


def _snapshot(repo_dir: Path) -> Path | None:
    """The snapshot folder in use: the commit in ``refs/main``, else in the
    first other ref (llama.cpp ``get_cached_ref``); ggmux adds a fallback to
    the newest snapshot when no ref is readable (``hf download --revision
    <sha>`` writes none)."""
    snaps = repo_dir / "snapshots"
    refs = repo_dir / "refs"
    commit = ""
    if refs.is_dir():
        for ref in sorted(refs.iterdir(), key=lambda r: r.name != "main"):
            if not ref.is_file():
                continue
            try:
                c = ref.read_text().strip()
            except OSError:
                continue
            if _COMMIT_RE.match(c) and (snaps / c).is_dir():
                commit = c
                break
    if commit:
        return snaps / commit
    try:
        dirs = [s for s in snaps.iterdir() if s.is_dir()]
    except OSError:
        return None
    return max(dirs, key=lambda s: s.stat().st_mtime, default=None)


def _cached_files(snapshot: Path) -> list[str]:
    """Paths (relative, ``/``-separated, sorted) of the files in a snapshot
    whose target exists (an interrupted download leaves dangling links)."""
    out = []
    for root, _dirs, files in os.walk(snapshot):
        for f in files:
            full = Path(root, f)
            if full.exists():
                out.append(full.relative_to(snapshot).as_posix())
    return sorted(out)


def _quant_bits(tag: str) -> int:
    """``Q4_K_M`` -> 4, ``F16`` -> 16, ``""`` -> 0 (llama.cpp ``extract_quant_bits``)."""
    m = re.search(r"[0-9]+", tag)
    return int(m.group()) if m else 0


def _best_projector(files: list[str], model: str) -> str | None:
    """The projector for ``model`` among ``files`` (llama.cpp
    ``find_best_sibling``): a ``mmproj`` file in the model's folder or an
    ancestor, the deepest first, then the closest quantisation bits."""
    model_dir = model.rsplit("/", 1)[0] if "/" in model else ""
    g = gguf_name(model.rsplit("/", 1)[-1])
    bits = _quant_bits(g.tag if g else "")
    best: tuple[int, int] | None = None
    choice = None
    for f in files:
        if not f.endswith(".gguf") or "mmproj" not in f:
            continue
        d = f.rsplit("/", 1)[0] if "/" in f else ""
        if d and not (model_dir == d or model_dir.startswith(d + "/")):
            continue
        fg = gguf_name(f.rsplit("/", 1)[-1])
        key = (-(d.count("/") + 1 if d else 0), abs(_quant_bits(fg.tag if fg else "") - bits))
        if best is None or key < best:
            best, choice = key, f
    return choice


def scan_hf_cache(cache: Path | None = None) -> list[ModelEntry]:
    """Models in the Hugging Face hub cache, named ``ORG/REPO:QUANT`` as
    llama.cpp's router names them (``common_list_cached_models``).

    For each ``models--ORG--REPO`` folder with a valid repo id, the files of
    its snapshot (see :func:`_snapshot`): every ``*.gguf`` that is a single
    file or the first part of a set, has a quantisation tag in its name, and
    is not a projector, imatrix or draft head, gives one model per
    (repo, tag), the first in sorted order winning. Its projector is the
    nearest ``mmproj`` file (llama.cpp attaches it by default). Returns
    ``[]`` when the cache folder does not exist.
    """
    root = cache if cache is not None else hf_cache_dir()
    if not root.is_dir():
        return []
    out: list[ModelEntry] = []
    seen: set[str] = set()
    for repo_dir in sorted(root.iterdir()):
        if not repo_dir.name.startswith("models--") or not repo_dir.is_dir():
            continue
        repo = repo_dir.name[len("models--") :].replace("--", "/")
        if not _valid_repo_id(repo):
            continue
        snap = _snapshot(repo_dir)
        if snap is None:
            continue
        files = _cached_files(snap)
        for rel in files:
            g = gguf_name(rel)
            if g is None or g.index != 1 or not g.tag:
                continue
            if any(s in g.prefix.rsplit("/", 1)[-1] for s in _NOT_MODEL):
                continue
            name = f"{repo}:{g.tag}"
            if name in seen:
                continue
            seen.add(name)
            proj = _best_projector(files, rel)
            out.append(_entry(name, snap / rel, "hf-cache", mmproj=snap / proj if proj else None))
    return out


def hf_cache_lookup(
    repo_tag: str, hf_file: str | None = None, cache: Path | None = None
) -> tuple[Path, Path | None] | None:
    """Resolve llama.cpp's ``-hf ORG/REPO[:QUANT]`` (and ``-hff FILE``)
    against the local cache only (ggmux never downloads): ``(model path,
    projector path or None)``, or None when not cached.

    As llama.cpp ``find_best_model``: ``FILE`` if given; else the first model
    file matching ``QUANT[.-]`` (case-insensitive); with no ``QUANT``,
    ``Q4_K_M``, then ``Q8_0``, then the first model file. Raises
    ``ValueError`` for a malformed repo id.
    """
    repo, _, tag = repo_tag.partition(":")
    if not _valid_repo_id(repo):
        raise ValueError(f"invalid Hugging Face repo {repo_tag!r} (expected ORG/REPO[:QUANT])")
    root = cache if cache is not None else hf_cache_dir()
    repo_dir = root / ("models--" + repo.replace("/", "--"))
    snap = _snapshot(repo_dir) if repo_dir.is_dir() else None
    if snap is None:
        return None
    files = _cached_files(snap)

    def usable(f: str) -> bool:
        g = gguf_name(f)
        name = f.rsplit("/", 1)[-1]
        return (
            g is not None
            and not any(s in name for s in _NOT_MODEL)
            and (g.count == 1 or g.index == 1)
        )

    chosen = None
    if hf_file:
        chosen = hf_file if hf_file in files else None
    else:
        for t in [tag] if tag else ["Q4_K_M", "Q8_0"]:
            pat = re.compile(re.escape(t) + r"[.-]", re.IGNORECASE)
            chosen = next((f for f in files if usable(f) and pat.search(f)), None)
            if chosen:
                break
        if chosen is None and not tag:
            chosen = next((f for f in files if usable(f)), None)
    if chosen is None:
        return None
    proj = _best_projector(files, chosen)
    return snap / chosen, (snap / proj if proj else None)
