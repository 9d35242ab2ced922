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
import os
from dataclasses import dataclass
from pathlib import Path

from .gguf_files import gguf_name, gguf_parts, size_of
from .hf_cache import hf_cache_lookup
from .ini import GLOBAL_SECTION, IniItem, PresetError, read_ini
from .llama_options import LLAMA_OPTIONS, LLAMA_VALUES, LlamaOption
from .preset_values import DOWNLOADS, ENGINE_KEYS, FIELDS, PRICE_KEYS, RESERVED, parse_bool
from .registry import ModelEntry

log = logging.getLogger(__name__)

CLI_FILE = "command line"


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
    if key in FIELDS:
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
    if key in DOWNLOADS:
        raise PresetError(
            file,
            item.line,
            f"{item.key!r}: ggmux does not download models; give a local file with 'model'",
        )
    if key in RESERVED:
        log.warning("%s:%d: %r is controlled by ggmux; ignored", file, item.line, item.key)
        return None
    try:
        if key in FIELDS:
            value: object = FIELDS[key](item.value)
        elif opt is not None and opt.kind in ("flag", "bool"):
            value = parse_bool(item.value)
        elif key in LLAMA_VALUES:
            value = LLAMA_VALUES[key](item.value)
        else:
            value = item.value
        if negated:
            value = not value
    except ValueError as e:
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


def llama_args_layer(argv: list[str]) -> Layer:
    """A layer from llama-server options given after ``--`` on ``ggmux
    serve``'s command line (``["--temp", "0.8", "--no-mmap"]``), for every
    model, over every preset: llama.cpp's router overlays its own command
    line on every preset (``server_models::load_models``). Each option is
    read as the preset key of the same name (``--temp 0.8`` as
    ``temp = 0.8``; ``--key=value`` too; a flag takes no value). Raises
    :class:`PresetError` (file ``command line``) for a word that is not an
    option, an unknown option, a missing or bad value."""
    layer: Layer = {}
    i = 0
    while i < len(argv):
        word = argv[i]
        name, eq, inline = word.lstrip("-").partition("=")
        if not word.startswith("-") or not name:
            raise PresetError(CLI_FILE, 0, f"expected a llama-server option after --, got {word!r}")
        try:
            _, opt, _ = normalise(name)
        except KeyError:
            raise PresetError(CLI_FILE, 0, f"unknown llama-server option {word!r}") from None
        if opt is not None and opt.kind in ("flag", "bool"):
            value, i = (inline if eq else "true"), i + 1
        elif eq:
            value, i = inline, i + 1
        elif i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        else:
            raise PresetError(CLI_FILE, 0, f"{word} needs a value")
        parsed = parse_item(CLI_FILE, IniItem(name, value, 0))
        if parsed is not None:
            _merge_into(layer, *parsed)
    return layer


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
    after the base ones in file order. With ``dedup-cache-models`` true (in
    a section or ``[*]``; false by default, as in llama.cpp), a Hugging Face
    cache entry whose file the section's ``hf-repo`` (or its draft's
    ``spec-draft-hf``) resolves to is marked ``hidden``: left out of the
    model lists, still served by its own name (llama.cpp
    ``server_models::load_models``, "hiding cache model ... deduplicated by
    a preset"). Raises :class:`PresetError`.
    """
    glob: Layer = preset.globals if preset else {}
    sections = {s.name: s for s in preset.sections} if preset else {}
    cli = cli or {}
    defaults = defaults or {}
    merged_base: dict[str, ModelEntry] = {}
    for e in base:
        merged_base[e.name] = e
    out: list[ModelEntry] = []
    hide: set[str] = set()  # real paths of the files whose cache entries are hidden
    for e in merged_base.values():
        g = {
            k: o
            for k, o in glob.items()
            if k not in _FILE_KEYS and not (k == "mmproj" and e.mmproj)
        }
        s = sections.get(e.name)
        layers = [defaults, g] + ([s.layer] if s else []) + [cli]
        source = f"preset:{preset.path}:{s.line}" if s else e.source
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
        if s is not None:
            hide |= _dedup_files(layers, out[-1], hf_cache)
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
        hide |= _dedup_files(layers, out[-1], hf_cache)
    for e in out:
        if e.source == "hf-cache" and e.path and os.path.realpath(e.path) in hide:
            e.hidden = True
            log.info("hiding cached model %s (deduplicated by a preset)", e.name)
    return out


def _dedup_files(layers: list[Layer], e: ModelEntry, hf_cache: Path | None) -> set[str]:
    """Real paths of the cache files a section with ``dedup-cache-models``
    true names by ``hf-repo`` (its model, ``e``) and ``spec-draft-hf`` (its
    draft, with ``spec-draft-model`` as the file, as llama.cpp reads it);
    empty when the key is false or absent (llama.cpp's default)."""
    if not _value(layers, "dedup-cache-models", False):
        return set()
    files = {os.path.realpath(e.path)} if _value(layers, "hf-repo", None) and e.path else set()
    draft = _value(layers, "hf-repo-draft", None)
    if draft:
        try:
            found = hf_cache_lookup(str(draft), _value(layers, "model-draft", None), hf_cache)
        except ValueError:
            found = None  # a malformed repo: the instance's load says so
        if found is not None:
            files.add(os.path.realpath(found[0]))
    return files


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
            base, aliases=list(base.aliases), env=dict(base.env), extra_args=list(base.extra_args),
            upstream=list(base.upstream),
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
        if key in ENGINE_KEYS:
            extra += [f"--{key}", str(v)]
            continue
        if key in FIELDS:
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
    elif key == "kv-size":
        e.kv_size = int(v)
    elif key == "first-byte-timeout":
        e.first_byte_timeout = float(v)
    elif key == "cmd":
        e.cmd = str(v)
    elif key == "cmd-stop":
        e.cmd_stop = str(v)
    elif key == "env":
        e.env = {**e.env, **v}
    elif key == "check-endpoint":
        e.check_endpoint = str(v)
    elif key == "upstream":
        e.upstream = list(v)
    elif key == "translate":
        e.translate = bool(v)
    elif key == "max-tokens-limit":
        e.max_tokens_limit = int(v)
    elif key == "cache-scope":
        e.cache_scope = str(v)
    elif key == "pin":
        e.pin = bool(v)
    elif key == "eviction-priority":
        e.eviction_priority = int(v)
    elif key == "max-wait":
        e.max_wait = float(v)
    elif key == "min-residency":
        e.min_residency = float(v)
    elif key in PRICE_KEYS:
        setattr(e, key.replace("-", "_"), float(v))
    else:  # pragma: no cover - FIELDS and this switch are kept in step
        raise AssertionError(key)
