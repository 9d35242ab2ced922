"""A graceful stop cuts no stream (issue 37, items 8 and 9): a group-wide
SIGTERM (systemd's KillMode=control-group) leaves the drain to the
supervisor; a proxy's drain lasts as long as the models' stop-timeout
lets an instance answer; a proxy stops only once its answers' last
bytes left."""

from __future__ import annotations

import os
import signal
import socket

import pytest
from conftest import chat_body, children_of, descendants, open_stream, wait_for
from ggmux.http1.connections import ConnectionRegistry
from ggmux.http1.drain import DRAIN_SLACK_S, DRAIN_TIMEOUT_S, drain_budget
from ggmux.shm import layout as L


def _read_to_end(sock: socket.socket, got: bytes) -> bytes:
    while True:
        try:
            chunk = sock.recv(65536)
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    sock.close()
    return got


def _first_events(sock: socket.socket, n: int) -> bytes:
    got = b""
    while got.count(b"data: ") < n:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


@pytest.mark.slow
def test_a_group_wide_sigterm_lets_a_stream_in_progress_finish(serve, fakes):
    fakes.add("a", token_s=0.1, tokens=20)  # a 2 s stream
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2")
    sock = open_stream(s.port, chat_body("a", stream=True), 60)
    got = _first_events(sock, 2)
    wait_for(lambda: s.seg.counters[:, :, L.C_IN_FLIGHT].sum() == 1, 10, what="1 in flight")
    # SIGTERM to every process of the server, as systemd stops a unit
    # (KillMode=control-group): the children first, then the supervisor
    pids = descendants(s.proc.pid)
    assert len(pids) >= 3  # two proxies and the instance
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    s.proc.send_signal(signal.SIGTERM)
    got = _read_to_end(sock, got)
    assert got.count(b"data: ") == 21 and got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), \
        got[-300:]
    assert s.proc.wait(60) == 0
    assert "exit code 143" not in s.logs(), s.logs()[-2000:]  # no instance cut by it
    wait_for(lambda: not children_of(s.proc.pid), 10, what="children gone")


@pytest.mark.slow
def test_the_proxies_drain_as_long_as_a_model_stop_timeout_lets_its_stream_run(
        serve, fakes, tmp_path):
    # stop-timeout 14 s: the instance lets a running stream go on 13 s; the
    # proxies used to end it at their own 10 s with "the server is stopping"
    fakes.add("a", token_s=0.1, tokens=110)  # an 11 s stream
    preset = tmp_path / "p.ini"
    preset.write_text("[a]\nstop-timeout = 14\n")
    s = serve("--fake-models-dir", str(fakes), "--models-preset", str(preset),
              "--proxies", "1")
    sock = open_stream(s.port, chat_body("a", stream=True), 120)
    got = _first_events(sock, 2)
    s.proc.send_signal(signal.SIGTERM)
    got = _read_to_end(sock, got)
    assert b"stopping" not in got, got[-300:]
    assert got.count(b"data: ") == 111 and got.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), \
        got[-300:]
    assert s.proc.wait(60) == 0


def test_the_drain_budget_follows_the_longest_stop_timeout():
    assert drain_budget([]) == DRAIN_TIMEOUT_S
    assert drain_budget([3.0, 5.0]) == DRAIN_TIMEOUT_S
    assert drain_budget([3.0, 30.0]) == 30.0 + DRAIN_SLACK_S


class _Transport:
    def __init__(self, pending: int) -> None:
        self.pending = pending

    def get_write_buffer_size(self) -> int:
        return self.pending


class _Conn:
    def __init__(self, sheddable: bool, pending: int = 0) -> None:
        self.sheddable = sheddable
        self.receiving = False
        self.transport = _Transport(pending)

    def shed(self) -> None:
        pass


def test_a_connection_is_unsettled_while_answered_or_while_its_last_bytes_wait():
    reg = ConnectionRegistry()
    idle, answering, flushing = _Conn(True), _Conn(False), _Conn(True, pending=4096)
    for c in (idle, answering, flushing):
        assert reg.admit(None, 100, 0, 100) == 0
        if c.sheddable:
            reg.sheddable[c] = None
    assert reg.unsettled() == 2
    answering.sheddable = True
    reg.sheddable[answering] = None
    flushing.transport.pending = 0
    assert reg.unsettled() == 0
