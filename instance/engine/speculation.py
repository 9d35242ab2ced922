"""Speculative decoding's switch in the engine: :func:`make_drafter` (the
proposers an :class:`~.model.EngineConfig` asks for, None when speculation
is off) and :func:`spec_summary` (the start log's line saying what drafts).
The proposers themselves are :mod:`.draft`'s, imported only when asked
for; the settings are :mod:`.spec_options`'.
"""

from __future__ import annotations

import os

from .model import EngineConfig


def spec_summary(spec) -> str:
    """One line saying what drafts (issue 37: a user had no sign that
    speculation was on): the types in the order tried, with their sizes."""
    parts = []
    for t in spec.ordered():
        if t == "ngram-simple":
            parts.append(f"ngram-simple (n {spec.ngram_simple_size_n}, "
                         f"up to {spec.ngram_simple_size_m} tokens)")
        elif t == "ngram-mod":
            parts.append(f"ngram-mod (n {spec.ngram_mod_n_match}, {spec.ngram_mod_n_min} to "
                         f"{spec.ngram_mod_n_max} tokens)")
        elif t == "draft-simple":
            parts.append(f"draft-simple ({os.path.basename(spec.draft_model)}, up to "
                         f"{spec.draft_n_max} tokens)")
        else:
            parts.append(t)
    return ("on, " + ", ".join(parts) + "; acceptance in timings.draft_n_accepted/draft_n, "
            "`ggmux ps` and the page")


def make_drafter(llama_cpp, config: EngineConfig, n_seq: int):
    """The speculative proposers of ``config.spec``, None when it is off.
    Raises :class:`~ggmux.instance.engine.spec_options.SpecError` (a
    ValueError) for options the engine cannot use."""
    if config.spec is None or not config.spec.on:
        if config.spec is not None:
            config.spec.check()
        return None
    from .draft import Drafter  # numpy tables and a second model only when asked for

    return Drafter(llama_cpp, config.spec, config, n_seq)
