"""mkdocs hook: the options reference (``options.md``) gets its tables from
``ggmux``'s own argument parser at build time, so it cannot drift from
``ggmux serve --help`` (:mod:`ggmux.supervisor.options_reference`)."""

MARK = "<!-- options: made from the parser when the site is built -->"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if MARK not in markdown:
        return markdown
    from ggmux.supervisor.options_reference import reference_markdown

    return markdown.replace(MARK, reference_markdown())
