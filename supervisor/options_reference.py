"""The manual's options reference (``docs/options.md`` on the site), made
from the ``ggmux`` parser itself, so that it says what ``--help`` says and
cannot drift from it: per option its flags, its ``GGMUX_<OPTION>``
variable, its default as ``--help`` shows it and its help text; then each
client command with its own options.

The parser is built with an empty environment (``build_parser({})``): the
reference shows ggmux's defaults, never the values of the machine that
builds the site (nor a key from its environment).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .serve_options import SECRET_OPTIONS, build_parser, env_name


@dataclass(slots=True)
class OptionRow:
    """One option of a parser: ``flags`` as the user types them (``--ctx-size,
    -c N``), ``env`` its variable (``serve`` only, else ""), ``meaning``
    its help text as ``--help`` prints it (defaults included)."""

    group: str
    flags: str
    env: str
    meaning: str


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _command_help(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def option_rows(parser: argparse.ArgumentParser, with_env: bool = False) -> list[OptionRow]:
    """The options and arguments of ``parser`` in ``--help``'s order, each with
    its group's title, its flags, its variable (``with_env``: ``serve``'s
    options are read from the environment too) and its help text with the
    default as ``--help`` shows it."""
    formatter = parser._get_formatter()
    titles = {id(a): g.title or "" for g in parser._action_groups for a in g._group_actions}
    rows = []
    for action in parser._actions:
        if action.dest in ("help", "version", "command") or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            continue
        meaning = formatter._expand_help(action) if action.help else ""
        if action.dest in SECRET_OPTIONS:
            meaning += " (never shown: --help names its variable, not its value)"
        env = env_name(action.dest) if with_env and action.option_strings else ""
        flags = formatter._format_action_invocation(action)
        rows.append(OptionRow(titles.get(id(action), ""), flags, env, meaning))
    return rows


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table(rows: list[OptionRow], with_env: bool) -> list[str]:
    head = ["| option | variable | meaning |", "| --- | --- | --- |"] if with_env else \
        ["| option | meaning |", "| --- | --- |"]
    out = list(head)
    for r in rows:
        cells = [f"`{r.flags}`"] + ([f"`{r.env}`" if r.env else ""] if with_env else []) + \
            [_cell(r.meaning)]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _usage(parser: argparse.ArgumentParser) -> str:
    return " ".join(parser.format_usage().split()).removeprefix("usage: ")


def _commands(name: str, parser: argparse.ArgumentParser, help_: str,
              common: set[str]) -> list[str]:
    """A client command's section: what it does, its usage line, its own
    options (not the ``common`` ones every command takes), then its own
    commands (``ggmux keys create``), one level down."""
    lines = [f"### {name}", "", _cell(help_), "", f"`{_usage(parser)}`", ""]
    own = [r for r in option_rows(parser) if r.flags.split(" ")[0].rstrip(",") not in common]
    if own:
        lines += _table(own, with_env=False) + [""]
    helps = _command_help(parser)
    for sub_name, sub in _subparsers(parser).items():
        sub_lines = _commands(f"{name} {sub_name}", sub, helps.get(sub_name, ""), common)
        lines += ["#" + sub_lines[0]] + sub_lines[1:]
    return lines


def reference_markdown() -> str:
    """The reference as Markdown: ``ggmux serve``'s options by group, the
    options every client command takes, then each client command with its
    own. Headings are level 2 to 4, for a page that brings its own title."""
    top = build_parser({})
    commands = _subparsers(top)
    helps = _command_help(top)
    serve = commands.pop("serve")
    lines = ["## ggmux serve", "", _cell(serve.description or ""), "", f"`{_usage(serve)}`", ""]
    groups: dict[str, list[OptionRow]] = {}
    for r in option_rows(serve, with_env=True):
        groups.setdefault(r.group, []).append(r)
    for title, group in groups.items():
        if title not in ("options", "optional arguments"):
            lines += [f"### {title[0].upper()}{title[1:]}", ""]
        lines += _table(group, with_env=True) + [""]
    common_rows = option_rows(top)
    common = {r.flags.split(" ")[0].rstrip(",") for r in common_rows}
    lines += ["## Client commands", "",
              ("They talk to a running server over its HTTP API. Every one takes these "
              "options, before or after the command alike:"), ""]
    lines += _table(common_rows, with_env=False) + [""]
    for name, sub in commands.items():
        lines += _commands(f"ggmux {name}", sub, helps.get(name, ""), common)
    return "\n".join(lines)


def option_names() -> set[str]:
    """Every long and short flag of every ``ggmux`` command (``--ctx-size``,
    ``-c``, ``--no-hf-cache``, ...): what the manual may name."""
    top = build_parser({})
    names = set()
    for parser in [top, *_subparsers(top).values()]:
        for action in parser._actions:
            names.update(action.option_strings)
        for sub in _subparsers(parser).values():
            for action in sub._actions:
                names.update(action.option_strings)
    return names
