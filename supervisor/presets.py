"""Model presets: llama.cpp's INI format (``--models-preset FILE``), so that
an existing llama.cpp preset file works unchanged, plus ggmux's own keys.

Format (llama.cpp ``common/preset.cpp`` ``parse_ini_from_file`` and
``load_from_ini``; tools/server/README.md "Model presets")::

    version = 1            ; the only key allowed before the first section
    [*]                    ; applied to every model, from every source
    c = 8192
    [ggml-org/gemma-3-4b-it-GGUF:Q4_K_M]   ; names an existing model: merges
    n-gpu-layers = 99
    [my-model]             ; a new model: needs model, hf-repo, cmd or upstream
    model = /models/my-model-Q4_K_M.gguf
    alias = mine, fast

* Lines: ``[name]`` section headers, ``key = value``, blank lines, and
  comments starting ``;`` or ``#``. An inline comment starts at ``;`` or
  ``#`` preceded by whitespace (llama.cpp cuts at any ``;``/``#``, which
  would break URLs and shell commands; ggmux needs the whitespace).
  Values are taken verbatim otherwise: no quotes are removed.
* Keys are llama-server's option names without dashes, long or short
  (``ctx-size``, ``c``), or their environment variable names
  (``LLAMA_ARG_CTX_SIZE``); a negated flag (``no-mmap = true``) sets the
  positive one to the opposite; flags take ``on/off``, ``true/false``,
  ``1/0``, ``enabled/disabled``. llama.cpp's preset-only keys
  ``load-on-startup``, ``stop-timeout``, ``dedup-cache-models`` and ggmux's
  keys (see ``presets.example.ini``) are accepted too. A key that appears
  twice in one section: the last wins (llama.cpp), except ``env``, which
  adds up.
* Values may hold ``${env.NAME}``, replaced by the environment variable
  ``NAME`` (llama-swap's macro syntax; not in llama.cpp, so a llama.cpp file
  is unaffected). Relative file paths are relative to the server's working
  directory, as in llama.cpp; ``~`` is expanded.
* Precedence for one model, lowest first (llama.cpp ``load_models``):
  ggmux's defaults (what ``--ctx-size``, ``--threads``, ``--n-gpu-layers``,
  ``--stop-timeout`` mean when not given) and ``--ttl``; ``[*]``; what the
  model's source found (its file and projector); the model's own section;
  ``--ctx-size``, ``--threads``, ``--n-gpu-layers``, ``--stop-timeout``
  given on the command line (llama.cpp overlays the router's own command
  line on every preset).
* Router-controlled llama.cpp options (``host``, ``port``, ``api-key-file``,
  ``ssl-*``, ``models-*``, ``hf-token``) are dropped with a warning, as
  llama.cpp drops or overwrites them. Options that download
  (``model-url``, ``mmproj-url``, ``docker-repo``) are errors: ggmux never
  downloads. ``hf-repo`` resolves against the local Hugging Face cache.

Errors are :class:`PresetError` (a ``ValueError``) and read
``FILE:LINE: reason``: unknown key, duplicate section, bad number or
boolean, missing model or projector file, a section that names no existing
model and gives none of ``model``, ``hf-repo``, ``cmd``, ``upstream``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .registry import ModelEntry, demo_path, gguf_name, gguf_parts, hf_cache_lookup, size_of

log = logging.getLogger(__name__)

GLOBAL_SECTION = "*"
CLI_FILE = "command line"


class PresetError(ValueError):
    """A preset that cannot be used: ``file``, ``line`` (1-based; 0 when the
    cause has no line) and ``reason``; ``str()`` is ``FILE:LINE: reason``."""

    def __init__(self, file: str, line: int, reason: str) -> None:
        self.file = file
        self.line = line
        self.reason = reason
        super().__init__(f"{file}:{line}: {reason}" if line else f"{file}: {reason}")


# ---- the INI reader ------------------------------------------------------------------


@dataclass(slots=True)
class IniItem:
    """``key = value`` on line ``line`` (value stripped, comment removed)."""

    key: str
    value: str
    line: int


@dataclass(slots=True)
class IniSection:
    """``[name]`` on line ``line`` and its items in file order."""

    name: str
    line: int
    items: list[IniItem] = field(default_factory=list)


_HEADER_RE = re.compile(r"^\[\s*([^\]]*?)\s*\]\s*(?:[;#].*)?$")
_ITEM_RE = re.compile(r"^([A-Za-z_][A-Za-z0-9_.-]*)\s*=\s*(.*)$")
_COMMENT_RE = re.compile(r"(?:^|\s)[;#]")
_MACRO_RE = re.compile(r"\$\{env\.([A-Za-z_][A-Za-z0-9_]*)\}")


def read_ini(path: str) -> tuple[list[IniItem], list[IniSection]]:
    """Read an INI file: ``(items before the first section, sections)``.

    Raises :class:`PresetError` for a line that is none of header, item,
    comment or blank, an empty or repeated section name, and a
    ``${env.NAME}`` whose variable is not set; ``OSError`` when the file
    cannot be read.
    """
    text = Path(path).read_text(encoding="utf-8")
    text = text.removeprefix("\ufeff")
    top: list[IniItem] = []
    sections: list[IniSection] = []
    seen: dict[str, int] = {}
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line[0] in ";#":
            continue
        if line.startswith("["):
            m = _HEADER_RE.match(line)
            if m is None:
                raise PresetError(path, n, f"bad section header {line!r} (expected [name])")
            name = m.group(1)
            if not name:
                raise PresetError(path, n, "empty section name")
            if name in seen:
                raise PresetError(
                    path, n, f"duplicate section [{name}] (first on line {seen[name]})"
                )
            seen[name] = n
            sections.append(IniSection(name, n))
            continue
        m = _ITEM_RE.match(line)
        if m is None:
            raise PresetError(
                path, n, f"expected 'key = value', '[section]' or a comment, got {line!r}"
            )
        value = m.group(2)
        c = _COMMENT_RE.search(value)
        if c is not None:
            value = value[: c.start()]
        item = IniItem(m.group(1), _expand(value.strip(), path, n), n)
        (sections[-1].items if sections else top).append(item)
    return top, sections


def _expand(value: str, path: str, line: int) -> str:
    def sub(m: re.Match) -> str:
        v = os.environ.get(m.group(1))
        if v is None:
            v = demo_path(m.group(1))  # presets.example.ini's demo models, as shipped
        if v is None:
            raise PresetError(
                path, line, f"${{env.{m.group(1)}}}: environment variable {m.group(1)} is not set"
            )
        return v

    return _MACRO_RE.sub(sub, value)


# ---- llama-server options ------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class LlamaOption:
    """One llama-server option: ``forms`` its names with dashes (``-c``,
    ``--ctx-size``), ``neg`` its negated names, ``kind`` ``"value"``,
    ``"flag"`` (present or not) or ``"bool"`` (positive/negative pair),
    ``env`` its environment variable (``""``: none). ``key`` is the
    canonical preset key: the last form without dashes, the one llama.cpp
    renders (``common_preset::to_args`` uses ``args.back()``)."""

    forms: tuple[str, ...]
    neg: tuple[str, ...]
    kind: str
    env: str

    @property
    def key(self) -> str:
        return self.forms[-1].lstrip("-")


def _parse_table(table: str) -> dict[str, tuple[LlamaOption, bool]]:
    """Preset key (any form without dashes, or env name) -> (option, negated)."""
    out: dict[str, tuple[LlamaOption, bool]] = {}
    for row in table.strip().splitlines():
        forms, neg, kind, env = row.split("|")
        opt = LlamaOption(tuple(forms.split(",")), tuple(n for n in neg.split(",") if n), kind, env)
        for f in opt.forms:
            out.setdefault(f.lstrip("-"), (opt, False))
        for f in opt.neg:
            out.setdefault(f.lstrip("-"), (opt, True))
        if env:
            out.setdefault(env, (opt, False))
    return out


# ---- value parsers ------------------------------------------------------------------------

_TRUE = ("on", "enabled", "true", "1")  # llama.cpp common_arg_utils::is_truthy
_FALSE = ("off", "disabled", "false", "0")  # is_falsey


class _Bad(ValueError):
    """A value a parser rejects; the caller adds file, line and key."""


def parse_bool(v: str) -> bool:
    """llama.cpp's truthy/falsey words (case-insensitive here); raises
    ``ValueError`` for anything else."""
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise _Bad(f"bad boolean {v!r} (expected one of {', '.join(_TRUE + _FALSE)})")


def _int(lo: int | None = None) -> Callable[[str], int]:
    def parse(v: str) -> int:
        try:
            n = int(v.strip())
        except ValueError:
            raise _Bad(f"bad number {v!r} (expected an integer)") from None
        if lo is not None and n < lo:
            raise _Bad(f"bad number {v!r} (must be at least {lo})")
        return n

    return parse


def _float(lo: float | None = None, positive: bool = False) -> Callable[[str], float]:
    def parse(v: str) -> float:
        try:
            x = float(v.strip())
        except ValueError:
            raise _Bad(f"bad number {v!r} (expected a number)") from None
        if not math.isfinite(x):
            raise _Bad(f"bad number {v!r} (must be finite)")
        if positive and x <= 0:
            raise _Bad(f"bad number {v!r} (must be greater than 0)")
        if lo is not None and x < lo:
            raise _Bad(f"bad number {v!r} (must be at least {lo:g})")
        return x

    return parse


def _n_gpu_layers(v: str) -> int:
    """An integer, or llama.cpp's ``all``/``auto`` (both -1: every layer;
    llama-cpp-python has no automatic fit)."""
    if v.strip().lower() in ("all", "auto"):
        return -1
    return _int()(v)


def _text(v: str) -> str:
    if not v:
        raise _Bad("empty value")
    return v


def _path(v: str) -> str:
    return os.path.abspath(os.path.expanduser(_text(v)))


def _aliases(v: str) -> list[str]:
    """Comma-separated, each stripped, empty ones dropped (llama.cpp)."""
    return [a for a in (s.strip() for s in v.split(",")) if a]


_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env(v: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs separated by spaces, shell-quoted where needed:
    ``env = CUDA_VISIBLE_DEVICES=0,1 "GREETING=hello world"``."""
    try:
        words = shlex.split(v)
    except ValueError as e:
        raise _Bad(f"bad env {v!r}: {e}") from None
    out: dict[str, str] = {}
    for w in words:
        k, eq, val = w.partition("=")
        if not eq or not _ENV_NAME_RE.match(k):
            raise _Bad(f"bad env entry {w!r} (expected NAME=VALUE)")
        out[k] = val
    if not out:
        raise _Bad("empty value")
    return out


def _endpoint(v: str) -> str:
    """A path starting ``/``, or ``none`` (stored as ``""``: no check)."""
    if v.strip().lower() == "none":
        return ""
    if not v.startswith("/"):
        raise _Bad(f"bad check-endpoint {v!r} (expected a path starting with / or 'none')")
    return v


def _url(v: str) -> str:
    if not re.match(r"^https?://[^/\s]+", v):
        raise _Bad(f"bad upstream {v!r} (expected http://HOST[:PORT][/PATH])")
    return v.rstrip("/")


def _repo(v: str) -> str:
    repo = v.partition(":")[0]
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise _Bad(f"bad hf-repo {v!r} (expected ORG/REPO[:QUANT])")
    return v


# Keys ggmux reads itself (canonical key -> parser). llama.cpp options among
# them are also in the table below, which maps their other spellings here.
_FIELDS: dict[str, Callable[[str], object]] = {
    # llama.cpp options
    "model": _path,
    "hf-repo": _repo,
    "hf-file": _text,
    "mmproj": _path,
    "mmproj-auto": parse_bool,
    "ctx-size": _int(0),
    "threads": _int(),
    "n-gpu-layers": _n_gpu_layers,
    "alias": _aliases,
    "api-key": _text,
    "tags": str,  # llama.cpp: informational only; accepted and not used
    # llama.cpp preset-only options (common_params_add_preset_options)
    "load-on-startup": parse_bool,
    "stop-timeout": _float(0),
    "dedup-cache-models": parse_bool,
    # ggmux (and llama-swap) keys
    "ttl": _float(),
    "replicas": _int(1),
    "weight": _float(positive=True),
    "priority": _int(),
    "max-concurrency": _int(0),
    "cmd": _text,
    "cmd-stop": _text,
    "env": _env,
    "check-endpoint": _endpoint,
    "upstream": _url,
    "translate": parse_bool,
}

# llama.cpp options the router itself controls: dropped with a warning
# (server-models.cpp unset_reserved_args / update_args).
_RESERVED = frozenset(
    {
        "host",
        "port",
        "reuse-port",
        "api-key-file",
        "ssl-key-file",
        "ssl-cert-file",
        "models-dir",
        "models-max",
        "models-preset",
        "models-autoload",
        "hf-token",
    }
)
# llama.cpp options that download: ggmux serves local files only.
_DOWNLOADS = frozenset({"model-url", "mmproj-url", "docker-repo"})


@dataclass(slots=True)
class Opt:
    """One preset value after parsing: ``value`` typed (str for pass-through
    llama.cpp options, bool for flags), where it was written (``file``,
    ``line``) and as which ``key``."""

    value: object
    file: str
    line: int
    key: str


Layer = dict  # canonical key -> Opt


def normalise(key: str) -> tuple[str, LlamaOption | None, bool]:
    """``(canonical key, llama.cpp option or None, negated)`` of a preset key;
    raises ``KeyError`` when the key is unknown."""
    if key in _FIELDS:
        hit = LLAMA_OPTIONS.get(key)
        return key, hit[0] if hit else None, False
    hit = LLAMA_OPTIONS.get(key)
    if hit is None:
        raise KeyError(key)
    opt, negated = hit
    return opt.key, opt, negated


def parse_item(file: str, item: IniItem) -> tuple[str, Opt] | None:
    """Parse one ``key = value``: ``(canonical key, Opt)``, or None for a key
    that is accepted and dropped. Raises :class:`PresetError`."""
    if item.key == "version":
        return None  # llama.cpp: reserved for future use
    try:
        key, opt, negated = normalise(item.key)
    except KeyError:
        raise PresetError(
            file,
            item.line,
            f"unknown key {item.key!r} (not a llama-server option nor a ggmux preset key)",
        ) from None
    if key in _DOWNLOADS:
        raise PresetError(
            file,
            item.line,
            f"{item.key!r}: ggmux does not download models; give a local file with 'model'",
        )
    if key in _RESERVED:
        log.warning("%s:%d: %r is controlled by ggmux; ignored", file, item.line, item.key)
        return None
    try:
        if key in _FIELDS:
            value: object = _FIELDS[key](item.value)
        elif opt is not None and opt.kind in ("flag", "bool"):
            value = parse_bool(item.value)
        else:
            value = item.value
        if negated:
            value = not value
    except _Bad as e:
        raise PresetError(file, item.line, f"{item.key!r}: {e}") from None
    return key, Opt(value, file, item.line, item.key)


def _merge_into(layer: Layer, key: str, opt: Opt) -> None:
    if key == "env" and "env" in layer:
        old = layer["env"]
        layer["env"] = Opt({**old.value, **opt.value}, opt.file, opt.line, opt.key)
    else:
        layer[key] = opt


# ---- preset files ----------------------------------------------------------------------


@dataclass(slots=True)
class PresetSection:
    """One model section: ``name``, header ``line``, parsed ``layer``."""

    name: str
    line: int
    layer: Layer


@dataclass(slots=True)
class PresetFile:
    """A parsed preset file: ``globals`` from ``[*]`` (empty if absent) and
    the model sections in file order."""

    path: str
    globals: Layer
    sections: list[PresetSection]


def load_preset(path: str) -> PresetFile:
    """Read and check a preset file (every key known, every value of its
    type). File existence of ``model``/``mmproj`` is checked later, by
    :func:`resolve`, against the final merged values. Raises
    :class:`PresetError`, including for a file that cannot be read."""
    try:
        top, sections = read_ini(path)
    except OSError as e:
        raise PresetError(path, 0, f"cannot read preset file: {e.strerror or e}") from None
    for item in top:
        if item.key != "version":
            raise PresetError(
                path,
                item.line,
                f"{item.key!r} is outside any section; put settings for every model under [*]",
            )
    out = PresetFile(path, {}, [])
    for s in sections:
        layer: Layer = {}
        for item in s.items:
            parsed = parse_item(path, item)
            if parsed is not None:
                _merge_into(layer, *parsed)
        if s.name == GLOBAL_SECTION:
            out.globals = layer
        else:
            out.sections.append(PresetSection(s.name, s.line, layer))
    return out


def command_line_layer(values: dict[str, object]) -> Layer:
    """A layer from options given explicitly on the command line
    (canonical key -> already typed value), highest precedence."""
    return {k: Opt(v, CLI_FILE, 0, "--" + k) for k, v in values.items()}


# ---- merging sources and presets ------------------------------------------------------------

# keys that say which file a model is: a source's own value beats [*]'s
_FILE_KEYS = ("model", "hf-repo", "hf-file")
_NEEDS_ONE_OF = ("model", "hf-repo", "cmd", "upstream")


def resolve(
    base: list[ModelEntry],
    preset: PresetFile | None = None,
    cli: Layer | None = None,
    hf_cache: Path | None = None,
    defaults: Layer | None = None,
) -> list[ModelEntry]:
    """Final entries from the models the sources found (``base``, earlier
    sources first), a preset file, the explicit command-line layer ``cli``
    and a ``defaults`` layer (command-line values that every source beats).

    A base entry named like an earlier one replaces it, in its place
    (llama.cpp: "if a model exists in both cached and local, local takes
    precedence"). Every entry gets ``defaults``, then ``[*]`` (except its
    file keys), then its own section (merged key by key), then ``cli``. Sections naming no base entry are new models,
    after the base ones in file order. A Hugging Face cache entry whose file
    a preset section also names is listed once, under the section's name,
    its cache name kept as an alias (llama.cpp's ``dedup-cache-models``,
    which ggmux turns on by default; ``dedup-cache-models = false`` keeps
    both). Raises :class:`PresetError`.
    """
    glob: Layer = preset.globals if preset else {}
    sections = {s.name: s for s in preset.sections} if preset else {}
    cli = cli or {}
    defaults = defaults or {}
    merged_base: dict[str, ModelEntry] = {}
    for e in base:
        merged_base[e.name] = e
    out: list[ModelEntry] = []
    dedup: dict[int, bool] = {}  # index in out of a section entry -> dedup-cache-models
    for e in merged_base.values():
        g = {
            k: o
            for k, o in glob.items()
            if k not in _FILE_KEYS and not (k == "mmproj" and e.mmproj)
        }
        s = sections.get(e.name)
        layers = [defaults, g] + ([s.layer] if s else []) + [cli]
        source = f"preset:{preset.path}:{s.line}" if s else e.source
        if s is not None:
            dedup[len(out)] = bool(_value(layers, "dedup-cache-models", True))
        out.append(
            _materialise(
                e.name,
                e,
                layers,
                source,
                hf_cache,
                s.line if s else 0,
                preset.path if preset else "",
            )
        )
    for s in sections.values():
        if s.name in merged_base:
            continue
        if not any(k in glob or k in s.layer for k in _NEEDS_ONE_OF):
            raise PresetError(
                preset.path,
                s.line,
                f"section [{s.name}] names no existing model and sets none of "
                + ", ".join(_NEEDS_ONE_OF),
            )
        layers = [defaults, glob, s.layer, cli]
        dedup[len(out)] = bool(_value(layers, "dedup-cache-models", True))
        out.append(
            _materialise(
                s.name,
                None,
                layers,
                f"preset:{preset.path}:{s.line}",
                hf_cache,
                s.line,
                preset.path,
            )
        )
    return _dedup_cache(out, dedup)


def _value(layers: list[Layer], key: str, default: object) -> object:
    for layer in reversed(layers):
        if key in layer:
            return layer[key].value
    return default


def _materialise(
    name: str,
    base: ModelEntry | None,
    layers: list[Layer],
    source: str,
    hf_cache: Path | None,
    section_line: int,
    preset_path: str,
) -> ModelEntry:
    merged: Layer = {}
    for layer in layers:
        for k, o in layer.items():
            _merge_into(merged, k, o)
    if base is not None:
        e = dataclasses.replace(
            base, aliases=list(base.aliases), env=dict(base.env), extra_args=list(base.extra_args)
        )
    else:
        e = ModelEntry(name=name, path="")
    e.name = name
    e.source = source

    def err(o: Opt | None, reason: str) -> PresetError:
        """The error at the value that caused it, else at the section header,
        else (a model no preset touched) at the model's source."""
        if o is not None:
            return PresetError(o.file, o.line, reason)
        if section_line:
            return PresetError(preset_path, section_line, reason)
        return PresetError(source, 0, reason)

    path_opt = merged.get("model")
    if path_opt is not None:
        e.path = str(path_opt.value)
    elif "hf-repo" in merged:
        o = merged["hf-repo"]
        hf_file = merged["hf-file"].value if "hf-file" in merged else None
        try:
            found = hf_cache_lookup(str(o.value), hf_file, hf_cache)
        except ValueError as x:
            raise err(o, str(x)) from None
        if found is None:
            raise err(
                o,
                f"hf-repo {o.value!r}{f' file {hf_file!r}' if hf_file else ''} is not "
                f"in the Hugging Face cache (ggmux does not download; fetch it first, "
                f"e.g. with 'hf download')",
            )
        e.path = str(found[0])
        if found[1] is not None and "mmproj" not in merged:
            e.mmproj = str(found[1])
        path_opt = o
    path_changed = base is None or e.path != base.path

    extra: list[str] = []
    for key, o in merged.items():
        v = o.value
        if key in _FIELDS:
            _apply_field(e, key, v)
            continue
        opt = LLAMA_OPTIONS[key][0]
        if opt.kind == "flag":
            if v:
                extra.append(opt.forms[-1])
        elif opt.kind == "bool":
            extra.append(opt.forms[-1] if v else opt.neg[-1])
        else:
            extra += [opt.forms[-1], str(v)]
    e.extra_args = extra
    if merged.get("mmproj-auto") is not None and not merged["mmproj-auto"].value:
        e.mmproj = None

    if e.upstream and not (e.path or e.cmd):
        e.kind = "upstream"  # remote only; with a model file it is an extra, remote replica
    elif e.cmd:
        e.kind = "cmd"
    elif base is None or path_changed:
        e.kind = "fake" if e.path.endswith(".json") else "llama"
    if e.kind in ("llama", "fake") and not e.path:
        raise err(None, f"model {name!r} has no model file")
    if e.path and e.kind != "upstream":
        if not os.path.isfile(e.path):
            raise err(path_opt, f"model file not found: {e.path}")
        if path_changed:
            missing = _missing_parts(e.path)
            if missing:
                raise err(path_opt, f"model {name!r}: part {missing} of {e.path} not found")
            e.size_bytes = size_of(e.path)
    if e.mmproj and not os.path.isfile(e.mmproj):
        raise err(merged.get("mmproj"), f"projector file not found: {e.mmproj}")
    return e


def _missing_parts(path: str) -> str | None:
    """The first missing part file of a multi-part model, or None."""
    g = gguf_name(os.path.basename(path))
    if g is None or g.count <= 1:
        return None
    have = {p.name for p in gguf_parts(path)}
    for i in range(1, g.count + 1):
        want = f"{g.prefix.rsplit('/', 1)[-1]}-{i:05d}-of-{g.count:05d}.gguf"
        if want not in have:
            return want
    return None


def _apply_field(e: ModelEntry, key: str, v: object) -> None:
    if key == "model" or key in ("hf-repo", "hf-file", "tags", "dedup-cache-models"):
        return  # handled by the caller, or informational only
    if key == "mmproj":
        e.mmproj = str(v)
    elif key == "mmproj-auto":
        return
    elif key == "ctx-size":
        e.ctx_size = int(v)
    elif key == "threads":
        e.threads = int(v) if int(v) > 0 else None  # llama.cpp: -1 = default
    elif key == "n-gpu-layers":
        e.n_gpu_layers = int(v)
    elif key == "alias":
        e.aliases = list(v)
    elif key == "api-key":
        e.api_key = str(v)
    elif key == "load-on-startup":
        e.load_on_startup = bool(v)
    elif key == "stop-timeout":
        e.stop_timeout = float(v)
    elif key == "ttl":
        e.ttl = float(v) if float(v) > 0 else None  # llama-swap: 0 = never unload
    elif key == "replicas":
        e.replicas = int(v)
    elif key == "weight":
        e.weight = float(v)
    elif key == "priority":
        e.priority = int(v)
    elif key == "max-concurrency":
        e.max_concurrency = int(v)
    elif key == "cmd":
        e.cmd = str(v)
    elif key == "cmd-stop":
        e.cmd_stop = str(v)
    elif key == "env":
        e.env = {**e.env, **v}
    elif key == "check-endpoint":
        e.check_endpoint = str(v)
    elif key == "upstream":
        e.upstream = str(v)
    elif key == "translate":
        e.translate = bool(v)
    else:  # pragma: no cover - _FIELDS and this switch are kept in step
        raise AssertionError(key)


def _dedup_cache(entries: list[ModelEntry], dedup: dict[int, bool]) -> list[ModelEntry]:
    cache = {
        os.path.realpath(e.path): i
        for i, e in enumerate(entries)
        if e.source == "hf-cache" and e.path
    }
    if not cache:
        return entries
    explicit = {a for e in entries for a in e.aliases}
    hidden: set[int] = set()
    for i, on in dedup.items():
        e = entries[i]
        j = cache.get(os.path.realpath(e.path)) if e.path and on else None
        if j is None or j == i or j in hidden:
            continue
        hidden.add(j)
        name = entries[j].name
        log.info("%s: listing cached model %s once, as %s", e.source, name, e.name)
        if name not in explicit:
            e.aliases.append(name)
            explicit.add(name)
    return [e for i, e in enumerate(entries) if i not in hidden]


# llama-server options for presets, generated from llama.cpp common/arg.cpp
# (build b11434, options of the server example; --help, --version,
# --cache-list, --completion-bash, --list-devices and two-value options left
# out), then options of earlier builds that existing preset files use
# (--mmap/--no-mmap, --mlock, --draft-max, ...). Columns:
# forms | negated forms | value, flag or bool | environment variable.
_LLAMA_TABLE = """
-t,--threads||value|LLAMA_ARG_THREADS
-tb,--threads-batch||value|
-C,--cpu-mask||value|
-Cr,--cpu-range||value|
--cpu-strict||value|
--prio||value|
--poll||value|
-Cb,--cpu-mask-batch||value|
-Crb,--cpu-range-batch||value|
--cpu-strict-batch||value|
--prio-batch||value|
--poll-batch||value|
-lcs,--lookup-cache-static||value|
-lcd,--lookup-cache-dynamic||value|
-c,--ctx-size||value|LLAMA_ARG_CTX_SIZE
--kv-unified-per-slot||value|LLAMA_ARG_KV_UNIFIED_PER_SLOT
-n,--predict,--n-predict||value|LLAMA_ARG_N_PREDICT
-b,--batch-size||value|LLAMA_ARG_BATCH
-ub,--ubatch-size||value|LLAMA_ARG_UBATCH
--keep||value|
--swa-full||flag|LLAMA_ARG_SWA_FULL
-ctxcp,--ctx-checkpoints,--swa-checkpoints||value|LLAMA_ARG_CTX_CHECKPOINTS
-cms,--checkpoint-min-step||value|LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT
-cram,--cache-ram||value|LLAMA_ARG_CACHE_RAM
-kvu,--kv-unified|-no-kvu,--no-kv-unified|bool|LLAMA_ARG_KV_UNIFIED
--cache-idle-slots|--no-cache-idle-slots|bool|LLAMA_ARG_CACHE_IDLE_SLOTS
--context-shift|--no-context-shift|bool|LLAMA_ARG_CONTEXT_SHIFT
-fa,--flash-attn||value|LLAMA_ARG_FLASH_ATTN
--perf|--no-perf|bool|LLAMA_ARG_PERF
-e,--escape|--no-escape|bool|
-r,--reverse-prompt||value|
-sp,--special||flag|
--warmup|--no-warmup|bool|
--spm-infill||flag|
--samplers||value|
-s,--seed||value|
--sampler-seq,--sampling-seq||value|
--ignore-eos||flag|
--temp,--temperature||value|LLAMA_ARG_TEMPERATURE
--top-k||value|LLAMA_ARG_TOP_K
--top-p||value|LLAMA_ARG_TOP_P
--min-p||value|LLAMA_ARG_MIN_P
--top-nsigma,--top-n-sigma||value|
--xtc-probability||value|
--xtc-threshold||value|
--typical,--typical-p||value|
--repeat-last-n||value|
--repeat-penalty||value|LLAMA_ARG_REPEAT_PENALTY
--presence-penalty||value|LLAMA_ARG_PRESENCE_PENALTY
--frequency-penalty||value|LLAMA_ARG_FREQUENCY_PENALTY
--dry-multiplier||value|
--dry-base||value|
--dry-allowed-length||value|
--dry-penalty-last-n||value|
--dry-sequence-breaker||value|
--adaptive-target||value|
--adaptive-decay||value|
--dynatemp-range||value|
--dynatemp-exp||value|
--mirostat||value|
--mirostat-lr||value|
--mirostat-ent||value|
-l,--logit-bias||value|
--grammar||value|
--grammar-file||value|
-j,--json-schema||value|
-jf,--json-schema-file||value|
-bs,--backend-sampling||flag|LLAMA_ARG_BACKEND_SAMPLING
--pooling||value|LLAMA_ARG_POOLING
--rope-scaling||value|LLAMA_ARG_ROPE_SCALING_TYPE
--rope-scale||value|LLAMA_ARG_ROPE_SCALE
--rope-freq-base||value|LLAMA_ARG_ROPE_FREQ_BASE
--rope-freq-scale||value|LLAMA_ARG_ROPE_FREQ_SCALE
--yarn-orig-ctx||value|LLAMA_ARG_YARN_ORIG_CTX
--yarn-ext-factor||value|LLAMA_ARG_YARN_EXT_FACTOR
--yarn-attn-factor||value|LLAMA_ARG_YARN_ATTN_FACTOR
--yarn-beta-slow||value|LLAMA_ARG_YARN_BETA_SLOW
--yarn-beta-fast||value|LLAMA_ARG_YARN_BETA_FAST
-kvo,--kv-offload|-nkvo,--no-kv-offload|bool|LLAMA_ARG_KV_OFFLOAD
--repack|-nr,--no-repack|bool|LLAMA_ARG_REPACK
--no-host||flag|LLAMA_ARG_NO_HOST
-ctk,--cache-type-k||value|LLAMA_ARG_CACHE_TYPE_K
-ctv,--cache-type-v||value|LLAMA_ARG_CACHE_TYPE_V
-dt,--defrag-thold||value|LLAMA_ARG_DEFRAG_THOLD
-np,--parallel||value|LLAMA_ARG_N_PARALLEL
-cb,--cont-batching|-nocb,--no-cont-batching|bool|LLAMA_ARG_CONT_BATCHING
-mm,--mmproj||value|LLAMA_ARG_MMPROJ
-mmu,--mmproj-url||value|LLAMA_ARG_MMPROJ_URL
--mmproj-auto|--no-mmproj,--no-mmproj-auto|bool|LLAMA_ARG_MMPROJ_AUTO
--mmproj-offload|--no-mmproj-offload|bool|LLAMA_ARG_MMPROJ_OFFLOAD
-mmdev,--mmproj-device||value|MTMD_BACKEND_DEVICE
--image-min-tokens||value|LLAMA_ARG_IMAGE_MIN_TOKENS
--image-max-tokens||value|LLAMA_ARG_IMAGE_MAX_TOKENS
--mtmd-batch-max-tokens||value|LLAMA_ARG_MTMD_BATCH_MAX_TOKENS
--video-fps||value|LLAMA_ARG_VIDEO_FPS
--video-timestamp-interval||value|LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL
--video-ffmpeg-dir||value|LLAMA_ARG_VIDEO_FFMPEG_DIR
--rpc||value|LLAMA_ARG_RPC
-lm,--load-mode||value|LLAMA_ARG_LOAD_MODE
-lzm,--lazy-mode||value|LLAMA_ARG_LAZY_MODE
--numa||value|LLAMA_ARG_NUMA
-dev,--device||value|LLAMA_ARG_DEVICE
-ot,--override-tensor||value|LLAMA_ARG_OVERRIDE_TENSOR
-cmoe,--cpu-moe||flag|LLAMA_ARG_CPU_MOE
-ncmoe,--n-cpu-moe||value|LLAMA_ARG_N_CPU_MOE
-ncffn,--n-cpu-ffn||value|LLAMA_ARG_N_CPU_FFN
-ngl,--gpu-layers,--n-gpu-layers||value|LLAMA_ARG_N_GPU_LAYERS
-sm,--split-mode||value|LLAMA_ARG_SPLIT_MODE
-ts,--tensor-split||value|LLAMA_ARG_TENSOR_SPLIT
-mg,--main-gpu||value|LLAMA_ARG_MAIN_GPU
-fit,--fit||value|LLAMA_ARG_FIT
-fitt,--fit-target||value|LLAMA_ARG_FIT_TARGET
-fitc,--fit-ctx||value|LLAMA_ARG_FIT_CTX
--check-tensors||flag|
--override-kv||value|
--op-offload|--no-op-offload|bool|
--lora||value|
--lora-scaled||value|
--control-vector||value|
--control-vector-scaled||value|
-a,--alias||value|LLAMA_ARG_ALIAS
--tags||value|LLAMA_ARG_TAGS
-m,--model||value|LLAMA_ARG_MODEL
-mu,--model-url||value|LLAMA_ARG_MODEL_URL
-dr,--docker-repo||value|LLAMA_ARG_DOCKER_REPO
-hf,-hfr,--hf-repo||value|LLAMA_ARG_HF_REPO
-hff,--hf-file||value|LLAMA_ARG_HF_FILE
-hft,--hf-token||value|HF_TOKEN
--embd-normalize||value|
--host||value|LLAMA_ARG_HOST
--port||value|LLAMA_ARG_PORT
--reuse-port||flag|LLAMA_ARG_REUSE_PORT
--path||value|LLAMA_ARG_STATIC_PATH
--cors-origins||value|LLAMA_ARG_CORS_ORIGINS
--cors-methods||value|LLAMA_ARG_CORS_METHODS
--cors-headers||value|LLAMA_ARG_CORS_HEADERS
--cors-credentials|--no-cors-credentials|bool|LLAMA_ARG_CORS_CREDENTIALS
--api-prefix||value|LLAMA_ARG_API_PREFIX
--ui-config,--webui-config||value|LLAMA_ARG_UI_CONFIG
--ui-config-file,--webui-config-file||value|LLAMA_ARG_UI_CONFIG_FILE
--ui-mcp-proxy,--webui-mcp-proxy|--no-ui-mcp-proxy,--no-webui-mcp-proxy|bool|LLAMA_ARG_UI_MCP_PROXY
--tools||value|LLAMA_ARG_TOOLS
--tools-runtime||value|LLAMA_ARG_TOOLS_RUNTIME
--mcp-servers-config||value|LLAMA_ARG_MCP_SERVERS_CONFIG
--mcp-servers-json||value|LLAMA_ARG_MCP_SERVERS_JSON
-ag,--agent|-no-ag,--no-agent|bool|LLAMA_ARG_AGENT
--ui,--webui|--no-ui,--no-webui|bool|LLAMA_ARG_UI
--embedding,--embeddings||flag|LLAMA_ARG_EMBEDDINGS
--rerank,--reranking||flag|LLAMA_ARG_RERANKING
--api-key||value|LLAMA_API_KEY
--api-key-file||value|LLAMA_ARG_API_KEY_FILE
--ssl-key-file||value|LLAMA_ARG_SSL_KEY_FILE
--ssl-cert-file||value|LLAMA_ARG_SSL_CERT_FILE
--chat-template-kwargs||value|LLAMA_ARG_CHAT_TEMPLATE_KWARGS
-to,--timeout||value|LLAMA_ARG_TIMEOUT
--sse-ping-interval||value|LLAMA_ARG_SSE_PING_INTERVAL
--threads-http||value|LLAMA_ARG_THREADS_HTTP
--cache-prompt|--no-cache-prompt|bool|LLAMA_ARG_CACHE_PROMPT
--cache-reuse||value|LLAMA_ARG_CACHE_REUSE
--metrics||flag|LLAMA_ARG_ENDPOINT_METRICS
--props||flag|LLAMA_ARG_ENDPOINT_PROPS
--slots|--no-slots|bool|LLAMA_ARG_ENDPOINT_SLOTS
--slot-save-path||value|
--media-path||value|
--models-dir||value|LLAMA_ARG_MODELS_DIR
--models-preset||value|LLAMA_ARG_MODELS_PRESET
--models-max||value|LLAMA_ARG_MODELS_MAX
--models-autoload|--no-models-autoload|bool|LLAMA_ARG_MODELS_AUTOLOAD
--jinja|--no-jinja|bool|LLAMA_ARG_JINJA
--reasoning-format||value|LLAMA_ARG_THINK
-rea,--reasoning||value|LLAMA_ARG_REASONING
--reasoning-effort||value|LLAMA_ARG_REASONING_EFFORT
--reasoning-budget||value|LLAMA_ARG_THINK_BUDGET
--reasoning-budget-message||value|LLAMA_ARG_THINK_BUDGET_MESSAGE
--reasoning-preserve|--no-reasoning-preserve|bool|LLAMA_ARG_REASONING_PRESERVE
--chat-template||value|LLAMA_ARG_CHAT_TEMPLATE
--chat-template-file||value|LLAMA_ARG_CHAT_TEMPLATE_FILE
--skip-chat-parsing|--no-skip-chat-parsing|bool|LLAMA_ARG_SKIP_CHAT_PARSING
--prefill-assistant|--no-prefill-assistant|bool|LLAMA_ARG_PREFILL_ASSISTANT
-sps,--slot-prompt-similarity||value|
--lora-init-without-apply||flag|
--sleep-idle-seconds||value|
--log-disable||flag|
--log-file||value|LLAMA_ARG_LOG_FILE
--log-jsonl|--no-log-jsonl|bool|LLAMA_ARG_LOG_JSONL
--log-prompts-dir||value|
--log-colors||value|LLAMA_ARG_LOG_COLORS
-v,--verbose,--log-verbose||flag|
--offline||flag|LLAMA_ARG_OFFLINE
-lv,--verbosity,--log-verbosity||value|LLAMA_ARG_LOG_VERBOSITY
--log-prefix|--no-log-prefix|bool|LLAMA_ARG_LOG_PREFIX
--log-timestamps|--no-log-timestamps|bool|LLAMA_ARG_LOG_TIMESTAMPS
--spec-draft-hf,-hfd,-hfrd,--hf-repo-draft||value|LLAMA_ARG_SPEC_DRAFT_HF_REPO
--spec-draft-threads,-td,--threads-draft||value|
--spec-draft-threads-batch,-tbd,--threads-batch-draft||value|
--spec-draft-cpu-mask,-Cd,--cpu-mask-draft||value|
--spec-draft-cpu-range,-Crd,--cpu-range-draft||value|
--spec-draft-cpu-strict,--cpu-strict-draft||value|
--spec-draft-prio,--prio-draft||value|
--spec-draft-poll,--poll-draft||value|
--spec-draft-cpu-mask-batch,-Cbd,--cpu-mask-batch-draft||value|
--spec-draft-cpu-strict-batch,--cpu-strict-batch-draft||value|
--spec-draft-prio-batch,--prio-batch-draft||value|
--spec-draft-poll-batch,--poll-batch-draft||value|
--spec-draft-type-k,-ctkd,--cache-type-k-draft||value|LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K
--spec-draft-type-v,-ctvd,--cache-type-v-draft||value|LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V
--spec-draft-override-tensor,-otd,--override-tensor-draft||value|
--spec-draft-cpu-moe,-cmoed,--cpu-moe-draft||flag|LLAMA_ARG_SPEC_DRAFT_CPU_MOE
--spec-draft-n-cpu-moe,--spec-draft-ncmoe,-ncmoed,--n-cpu-moe-draft||value|LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE
--spec-draft-n-max||value|LLAMA_ARG_SPEC_DRAFT_N_MAX
--spec-draft-n-min||value|LLAMA_ARG_SPEC_DRAFT_N_MIN
--spec-synth-len||value|LLAMA_ARG_SPEC_SYNTH_LEN
--spec-synth-rates||value|LLAMA_ARG_SPEC_SYNTH_RATES
--spec-draft-p-split,--draft-p-split||value|LLAMA_ARG_SPEC_DRAFT_P_SPLIT
--spec-draft-p-min,--draft-p-min||value|LLAMA_ARG_SPEC_DRAFT_P_MIN
--spec-draft-backend-sampling|--no-spec-draft-backend-sampling|bool|LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING
--spec-draft-sampling||value|LLAMA_ARG_SPEC_DRAFT_SAMPLING
--spec-draft-device,-devd,--device-draft||value|
--spec-draft-ngl,-ngld,--gpu-layers-draft,--n-gpu-layers-draft||value|LLAMA_ARG_N_GPU_LAYERS_DRAFT
--spec-draft-model,-md,--model-draft||value|LLAMA_ARG_SPEC_DRAFT_MODEL
--spec-type||value|LLAMA_ARG_SPEC_TYPE
--spec-ngram-mod-n-min||value|
--spec-ngram-mod-n-max||value|
--spec-ngram-mod-n-match||value|
--spec-ngram-simple-size-n||value|
--spec-ngram-simple-size-m||value|
--spec-ngram-simple-min-hits||value|
--spec-ngram-map-k-size-n||value|
--spec-ngram-map-k-size-m||value|
--spec-ngram-map-k-min-hits||value|
--spec-ngram-map-k4v-size-n||value|
--spec-ngram-map-k4v-size-m||value|
--spec-ngram-map-k4v-min-hits||value|
--embd-gemma-default||flag|
--fim-qwen-1.5b-default||flag|
--fim-qwen-3b-default||flag|
--fim-qwen-7b-default||flag|
--fim-qwen-7b-spec||flag|
--fim-qwen-14b-spec||flag|
--fim-qwen-30b-default||flag|
--gpt-oss-20b-default||flag|
--gpt-oss-120b-default||flag|
--vision-gemma-4b-default||flag|
--vision-gemma-12b-default||flag|
--spec-default||flag|
--mmap|--no-mmap|bool|LLAMA_ARG_MMAP
--mlock||flag|LLAMA_ARG_MLOCK
-dio,--direct-io|-ndio,--no-direct-io|bool|LLAMA_ARG_DIO
--draft,--draft-n,--draft-max||value|LLAMA_ARG_DRAFT_MAX
--draft-min,--draft-n-min||value|LLAMA_ARG_DRAFT_MIN
-cd,--ctx-size-draft||value|LLAMA_ARG_CTX_SIZE_DRAFT
-mv,--model-vocoder||value|
--tts-use-guide-tokens||flag|
-hfv,-hfrv,--hf-repo-v||value|LLAMA_ARG_HF_REPO_V
-hffv,--hf-file-v||value|LLAMA_ARG_HF_FILE_V
--allowed-local-media-path||value|LLAMA_ARG_ALLOWED_LOCAL_MEDIA_PATH
--local-media-max-size-mb||value|LLAMA_ARG_LOCAL_MEDIA_MAX_SIZE_MB
--embd-bge-small-en-default||flag|
--embd-e5-small-en-default||flag|
--embd-gte-small-default||flag|
--spec-ngram-size-n||value|
--spec-ngram-size-m||value|
--spec-ngram-min-hits||value|
"""

LLAMA_OPTIONS: dict[str, tuple[LlamaOption, bool]] = _parse_table(_LLAMA_TABLE)
