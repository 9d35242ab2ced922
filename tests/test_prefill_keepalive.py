"""A long prefill never looks dead to an agent (issue 31 item 12): while the
replica has sent no content, a streamed answer in an API that has keep-alive
events gets its opening events and then the API's own keep-alive event every
``--stream-keepalive`` seconds (Anthropic ``message_start`` then ``ping``;
Responses ``response.created`` / ``response.in_progress`` then
``response.in_progress`` again); Ollama's NDJSON has no such event and gets
nothing early. Codex counts its stream idle timeout in events, not SSE
comments: the real Codex CLI, given an idle timeout shorter than the fake
instance's first-token delay, finishes its task only because of them.

The fake instance's ``ttft_s`` is the long prefill. The counts asserted are
loose (a delay of several intervals must hold at least two keep-alives), and
nothing asserts a time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
from conftest import Server, free_port, write_fake

TTFT_S = 2.5  # the fake's delay before its first token: the long prefill
INTERVAL_S = 0.25  # --stream-keepalive


@pytest.fixture(scope="module")
def slow_first_token(tmp_path_factory):
    d = tmp_path_factory.mktemp("prefill")
    cwd = d / "codex-work"
    cwd.mkdir()
    write_fake(d / "fakes", "slow", ttft_s=TTFT_S, tokens=3, tool=["exec_command"],
               tool_arguments={"exec_command": {"cmd": "printf hi > hello.txt"}})
    s = Server(["--fake-models-dir", str(d / "fakes"), "--no-hf-cache", "--proxies", "1",
                "--stream-keepalive", str(INTERVAL_S)], free_port(), d / "server.log")
    s.dir, s.cwd = d, cwd
    try:
        s.wait_ready()
        # loaded first: a stream waiting for the load gets its SSE comments too
        st, _, body = s.request("POST", "/v1/chat/completions", {
            "model": "slow", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]})
        assert st == 200, body
        yield s
    finally:
        s.stop()


def sse_names(data: bytes) -> list[str]:
    """The ``event:`` names of an SSE body, ``:comment`` for a comment."""
    out = []
    for block in data.split(b"\n\n"):
        if block.startswith(b":"):
            out.append(":comment")
        for line in block.split(b"\n"):
            if line.startswith(b"event: "):
                out.append(line[7:].decode())
    return out


def test_anthropic_stream_opens_and_pings_while_the_first_token_is_slow(slow_first_token):
    st, headers, data = slow_first_token.request("POST", "/v1/messages", {
        "model": "slow", "max_tokens": 3, "stream": True,
        "messages": [{"role": "user", "content": "hi"}]})
    assert st == 200 and headers["content-type"].startswith("text/event-stream")
    names = sse_names(data)
    first_block = names.index("content_block_start")
    assert names[0] == "message_start"
    assert names[1:first_block].count("ping") >= 2, names  # the prefill's keep-alives
    assert set(names[1:first_block]) == {"ping"}, names
    assert names[-1] == "message_stop"
    start = json.loads(data.split(b"data: ", 1)[1].split(b"\n", 1)[0])
    assert start["message"]["role"] == "assistant"


def test_responses_stream_opens_and_says_in_progress_while_the_first_token_is_slow(
        slow_first_token):
    st, _, data = slow_first_token.request("POST", "/v1/responses", {
        "model": "slow", "input": "hi", "stream": True})
    assert st == 200
    names = sse_names(data)
    first_item = names.index("response.output_item.added")
    assert names[:2] == ["response.created", "response.in_progress"], names
    assert names[2:first_item].count("response.in_progress") >= 2, names
    assert set(names[2:first_item]) == {"response.in_progress"}, names
    assert names[-1] == "response.completed"
    seqs = [json.loads(b.split(b"data: ", 1)[1])["sequence_number"]
            for b in data.split(b"\n\n") if b"data: " in b]
    assert seqs == list(range(len(seqs)))  # the keep-alives keep the numbering


def test_ollama_ndjson_has_no_keepalive_event_and_gets_nothing_early(slow_first_token):
    st, headers, data = slow_first_token.request("POST", "/api/chat", {
        "model": "slow", "messages": [{"role": "user", "content": "hi"}],
        "options": {"num_predict": 3}})
    assert st == 200 and headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(x) for x in data.splitlines()]
    assert lines[0]["message"]["content"] and not lines[0]["done"]  # content first
    assert lines[-1]["done"] is True


def test_real_codex_with_an_idle_timeout_shorter_than_the_prefill_finishes(slow_first_token):
    # Codex's stream_idle_timeout_ms (300000 by default) counts SSE events: with
    # 1200 ms against a 2.5 s first token it gives up unless keep-alive events come
    codex = shutil.which("codex")
    if codex is None:
        pytest.skip("Codex is not installed (npm install -g @openai/codex)")
    s = slow_first_token
    home = s.dir / "codex-home"
    home.mkdir(exist_ok=True)
    (home / "config.toml").write_text(
        'model = "slow"\nmodel_provider = "ggmux"\n\n[model_providers.ggmux]\n'
        f'name = "ggmux"\nbase_url = "{s.base}/v1"\nwire_api = "responses"\n'
        "stream_idle_timeout_ms = 1200\nstream_max_retries = 0\nrequest_max_retries = 0\n")
    env = {"PATH": os.environ["PATH"], "HOME": str(home), "CODEX_HOME": str(home)}
    out = subprocess.run(
        [codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
         "Create a file named hello.txt containing hi"],
        cwd=s.cwd, env=env, capture_output=True, text=True, timeout=300, check=False,
        stdin=subprocess.DEVNULL)
    assert out.returncode == 0, f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}"
    assert (s.cwd / "hello.txt").read_text() == "hi"
