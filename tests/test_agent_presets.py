"""README's ready-to-paste agent lines on the demo model (issue 31 item 13),
run as README writes them.

* The server line (``ggmux serve --models-preset presets.agents.ini``) starts
  ggmux on the real smollm2-135m, and each agent's captured first request
  (tests/agent_requests/: Claude Code 2.1's 22k-token one, Codex 0.171's
  10k-token one plus the ``web_search`` tool Codex's default config offers)
  is accepted through it: the built-in instance takes the request (its
  ``prompt_progress`` arrives: the prompt was rendered, tokenized and fits
  the context; Anthropic's ``message_start`` carries its size), not a 400.
  The answer itself, a prefill of minutes on a CPU, is left to the opt-in
  slow runs of tests/test_agents.py: the client hangs up once the request
  was taken, which ends the prefill.
* The Codex line runs the real Codex CLI (skipped without it), as written
  but for the port, in a fresh folder that is no git repository, against
  the fake instance: it exits 0 and its tool ran.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from conftest import Server, free_port, write_fake
from manual import manual

ROOT = Path(__file__).resolve().parent.parent
REQUESTS = Path(__file__).parent / "agent_requests"


def readme_lines() -> dict[str, str]:
    """The lines of README's ready-to-paste block: ``serve``, ``claude``,
    ``codex`` (the block that starts ``ggmux serve --models-preset``)."""
    text = manual()
    block = re.search(r"```sh\n(ggmux serve --models-preset [^\n]+\n.*?)```", text, re.DOTALL)
    assert block, "the manual has no ready-to-paste agent block"
    out = {}
    for line in block.group(1).splitlines():
        if line.startswith("ggmux serve"):
            out["serve"] = line
        elif " claude " in f" {line} ":
            out["claude"] = line
        elif line.startswith("codex "):
            out["codex"] = line
    assert set(out) == {"serve", "claude", "codex"}, out
    return out


LINES = readme_lines()


def preset_ctx(path: Path) -> int:
    return int(re.search(r"^ctx-size = (\d+)", path.read_text(), re.MULTILINE).group(1))


@pytest.fixture(scope="module")
def agents_server(tmp_path_factory):
    """``ggmux serve`` with README's arguments (the preset file taken from
    the repository root, where README's line runs)."""
    argv = shlex.split(LINES["serve"])
    assert argv[:2] == ["ggmux", "serve"]
    args = [str(ROOT / a) if a.endswith(".ini") else a for a in argv[2:]]
    d = tmp_path_factory.mktemp("agent-presets")
    # (the harness adds its port, one proxy, and a keep-alive interval longer
    # than the test: Anthropic's message_start then waits for the instance to take
    # the request and carries the prompt's size, which is what is asserted)
    s = Server([*args, "--proxies", "1", "--stream-keepalive", "3000"], free_port(),
               d / "server.log")
    s.preset = ROOT / args[args.index("--models-preset") + 1]
    try:
        s.wait_ready(60)
        yield s
    finally:
        s.stop()


def first_events(port: int, path: str, body: dict, until,
                 timeout: float = 900) -> tuple[int, dict, list[tuple[str, dict]]]:
    """POST ``body`` as a stream and read events until ``until(name, data)``
    holds for one (or an ``error`` event, or the end); then hang up.
    ``(status, headers, [(event, data)])``."""
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sk:
        sk.sendall(b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (path.encode(), len(data), data))
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sk.recv(65536) or b""
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
        events: list[tuple[str, dict]] = []
        while status == 200:
            for m in re.finditer(rb"event: ([\w.]+)\ndata: ([^\n]*)\n\n", rest):
                events.append((m.group(1).decode(), json.loads(m.group(2))))
            if any(n == "error" or until(n, d) for n, d in events):
                break
            events.clear()
            chunk = sk.recv(65536)
            if not chunk:
                break
            rest += chunk
        if status != 200:
            rest += sk.recv(65536)
            events = [("body", {"raw": rest.decode("latin-1")})]
    return status, headers, events


def test_readmes_preset_takes_codexs_first_request_with_its_default_web_search(
        agents_server):
    s = agents_server
    argv = shlex.split(LINES["codex"])
    model = next(a.split("=", 1)[1] for a in argv if a.startswith("model="))
    body = json.loads((REQUESTS / "codex_first.json").read_text())
    body = {**body, "model": model, "stream": True, "return_progress": True,
            "tools": [*body["tools"], {"type": "web_search", "external_web_access": False}]}
    status, headers, events = first_events(
        s.port, "/v1/responses", body,
        lambda n, d: n == "response.in_progress" and "prompt_progress" in d)
    assert status == 200, events
    assert headers.get("x-ggmux-dropped-tools") == "web_search"
    names = [n for n, _ in events]
    assert "error" not in names and names[:2] == ["response.created", "response.in_progress"]
    progress = next(d for n, d in events if "prompt_progress" in d)["prompt_progress"]
    assert 5000 < progress["total"] <= preset_ctx(s.preset), progress


def test_readmes_preset_takes_claude_codes_whole_first_request(agents_server):
    s = agents_server
    env_and_cmd = shlex.split(LINES["claude"])
    model = env_and_cmd[env_and_cmd.index("--model") + 1]
    body = {**json.loads((REQUESTS / "claude_code_first.json").read_text()), "model": model,
            "stream": True}
    status, _, events = first_events(s.port, "/v1/messages?beta=true", body,
                                     lambda n, d: n == "message_start")
    assert status == 200, events
    names = [n for n, _ in events]
    assert "error" not in names and "message_start" in names, events
    start = dict(events)["message_start"]["message"]["usage"]
    # its size, from the built-in instance's prompt_progress: taken, and it fits
    assert 20000 < start["input_tokens"] <= preset_ctx(s.preset), start


def test_readmes_codex_line_runs_in_a_fresh_folder(tmp_path):
    codex = shutil.which("codex")
    if codex is None:
        pytest.skip("Codex is not installed (npm install -g @openai/codex)")
    argv = shlex.split(LINES["codex"])
    assert argv[:2] == ["codex", "exec"] and "--skip-git-repo-check" in argv
    model = next(a.split("=", 1)[1] for a in argv if a.startswith("model="))
    work = tmp_path / "fresh"  # no git repository
    work.mkdir()
    write_fake(tmp_path / "fakes", model, tokens=3, tool=["exec_command"],
               tool_arguments={"exec_command": {"cmd": "printf hi > hello.txt"}})
    s = Server(["--fake-models-dir", str(tmp_path / "fakes"), "--no-hf-cache", "--proxies",
                "1"], free_port(), tmp_path / "server.log")
    try:
        s.wait_ready()
        home = tmp_path / "home"
        home.mkdir()
        # as README writes it: its -s workspace-write lets the task write the
        # file (the default read-only sandbox could not: issue 37)
        assert "-s" in argv and argv[argv.index("-s") + 1] == "workspace-write"
        cmd = [codex, *[a.replace("127.0.0.1:8080", f"127.0.0.1:{s.port}") for a in argv[1:]]]
        env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
        out = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True,
                             timeout=300, stdin=subprocess.DEVNULL, check=False)
        assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
        assert (work / "hello.txt").read_text() == "hi"
        # its default config offers the hosted web_search: left out, not a 400
        assert "left out the hosted tools web_search" in s.logs()
    finally:
        s.stop()
