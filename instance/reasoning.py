"""Where the built-in instance puts a model's reasoning: the
``--reasoning-format`` option (llama-server's option of that name, also a
preset key), shared by ``ggmux serve`` and the instance.

``deepseek`` (the default, as llama-server's ``--reasoning-format
deepseek``): ``<think>`` blocks (DeepSeek R1, Qwen 3, Granite, Command R7B's
``<|START_THINKING|>``) and GPT-OSS's analysis channel go to
``message.reasoning_content`` / ``delta.reasoning_content``; ``none``: they
stay inline in the content. ``auto`` and ``deepseek-legacy`` (llama-server's
other names) are ``deepseek`` here. A request's ``reasoning_format`` field
overrides it.
"""

from __future__ import annotations

import argparse

REASONING_FORMATS = ("none", "deepseek", "auto", "deepseek-legacy")


def add_reasoning_option(parser: argparse.ArgumentParser) -> None:
    """``--reasoning-format`` (see the module docstring)."""
    parser.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="deepseek",
                        help="built-in instance: a model's reasoning (<think>, GPT-OSS's "
                             "analysis channel) goes to reasoning_content (deepseek; auto and "
                             "deepseek-legacy are the same here) or stays inline in the "
                             "content (none); a request's reasoning_format overrides it "
                             "(default: %(default)s)")


def reasoning_argv(value: str) -> list[str]:
    """Options that pass ``--reasoning-format`` on to an instance (none for
    the default)."""
    return [] if value == "deepseek" else ["--reasoning-format", value]
