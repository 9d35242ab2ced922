"""``llama-server``'s command line, served by ``ggmux serve``: the shim that
llama.cpp's server tests start (``LLAMA_SERVER_BIN_PATH``) in the
conformance run (:mod:`bench.conformance`).

It maps options only; requests and answers never pass through it (it
``exec``s ``ggmux serve``, which then is the process the tests talk to and
stop). The mapping (:func:`plan`):

* router options become ``ggmux serve`` options of the same meaning:
  ``--host``, ``--port``, ``--models-dir``, ``--models-preset`` (the file
  itself, so the tests' edits and reloads reach ggmux), ``--models-max``,
  ``--[no-]models-autoload``, ``--metrics`` (``--no-metrics`` without it:
  llama-server's ``/metrics`` is off by default, ggmux's on),
  ``--api-key``, ``--cors-origins``,
  ``--sleep-idle-seconds``, and ``--ctx-size``, ``--parallel``,
  ``--threads``, ``--n-gpu-layers`` (over every model, as llama-server's
  router overlays its own command line on every preset; ``--ctx-size C
  --parallel P`` becomes ``--ctx-size C/P --kv-size C``: llama-server's
  slots share C);
* a model on the command line (``--hf-repo`` [``--hf-file``], ``--model``)
  makes llama-server serve that one model, loaded at start: a generated
  preset with one section (named after the first ``--alias``, else the repo
  or the file), ``load-on-startup``, ``--no-hf-cache``, and
  ``--model-fallback`` naming it (a llama-server of one model serves any
  ``model`` a request names: ``gpt-3.5-turbo``, ``test``);
* every other option llama-server knows goes, as given, after ``--`` to
  ``ggmux serve``, which applies it to every model (and refuses what it
  cannot parse); options ggmux has no key for, and those that download
  (``--model-url``, ``--mmproj-url``, ``--docker-repo``), are dropped with a
  line on stderr; ``--offline`` is what ggmux always is.

Usage: ``python bench/llama_shim.py LLAMA-SERVER-OPTIONS...``; the folder
of the generated presets is ``$GGMUX_SHIM_DIR`` (default: the temporary
folder).
"""

from __future__ import annotations

import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from ggmux.supervisor.llama_options import LLAMA_OPTIONS, LlamaOption

# llama-server option (canonical key) -> the ggmux serve option of the same meaning
SERVE_OPTIONS = {
    "host": "--host", "port": "--port", "models-dir": "--models-dir",
    "models-preset": "--models-preset", "models-max": "--models-max", "api-key": "--api-key",
    "cors-origins": "--cors-origins", "sleep-idle-seconds": "--sleep-idle-seconds",
    "ctx-size": "--ctx-size", "parallel": "--parallel", "threads": "--threads",
    "n-gpu-layers": "--n-gpu-layers",
}
SERVE_BOOLS = {"models-autoload": ("--models-autoload", "--no-models-autoload"),
               "metrics": ("--metrics", "--no-metrics")}
MODEL_KEYS = ("hf-repo", "hf-file", "model", "alias", "tags")  # the one model of a single-model server
DOWNLOADS = ("model-url", "mmproj-url", "docker-repo")  # ggmux never downloads
ALWAYS = ("offline",)  # what ggmux always does: nothing to pass


@dataclass(slots=True)
class ShimPlan:
    """``serve`` the ``ggmux serve`` options; ``preset`` the text of the
    generated single-model preset (None in router mode); ``llama`` the
    llama-server options for every model (after ``--``); ``dropped`` what
    was left out, each with its reason."""

    serve: list[str] = field(default_factory=list)
    preset: str | None = None
    llama: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)

    def argv(self, preset_path: str | None = None) -> list[str]:
        """``ggmux serve``'s arguments (``preset_path``: where :attr:`preset` was written)."""
        out = ["serve", *self.serve]
        if preset_path is not None:
            out += ["--models-preset", preset_path, "--no-hf-cache"]
        return out + (["--", *self.llama] if self.llama else [])


def _options(argv: list[str]) -> list[tuple[str, LlamaOption | None, bool, str | None, str]]:
    """``(key, option, negated, value, as typed)`` for each option of ``argv``
    (``key`` canonical; ``option`` None for an option ggmux does not know)."""
    out = []
    i = 0
    while i < len(argv):
        typed = argv[i]
        name, eq, inline = typed.lstrip("-").partition("=")
        hit = LLAMA_OPTIONS.get(name)
        if hit is None:
            # unknown: take the next word as its value unless it is an option
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv)
                                       and not argv[i + 1].startswith("-") else None)
            i += 1 + (value is not None and not eq)
            out.append((name, None, False, value, typed))
            continue
        opt, negated = hit
        if opt.kind == "value":
            value = inline if eq else (argv[i + 1] if i + 1 < len(argv) else None)
            i += 1 if eq else 2
        else:
            value = None
            i += 1
        out.append((opt.key, opt, negated, value, typed))
    return out


def model_name(models: dict[str, str]) -> str:
    """The name a single-model server lists: the first ``alias``, else the
    Hugging Face repo as given, else the file's name without ``.gguf``."""
    if models.get("alias"):
        return models["alias"].split(",")[0].strip()
    if models.get("hf-repo"):
        return models["hf-repo"]
    return Path(models.get("model", "model")).name.removesuffix(".gguf")


def _per_slot_context(serve: list[str], unified: bool = False) -> None:
    """llama-server's ``--ctx-size C --parallel P`` is one KV cache of C
    tokens split into P slots of C/P; ggmux's ``--ctx-size`` is what one
    request may use and ``--kv-size`` the cache of all slots: ``--ctx-size
    C/P --kv-size C`` (in place; only when both are given and C is not 0).
    With ``--kv-unified`` (``unified``) any slot may use all C cells, so
    one request may too: ``--ctx-size C --kv-size C``."""
    if "--ctx-size" not in serve or "--parallel" not in serve:
        return
    i, j = serve.index("--ctx-size") + 1, serve.index("--parallel") + 1
    try:
        c, n = int(serve[i]), int(serve[j])
    except ValueError:
        return
    if c > 0 and n > 1:
        serve[i] = str(c if unified else c // n)
        serve += ["--kv-size", str(c)]


def plan(argv: list[str]) -> ShimPlan:
    """Map llama-server's ``argv`` (without the program) to ``ggmux serve``
    (see the module docstring). Raises ``ValueError`` for an option that
    needs a value and has none."""
    p = ShimPlan()
    models: dict[str, str] = {}
    for key, opt, negated, value, typed in _options(argv):
        if opt is not None and opt.kind == "value" and value is None:
            raise ValueError(f"{typed} needs a value")
        if opt is None:
            p.dropped.append(f"{typed}{'' if value is None else ' ' + value}: not a "
                             "llama-server option ggmux knows")
        elif key in ALWAYS:
            continue
        elif key in DOWNLOADS:
            p.dropped.append(f"{typed} {value}: ggmux never downloads")
        elif key in SERVE_OPTIONS:
            p.serve += [SERVE_OPTIONS[key], str(value)]
        elif key in SERVE_BOOLS:
            p.serve.append(SERVE_BOOLS[key][1 if negated else 0])
        elif key in MODEL_KEYS:
            models[key] = str(value)
        else:
            p.llama += [typed] if value is None else [typed, value]
    _per_slot_context(p.serve, any(k == "kv-unified" and not negated
                                   for k, _, negated, *_ in _options(argv)))
    if not any(k == "metrics" for k, *_ in _options(argv)):
        p.serve.append("--no-metrics")  # llama-server's /metrics is off without --metrics
    if "hf-repo" in models or "model" in models:
        # one model: llama-server serves every request with it, whatever it names
        p.serve += ["--model-fallback", model_name(models)]
        lines = [f"[{model_name(models)}]"]
        lines += [f"{k} = {v}" for k, v in models.items() if k != "alias"]
        extra = [a.strip() for a in models.get("alias", "").split(",")[1:] if a.strip()]
        if extra:
            lines.append("alias = " + ", ".join(extra))
        lines.append("load-on-startup = true")  # llama-server loads its one model at start
        p.preset = "\n".join(lines) + "\n"
    else:
        p.dropped += [f"--{k} {models[k]}: a router takes no model on its command line"
                      for k in models]
    return p


def main(argv: list[str]) -> int:
    """Print what was dropped, write the preset, ``exec`` ``ggmux serve``."""
    try:
        shim = plan(argv)
    except ValueError as e:
        print(f"llama_shim: {e}", file=sys.stderr)
        return 2
    for line in shim.dropped:
        print(f"llama_shim: dropped {line}", file=sys.stderr)
    preset_path = None
    if shim.preset is not None:
        folder = Path(os.environ.get("GGMUX_SHIM_DIR") or tempfile.gettempdir())
        folder.mkdir(parents=True, exist_ok=True)
        fd, preset_path = tempfile.mkstemp(prefix="shim-", suffix=".ini", dir=folder)
        with os.fdopen(fd, "w") as f:
            f.write(shim.preset)
    cmd = [sys.executable, "-m", "ggmux.supervisor", *shim.argv(preset_path)]
    print("llama_shim: " + " ".join(cmd), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)
    return 127  # pragma: no cover - execv does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
