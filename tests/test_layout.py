"""The package's layering (DESIGN.md "Processes"; issue 21), read from the
source with ``ast``: no import circle anywhere in supervisor/, proxy/,
instance/, shm/, http1/, client/ and ledger/, ``http1/`` imports nothing
else of proxy/, instance/ and supervisor/ use only proxy's HTTP core (and
its key helpers), and the usage ledger, which the supervisor writes and
the proxies read, is a package of its own that imports only shm/.

Every ``import`` statement counts, those under ``if TYPE_CHECKING:`` and
inside functions too: a circle that only type checkers or a lazy import see
is still a circle between the modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PARTS = ("supervisor", "proxy", "instance", "shm", "http1", "client", "ledger")


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of :data:`PARTS` (a package as
    its ``__init__``) and the root package."""
    mods = {"ggmux": ROOT / "__init__.py", "ggmux.__main__": ROOT / "__main__.py"}
    for part in PARTS:
        for path in sorted((ROOT / part).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            names = list(rel.parts)
            if names[-1] == "__init__":
                names.pop()
            mods[".".join(["ggmux", *names])] = path
    return mods


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of ``mods`` that ``name``'s source imports explicitly
    (``from pkg import x``: ``pkg.x`` when that is a module, else ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            # `import ggmux.http1.limits` names the module itself
            while t and t not in mods and "." in t:
                t = t.rpartition(".")[0]
            if t in mods and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_reader_sees_the_edges_it_must():
    """The graph is not empty by mistake: known edges are in it."""
    g = _graph()
    assert "ggmux.http1.connection" in g["ggmux.http1"]
    assert "ggmux.shm.layout" in g["ggmux.proxy.balancer"]
    assert "ggmux.http1" in g["ggmux.instance.server"]


def test_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circle_anywhere():
    assert _circles(_graph()) == []


def test_http_core_imports_neither_the_proxy_nor_the_instance_nor_the_supervisor():
    bad = {(m, t) for m, targets in _graph().items()
           if m == "ggmux.http1" or m.startswith("ggmux.http1.")
           for t in targets
           if t.startswith(("ggmux.proxy", "ggmux.instance", "ggmux.supervisor"))}
    assert bad == set()


def test_no_module_of_instance_imports_the_proxy():
    bad = {(m, t) for m, targets in _graph().items()
           if m.startswith("ggmux.instance")
           for t in targets if t.startswith("ggmux.proxy")}
    assert bad == set()


def test_the_supervisor_imports_nothing_of_the_proxy():
    """The supervisor starts proxies as processes; what both need (keys,
    limits) is in the HTTP core."""
    bad = {(m, t) for m, targets in _graph().items()
           if m.startswith("ggmux.supervisor")
           for t in targets if t.startswith("ggmux.proxy")}
    assert bad == set()


def test_the_command_line_client_is_a_client_of_the_http_api():
    """``ggmux ps``/``load``/... talk to a server over HTTP like any SDK: they
    import no part of the server (shm/'s log-line helpers aside)."""
    bad = {(m, t) for m, targets in _graph().items()
           if m.startswith("ggmux.client")
           for t in targets
           if t.startswith(("ggmux.proxy", "ggmux.instance", "ggmux.supervisor"))}
    assert bad == set()


def test_the_usage_ledger_imports_only_the_shared_memory_plane():
    """The supervisor writes the ledger and every proxy reads it (``GET
    /usage``): its package stands beside http1/ and shm/, on shm/ alone."""
    g = _graph()
    assert "ggmux.ledger.store" in g["ggmux.proxy.operator.usage"]
    assert "ggmux.ledger.ledger" in g["ggmux.supervisor.ledger_wiring"]
    bad = {(m, t) for m, targets in g.items() if m.startswith("ggmux.ledger")
           for t in targets if not t.startswith(("ggmux.ledger", "ggmux.shm"))}
    assert bad == set()


def test_the_proxy_imports_nothing_of_the_supervisor():
    bad = {(m, t) for m, targets in _graph().items()
           if m.startswith("ggmux.proxy")
           for t in targets if t.startswith("ggmux.supervisor")}
    assert bad == set()


def test_every_bench_script_imports():
    """Every harness in bench/ imports (as ``ggmux.bench.NAME``, how the
    ones with package-relative imports run): a module split elsewhere
    cannot leave a benchmark naming what moved (proxy_instructions once
    imported NGINX_CONF from bench.compare after it moved out)."""
    import importlib

    bench = ROOT / "bench"
    failed = {}
    for path in sorted(bench.glob("*.py")):
        name = f"ggmux.bench.{path.stem}"
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - each module's own error, reported together
            failed[name] = repr(e)
    assert failed == {}
