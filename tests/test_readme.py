"""README.md and the manual's pages (docs/) stay true for a first reader:
their shell blocks run here as written (the curl lines, the OpenAI example,
the command line block and the one-machine cluster recipe, against real
``ggmux serve`` processes and the demo models they name), every other
shell block is listed below with the reason it cannot run in a test, and
what users read (README, the manual, the container files, the example
preset, ``--help``, log lines and error messages) names no issue number, no
file outside the repository and no install from the package index, where
ggmux is not. A block that README and a page both hold is the same text
(run once).

"As written" means the block's text, line by line, through ``bash``; only
the ports are replaced by free ones (8080, 4222, 8081, 8082: the machine
is shared), the model caches are empty (so the demo models serve) and
``$GGMUX_URL`` names the test's server for the client commands. A line
that follows a stream (``curl -N``, ``logs -f``) runs until its first
output, as a reader stops it with Ctrl-C.
"""

from __future__ import annotations

import ast
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import Server, alive, free_port, segment_exists, wait_for
from ggmux.supervisor.demo import demo_models
from manual import fenced as page_blocks
from manual import manual, pages

ROOT = Path(__file__).resolve().parent.parent
MANUAL = manual()  # README.md and docs/*.md
SMOL, GEMMA = "smollm2-135m", "gemma3-270m"

# Every sh block of README.md and the manual, by a phrase only it holds:
# None for the blocks the tests below run, else why it cannot run in a test.
SH_BLOCKS: dict[str, str | None] = {
    "pip install -e '.[demo]' && ggmux serve":
        "installs ggmux and compiles llama-cpp-python (minutes); the `ggmux serve` it ends with "
        "is the server every run block here talks to",
    "pip install -e '.[test]' && python -m pytest": "the test command itself",
    'python -m pytest -m "not slow and not fuzz"': "the quick test command, a part of this suite",
    "docker build -t ggmux .":
        "needs a Docker engine (or podman) and a base image; tests/test_container.py checks the "
        "Dockerfile and compose file, and builds and runs the image with GGMUX_TEST_CONTAINER=1",
    "docker build --build-arg BASE=nvidia/cuda":
        "needs nvidia/cuda images and a GPU; tests/test_container.py checks the recipe",
    "helm install llm deploy/helm/ggmux -n ai --set":
        "needs a Kubernetes cluster; tests/test_helm_chart.py lints and renders the chart with "
        "these values and validates the manifests against the Kubernetes schemas",
    "docker push registry.example/ggmux":
        "needs a Docker engine and a registry; tests/test_container.py builds the image with "
        "GGMUX_TEST_CONTAINER=1, and tests/test_helm_chart.py checks the chart runs it",
    "kubectl create namespace ai":
        "needs a Kubernetes cluster with the Inference Extension's CRDs; tests/test_helm_chart.py "
        "renders the chart with these values and validates the manifests",
    "python -m bench.pool":
        "a benchmark of several minutes on three servers; its figures, command and load are in "
        "bench/RESULTS.md",
    "claude --model qwen3-8b":
        "Claude Code against a model this machine does not have: tests/test_agents.py runs "
        "Claude Code against ggmux",
    "ggmux serve --models-preset presets.agents.ini":
        "agents on the real demo model (prefills of minutes): tests/test_agent_presets.py "
        "starts this server line, sends each agent's first request through it, and runs the "
        "Codex line on the fake instance",
    "--node-name gpu1":
        "several machines (gpu1, cpu1, nats-host); the one-machine recipe runs instead",
    "/usage?from=7d&group=key,model,day":
        "needs $ADMIN, an admin key the demo server has not: tests/test_ledger.py asks /usage "
        "with ranges, groups and CSV, and runs ggmux usage",
    "curl -sN http://127.0.0.1:8080/models/sse": None,  # test_the_use_it_curl_lines
    "ggmux ps --all": None,  # test_the_command_line_block
    "nats-server -js -a 127.0.0.1 -p 4222": None,  # test_the_one_machine_cluster_recipe
    "touch keys.ini": None,  # test_the_small_team_walkthrough_runs_without_a_restart
    "ggmux keys info": None,  # the same
    "ggmux serve --models-dir models":
        "needs a vision model's folder: tests/test_vision.py serves bench/vision_model.py's "
        "folder with --models-dir and sends it every API's images",
    "pip install -e '.[docs]' && mkdocs serve":
        "serves the site until stopped; .ci/run builds it with mkdocs build --strict and "
        "tests/test_docs.py checks its examples and links",
}

needs_demo = pytest.mark.skipif(len(demo_models()) < 2, reason="the demo models are not installed")


def fenced(lang: str) -> list[str]:
    """The distinct bodies of the manual's fenced blocks in language ``lang``
    (a block README and a page both hold, word for word, counts once)."""
    return list(dict.fromkeys(b for _, b in page_blocks(lang)))


def block(phrase: str, lang: str = "sh") -> str:
    found = [b for b in fenced(lang) if phrase in b]
    assert len(found) == 1, f"{len(found)} different {lang} blocks of the manual hold {phrase!r}"
    return found[0]


def logical_lines(text: str) -> list[str]:
    """A block's commands: continuation lines joined, blank and comment lines
    dropped (a trailing ``# comment`` stays: bash reads it as one)."""
    out, cur = [], ""
    for line in text.splitlines():
        if line.endswith("\\"):
            cur += line[:-1]
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def shell_env(tmp: Path, **extra: str) -> dict[str, str]:
    """The environment a reader's shell has after ``. .venv/bin/activate``:
    this interpreter's scripts (``ggmux``, ``nats-server``) first on PATH;
    empty model caches, so ``ggmux serve`` serves the demo models; one
    llama.cpp thread per instance (``GGMUX_THREADS``, as conftest's servers
    have it: two spin against the rest of the test on two cores)."""
    empty = tmp / "empty-cache"
    empty.mkdir(exist_ok=True)
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "HF_HUB_CACHE": str(empty), "LLAMA_CACHE": str(empty),
            "HF_HOME": str(empty), "GGMUX_THREADS": "1",
            "GGMUX_STATE_DIR": str(tmp / "state"), **extra}  # (the usage ledger's file)


def sh(line: str, env: dict, timeout: float = 120, typed: bytes = b"") -> tuple[int, str]:
    """``(exit status, stdout and stderr)`` of ``bash -c line``, ``typed``
    its input."""
    r = subprocess.run(["bash", "-c", line], env=env, input=typed, capture_output=True,
                       timeout=timeout, check=False)
    return r.returncode, (r.stdout + r.stderr).decode(errors="replace")


def follow(line: str, env: dict, want: str, timeout: float = 60) -> str:
    """Run a line that streams until stopped: its output once it holds
    ``want``, then the line is stopped (SIGINT to its process group, as a
    reader's Ctrl-C)."""
    p = subprocess.Popen(["bash", "-c", line], env=env, stdin=subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         start_new_session=True)
    got = bytearray()
    done = threading.Event()

    def read() -> None:
        while chunk := p.stdout.read1(65536):
            got.extend(chunk)
            if want.encode() in got:
                done.set()
        done.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        done.wait(timeout)
        assert want.encode() in got, f"{line!r} gave no {want!r} in {timeout} s: {bytes(got)!r}"
        return got.decode(errors="replace")
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGINT)
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


# ---- which blocks run ----------------------------------------------------------------------
def test_every_shell_block_of_the_readme_is_run_here_or_skipped_with_its_reason():
    blocks = fenced("sh")
    for b in blocks:
        marks = [m for m in SH_BLOCKS if m in b]
        assert len(marks) == 1, f"manual block not listed in SH_BLOCKS (or listed twice): {b}"
    for m in SH_BLOCKS:
        assert sum(m in b for b in blocks) == 1, f"no single manual block holds {m!r}"


# ---- what users read -------------------------------------------------------------------------
def _user_strings() -> list[tuple[str, int, str]]:
    """String literals of the package that are not docstrings (log lines,
    error messages, ``--help`` texts, answers): ``(file, line, text)``."""
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in ("tests", ".venv", "build") or "bench" in rel.parts:
            continue
        tree = ast.parse(p.read_text())
        # a string that is a statement of its own is a docstring (of a module,
        # class, function or attribute): developers read those
        docs = {id(n.value) for n in ast.walk(tree)
                if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
        for n in ast.walk(tree):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
                out.append((str(rel), n.lineno, n.value))
    return out


ISSUE = re.compile(r"\bissues? \d+|DESIGN\.md|outside (of )?this repository", re.IGNORECASE)
INDEX_INSTALL = re.compile(r"pip install ['\"]?ggmux\b")  # ggmux is not on the package index


def test_what_users_read_names_no_issue_no_outside_file_and_no_package_index_install():
    docs = {name: (ROOT / name).read_text() for name in
            (*pages(), "compose.yaml", "Dockerfile", "presets.example.ini", "presets.agents.ini",
             "certs/README.md")}
    docs["ggmux serve --help"] = subprocess.run(
        [sys.executable, "-m", "ggmux", "serve", "--help"], capture_output=True, text=True,
        check=True, timeout=60).stdout
    for name, text in docs.items():
        assert not ISSUE.search(text), (name, ISSUE.search(text).group(0))
        assert not INDEX_INSTALL.search(text), (name, INDEX_INSTALL.search(text).group(0))
    for where, line, text in _user_strings():
        assert not ISSUE.search(text), f"{where}:{line}: {text[:200]!r}"
        assert not INDEX_INSTALL.search(text), f"{where}:{line}: {text[:200]!r}"


def test_the_install_lines_run_in_the_clone():
    """The demo's and the tests' install lines are editable installs of the
    clone, and README says to start in it."""
    for phrase in ("pip install -e '.[demo]'", "pip install -e '.[test]'"):
        assert phrase in block(phrase)
    assert block("pip install -e '.[demo]'").startswith("cd ggmux ")


# ---- blocks run against a real server -----------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """One ``ggmux serve`` with the demo models (and no other source)."""
    if len(demo_models()) < 2:
        pytest.skip("the demo models are not installed")
    d = tmp_path_factory.mktemp("readme")
    # --n-predict bounds the answers the blocks ask for without a limit (the
    # haiku and the conversations of `ggmux run`): the lines run as written,
    # and a 135M model's chatter until its end of turn proves nothing more
    s = Server(["--proxies", "1", "--ctx-size", "512", "--spares", "0", "--n-predict", "24"],
               free_port(), d / "server.log")
    s.dir = d
    try:
        s.wait_ready(60)
        yield s
    finally:
        s.stop()


@pytest.mark.slow
def test_the_use_it_curl_lines(demo):
    env = shell_env(demo.dir)
    lines = [ln.replace("127.0.0.1:8080", f"127.0.0.1:{demo.port}")
             for ln in logical_lines(block("curl -sN http://127.0.0.1:8080/models/sse"))]
    assert len(lines) == 4
    chat, models, load, sse = lines
    rc, out = sh(chat, env)
    assert rc == 0 and json.loads(out)["choices"][0]["message"]["content"], out
    rc, out = sh(models, env)
    assert rc == 0 and {SMOL, GEMMA} <= {m["id"] for m in json.loads(out)["data"]}, out
    rc, out = sh(load, env)
    assert rc == 0 and json.loads(out)["success"] is True, out
    # one event per model at once, then its changes (the load above: loading, loaded)
    out = follow(sse, env, f'"id":"{GEMMA}"')
    assert out.startswith("event: model\n"), out
    wait_for(lambda: demo.models()[GEMMA]["status"]["value"] == "loaded", 120, 0.1,
             what="gemma3-270m loaded by POST /models/load")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_openai_example(demo):
    code = block("from openai import OpenAI", "python").replace("127.0.0.1:8080",
                                                                f"127.0.0.1:{demo.port}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300, check=False, env=shell_env(demo.dir))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(r.stdout.strip().splitlines()) >= 2, r.stdout  # the haiku, then the completion


@pytest.mark.slow
@pytest.mark.timeout(900)  # three answers of smollm2, a load and an unload of gemma3
def test_the_command_line_block(demo):
    env = shell_env(demo.dir, GGMUX_URL=demo.base)
    env.pop("GGMUX_API_KEY", None)
    lines = logical_lines(block("ggmux ps --all"))
    assert [ln.split()[:2] for ln in lines][:4] == [["ggmux", "ps"], ["ggmux", "ps"],
                                                    ["ggmux", "load"], ["ggmux", "unload"]]
    for line in lines:
        if " -f " in line:  # follows the log: its first lines, then Ctrl-C
            out = follow(line, env, "\n")
            continue
        # the conversation: the reader types a turn, then /bye
        typed = b"Say hi\n/bye\n" if "# a conversation" in line else b""
        rc, out = sh(line, env, timeout=300, typed=typed)
        assert rc == 0, (line, out)
        assert out.strip(), (line, "no output")
        if line.startswith("ggmux ps --all"):
            assert SMOL in out and GEMMA in out, out
        elif line.startswith("ggmux unload"):
            assert demo.models()[GEMMA]["status"]["value"] == "unloaded"
        elif line.startswith("ggmux load"):
            assert demo.models()[GEMMA]["status"]["value"] == "loaded"


# ---- a small team ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(900)  # a server of the demo models, and one answer of smollm2
@needs_demo
def test_the_small_team_walkthrough_runs_without_a_restart(tmp_path):
    """The operator's block (a keys file, the admin key, the server, a key
    made) and the member's (her key, a request, her limits) as written, in
    one shell in a fresh folder: no step needs a restart."""
    port = free_port()
    operator = logical_lines(block("touch keys.ini").replace("127.0.0.1:8080",
                                                             f"127.0.0.1:{port}"))
    member = logical_lines(block("ggmux keys info").replace("127.0.0.1:8080",
                                                            f"127.0.0.1:{port}"))
    log = tmp_path / "team.log"
    shell = Shell(shell_env(tmp_path, GGMUX_URL=f"http://127.0.0.1:{port}", GGMUX_PORT=str(port)),
                  log)
    try:
        assert shell.run(f"cd {tmp_path}")[0] == 0
        secret = None
        for line in operator + member:
            if line.startswith("export GGMUX_API_KEY="):
                assert secret, "ggmux keys create printed no key"
                line = line.replace("sk-ggmux-...", secret)
            rc, out = shell.run(line, timeout=300)
            assert rc == 0, (line, out, log.read_text()[-3000:])
            if re.search(r"&\s*(#.*)?$", line):  # the server: the reader waits for it
                wait_for(lambda: f"listening on http://127.0.0.1:{port}" in log.read_text(),
                         120, 0.1, "the server listening")
            elif line.startswith("ggmux keys create alice"):
                found = re.search(r"^alice: (sk-ggmux-\S+)$", out, re.MULTILINE)
                assert found, (out, log.read_text()[-3000:])
                secret = found.group(1)
            elif line.startswith("curl"):
                assert json.loads(out)["choices"][0]["message"]["content"], out
            elif line.startswith("ggmux keys info"):
                assert out.startswith("key alice: models smollm2-135m"), out
                assert "rpm" in out and "tokens-per-day" in out, out
            elif line.startswith("ggmux keys"):
                assert "alice" in out, out
        assert "[alice]" in (tmp_path / "keys.ini").read_text()
        assert "are closed: set --admin-key" not in log.read_text()
        assert shell.run("kill %1; wait %1", timeout=120)[0] in (0, 143)
    finally:
        shell.close()


# ---- the one-machine cluster ----------------------------------------------------------------
class Shell:
    """One ``bash`` reading commands from a pipe, so a block's lines share
    its variables and background jobs as a reader's terminal does; stderr
    (the servers' logs) goes to ``log``."""

    def __init__(self, env: dict, log: Path) -> None:
        self.log = log
        self.p = subprocess.Popen(["bash"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=log.open("wb"), env=env, start_new_session=True)
        self.lines: queue.Queue[bytes] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.p.stdout:
            self.lines.put(line)

    def run(self, line: str, timeout: float = 120) -> tuple[int, str]:
        """Run ``line``: ``(its exit status, its stdout)``."""
        tag = uuid.uuid4().hex
        # (the status before the newline's echo, which would set $? to 0)
        self.p.stdin.write(f"{line}\nggmux_rc=$?; echo; echo {tag} $ggmux_rc\n".encode())
        self.p.stdin.flush()
        out, deadline = [], time.monotonic() + timeout
        while True:
            try:
                got = self.lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{line!r} did not finish in {timeout} s: "
                                     f"{self.log.read_text()[-3000:]}") from None
            if got.startswith(tag.encode()):
                return int(got.split()[1]), b"".join(out).decode(errors="replace")
            out.append(got)

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.close()
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # whatever the block left behind
        except ProcessLookupError:
            pass
        self.p.wait()


def _json(out: str):
    try:
        return json.loads(out)
    except ValueError:
        return None


@pytest.mark.slow
@pytest.mark.timeout(900)  # two nodes start, measure the demo models and load one
@needs_demo
def test_the_one_machine_cluster_recipe(tmp_path):
    text = block("nats-server -js -a 127.0.0.1 -p 4222")
    ports = {p: free_port() for p in ("4222", "8081", "8082")}
    for old, new in ports.items():
        text = re.sub(rf"\b{old}\b", str(new), text)
    lines = logical_lines(text)
    assert lines[0].startswith("export GGMUX_CLUSTER_TOKEN=")
    starts = [ln for ln in lines if ln.endswith("&")]
    assert [ln.split()[0] for ln in starts] == ["nats-server", "ggmux", "ggmux"]
    cluster_a, chat, model_b, stop = lines[1 + len(starts):]
    a, b = (f"http://127.0.0.1:{ports[p]}" for p in ("8081", "8082"))
    shell = Shell(shell_env(tmp_path), tmp_path / "recipe.log")
    try:
        assert shell.run(lines[0])[0] == 0
        for line in starts:
            assert shell.run(line)[0] == 0
        # the reader waits for each node's "listening on" line
        for url in (a, b):
            wait_for(lambda u=url: f"listening on {u}" in (tmp_path / "recipe.log").read_text(),
                     120, 0.1, f"{url} listening")

        def both_nodes() -> bool:
            rc, out = shell.run(cluster_a)
            doc = _json(out) if rc == 0 else None
            return doc is not None and {n["name"] for n in doc["nodes"]} == {"a", "b"}

        wait_for(both_nodes, 60, 0.5, "both nodes in node a's /cluster")
        rc, out = shell.run(chat, timeout=300)
        assert rc == 0 and _json(out)["choices"][0]["message"]["content"], out

        def node_b_says_a_serves_it() -> bool:
            rc, out = shell.run(model_b)
            doc = _json(out) if rc == 0 else None
            smol = [m for m in (doc or {}).get("data", []) if m["id"] == SMOL]
            return bool(smol) and smol[0]["status"].get("node") == "a"

        wait_for(node_b_says_a_serves_it, 30, 0.5, "node b's status.node of smollm2: a")
        rc, _ = shell.run(stop, timeout=180)
        assert rc == 0
        log = (tmp_path / "recipe.log").read_text()
        assert len(re.findall(r"\bINFO \S+: stopped$", log, re.MULTILINE)) == 2, log[-3000:]
        for p in (ports["8081"], ports["8082"]):
            assert not segment_exists(p) and not segment_exists(p, "-log")
    finally:
        pid = shell.p.pid
        shell.close()
        assert not alive(pid)


# ---- what the manual quotes ----------------------------------------------------------------
FLAT = " ".join(MANUAL.split())  # the manual's text, its line breaks as spaces


def quoted(start: str) -> str:
    """The one backticked text of the manual that starts with ``start`` (a
    quote repeated word for word counts once)."""
    found = set(re.findall(r"`(" + re.escape(start) + r"[^`]*)`", FLAT))
    assert len(found) == 1, f"{len(found)} quotes of the manual start with {start!r}"
    return found.pop()


def as_pattern(quote: str, holes: dict[str, str]) -> re.Pattern:
    """``quote`` as a regular expression, each key of ``holes`` (a
    placeholder of the quote: ``URL``, ``N``, ``...``) standing for its
    expression."""
    pattern = re.escape(quote)
    for hole, rx in holes.items():
        assert re.escape(hole) in pattern, (hole, quote)
        pattern = pattern.replace(re.escape(hole), rx)
    return re.compile(pattern)


class _Answers(threading.Thread):
    """A server that answers ``GET /ps`` with ``body``, as a server that is
    not ggmux (or a ggmux with nothing running) would."""

    def __init__(self, body: bytes) -> None:
        super().__init__(daemon=True)
        from http.server import BaseHTTPRequestHandler, HTTPServer

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.start()

    def run(self) -> None:
        self.httpd.serve_forever()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _cli(*args: str) -> tuple[int, str]:
    r = subprocess.run([sys.executable, "-m", "ggmux", *args], capture_output=True, text=True,
                       timeout=60, check=False)
    return r.returncode, (r.stdout + r.stderr).strip()


def test_the_cli_messages_the_manual_quotes_are_what_the_commands_print():
    nothing = _Answers(json.dumps({"models": [{"id": "a", "state": "unloaded"}]}).encode())
    stranger = _Answers(b"hello")
    try:
        cases = [  # (the quote's start, its placeholders, the command, its exit status)
            ("no model is running", {"N known": r"\d+ known"}, ("--url", nothing.url, "ps"), 0),
            ("ggmux: no usable answer", {"from URL": r"from \S+", "...": ".+"},
             ("--url", stranger.url, "ps"), 3),
            ("ggmux: no server answers", {"at URL": r"at \S+", "(...)": r"\(.+?\)"},
             ("--url", f"http://127.0.0.1:{free_port()}", "ps"), 3),
        ]
        for start, holes, args, code in cases:
            pattern = as_pattern(quoted(start), holes)
            rc, out = _cli(*args)
            assert rc == code and pattern.fullmatch(out), (quoted(start), rc, out)
    finally:
        nothing.stop()
        stranger.stop()


def test_the_log_lines_the_manual_quotes_are_what_ggmux_serve_logs(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1")
    # an empty prompt loads the model; keep_alive 0 unloads it (README's API table)
    assert s.request("POST", "/api/generate", {"model": "m", "prompt": ""})[0] == 200
    assert s.request("POST", "/api/generate", {"model": "m", "keep_alive": 0})[0] == 200
    wait_for(lambda: "stopping m " in s.logs(), 30, what="the unload's log line")
    logs = s.logs()
    for start, holes in [
        ("listening on http://", {"...": r"\S+"}),
        ("stopping m (slot 0, ", {"...": r"[^)]*"}),
    ]:
        pattern = as_pattern(quoted(start), holes)
        assert pattern.search(logs), (quoted(start), logs[-3000:])
    # the first proxy's line and the instance's ([proxy-0] and [m#0] tag them)
    compiled = as_pattern(quoted("hot path compiled"), {"N": r"\d+"})
    pure = as_pattern(quoted("hot path runs pure Python"),
                      {"N of M": r"\d+ of \d+", "(why)": r"\(.+\)", "...": ".+"})
    for tag in ("[proxy-0]", "[m#0]"):
        lines = [ln for ln in logs.splitlines() if tag in ln and "hot path" in ln]
        assert len(lines) == 1 and (compiled.search(lines[0]) or pure.search(lines[0])), lines


TEST_COUNT_SLACK = 0.1
"""How far the manual's test counts may be from the suite's (a fraction):
they are measurements of a suite that grows with every change, not
promises."""


def _whole_run(config) -> bool:
    """Whether this run collected the whole suite as README's command does
    (``tests``, addopts' ``-m 'not fuzz'``, nothing deselected by name): then
    its own items are the count, and the two collections of a fresh
    interpreter (5 s each) are not needed."""
    o = config.option
    paths = [(config.invocation_params.dir / a).resolve() for a in config.args]
    return (paths == [ROOT / "tests"] and o.markexpr == "not fuzz" and not o.keyword
            and not getattr(o, "lf", False) and not getattr(o, "deselect", None)
            and not o.ignore and not o.ignore_glob)


def test_the_test_counts_the_manual_quotes_are_the_suites(request):
    counts = re.findall(r"measured: \d+ s for (\d+) tests", FLAT)
    assert len(counts) == 2, counts  # the whole suite, then the quick one
    for marks, quote in ((None, counts[0]), ("not slow and not fuzz", counts[1])):
        if _whole_run(request.config):  # (an xdist worker collects every item too)
            items = request.session.items
            have = len(items) if marks is None else sum(
                1 for it in items if it.get_closest_marker("slow") is None)
            assert abs(int(quote) - have) <= TEST_COUNT_SLACK * have, (marks, quote, have)
            continue
        args = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0",
                "-p", "no:cacheprovider", str(ROOT / "tests")]
        if marks:
            args += ["-m", marks]
        r = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False,
                           cwd=ROOT)
        m = re.search(r"(\d+)(?:/\d+)? tests? collected", r.stdout) or re.search(
            r"^(\d+) tests? collected", r.stdout, re.MULTILINE)
        assert m, r.stdout[-2000:] + r.stderr[-2000:]
        have = int(m.group(1))
        assert abs(int(quote) - have) <= TEST_COUNT_SLACK * have, (marks, quote, have)
