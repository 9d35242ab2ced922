"""The ``ggmux`` command line (issue 15): the client commands against a real
server on fake models, ``--version``, ``python -m ggmux``, the message when
no server answers, ``GGMUX_<OPTION>`` for every serve option, and ``--help``
that never shows a key and says each default once."""

from __future__ import annotations

import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
from typing import ClassVar

import pytest
from conftest import chat_body, free_port, served_by, wait_for
from ggmux import __version__
from ggmux.client.ps import ps_table
from ggmux.shm import layout as L
from ggmux.supervisor.cli import build_parser, main


def ggmux(*args: str, url: str | None = None, stdin: str | None = None, env=None,
          timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``python -m ggmux ARGS`` with ``$GGMUX_URL`` set to ``url``."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
    if url:
        e["GGMUX_URL"] = url
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "ggmux", *args], check=False, input=stdin,
                          capture_output=True, text=True, timeout=timeout, env=e,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def test_version_and_python_m_ggmux_help():
    r = ggmux("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"ggmux {__version__}"
    r = ggmux("--help")
    assert r.returncode == 0
    for cmd in ("serve", "ps", "load", "unload", "logs", "run"):
        assert cmd in r.stdout


@pytest.mark.slow
def test_client_commands_say_clearly_when_no_server_answers():
    url = f"http://127.0.0.1:{free_port()}"
    for args in (("ps",), ("load", "a"), ("unload", "--all"), ("logs",), ("run", "a", "hi")):
        r = ggmux(*args, url=url)
        assert r.returncode == 3, (args, r)
        assert f"no server answers at {url}" in r.stderr and "ggmux serve" in r.stderr
        assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_ps_load_unload_and_run_against_a_server(serve, fakes):
    fakes.add("alpha", tokens=4)
    fakes.add("beta", tokens=4)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    r = ggmux("ps", url=s.base)  # like ollama ps: what runs; nothing does, and it says so
    assert r.returncode == 0
    assert r.stdout == "no model is running (2 known; ggmux ps --all lists every model)\n"
    assert "alpha" in ggmux("ps", "--all", url=s.base).stdout

    r = ggmux("load", "alpha", url=s.base)
    assert r.returncode == 0 and r.stdout.startswith("loaded alpha in "), r
    assert s.models()["alpha"]["status"]["value"] == "loaded"  # it waited for the load
    r = ggmux("ps", url=s.base)
    assert r.stdout.split()[:9] == [
        "NAME", "STATE", "REPLICAS", "MEMORY", "CACHE", "IN", "FLIGHT", "WAITING", "IDLE"]
    line = next(x for x in r.stdout.splitlines() if x.startswith("alpha"))
    assert line.split()[1:3] == ["loaded", "1/1"]
    assert "beta" not in r.stdout

    r = ggmux("run", "alpha", "say", "hi", url=s.base)
    assert r.returncode == 0 and served_by(r.stdout.encode())[0] == "alpha"
    assert r.stdout.count("\n") == 1  # one answer, streamed, one final newline

    # a piped conversation: one turn per line, the conversation kept
    r = ggmux("run", "alpha", url=s.base, stdin="first question\nsecond question\n")
    assert r.returncode == 0
    answers = [x for x in r.stdout.splitlines() if x]
    assert len(answers) == 2 and all(served_by(a.encode())[0] == "alpha" for a in answers)

    r = ggmux("unload", "alpha", url=s.base)
    assert r.returncode == 0 and r.stdout.strip() == "unloaded alpha"
    assert s.models()["alpha"]["status"]["value"] == "unloaded"

    for name in ("alpha", "beta"):
        assert s.request("POST", "/models/load", {"model": name})[0] == 200
    wait_for(lambda: all(m["status"]["value"] == "loaded" for m in s.models().values()),
             10, what="both loaded")
    r = ggmux("unload", "--all", url=s.base)
    assert r.returncode == 0, r
    wait_for(lambda: all(m["status"]["value"] == "unloaded" for m in s.models().values()),
             10, what="every idle model unloaded")

    r = ggmux("load", "nope", url=s.base)
    assert r.returncode == 1 and "model 'nope' not found" in r.stderr
    assert ggmux("unload", url=s.base).returncode == 2  # neither NAME nor --all


class _Recorder(http.server.BaseHTTPRequestHandler):
    """An OpenAI-style server that streams ``answer N`` and records each body."""

    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.end_headers()
        n = len(type(self).bodies)
        for piece in ("answer", f" {n}"):
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            self.wfile.flush()
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


def test_run_keeps_the_conversation_between_piped_turns():
    _Recorder.bodies = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        r = ggmux("run", "m", "--system", "be brief", url=f"http://127.0.0.1:{srv.server_port}",
                  stdin="one\n\ntwo\n")
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 0 and r.stdout == "answer 1\nanswer 2\n"
    first, second = _Recorder.bodies
    assert first["stream"] is True and first["model"] == "m"
    assert second["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "one"},
        {"role": "assistant", "content": "answer 1"}, {"role": "user", "content": "two"}]


def test_run_takes_the_prompt_after_its_options_and_bounds_a_completion():
    _Recorder.bodies = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}"
    try:
        # README's form: the options between the model and the prompt
        r = ggmux("run", "m", "--completion", "The capital", "of France is", url=url)
        assert r.returncode == 0, r.stderr
        r2 = ggmux("run", "m", "hi", "--bogus", url=url)
    finally:
        srv.shutdown()
        srv.server_close()
    (body,) = _Recorder.bodies
    assert body["prompt"] == "The capital of France is"
    assert body["max_tokens"] == 128  # a base model may never stop by itself
    assert r2.returncode == 2 and "--bogus" in r2.stderr


@pytest.mark.slow
def test_the_client_sends_the_key_from_the_environment(serve, fakes):
    fakes.add("alpha", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--api-key", "k-api", "--admin-key", "k-admin")
    r = ggmux("ps", url=s.base)
    assert r.returncode == 1 and "invalid or missing API key" in r.stderr
    assert "GGMUX_API_KEY" in r.stderr
    assert ggmux("ps", url=s.base, env={"GGMUX_API_KEY": "k-api"}).returncode == 0
    r = ggmux("load", "alpha", url=s.base, env={"GGMUX_API_KEY": "k-api"})
    assert r.returncode == 1 and "needs the admin key" in r.stderr  # an admin route
    r = ggmux("load", "alpha", url=s.base, env={"GGMUX_API_KEY": "k-api",
                                                "GGMUX_ADMIN_KEY": "k-admin"})
    assert r.returncode == 0, r
    r = ggmux("run", "alpha", "hi", url=s.base, env={"GGMUX_API_KEY": "k-api"})
    assert r.returncode == 0 and served_by(r.stdout.encode())[0] == "alpha"


# ---- GGMUX_<OPTION> ------------------------------------------------------------------
def test_every_serve_option_reads_its_environment_variable_and_the_command_line_wins():
    env = {"GGMUX_MODELS_MAX": "1", "GGMUX_PORT": "9123", "GGMUX_HF_CACHE": "0",
           "GGMUX_MODELS_DIR": os.pathsep.join(["/a", "/b"]), "GGMUX_LOAD_WAIT": "7.5",
           "GGMUX_MAX_CONNECTIONS": "99", "GGMUX_API_KEY": "secret"}
    args = build_parser(env).parse_args(["serve"])
    assert (args.models_max, args.port, args.hf_cache, args.models_dir, args.load_wait,
            args.max_connections, args.api_key) == (1, 9123, False, ["/a", "/b"], 7.5, 99,
                                                    "secret")
    args = build_parser(env).parse_args(["serve", "--models-max", "3", "--hf-cache"])
    assert args.models_max == 3 and args.hf_cache is True
    serve_parser = build_parser({})._subparsers._group_actions[0].choices["serve"]
    for action in serve_parser._actions:  # every option: its variable is read
        if action.option_strings and action.dest != "help":
            value = str(next(iter(action.choices))) if action.choices else "1"
            probe = {"GGMUX_" + action.dest.upper(): value}
            got = getattr(build_parser(probe).parse_args(["serve"]), action.dest)
            assert got not in (None, []) and got == getattr(
                build_parser({}).parse_args(["serve", action.option_strings[0], value]
                                            if action.nargs != 0 else
                                            ["serve", action.option_strings[0]]),
                action.dest), action.dest


def test_a_bad_environment_value_is_a_usage_error_naming_the_variable():
    r = ggmux("serve", "--help", env={"GGMUX_MODELS_MAX": "many"})
    assert r.returncode == 2 and "$GGMUX_MODELS_MAX='many' for --models-max" in r.stderr
    r = ggmux("serve", "--help", env={"GGMUX_HF_CACHE": "perhaps"})
    assert r.returncode == 2 and "$GGMUX_HF_CACHE" in r.stderr


@pytest.mark.parametrize("flag", ["--ctx-checkpoints", "--checkpoint-min-step",
                                  "--cache-checkpoints", "--cache-checkpoint-max"])
def test_a_negative_checkpoint_option_is_a_usage_error(flag, tmp_path):
    """-1 was taken silently and turned checkpoints off (llama.cpp's own
    parser takes it too): now the flag is named and nothing starts."""
    r = ggmux("serve", "--port", "1", "--models-dir", str(tmp_path), "--no-hf-cache", flag, "-1")
    assert r.returncode == 2 and f"{flag} must be 0 or more, not -1" in r.stderr, r.stderr


def test_ggmux_models_max_in_the_environment_behaves_like_the_option(serve, fakes, monkeypatch):
    fakes.add("a")
    fakes.add("b")
    monkeypatch.setenv("GGMUX_MODELS_MAX", "1")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert int(s.seg.header[L.H_MODELS_MAX]) == 1
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("a"))
    assert st == 200 and served_by(body)[0] == "a"
    st, _, body = s.request("POST", "/v1/chat/completions", chat_body("b"))
    assert st == 200 and served_by(body)[0] == "b"
    wait_for(lambda: s.models()["a"]["status"]["value"] == "unloaded", 5, what="a evicted")


# ---- --help -----------------------------------------------------------------------
def _option_helps(text: str) -> dict[str, str]:
    """``--option`` -> its help text, from argparse's help output."""
    out: dict[str, str] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"^  (-\S+)", line)
        if m:
            cur = re.findall(r"--[\w-]+", line)[0] if "--" in line else m.group(1)
            out[cur] = line
        elif cur and line.startswith("     "):
            out[cur] += " " + line.strip()
        else:
            cur = None
    return out


def test_serve_help_names_the_key_variables_and_never_shows_a_key():
    r = ggmux("serve", "--help", env={"GGMUX_API_KEY": "sk-very-secret",
                                      "GGMUX_ADMIN_KEY": "sk-admin-secret"})
    assert r.returncode == 0
    assert "sk-very-secret" not in r.stdout and "sk-admin-secret" not in r.stdout
    helps = _option_helps(r.stdout)
    assert "$GGMUX_API_KEY" in helps["--api-key"]
    assert "$GGMUX_ADMIN_KEY" in helps["--admin-key"]


def test_serve_help_says_each_default_once():
    helps = _option_helps(ggmux("serve", "--help").stdout)
    assert len(helps) > 30
    for opt, text in helps.items():
        assert text.count("default") <= 1, (opt, text)
        assert "(default: None)" not in text and "(default: [])" not in text, (opt, text)
    assert "(default: 4)" in helps["--models-max"]


def test_client_options_go_before_or_after_the_command(serve, fakes, capsys, monkeypatch):
    """``--url``, ``--timeout`` and ``--max-answer-bytes`` are options of
    ``ggmux`` and of each client command alike; after the command wins."""
    fakes.add("alpha", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    nowhere = f"http://127.0.0.1:{free_port()}"
    r = ggmux("--url", s.base, "ps", "--all", url=nowhere)
    assert r.returncode == 0 and "alpha" in r.stdout, r
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))
    for args, rc, out in (
            (("ps", "--all", "--url", s.base), 0, "alpha"),
            (("--url", nowhere, "--timeout", "5", "ps", "--url", s.base, "--all"), 0, "alpha"),
            (("--timeout=5", "--max-answer-bytes", "100000", "run", "alpha", "hi", "--url",
              s.base), 0, "[alpha:"),
            (("--url", s.base, "--max-answer-bytes", "10", "ps"), 3,
             "over the 10 bytes cap (--max-answer-bytes)"),
            (("--timeout", "0", "ps", "--url", s.base), 2, "must be above 0")):
        capsys.readouterr()
        assert main(list(args)) == rc, args
        assert out in "".join(capsys.readouterr()), args
    with pytest.raises(SystemExit) as e:
        main(["--url", s.base, "serve"])
    assert e.value.code == 2 and "--url is an option of the client commands" in \
        capsys.readouterr().err


def test_ps_table_says_when_nothing_runs_and_shows_odd_fields_as_dashes():
    assert ps_table({"models": []}, every=True) == "the server has no models\n"
    assert "ggmux ps --all" in ps_table({"models": [{"id": "a", "state": "unloaded"}]})
    doc = {"models": [{"id": "a", "state": "loading", "progress": "half", "replicas": "two",
                       "memory": [], "cache": 3, "idle_s": "long", "unload_in_s": {}}]}
    assert ps_table(doc).splitlines()[1].split() == ["a", "loading", "-", "-", "-", "0", "0",
                                                     "-", "-"]


def test_ps_table_shows_idle_time_and_time_until_unload():
    doc = {"models": [
        {"id": "a", "state": "loaded", "replicas": [{"state": "ready"}], "in_flight": 0,
         "waiting": 0, "memory": {"effective": 300 << 20}, "idle_s": 75.0, "unload_in_s": 225.0},
        {"id": "b", "state": "loading", "progress": 0.5, "replicas": [{"state": "loading"}],
         "memory": {}, "idle_s": None, "unload_in_s": None},
        {"id": "c", "state": "unloaded", "replicas": [], "memory": {}},
    ]}
    lines = ps_table(doc).splitlines()
    assert lines[1].split() == ["a", "loaded", "1/1", "300.0", "MiB", "-", "0", "0", "1",
                                "min", "15", "s", "3", "min", "45", "s"]
    assert lines[2].split()[:4] == ["b", "loading", "50%", "0/1"]
    assert len(lines) == 3  # c is not running
    assert len(ps_table(doc, every=True).splitlines()) == 4


@pytest.mark.parametrize("args", [("logs", "--help"), ("run", "--help"), ("ps", "--help")])
def test_client_command_help_mentions_the_url_variable(args):
    r = ggmux(*args)
    assert r.returncode == 0 and "$GGMUX_URL" in r.stdout


BAD_URLS = ["not a url", "http://", "ftp://host", "http://h:99999", "http://h:abc", "http://h:0",
            "http://[::1", "http://a b", "http://h/ x", "http://h\n", "http://h\x1b[2J",
            "http://a..b", "http://h?x=1", "http://127.0.0.1:1/é"]
CLIENT_COMMANDS = [["ps"], ["ps", "--all"], ["load", "m"], ["unload", "m"], ["unload", "--all"],
                   ["logs"], ["logs", "-f"], ["logs", "--requests"], ["run", "m", "hi"],
                   ["run", "m", "--completion", "hi"]]


@pytest.mark.parametrize("cmd", CLIENT_COMMANDS, ids=" ".join)
def test_a_bad_url_is_one_line_and_exit_2_for_every_client_command(cmd, capsys, monkeypatch):
    # issue 31, item 9: `ggmux --url 'not a url' ps` ended in a traceback
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))  # `run`'s piped input: none
    for url in BAD_URLS:
        for argv, env in (([*cmd, "--url", url], None), (["--url", url, *cmd], None),
                          (cmd, url)):
            if env is None:
                monkeypatch.delenv("GGMUX_URL", raising=False)
            else:
                monkeypatch.setenv("GGMUX_URL", env)
            rc = main(list(argv))
            out, err = capsys.readouterr()
            assert rc == 2, (argv, url, err)
            assert out == "" and err.count("\n") == 1, (argv, url, err)
            assert err.startswith("ggmux: not an http:// URL: ") and repr(url) in err
            assert "\x1b" not in err and "Traceback" not in err


def test_ps_shows_no_memory_for_a_model_that_holds_none():
    # issue 31, item 14: an unloaded model showed its measured minimum
    doc = {"models": [
        {"id": "a", "state": "unloaded", "replicas": [],
         "memory": {"min": 200 << 20, "max": 300 << 20, "effective": 0}},
        {"id": "b", "state": "loading", "progress": 0.5, "replicas": [{"state": "loading"}],
         "memory": {"min": 200 << 20, "max": 300 << 20, "effective": 0}},
        {"id": "c", "state": "loaded", "replicas": [{"state": "ready"}],
         "memory": {"min": 200 << 20, "max": 300 << 20, "effective": 250 << 20}},
    ]}
    rows = {line.split()[0]: line.split() for line in ps_table(doc, every=True).splitlines()[1:]}
    assert rows["a"][:4] == ["a", "unloaded", "-", "-"] and "MiB" not in rows["a"]
    assert rows["b"][4:7] == ["200.0", "MiB", "min"]  # set aside for the load, said so
    assert rows["c"][3:5] == ["250.0", "MiB"]
