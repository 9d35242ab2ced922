"""Speculative decoding's settings: llama-server's ``--spec-*`` options
(llama.cpp ``common/arg.cpp`` and ``common/common.h``, build b11434) as one
record, checked when the engine loads. No llama.cpp here.

Issue 30. The types the built-in engine drafts with are
:data:`SUPPORTED`; llama.cpp's other types (:data:`LLAMA_TYPES`) are a load
error naming the supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = ("ngram-simple", "ngram-mod", "draft-simple")
"""The ``--spec-type`` names this engine drafts with (llama.cpp's
``common_speculative_type_from_name``): n-gram lookups over a slot's own
tokens, and a draft model of the same vocabulary."""

LLAMA_TYPES = ("none", "draft-simple", "draft-eagle3", "draft-mtp", "draft-dflash",
               "draft-dspark", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod",
               "ngram-cache")
"""Every ``--spec-type`` name of llama.cpp b11434 (``common/speculative.cpp``)."""

ORDER = ("ngram-simple", "ngram-mod", "draft-simple")
"""llama.cpp's order of preference when several types are given
(``common_speculative_init``): the first that proposes a draft for a slot
wins that step."""


class SpecError(ValueError):
    """A speculative decoding option the engine cannot use (an unknown or
    unsupported type, a bad size, a draft model of another vocabulary):
    the model does not load, with this message."""


@dataclass(slots=True)
class SpecConfig:
    """llama-server's speculative options (defaults: b11434's
    ``common_params_speculative``). ``types``: the ``--spec-type`` list;
    ``draft_n_max`` / ``draft_n_min`` / ``draft_p_min``
    (``--spec-draft-n-max`` 3, ``-n-min`` 0, ``-p-min`` 0.0): the draft
    model's longest draft, shortest kept draft, and the probability below
    which it stops drafting; ``ngram_simple_*`` (``--spec-ngram-simple-size-n``
    12, ``-size-m`` 48): the n-gram looked up and the longest m-gram drafted
    after it; ``ngram_mod_*`` (``--spec-ngram-mod-n-match`` 24, ``-n-max``
    64, ``-n-min`` 48): the hashed n-gram and the longest/shortest draft;
    ``draft_model``: the GGUF of ``--spec-draft-model`` (``-md``,
    ``--model-draft``); ``draft_ngl``: its ``--spec-draft-ngl`` (``None``:
    the target's ``n_gpu_layers``).

    ggmux's adaptive rule (issue 30: a chat is never slower): a slot whose
    verifications accept nothing ``pause_after`` times in a row stops
    drafting for ``pause_tokens`` generated tokens, doubled at each further
    pause up to ``pause_max``; any accepted draft token ends the pauses.
    Its drafts are cut to the length that gives the most tokens per second
    at its recent acceptance rate, none where no length pays
    (:meth:`~ggmux.instance.engine.draft.SlotSpec.limit`,
    :mod:`~ggmux.instance.engine.spec_cost`), with one more token in a
    step's batch costing what the engine's own decodes measure;
    ``token_cost`` is that cost (a share of a one-token decode) until
    they say (0.35: smollm2-135m on one CPU thread, a 9-token
    verification took ~90 ms where one token took ~23 ms; a GPU's is
    lower)."""

    types: tuple[str, ...] = ()
    draft_n_max: int = 3
    draft_n_min: int = 0
    draft_p_min: float = 0.0
    ngram_simple_size_n: int = 12
    ngram_simple_size_m: int = 48
    ngram_simple_min_hits: int = 1
    ngram_mod_n_match: int = 24
    ngram_mod_n_max: int = 64
    ngram_mod_n_min: int = 48
    draft_model: str = ""
    draft_ngl: int | None = None
    pause_after: int = 3
    pause_tokens: int = 16
    pause_max: int = 256
    token_cost: float = 0.35
    error: str = ""  # an option value that did not parse (reported by check)

    @property
    def on(self) -> bool:
        """Whether any drafting type is set."""
        return any(t != "none" for t in self.types)

    def check(self) -> None:
        """Raise :class:`SpecError` for a type llama.cpp does not know, one
        this engine does not draft with (naming :data:`SUPPORTED`), a size
        out of llama.cpp's range, or ``draft-simple`` without a model."""
        if self.error:
            raise SpecError(self.error)
        for t in self.types:
            if t not in LLAMA_TYPES:
                raise SpecError(f"unknown --spec-type {t!r} (llama.cpp's types: "
                                f"{', '.join(LLAMA_TYPES)})")
            if t != "none" and t not in SUPPORTED:
                raise SpecError(f"--spec-type {t} is not supported by the built-in engine "
                                f"(supported: {', '.join(SUPPORTED)}; use a cmd llama-server "
                                f"replica for the others)")
        if self.draft_n_max < 0 or self.draft_n_min < 0:
            raise SpecError("--spec-draft-n-max and --spec-draft-n-min must be >= 0")
        for name in ("ngram_simple_size_n", "ngram_simple_size_m", "ngram_mod_n_match"):
            if not 1 <= getattr(self, name) <= 1024:
                raise SpecError(f"--spec-{name.replace('_', '-')} must be from 1 to 1024")
        if not 0 <= self.ngram_mod_n_min <= 1024 or not 0 <= self.ngram_mod_n_max <= 1024:
            raise SpecError("--spec-ngram-mod-n-min/-n-max must be from 0 to 1024")
        if self.ngram_simple_min_hits < 1:
            raise SpecError("--spec-ngram-simple-min-hits must be at least 1")
        if "draft-simple" in self.types and not self.draft_model:
            raise SpecError("--spec-type draft-simple needs a draft model (--spec-draft-model)")
        if not 0 <= self.token_cost <= 10:
            raise SpecError("spec token_cost must be from 0 to 10")
        if self.pause_after < 1 or self.pause_tokens < 0 or self.pause_max < self.pause_tokens:
            raise SpecError("spec pause settings: pause_after >= 1, 0 <= pause_tokens <= "
                            "pause_max")

    def ordered(self) -> list[str]:
        """The set types in llama.cpp's order of preference (:data:`ORDER`)."""
        return [t for t in ORDER if t in self.types]


# llama-server option -> (SpecConfig field, converter)
OPTIONS = {
    "--spec-type": ("types", lambda v: tuple(t.strip() for t in str(v).split(",") if t.strip())),
    "--spec-draft-n-max": ("draft_n_max", int),
    "--spec-draft-n-min": ("draft_n_min", int),
    "--spec-draft-p-min": ("draft_p_min", float), "--draft-p-min": ("draft_p_min", float),
    "--spec-draft-model": ("draft_model", str), "-md": ("draft_model", str),
    "--model-draft": ("draft_model", str),
    "--spec-draft-ngl": ("draft_ngl", lambda v: -1 if v in ("all", "auto") else int(v)),
    "-ngld": ("draft_ngl", lambda v: -1 if v in ("all", "auto") else int(v)),
    "--gpu-layers-draft": ("draft_ngl", lambda v: -1 if v in ("all", "auto") else int(v)),
    "--n-gpu-layers-draft": ("draft_ngl", lambda v: -1 if v in ("all", "auto") else int(v)),
    "--spec-ngram-simple-size-n": ("ngram_simple_size_n", int),
    "--spec-ngram-simple-size-m": ("ngram_simple_size_m", int),
    "--spec-ngram-simple-min-hits": ("ngram_simple_min_hits", int),
    "--spec-ngram-mod-n-match": ("ngram_mod_n_match", int),
    "--spec-ngram-mod-n-max": ("ngram_mod_n_max", int),
    "--spec-ngram-mod-n-min": ("ngram_mod_n_min", int),
}
"""The options :func:`~ggmux.instance.llama_args.llama_kwargs` reads into
:class:`SpecConfig` (``--spec-default``: llama-server's preset, ngram-mod
24/48/64, is a flag handled there)."""


def set_option(spec: SpecConfig, opt: str, value: str) -> None:
    """Set llama-server option ``opt`` (a key of :data:`OPTIONS`) to
    ``value`` on ``spec``; a value that does not parse is kept as
    ``spec.error`` (the load fails with it, as llama-server refuses to
    start)."""
    field, conv = OPTIONS[opt]
    try:
        setattr(spec, field, conv(value))
    except ValueError:
        spec.error = spec.error or f"bad value for {opt}: {value!r}"


def spec_default(spec: SpecConfig) -> None:
    """llama-server's ``--spec-default``: ngram-mod with n-match 24, n-min
    48, n-max 64 (``common/arg.cpp``)."""
    if "ngram-mod" not in spec.types:
        spec.types = (*spec.types, "ngram-mod")
    spec.ngram_mod_n_match, spec.ngram_mod_n_min, spec.ngram_mod_n_max = 24, 48, 64



__all__ = ["LLAMA_TYPES", "OPTIONS", "ORDER", "SUPPORTED", "SpecConfig", "SpecError",
           "set_option", "spec_default"]
