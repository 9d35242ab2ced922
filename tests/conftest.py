"""Test helpers: run ``ggmux serve`` as a real process and clean up after it.

Every server a test starts is stopped at the end of the test, and the test
fails if any of its child processes or its shared-memory segment is left.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

# Bytecode caches on, for this process and every one it starts (the pytest
# workers, each ggmux serve and its proxies, instances and measure children):
# where PYTHONDONTWRITEBYTECODE is set (a container default, and this
# project's machines) an editable install has no .pyc of ggmux's own modules,
# so each of the suite's ~1,500 Python processes compiled them all again at
# its start (a proxy: 0.56 CPU s, 0.37 with the cache) and pytest rewrote
# every test module's asserts again in each worker (14 s of collection).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

# The KV disk tier's MAC key (instance/cache/safe_files.py) lives in
# $XDG_STATE_HOME/ggmux: the suite's servers and instances keep theirs in a
# folder of its own, not in the user's home.
if "GGMUX_TEST_STATE" not in os.environ:
    os.environ["GGMUX_TEST_STATE"] = os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(
        prefix="ggmux-test-state-")
    atexit.register(shutil.rmtree, os.environ["GGMUX_TEST_STATE"], True)

import posix_ipc
import pytest
from ggmux.shm.segment import Segment, queue_name, segment_name


def minute_left(seconds: float = 10.0) -> int:
    """The calendar minute (``time.time() // 60``) once at least ``seconds``
    of it are left: per-minute limits (rpm, tpm) count a calendar minute, and
    a test that reads a count after its requests must not see it start again
    at 0 in between (waits ``seconds`` at most)."""
    wait_for(lambda: time.time() % 60 <= 60 - seconds, seconds + 1, 0.05,
             f"a minute with {seconds:g} s left")
    return int(time.time() // 60)


def wait_for(cond, timeout: float = 10.0, interval: float = 0.01, what: str = "condition"):
    """Poll ``cond()`` until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def connectable(port: int) -> bool:
    """Whether something accepts connections on 127.0.0.1:``port``."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d))
    return out


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid`` (children, theirs, ...)."""
    out, todo = [], [pid]
    while todo:
        kids = children_of(todo.pop())
        out += kids
        todo += kids
    return out


def secrets_shown(pid: int, secrets) -> list[tuple[int, str, str]]:
    """``(pid, "cmdline" | "environ", secret)`` for each of ``secrets`` (str)
    found in the command line or environment of a living descendant of
    ``pid``: a test of "no key on any child's command line nor in its
    environment" asserts this is empty."""
    found = []
    for child in descendants(pid):
        for what in ("cmdline", "environ"):
            try:
                with open(f"/proc/{child}/{what}", "rb") as f:
                    data = f.read()
            except OSError:
                continue  # gone meanwhile
            found += [(child, what, x) for x in secrets if x.encode() in data]
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SEGMENT_SUFFIXES = ("", "-log", "-req", "-use", "-keys")
"""Every shared-memory object a server makes, by suffix of its segment's
name: the state segment, the log ring, the request ring, the usage
ledger's status and the key table."""


def unlink_server_objects(port: int) -> None:
    """Remove what a SIGKILLed supervisor of ``port`` could not: its
    segments (:data:`SEGMENT_SUFFIXES`) and its command queue; missing ones
    are fine."""
    for suffix in SEGMENT_SUFFIXES:
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory(segment_name(port) + suffix)
    with contextlib.suppress(posix_ipc.ExistentialError):
        posix_ipc.unlink_message_queue(queue_name(port))


def segment_exists(port: int, suffix: str = "") -> bool:
    try:
        posix_ipc.SharedMemory(segment_name(port) + suffix).close_fd()
        return True
    except posix_ipc.ExistentialError:
        return False


class Server:
    """A running ``ggmux serve``; ``request()`` is a small HTTP client."""

    def __init__(self, args: list[str], port: int, log_path: Path) -> None:
        self.port = port
        self.args = args
        self.log_path = log_path
        self.log = open(log_path, "wb")  # noqa: SIM115 - open for the server's life
        # an empty model cache: the machine's own Hugging Face / llama.cpp cache
        # must not add models to the ones a test names
        empty = log_path.parent / "empty-cache"
        empty.mkdir(exist_ok=True)
        env = {**os.environ, "HF_HUB_CACHE": str(empty), "LLAMA_CACHE": str(empty),
               "HF_HOME": str(empty)}
        # the usage ledger's SQLite file in the test's directory, not ~/.local/state
        env.setdefault("GGMUX_STATE_DIR", str(log_path.parent / "state"))
        # one llama.cpp thread per instance unless the test says otherwise:
        # ggml's threads spin at each barrier, so two threads on two cores
        # that the test, the proxies and the supervisor share wait out each
        # other's time slices (48 tokens of smollm2 on this 2-core machine
        # under load: 14 s and 1.5 CPU s with one thread, 338 s and 38 CPU s
        # with two); the replies do not depend on it
        if "--threads" not in args:
            args = [*args, "--threads", "1"]
        # no spare instance unless the test asks (--spares N): a spare
        # imports llama-cpp-python (about 1 CPU s) at the server's start and
        # again after each load, a fifth of the suite's CPU when every
        # server kept one; the tests of spares (test_first_run.py, ...) ask
        if "--spares" not in args:
            args = [*args, "--spares", "0"]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(port), *args],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
        )
        self.base = f"http://127.0.0.1:{port}"
        self._seg: Segment | None = None

    def wait_ready(self, timeout: float = 30.0) -> Server:
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited: {self.logs()}")
            try:
                return self.request("GET", "/health")[0] == 200
            except OSError:
                return False

        wait_for(up, timeout, 0.05, "server /health")
        return self

    def request(self, method: str, path: str, body=None, headers=None, timeout: float = 60.0):
        """``(status, headers dict, body bytes)``; dict/list bodies go as JSON,
        and a body goes with ``content-type: application/json`` unless
        ``headers`` name one (as the SDKs send: ggmux refuses other types,
        issue 18 finding 5)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            if isinstance(body, (dict, list)):
                body = json.dumps(body).encode()
            headers = dict(headers or {})
            if body is not None and not any(k.lower() == "content-type" for k in headers):
                headers["content-type"] = "application/json"
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def json(self, method: str, path: str, body=None, **kw):
        status, _, data = self.request(method, path, body, **kw)
        return status, json.loads(data) if data else None

    def models(self) -> dict[str, dict]:
        status, doc = self.json("GET", "/v1/models")
        assert status == 200
        return {m["id"]: m for m in doc["data"]}

    @property
    def seg(self) -> Segment:
        if self._seg is None:
            self._seg = Segment.attach(segment_name(self.port))
        return self._seg

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, wait, and check nothing of this server is left."""
        if self._seg is not None:
            self._seg.close()
            self._seg = None
        kids = children_of(self.proc.pid) if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server did not stop in {timeout} s: {self.logs()[-3000:]}")
        self.log.close()
        for pid in kids:
            wait_for(lambda p=pid: not alive(p), 10, 0.02, f"child {pid} to exit")
        assert not segment_exists(self.port), "shared-memory segment left behind"
        assert not segment_exists(self.port, "-log"), "log ring left behind"
        assert not segment_exists(self.port, "-req"), "request ring left behind"
        assert not segment_exists(self.port, "-use"), "usage status left behind"
        assert not segment_exists(self.port, "-keys"), "key table left behind"
        try:
            posix_ipc.MessageQueue(queue_name(self.port)).close()
            raise AssertionError("command queue left behind")
        except posix_ipc.ExistentialError:
            pass


@pytest.fixture
def private_files():
    """Files the test makes are readable by their owner only (umask 077), as
    a keys file that holds secrets must be (ggmux refuses one others may
    read); the servers it starts inherit the mask."""
    old = os.umask(0o077)
    yield
    os.umask(old)


@pytest.fixture
def serve(tmp_path):
    """``serve(*args) -> Server`` started and ready; stopped after the test."""
    started: list[Server] = []

    def start(*args: str, port: int | None = None, ready: bool = True) -> Server:
        s = Server(list(args), port or free_port(), tmp_path / f"server{len(started)}.log")
        started.append(s)
        if ready:
            s.wait_ready()
        return s

    yield start
    for s in started:
        s.stop()


def write_fake(directory: Path, name: str, **behaviour) -> Path:
    """A fake model ``name`` (see ggmux.instance.fake) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    p = directory / f"{name}.json"
    p.write_text(json.dumps(behaviour))
    return p


@pytest.fixture
def fakes(tmp_path):
    """Folder for fake models: ``fakes.add(name, **behaviour)``; ``str(fakes)``."""

    class Fakes:
        dir = tmp_path / "fakes"

        def add(self, name: str, **behaviour) -> Path:
            return write_fake(self.dir, name, **behaviour)

        def __str__(self) -> str:
            return str(self.dir)

    f = Fakes()
    f.dir.mkdir()
    return f


def served_by(body: bytes) -> tuple[str, int]:
    """(model name, pid) from a fake instance's answer text ``[name:pid]``."""
    m = re.search(rb"\[([^:\]]+):(\d+)\]", body)
    assert m, body
    return m.group(1).decode(), int(m.group(2))


def open_stream(port: int, body: dict, timeout: float | None = None,
                headers: dict[str, str] | None = None) -> socket.socket:
    """A raw connection that has sent ``POST /v1/chat/completions`` with
    ``body`` (and ``headers``); the test reads (or drops) the response itself.
    It asks ``connection: close`` (unless ``headers`` name a ``connection``),
    so reading to EOF ends with the response, not at the socket's timeout."""
    data = json.dumps(body).encode()
    headers = dict(headers or {})
    if not any(k.lower() == "connection" for k in headers):
        headers["connection"] = "close"
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\n%scontent-length: %d\r\n\r\n%s"
                 % (extra, len(data), data))
    return sock


def chat_body(model: str, stream: bool = False, **extra) -> dict:
    return {"model": model, "stream": stream,
            "messages": [{"role": "user", "content": "Say hi"}], **extra}


CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]


@pytest.fixture
def browser_page(tmp_path):
    """A fresh Chromium profile and page (Debian's ``chromium`` driven by
    Playwright with that executable, never ``playwright install``); console
    errors collected in ``page.errors``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, args=CHROMIUM_ARGS,
            headless=True, viewport={"width": 1280, "height": 900})
        page = ctx.pages[0] if ctx.pages else ctx.new_page()
        page.errors = []
        page.on("pageerror", lambda e: page.errors.append(str(e)))
        try:
            yield page
        finally:
            ctx.close()


@pytest.fixture
def nats_server(tmp_path):
    """``nats_server(auth=None) -> NatsServer`` started (JetStream, loopback, a free
    port, its own store); every one is stopped after the test (tests/natsd.py)."""
    from natsd import NatsServer

    started: list = []

    def start(auth: list[str] | None = None):
        s = NatsServer(tmp_path / f"nats{len(started)}", auth)
        started.append(s)
        return s.start()

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def recorder(tmp_path):
    """A recording replica (tests/recorder.py) in a thread: ``(port, requests())``, where
    ``requests()`` lists what it was sent (method, path, headers)."""
    from recorder import make_handler

    log = tmp_path / "recorded.jsonl"
    log.touch()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(str(log), None))
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()

    def requests() -> list[dict]:
        return [json.loads(line) for line in log.read_text().splitlines()
                if not json.loads(line)["path"].endswith("/health")]

    yield srv.server_address[1], requests
    srv.shutdown()
    srv.server_close()


# The longest modules first (measured seconds on 2 cores, December 2026:
# test_kv_tiers 86, test_checkpoints 83, test_contention 80, test_cluster 78,
# ...): the workers (-n 2 --dist loadscope, whole modules each) take them
# while the short ones fill in after, instead of one worker running a long
# module alone at the end. Order inside each module is unchanged.
LONGEST_FIRST = ("test_kv_tiers", "test_checkpoints", "test_contention", "test_cluster",
                 "test_spec_decoding", "test_scheduler", "test_page_models", "test_vision",
                 "test_parallel_slots", "test_engine", "test_readme", "test_page",
                 "test_forwarding_faults", "test_tools_real", "test_cluster_rejoin",
                 "test_cluster_agent", "test_ledger", "test_kv_tiers_router",
                 "test_hostile_tenant", "test_cli_answers")


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda it: rank.get(it.module.__name__.rpartition(".")[2], len(rank)))
