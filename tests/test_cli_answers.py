"""The CLI never shows a traceback (issue 18, finding 9): against a server
whose answer is unusable (the wrong shape, not JSON, silent, endless, too
big) every client command says so in one line and exits with 3; each has
a deadline (``--timeout``) and a size cap (``--max-answer-bytes``), and a
stream that began may pause longer than the deadline. Each bad server is a
thread of the test; the CLI runs in the test's process (``main()``, what
``python -m ggmux`` runs), and once as its own process."""

from __future__ import annotations

import io
import json
import socket
import socketserver
import sys
import threading
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from ggmux.client.commands import client_from_args
from ggmux.supervisor.cli import build_parser, main
from test_cli import ggmux

Answer = Callable[[socket.socket, threading.Event], None]


class BadServer:
    """A TCP server in a thread that reads each request's head and hands
    the socket to ``answer(sock, stop)``; ``stop`` is set when the test
    ends, so an answer that waits forever (``stop.wait()``) ends too."""

    def __init__(self, answer: Answer) -> None:
        self.stop = threading.Event()
        outer = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock = self.request
                head = b""
                while b"\r\n\r\n" not in head:
                    b = sock.recv(65536)
                    if not b:
                        return
                    head += b
                try:
                    answer(sock, outer.stop)
                except OSError:
                    pass  # the client went away: what a cap or a timeout does

        self.srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self.srv.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}"
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.srv.shutdown()
        self.srv.server_close()


@pytest.fixture
def bad_server():
    started: list[BadServer] = []

    def start(answer: Answer) -> BadServer:
        started.append(BadServer(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture
def cli(capsys, monkeypatch):
    """``cli(*args)``: ``ggmux ARGS`` run by ``main()`` in this process, no
    key variables, stdin empty; ``.returncode``, ``.stdout``, ``.stderr``."""
    for name in ("GGMUX_URL", "GGMUX_API_KEY", "GGMUX_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "stdin", io.StringIO(""))

    def run(*args: str) -> SimpleNamespace:
        capsys.readouterr()
        rc = main(list(args))
        out, err = capsys.readouterr()
        return SimpleNamespace(returncode=rc, stdout=out, stderr=err)

    return run


def body(data: bytes, ctype: str = "application/json") -> Answer:
    def answer(sock, stop):
        sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                     b"connection: close\r\n\r\n%s" % (ctype.encode(), len(data), data))
    return answer


def silent(sock, stop):
    stop.wait()


def announced_600_mb(sock, stop):
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"content-length: 629145600\r\n\r\n")
    block = b"[" * 65536
    while not stop.is_set():
        sock.sendall(block)


def endless_chunks(sock, stop):
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                 b"transfer-encoding: chunked\r\n\r\n")
    chunk = b"10000\r\n" + b" " * 0x10000 + b"\r\n"
    while not stop.is_set():
        sock.sendall(chunk)


def sse_head(sock) -> None:
    sock.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                 b"connection: close\r\n\r\n")


def sse_endless_line(sock, stop):
    sse_head(sock)
    while not stop.is_set():
        sock.sendall(b"data: " + b"x" * 65536)


def sse_after_a_pause(pause: float, events: list[bytes]) -> Answer:
    """The head at once, then nothing for ``pause`` seconds (longer than
    the client's --timeout), then ``events``."""
    def answer(sock, stop):
        sse_head(sock)
        stop.wait(pause)
        for e in events:
            sock.sendall(b"data: " + e + b"\n\n")
    return answer


def chunk(text: str) -> bytes:
    return json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]}).encode()


def assert_no_usable_answer(r, *words: str) -> None:
    assert r.returncode == 3, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ggmux: no usable answer from "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize(("answer", "words"), [
    (body(b"[]"), ("GET /ps", "a JSON array, not an object")),
    (body(b'{"models": [{"name": "m", "state": "loaded"}]}'), ("models[0] has no string 'id'",)),
    (body(b'{"models": [{"id": "m"}]}'), ("models[0] has no string 'state'",)),
    (body(b'{"models": {"id": "m"}}'), ("'models' is a JSON object, not an array",)),
    (body(b'{"data": []}'), ("no 'models'",)),
    (body(b"<html>hello</html>", "text/html"), ("not JSON", "<html>")),
    (body(b"[" * 100000 + b"]" * 100000), ("not JSON",)),
    (silent, ("nothing within 0.5 s (--timeout)",)),
    (announced_600_mb, ("600 MiB announced, over the 16 MiB cap (--max-answer-bytes)",)),
    (endless_chunks, ("over the 16 MiB cap (--max-answer-bytes)",)),
], ids=["array", "no-id", "no-state", "models-object", "no-models", "html", "deep", "silent",
        "600-mb", "endless"])
def test_ps_says_in_one_line_that_the_answer_is_unusable(bad_server, cli, answer, words):
    s = bad_server(answer)
    assert_no_usable_answer(cli("--timeout", "0.5", "ps", "--url", s.url), *words)


def test_the_ggmux_process_exits_3_without_a_traceback(bad_server):
    s = bad_server(body(b"[]"))
    assert_no_usable_answer(ggmux("--url", s.url, "ps", "--timeout", "0.5"),
                            "a JSON array, not an object")


@pytest.mark.parametrize("args", [("load", "m"), ("unload", "m"), ("ps", "--json")])
@pytest.mark.parametrize(("answer", "words"), [
    (body(b"[]"), ("a JSON array, not an object",)),
    (body(b'{"data": [{"status": {"value": "loaded"}}], "models": [{"state": "x"}]}'),
     ("[0] has no string 'id'",)),
    (silent, ("nothing within 0.5 s",)),
], ids=["array", "no-id", "silent"])
def test_load_unload_and_ps_json_refuse_a_bad_answer(bad_server, cli, args, answer, words):
    s = bad_server(answer)
    assert_no_usable_answer(cli(*args, "--timeout", "0.5", "--url", s.url), *words)


def test_logs_and_run_time_out_before_the_head_and_cap_what_they_read(bad_server, cli):
    s = bad_server(silent)
    for args in (("logs",), ("logs", "-f"), ("run", "m", "hi")):
        assert_no_usable_answer(cli(*args, "--timeout", "0.5", "--url", s.url), "nothing within")
    s = bad_server(endless_chunks)
    assert_no_usable_answer(cli("logs", "--max-answer-bytes", "100000", "--url", s.url),
                            "over the 100000 bytes cap")
    s = bad_server(sse_endless_line)
    assert_no_usable_answer(cli("run", "m", "hi", "--max-answer-bytes", "100000", "--url", s.url),
                            "an event over the 100000 bytes cap")
    s = bad_server(body(b'{"choices": []}'))
    assert_no_usable_answer(cli("run", "m", "hi", "--url", s.url), "not an event stream")
    s = bad_server(sse_after_a_pause(0.0, [b"[1, 2]"]))
    assert_no_usable_answer(cli("run", "m", "hi", "--url", s.url), "an event that is a JSON array")
    s = bad_server(sse_after_a_pause(0.0, [b"{not json"]))
    assert_no_usable_answer(cli("run", "m", "hi", "--url", s.url), "an event that is not JSON")


def test_a_stream_that_began_may_pause_longer_than_the_timeout(bad_server, cli):
    s = bad_server(sse_after_a_pause(1.5, [chunk("late"), chunk(" answer"), b"[DONE]"]))
    r = cli("run", "m", "hi", "--timeout", "0.3", "--url", s.url)
    assert r.returncode == 0 and r.stdout == "late answer\n", r
    rec = json.dumps({"ts": "not a time", "level": "INFO", "src": "x", "msg": "a line"})
    s = bad_server(sse_after_a_pause(1.5, [rec.encode(), b"[3]"]))
    r = cli("logs", "-f", "--timeout", "0.3", "--url", s.url)
    assert r.returncode == 0 and r.stdout.endswith("INFO [x] a line\n"), r
    assert "Traceback" not in r.stderr


def test_run_waits_longer_than_the_other_commands_for_its_answer_to_begin():
    """The head of ``run``'s answer comes with the first token (after the
    prompt is read, once a slot is free): 600 s unless ``--timeout``."""
    parse = build_parser({}).parse_args
    assert client_from_args(parse(["ps"])).timeout == 10
    assert client_from_args(parse(["run", "m"])).timeout == 600
    assert client_from_args(parse(["--timeout", "3", "run", "m"])).timeout == 3
    assert client_from_args(parse(["run", "m", "--timeout", "4"])).timeout == 4
    assert client_from_args(parse(["--timeout", "3", "load", "m", "--timeout", "5"])).timeout == 5


def test_the_load_wait_ends_at_its_deadline_on_a_silent_event_stream(bad_server, cli):
    """``load`` finds the model, the server takes the load, then its
    ``/models/sse`` sends its head and nothing more: 504 after ``--wait``."""
    models = json.dumps({"data": [{"id": "m", "status": {"value": "loading"}}]}).encode()

    def answer(sock, stop):
        sock.settimeout(5)
        if not hasattr(answer, "n"):
            answer.n = 0
        answer.n += 1
        if answer.n <= 2:  # POST /models/load, GET /v1/models
            body(b'{"success": true}' if answer.n == 1 else models)(sock, stop)
        else:
            sse_head(sock)
            stop.wait()

    s = bad_server(answer)
    r = cli("load", "m", "--wait", "1", "--url", s.url)
    assert r.returncode == 1 and "'m' is still ? after 1 s (--wait)" in r.stderr, r
    assert "Traceback" not in r.stderr
