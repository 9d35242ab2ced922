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

Each test runs twice. First on the fake instance: fast, and it checks
that the tool really ran (the file is written). Then on the real demo model
smollm2-135m (the generic tool format), marked ``slow`` and opt-in
(``pytest tests/test_agents.py -m slow``, or ``GGMUX_SLOW=1``): the same
clients against the built-in instance with ``ctx-size`` 32768 and one slot,
answers capped at ``n-predict`` 512 tokens (the preset; each client but
Codex asks for 96 or 128), as few turns as each client allows: the Agents
SDK forced to its tool and stopped on it
(one request), LangChain's calls named or prompted. Only the protocol is
asserted for the CLIs: a 135M model rarely does the task.

The CLIs' prompts are long. Claude Code 2.1's request is 22158 tokens
(its 24 built-in tools are 19k of them), so its real run offers only
``--tools Write`` (3317 tokens; every tool's schema is compiled and run
through llama.cpp's grammar engine on bytes in tests/test_agent_schemas.py,
and the fake run sends them all through ggmux); ``GGMUX_AGENT_FULL=1``
runs it with all of them. Codex runs unchanged (about 10k tokens). On this
project's shared 2-core machine (load average 20 to 30, December 2026)
smollm2 read prompts at 8 to 10 tokens/s and wrote 2 tokens/s: the Agents
SDK's one request took about 140 s, ChatOllama's 23 s, Claude Code's run
(one 1819-token turn, cut at 128 tokens) 297 s; README's "Tools and
agents" has the table. A quiet machine is tens of times faster.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from access_log import AccessLog
from conftest import Server, free_port, write_fake

pytestmark = pytest.mark.slow  # Claude Code, Codex and agent SDKs end to end

SMOL = "smollm2-135m"
# the real model's preset: Claude Code's whole prompt fits (smollm2 is trained
# for 8k, which llama.cpp stretches); one slot (the CLIs send one request at a
# time); answers stop at 512 tokens unless the client asks for fewer (each
# but Codex does): a tool call is 40 to 300 (Codex's exec_command), and a 135M
# model left to write its own ``response`` would go on to the context's end; one
# thread: on a loaded machine llama.cpp's two spinning threads wait on each
# other at every barrier (measured on the shared 2-core machine, load 30:
# 40 tokens in 10 to 22 s with one thread, 30 to 160 s with two)
# DRY (llama.cpp's repetition sampler) with no sequence breaker inside the
# JSON: greedy smollm2 otherwise repeats one phrase inside a call's string
# until n-predict, or appends the same call to a parallel call list forever
# (Codex's first turn: both seen; with these two lines it made two whole
# calls in 110 tokens)
SMOL_PRESET = f"""[{SMOL}]
model = ${{env.GGMUX_DEMO_SMOLLM2}}
ctx-size = 32768
parallel = 1
n-predict = 512
temp = 0
threads = 1
dry-multiplier = 0.8
dry-sequence-breaker = <|im_end|>
"""
FULL = os.environ.get("GGMUX_AGENT_FULL") == "1"


def slow_asked(config) -> bool:
    """Whether this run asked for the slow real-model runs."""
    expr = config.getoption("markexpr") or ""
    return os.environ.get("GGMUX_SLOW") == "1" or ("slow" in expr and "not slow" not in expr)


@pytest.fixture(scope="module", params=["fake", pytest.param("real", marks=pytest.mark.slow)])
def agents(request, tmp_path_factory):
    """The server (``real``: smollm2-135m, else the fake ``agent``), its
    ``model`` name, and per CLI a working folder its tool writes into."""
    real = request.param == "real"
    if real and not slow_asked(request.config):
        pytest.skip("the real-model agent runs are opt-in: -m slow or GGMUX_SLOW=1")
    d = tmp_path_factory.mktemp(f"agents-{request.param}")
    cwd = {k: d / f"{k}-work" for k in ("claude", "codex")}
    for p in cwd.values():
        p.mkdir()
    if real:
        (d / "presets.ini").write_text(SMOL_PRESET)
        args = ["--models-preset", str(d / "presets.ini"), "--no-hf-cache", "--proxies", "1",
                "--spares", "0", "--first-byte-timeout", "3000"]
    else:
        write_fake(d / "fakes", "agent", tokens=4, tool=["Write", "exec_command"],
                   tool_arguments={
                       "Write": {"file_path": str(cwd["claude"] / "hello.txt"), "content": "hi"},
                       "exec_command": {"cmd": "printf hi > hello.txt"}})
        args = ["--fake-models-dir", str(d / "fakes"), "--no-hf-cache", "--proxies", "1"]
    s = Server(args, free_port(), d / "server.log")
    s.dir, s.cwd, s.real = d, cwd, real
    s.model = SMOL if real else "agent"
    # a real turn is a long prefill on a shared 2-core machine (module docstring)
    s.timeout = 3000 if real else 120
    try:
        s.wait_ready(120 if real else 30)
        yield s
    finally:
        s.stop()


def weather(city: str) -> str:
    """The weather in a city."""
    return f"{city}: sunny"


# ---- SDKs ------------------------------------------------------------------------------
@pytest.mark.timeout(3600)
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

    client = AsyncOpenAI(base_url=agents.base + "/v1", api_key="unused", max_retries=0,
                         timeout=agents.timeout)
    model = sdk.OpenAIChatCompletionsModel(model=agents.model, openai_client=client)
    if agents.real:  # one request: the tool forced, its output the final one
        agent = sdk.Agent(name="forecaster", instructions="Answer with the weather tool.",
                          tools=[get_weather], model=model, tool_use_behavior="stop_on_first_tool",
                          model_settings=sdk.ModelSettings(tool_choice="required", max_tokens=96))
    else:  # the round trip: the call, then the answer after its result
        agent = sdk.Agent(name="forecaster", instructions="Answer with the weather tool.",
                          tools=[get_weather], model=model)
    result = asyncio.run(sdk.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    assert called, "the agent's tool was never called"
    assert all(isinstance(c, str) for c in called)
    if agents.real:
        assert result.final_output == f"{called[0]}: sunny"
    else:
        assert called == ["city"] and result.final_output.startswith("[agent:")


@pytest.mark.timeout(3600)
def test_langchain_chat_openai_bind_tools_gets_tool_calls(agents):
    lc = pytest.importorskip("langchain_openai")
    llm = lc.ChatOpenAI(model=agents.model, base_url=agents.base + "/v1", api_key="unused",
                        max_retries=0, max_tokens=96, timeout=agents.timeout)
    msg = llm.bind_tools([weather], tool_choice="weather").invoke("Weather in Oslo?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "weather", msg
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    chunks = list(llm.bind_tools([weather], tool_choice="weather").stream("Weather in Oslo?"))
    whole = chunks[0]
    for c in chunks[1:]:
        whole += c
    assert whole.tool_calls and whole.tool_calls[0]["name"] == "weather", whole
    assert not whole.invalid_tool_calls


@pytest.mark.timeout(3600)
def test_langchain_chat_ollama_bind_tools_gets_tool_calls(agents):
    lc = pytest.importorskip("langchain_ollama")
    # Ollama's API has no tool_choice: the model chooses, so the real one is asked to
    llm = lc.ChatOllama(model=agents.model, base_url=agents.base, num_predict=96,
                        temperature=0, client_kwargs={"timeout": agents.timeout})
    msg = llm.bind_tools([weather]).invoke([("system", "Answer with the weather tool."),
                                           ("human", "Weather in Oslo?")])
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "weather", msg
    assert isinstance(msg.tool_calls[0]["args"], dict)


# ---- CLIs ------------------------------------------------------------------------------
def _run(cmd: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, check=False, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout)


def _all_answered(log: AccessLog, out: subprocess.CompletedProcess, agents) -> None:
    assert log.entries, "the CLI sent no request"
    bad = [e for e in log.entries if e[2] != 200]
    assert not bad, (f"requests not answered 200: {bad}\nstdout: {out.stdout[-2000:]}\n"
                     f"stderr: {out.stderr[-2000:]}\nggmux: {agents.logs()[-3000:]}")


@pytest.mark.timeout(3600)
def test_claude_code_runs_a_task_and_every_request_is_answered_200(agents):
    claude = shutil.which("claude")
    if claude is None:
        pytest.skip("Claude Code is not installed (npm install -g @anthropic-ai/claude-code)")
    home = agents.dir / "claude-home"
    home.mkdir(exist_ok=True)
    log = AccessLog(agents.port, agents.timeout)
    model = agents.model
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "ANTHROPIC_BASE_URL": log.base,
           "ANTHROPIC_AUTH_TOKEN": "unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           # its background model (titles, summaries) is the same local one
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "DISABLE_AUTOUPDATER": "1"}
    cmd = [claude, "-p", "Create a file named hello.txt containing hi", "--model", model,
           "--permission-mode", "acceptEdits"]
    if agents.real:
        env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] = "128"  # its max_tokens (32000 otherwise)
        if not FULL:
            cmd += ["--tools", "Write"]  # 3k of its 22k-token prompt (module docstring)
    t0 = time.monotonic()
    try:
        out = _run(cmd, agents.cwd["claude"], env, agents.timeout)
    finally:
        log.close()
    took(agents, "claude", t0, log)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    _all_answered(log, out, agents)
    messages = [e for e in log.entries if e[1].split("?")[0] == "/v1/messages"]
    if agents.real:
        assert messages
    else:  # the tool call, then the turn after its result
        assert len(messages) >= 2
        assert (agents.cwd["claude"] / "hello.txt").read_text() == "hi"


@pytest.mark.timeout(3600)
def test_codex_exec_runs_a_task_and_every_request_is_answered_200(agents):
    codex = shutil.which("codex")
    if codex is None:
        pytest.skip("Codex is not installed (npm install -g @openai/codex)")
    home = agents.dir / "codex-home"
    home.mkdir(exist_ok=True)
    log = AccessLog(agents.port, agents.timeout)
    (home / "config.toml").write_text(
        f'model = "{agents.model}"\nmodel_provider = "ggmux"\n\n'
        '[model_providers.ggmux]\nname = "ggmux"\n'
        f'base_url = "{log.base}/v1"\nwire_api = "responses"\n')
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    t0 = time.monotonic()
    try:
        out = _run([codex, "exec", "--skip-git-repo-check",
                    "--dangerously-bypass-approvals-and-sandbox",
                    "Create a file named hello.txt containing hi"], agents.cwd["codex"], env,
                   agents.timeout)
    finally:
        log.close()
    took(agents, "codex", t0, log)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    _all_answered(log, out, agents)
    assert [e for e in log.entries if e[1] == "/v1/responses"]
    if not agents.real:
        assert (agents.cwd["codex"] / "hello.txt").read_text() == "hi"
        assert json.dumps(log.entries)  # every entry is plain data


def took(agents, cli: str, t0: float, log: AccessLog) -> None:
    """Log how long a CLI ran and what it sent (a measurement, not an assert)."""
    logging.getLogger(__name__).warning("%s on %s: %.0f s, requests %s", cli, agents.model,
                                        time.monotonic() - t0, log.entries)
