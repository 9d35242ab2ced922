"""What ``ggmux`` says about an option it does not know (issue 37, "the
first hour"): argparse's bare "unrecognized arguments: --model-max 2" left
a new user guessing. The message names the close option (difflib, as git
and pip do) and, for an option of llama-server, says that those go after
``--`` (``ggmux serve -- --temp 0.7``), where every model gets them.
"""

from __future__ import annotations

import argparse
import difflib

from .llama_options import LLAMA_OPTIONS

CUTOFF = 0.75
"""difflib's similarity a known option needs to be suggested (0 to 1)."""


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every ``--long`` option string of ``parser``."""
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--")]


def unknown_options_message(parser: argparse.ArgumentParser, extra: list[str],
                            command: str | None) -> str:
    """The error for the arguments ``extra`` that ``parser`` (the command's
    own parser) did not take: argparse's line, then one hint per unknown
    option: ``did you mean --x?`` and, for a llama-server option of
    ``serve``, that it goes after ``--``."""
    lines = [f"unrecognized arguments: {' '.join(extra)}"]
    known = option_strings(parser)
    for arg in extra:
        if not arg.startswith("--") or arg == "--":
            continue
        name = arg.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=CUTOFF)
        if command == "serve" and name[2:] in LLAMA_OPTIONS:
            lines.append(f"{name} is a llama-server option: give it after '--', for every "
                         f"model (ggmux serve [options] -- {name} VALUE), or as a preset key "
                         f"({name[2:]} = VALUE) for one")
        elif close:
            lines.append(f"{name}: did you mean {close[0]}?")
    return "\n".join(lines)


def subparser(parser: argparse.ArgumentParser, command: str | None
              ) -> argparse.ArgumentParser:
    """The parser of ``command`` (``serve``, ``ps``, ...), else ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser
