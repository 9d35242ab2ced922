"""llama.cpp's INI format as presets and keys files use it (:func:`read_ini`):
``[section]`` lines, ``key = value`` items, comments from ``;`` or ``#`` at
a line's start or after a space (llama.cpp cuts at any ``;``/``#``, which
breaks URLs and shell commands), ``${env.NAME}`` replaced by the variable
(the demo models' variables default to their files), and
:class:`PresetError` (``FILE:LINE: reason``) for what cannot be read."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from .demo import demo_path

GLOBAL_SECTION = "*"


class PresetError(ValueError):
    """A preset that cannot be used: ``file``, ``line`` (1-based; 0 when the
    cause has no line) and ``reason``; ``str()`` is ``FILE:LINE: reason``."""

    def __init__(self, file: str, line: int, reason: str) -> None:
        self.file = file
        self.line = line
        self.reason = reason
        super().__init__(f"{file}:{line}: {reason}" if line else f"{file}: {reason}")


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


def read_ini(path: str, quote: bool = True) -> tuple[list[IniItem], list[IniSection]]:
    """Read an INI file: ``(items before the first section, sections)``.

    Raises :class:`PresetError` for bytes that are not UTF-8, a line that
    is none of header, item, comment or blank, an empty or repeated section
    name, and a ``${env.NAME}`` whose variable is not set; ``OSError`` when
    the file cannot be read. ``quote``: whether an error quotes the bad
    line (not for a keys file, whose bad line may be a secret).
    """
    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PresetError(path, data.count(b"\n", 0, e.start) + 1,
                          "not UTF-8 text") from None
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
                shown = f" {line!r}" if quote else ""
                raise PresetError(path, n, f"bad section header{shown} (expected [name])")
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
                path, n, "expected 'key = value', '[section]' or a comment"
                + (f", got {line!r}" if quote else "")
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
