"""llama-server's ``generation_settings`` of one request, and the server's
sampling defaults (``--temp``, ``--top-k``, ... on the command line).

The shape is ``task_params::to_json`` of llama.cpp's
``tools/server/server-task.cpp``: the settings a request was served with,
in ``/completion`` answers, ``__verbose`` and ``/props``' default ones.
"""

from __future__ import annotations

from dataclasses import fields

from .engine.sampling import Sampling

SAMPLING_OPTIONS = {
    "--temp": "temperature", "--temperature": "temperature",
    "--top-k": "top_k", "--top-p": "top_p", "--min-p": "min_p", "--typical": "typical_p",
    "--repeat-penalty": "repeat_penalty", "--repeat-last-n": "repeat_last_n",
    "--presence-penalty": "presence_penalty", "--frequency-penalty": "frequency_penalty",
    "--mirostat": "mirostat", "--mirostat-lr": "mirostat_eta", "--mirostat-ent": "mirostat_tau",
    "--dry-multiplier": "dry_multiplier", "--dry-base": "dry_base",
    "--dry-allowed-length": "dry_allowed_length", "--dry-penalty-last-n": "dry_penalty_last_n",
}
"""llama-server sampling option -> :class:`~ggmux.instance.engine.sampling.Sampling`
field: the default of every request that does not give its own."""

_INTS = {"top_k", "repeat_last_n", "mirostat", "dry_allowed_length", "dry_penalty_last_n"}


def sampling_default(option: str, value: str) -> tuple[str, float | int]:
    """``(Sampling field, value)`` of one of :data:`SAMPLING_OPTIONS`.
    Raises ValueError for a value that is not a number."""
    name = SAMPLING_OPTIONS[option]
    return name, int(value) if name in _INTS else float(value)


def default_sampling(defaults: dict) -> Sampling:
    """A :class:`Sampling` with the server's defaults (field -> value)."""
    s = Sampling()
    names = {f.name for f in fields(Sampling)}
    for k, v in defaults.items():
        if k in names:
            setattr(s, k, list(v) if isinstance(v, list) else v)
    return s


def generation_settings(s: Sampling, n_predict: int, seed: int, *, stream: bool,
                        n_probs: int, ignore_eos: bool, timings_per_token: bool,
                        post_sampling_probs: bool = False,
                        reasoning_format: str) -> dict:
    """llama-server's ``generation_settings`` (``task_params::to_json``):
    ``n_predict``/``max_tokens`` the request's limit (-1: none), ``seed``
    the seed it drew with (the server's when it gave none); the samplers
    ggmux does not have are llama.cpp's neutral values."""
    return {
        "seed": seed, "temperature": s.temperature, "dynatemp_range": 0.0,
        "dynatemp_exponent": 1.0, "top_k": s.top_k, "top_p": s.top_p, "min_p": s.min_p,
        "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1,
        "typical_p": s.typical_p, "repeat_last_n": s.repeat_last_n,
        "repeat_penalty": s.repeat_penalty, "presence_penalty": s.presence_penalty,
        "frequency_penalty": s.frequency_penalty, "dry_multiplier": s.dry_multiplier,
        "dry_base": s.dry_base, "dry_allowed_length": s.dry_allowed_length,
        "dry_penalty_last_n": s.dry_penalty_last_n,
        "dry_sequence_breakers": list(s.dry_sequence_breakers), "mirostat": s.mirostat,
        "mirostat_tau": s.mirostat_tau, "mirostat_eta": s.mirostat_eta,
        "adaptive_target": -1.0, "adaptive_decay": 0.9,
        "max_tokens": n_predict, "n_predict": n_predict, "n_keep": 0, "n_discard": 0,
        "ignore_eos": ignore_eos, "stream": stream, "n_probs": n_probs, "min_keep": 0,
        "grammar": s.grammar or "", "grammar_lazy": s.grammar_lazy,
        "reasoning_format": reasoning_format, "timings_per_token": timings_per_token,
        "post_sampling_probs": post_sampling_probs, "lora": [],
    }
