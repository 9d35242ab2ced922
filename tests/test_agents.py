"""Real agent clients against a real ``ggmux serve`` (issue 19): the OpenAI
Agents SDK, LangChain's ChatOpenAI and ChatOllama, Claude Code and Codex,
each unchanged but for where it is pointed. Each test skips only when its
package or binary is missing (``pip install -e '.[test]'``; the CLIs come
from ``.ci/run``'s npm step).

They run on the fake instance (ggmux.instance.fake), which calls the first
tool it is offered (or the one its ``tool`` list names, with the arguments
``tool_arguments`` gives) and answers text once it sees the tool's result,
so each agent runs one tool and ends in seconds; what is tested is the
protocol: every request the CLI made (counted by tests/access_log.py, a
recording proxy between it and ggmux) was answered 200, and the tool ran.

To run them on the demo model instead (once the built-in instance calls
tools): ``GGMUX_AGENT_MODEL=smollm2-135m pytest tests/test_agents.py``. The
server then serves the demo models with ``--ctx-size 32768`` (Claude Code's
system prompt and tools are about 20k tokens; smollm2 is trained for 8k,
which llama.cpp stretches), the CLIs get up to 15 minutes, and only the
protocol is asserted: a 135M model rarely does the task. One turn is a
~20k-token prefill: on this project's shared 2-core machine (load average
18) smollm2 took 98 s for the first 1024 tokens of Claude Code's request,
so expect minutes per turn on 2 cores unless the prompt is cached.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from access_log import AccessLog
from conftest import Server, free_port, write_fake

pytestmark = pytest.mark.slow  # Claude Code, Codex and agent SDKs end to end

REAL = os.environ.get("GGMUX_AGENT_MODEL")  # e.g. smollm2-135m; unset: the fake
MODEL = REAL or "agent"
CLI_TIMEOUT = 900 if REAL else 120


@pytest.fixture(scope="module")
def agents(tmp_path_factory):
    """The server, and per CLI a working folder the fake's tool writes into."""
    d = tmp_path_factory.mktemp("agents")
    cwd = {k: d / f"{k}-work" for k in ("claude", "codex")}
    for p in cwd.values():
        p.mkdir()
    if REAL:
        args = ["--proxies", "1", "--spares", "0", "--ctx-size", "32768"]
    else:
        write_fake(d / "fakes", "agent", tokens=4, tool=["Write", "exec_command"],
                   tool_arguments={
                       "Write": {"file_path": str(cwd["claude"] / "hello.txt"), "content": "hi"},
                       "exec_command": {"cmd": "printf hi > hello.txt"}})
        args = ["--fake-models-dir", str(d / "fakes"), "--no-hf-cache", "--proxies", "1"]
    s = Server(args, free_port(), d / "server.log")
    s.dir, s.cwd = d, cwd
    try:
        s.wait_ready(120 if REAL else 30)
        yield s
    finally:
        s.stop()


def weather(city: str) -> str:
    """The weather in a city."""
    return f"{city}: sunny"


# ---- SDKs ------------------------------------------------------------------------------
def test_openai_agents_sdk_runs_an_agent_whose_tool_is_called(agents):
    sdk = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    sdk.set_tracing_disabled(True)
    called = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        called.append(city)
        return f"{city}: sunny"

    client = AsyncOpenAI(base_url=agents.base + "/v1", api_key="unused", max_retries=0)
    agent = sdk.Agent(name="forecaster", instructions="Answer with the weather tool.",
                      tools=[get_weather],
                      model=sdk.OpenAIChatCompletionsModel(model=MODEL, openai_client=client))
    result = asyncio.run(sdk.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert called, "the agent's tool was never called"
    assert isinstance(result.final_output, str) and result.final_output
    if not REAL:
        assert called == ["city"] and result.final_output.startswith("[agent:")


def test_langchain_chat_openai_bind_tools_gets_tool_calls(agents):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=MODEL, base_url=agents.base + "/v1", api_key="unused",
                        max_retries=0)
    msg = llm.bind_tools([weather], tool_choice="weather").invoke("Weather in Oslo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    chunks = list(llm.bind_tools([weather], tool_choice="weather").stream("Weather in Oslo?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "weather"


def test_langchain_chat_ollama_bind_tools_gets_tool_calls(agents):
    lc = pytest.importorskip("langchain_ollama")
    llm = lc.ChatOllama(model=MODEL, base_url=agents.base)
    msg = llm.bind_tools([weather]).invoke("Weather in Oslo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "weather"
    assert isinstance(msg.tool_calls[0]["args"], dict)


# ---- CLIs ------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, check=False, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT)


def _all_answered(log: AccessLog, out: subprocess.CompletedProcess, agents) -> None:
    assert log.entries, "the CLI sent no request"
    bad = [e for e in log.entries if e[2] != 200]
    assert not bad, (f"requests not answered 200: {bad}\nstdout: {out.stdout[-2000:]}\n"
                     f"stderr: {out.stderr[-2000:]}\nggmux: {agents.logs()[-3000:]}")


def test_claude_code_runs_a_task_and_every_request_is_answered_200(agents):
    claude = shutil.which("claude")
    if claude is None:
        pytest.skip("Claude Code is not installed (npm install -g @anthropic-ai/claude-code)")
    home = agents.dir / "claude-home"
    home.mkdir(exist_ok=True)
    log = AccessLog(agents.port)
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": log.base,
           "ANTHROPIC_AUTH_TOKEN": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           # its background model (titles, summaries) is the same local one
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_SMALL_FAST_MODEL": MODEL,
           "DISABLE_AUTOUPDATER": "1"}
    try:
        out = _run([claude, "-p", "Create a file named hello.txt containing hi", "--model",
                    MODEL, "--permission-mode", "acceptEdits"], agents.cwd["claude"], env)
    finally:
        log.close()
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    _all_answered(log, out, agents)
    messages = [e for e in log.entries if e[1].split("?")[0] == "/v1/messages"]
    assert len(messages) >= 2  # the tool call, then the turn after its result
    if not REAL:
        assert (agents.cwd["claude"] / "hello.txt").read_text() == "hi"


def test_codex_exec_runs_a_task_and_every_request_is_answered_200(agents):
    codex = shutil.which("codex")
    if codex is None:
        pytest.skip("Codex is not installed (npm install -g @openai/codex)")
    home = agents.dir / "codex-home"
    home.mkdir(exist_ok=True)
    log = AccessLog(agents.port)
    (home / "config.toml").write_text(
        f'model = "{MODEL}"\nmodel_provider = "ggmux"\nweb_search = "disabled"\n\n'
        '[model_providers.ggmux]\nname = "ggmux"\n'
        f'base_url = "{log.base}/v1"\nwire_api = "responses"\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    try:
        out = _run([codex, "exec", "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox",
                    "Create a file named hello.txt containing hi"], agents.cwd["codex"], env)
    finally:
        log.close()
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    _all_answered(log, out, agents)
    assert [e for e in log.entries if e[1] == "/v1/responses"]
    if not REAL:
        assert (agents.cwd["codex"] / "hello.txt").read_text() == "hi"
        assert json.dumps(log.entries)  # every entry is plain data
