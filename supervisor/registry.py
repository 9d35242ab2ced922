"""The model registry: which models exist, where their files are, and how
each is started.

Sources, each later one overriding the earlier (DESIGN.md "Configuration",
llama.cpp ``server_models::load_models``):

1. the Hugging Face hub cache (:func:`~ggmux.supervisor.hf_cache.scan_hf_cache`),
   listed whenever it exists, as llama.cpp's router lists it;
2. ``--models-dir`` folders (:func:`scan_models_dir`), and
   ``--fake-models-dir`` for tests (each ``*.json`` is a fake model, see
   :mod:`ggmux.instance.fake`);
3. ``--models-preset`` (:mod:`ggmux.supervisor.presets`);
4. the command line.

With no source given, the demo models of the ``demo`` extra
(:func:`~ggmux.supervisor.demo.demo_models`). Model names are looked up only through
:class:`Registry`, never turned into paths, so a request naming
``../x`` or ``/etc/passwd`` can never make the server open a file that no
source listed.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from .gguf_files import gguf_name, is_projector, size_of

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
    ``price_input``, ``price_cached_input``, ``price_output`` currency per
    million tokens of a ``cmd`` model's or an ``upstream``'s answers, and
    ``spend_per_day|week|month`` those replicas' budget (0: none; issue 36);
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
    price_input: float = 0.0
    price_cached_input: float = 0.0
    price_output: float = 0.0
    spend_per_day: float = 0.0
    spend_per_week: float = 0.0
    spend_per_month: float = 0.0
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
            "stop_timeout": self.stop_timeout,
            "check_endpoint": self.check_endpoint,
            "upstream": [_without_userinfo(u) for u in self.upstream],
            "translate": self.translate,
            "hidden": self.hidden,
            "cache_scope": self.cache_scope,
            "pin": self.pin,
            "eviction_priority": self.eviction_priority,
            "price_input": self.price_input,
            "price_cached_input": self.price_cached_input,
            "price_output": self.price_output,
            "spend_per_day": self.spend_per_day,
            "spend_per_week": self.spend_per_week,
            "spend_per_month": self.spend_per_month,
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
