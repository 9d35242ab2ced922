"""The manual as the tests read it: README.md (the front door) and the
pages of ``docs/`` (the mkdocs site), by their paths from the repository's
root. Tests that check what the manual says read it here, so a text that
moves from one page to another stays checked.

A page may include a file of the repository with pymdown's snippet line
(``--8<-- "presets.example.ini"``); :func:`expanded` gives a page's text
with those lines replaced by the file, as the site shows it.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$', re.MULTILINE)


def pages() -> list[str]:
    """README.md, then every page of docs/, by path from the root."""
    return ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in DOCS.glob("*.md"))


def text(page: str) -> str:
    """One page's Markdown, as written (snippet lines unexpanded)."""
    return (ROOT / page).read_text()


def expanded(page: str) -> str:
    """One page's Markdown with each snippet line replaced by the file it
    names (relative to the root, as mkdocs.yml's ``base_path`` says)."""
    return SNIPPET.sub(lambda m: (ROOT / m.group(1)).read_text().rstrip("\n"), text(page))


def manual() -> str:
    """Every page's Markdown as written, one after the other."""
    return "\n".join(text(p) for p in pages())


def fenced(lang: str, expand: bool = False) -> list[tuple[str, str]]:
    """``(page, body)`` of every fenced block in language ``lang``."""
    out = []
    for page in pages():
        body = expanded(page) if expand else text(page)
        out += [(page, b) for b in re.findall(rf"^```{lang}\n(.*?)^```$", body,
                                              re.MULTILINE | re.DOTALL)]
    return out
