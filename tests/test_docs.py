"""The manual (README.md and the mkdocs site in docs/) checked against the
code, so that what a reader copies works: every INI example reads with the
real preset or keys-file parser, every option it names is one that
``ggmux --help`` (or llama-server, or the tool the example runs) has, every
link between its pages reaches a file and a heading that exist, README
stays a front door, and the options reference is made from the parser.

``mkdocs build --strict`` (in ``.ci/run``) checks the site's own links
again as rendered; these tests run without mkdocs installed, and also
check README, which the site does not hold.
"""

from __future__ import annotations

import importlib.util
import re

import pytest
from ggmux.supervisor.keys_file import KNOWN as KEY_SETTINGS
from ggmux.supervisor.keys_file import read_keys_file
from ggmux.supervisor.llama_options import LLAMA_OPTIONS
from ggmux.supervisor.options_reference import option_names, reference_markdown
from ggmux.supervisor.presets import load_preset
from manual import DOCS, ROOT, expanded, fenced, pages, text

README_MAX_LINES = 400
"""README is the front door: what ggmux is, the fresh-machine commands, a
first request, the page, the command line, a small team, more demand than
memory, and links into the manual; the rest lives on the manual's pages."""


def test_readme_is_a_front_door_of_at_most_400_lines_that_links_every_page():
    readme = text("README.md")
    assert len(readme.splitlines()) <= README_MAX_LINES
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", readme))
    # every page a reader picks by task (the included files are reached from them)
    tasks = {p.name for p in DOCS.glob("*.md")} - {"index.md", "results.md", "preset-example.md"}
    assert tasks <= linked, tasks - linked


def test_every_page_of_docs_is_in_the_sites_navigation():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    for page in DOCS.glob("*.md"):
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.MULTILINE), page.name


# ---- INI examples ----------------------------------------------------------------------------
def _is_keys_file(body: str) -> bool:
    """A keys file's sections hold only keys-file settings; a preset's hold
    llama-server options and router keys (``model``, ``cmd``, ...)."""
    keys = set(re.findall(r"^\s*([\w.-]+)\s*=", body, re.MULTILINE))
    names = set(re.findall(r"^\[([^\]]+)\]", body, re.MULTILINE))
    return bool(keys) and keys <= KEY_SETTINGS and bool(names - {"*"})


def _ini_examples() -> list[tuple[str, str]]:
    return fenced("ini", expand=True)


def test_the_manual_has_ini_examples_of_both_kinds():
    kinds = {_is_keys_file(body) for _, body in _ini_examples()}
    assert kinds == {True, False}  # a keys file and a preset, at least


@pytest.mark.parametrize("page, body", _ini_examples(),
                         ids=[f"{p}#{i}" for i, (p, _) in enumerate(_ini_examples())])
def test_every_ini_example_reads_with_the_real_parser(tmp_path, monkeypatch, page, body):
    """A keys file with the keys-file reader (every setting known and in
    range, a secret or its hash per key), anything else with the preset
    reader (every key a llama-server option or a router key, every value of
    its type), both as ``ggmux serve`` reads them at start."""
    # the variables the examples name: a CI key's secret, the demo models' files
    monkeypatch.setenv("CI_KEY", "sk-ci-example")
    monkeypatch.setenv("GGMUX_DEMO_SMOLLM2", "/models/smollm2.gguf")
    monkeypatch.setenv("GGMUX_DEMO_GEMMA3", "/models/gemma3.gguf")
    f = tmp_path / "example.ini"
    f.write_text(body)
    if _is_keys_file(body):
        assert read_keys_file(str(f)), page
    else:
        preset = load_preset(str(f))
        assert preset.sections or preset.globals, page


# ---- options ---------------------------------------------------------------------------------
def _bench_options() -> set[str]:
    """The options bench/'s harnesses define (their argparse lines)."""
    out = set()
    for p in (ROOT / "bench").glob("*.py"):
        for call in re.findall(r"add_argument\(\s*([^)]*)", p.read_text()):
            out.update(re.findall(r"[\"'](--?[a-z][\w-]*)[\"']", call))
    return out


OTHER_TOOLS = {
    # pip, python, pytest and its plugins (the install and test lines)
    "--upgrade", "--collect-only", "--durations", "--dist", "--timeout", "--inplace",
    # curl
    "--json",
    # docker, podman, compose
    "--build-arg", "--format", "--gpus", "--device", "--profile", "--mount",
    # the linker, in the CUDA image's CMAKE_ARGS
    "--allow-shlib-undefined",
    # nats-server
    "--js",
    # npm
    "--global",
    # Codex and Claude Code
    "--skip-git-repo-check", "--model", "--tools",
    # llama-server's own, which its router or web UI has and ggmux does not
    # (named to say so), or that ggmux passes to a cmd replica
    "--ui-mcp-proxy", "--api-key-file", "--slot-save-path", "--jinja",
    # mkdocs (and helm lint)
    "--strict",
    # helm; pip's install of vLLM's event classes without vLLM's dependencies
    "--set", "--no-deps",
    # the Inference Extension's endpoint picker, and vLLM's KV events option
    "--total-queued-requests-metric", "--kv-cache-usage-percentage-metric",
    "--lora-info-metric", "--kv-events-config",
}
"""Options of other programs that the manual's examples and comparisons
name: each is in an example that runs that program, or in a sentence about
it (these are not ggmux's, and ``--help`` does not list them)."""


def _named_options() -> dict[str, set[str]]:
    """Option -> the pages that name it (``--[no-]x`` as both forms), read
    from the pages as written (an included file is checked where it lives)."""
    out: dict[str, set[str]] = {}
    for page in pages():
        body = re.sub(r"https?://\S+", "", text(page))
        for m in re.finditer(r"(?<![\w/.-])--(\[no-\])?([a-z][a-z0-9]*(?:-[a-z0-9]+)*)", body):
            names = [f"--{m.group(2)}"] + ([f"--no-{m.group(2)}"] if m.group(1) else [])
            for n in names:
                out.setdefault(n, set()).add(page)
    return out


def test_every_option_the_manual_names_exists():
    """A ``--option`` on any page is one of ggmux's (``serve`` or a client
    command: what ``--help`` lists), a llama-server option a preset or
    ``ggmux serve --`` passes on, an option of a bench/ harness, or one of
    the other programs the examples run (:data:`OTHER_TOOLS`)."""
    known = option_names() | _bench_options() | OTHER_TOOLS
    llama = {f"--{k}" for k in LLAMA_OPTIONS if not k.isupper()}
    unknown = {opt: sorted(where) for opt, where in _named_options().items()
               if opt not in known and opt not in llama}
    assert not unknown, unknown


def test_a_removed_option_would_be_found():
    """The check above reads the pages: an option no program has is caught."""
    named = _named_options()
    assert "--models-max" in named and "--no-hf-cache" in named
    assert "--no-such-option" not in option_names() | _bench_options() | OTHER_TOOLS


# ---- links -----------------------------------------------------------------------------------
def slug(heading: str) -> str:
    """A heading's anchor as GitHub and mkdocs (Python-Markdown's toc) make
    it for the headings the manual has: lower case, punctuation dropped,
    spaces as hyphens."""
    s = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    s = re.sub(r"[^\w\s-]", "", s)
    return re.sub(r"\s+", "-", s)


def _prose(body: str) -> str:
    """A page without its fenced blocks and code spans (no links there)."""
    body = re.sub(r"^(\s*)```.*?^\1```$", "", body, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", body)


def anchors(page: str) -> set[str]:
    body = expanded(page)
    out = {slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", _prose(body), re.MULTILINE)}
    out |= set(re.findall(r'<a id="([^"]+)"', body))
    return out


def _links(page: str) -> list[tuple[str, str]]:
    """``(target, anchor)`` of every relative link and image of ``page``."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(text(page))):
        if re.match(r"[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


@pytest.mark.parametrize("page", pages())
def test_every_link_of_the_manual_reaches_a_file_and_a_heading(page):
    base = (ROOT / page).parent
    links = _links(page)
    for path, anchor in links:
        target = (base / path).resolve() if path else ROOT / page
        assert target.exists(), (page, path)
        assert ROOT in target.parents, (page, path)  # inside the repository
        if page.startswith("docs/"):  # the site holds docs/ only
            assert DOCS in target.parents, (page, path)
        if anchor:
            rel = str(target.relative_to(ROOT))
            assert rel.endswith(".md"), (page, path, anchor)
            assert anchor in anchors(rel), (page, f"{path}#{anchor}", sorted(anchors(rel)))


def test_the_link_check_sees_links_and_anchors():
    assert ("docs/keys.md", "") in _links("README.md")
    assert "kv-tiers-the-routers-side" in anchors("docs/kv-tiers.md")
    assert slug("KV tiers: the router's side") == "kv-tiers-the-routers-side"


# ---- the options reference -------------------------------------------------------------------
def test_the_options_page_is_made_from_the_parser_when_the_site_is_built():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = text("docs/options.md")
    assert hooks.MARK in page
    built = hooks.on_page_markdown(page, page=None)
    assert hooks.MARK not in built and reference_markdown() in built
    other = text("docs/keys.md")
    assert hooks.on_page_markdown(other, page=None) == other


def test_the_options_reference_lists_every_option_with_its_variable_and_default():
    ref = reference_markdown()
    for name in option_names() - {"-h", "--help", "--version"}:
        assert re.search(rf"`[^`]*{re.escape(name)}\b", ref), name
    row = next(ln for ln in ref.splitlines() if ln.startswith("| `--models-max"))
    assert "`GGMUX_MODELS_MAX`" in row and "(default: 4)" in row
    # the machine that builds the site shows nothing of its own
    assert "(default: the CPU count)" in ref
    assert not re.search(r"\bsk-", ref)


def test_a_keys_file_in_the_clone_is_ignored_by_git(tmp_path):
    """The manual's ``--keys keys.ini`` runs in the clone: git must not take
    the secrets in it (nor the built site) into a commit."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    for name in ("keys.ini", "site/index.html"):
        r = subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT, check=False)
        assert r.returncode == 0, f"git does not ignore {name}"
