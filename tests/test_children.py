"""ChildSet: start a child that speaks state lines, read its lines, stop it.

The supervisor's instances and (later) the cluster agent are driven this
way; these tests run a small real Python child, no server.
"""

from __future__ import annotations

import select
import socket
import sys
import time

import pytest
from ggmux.supervisor.children import ChildSet, state_line

# echoes each stdin line back as a state line; stdin EOF: says so and exits 0
ECHO = r"""
import sys
print('state:{"state": "ready"}', flush=True)
for line in sys.stdin:
    print('state:{"state": "echo", "line": "%s"}' % line.strip(), flush=True)
sys.stdout.write('state:{"state": "bye"}\nstray\nstate:{bad\n')
sys.stdout.flush()
"""


def pump(children: ChildSet, poller: select.poll, cond, timeout: float = 10.0):
    """Run the poll loop (as the supervisor does) until ``cond()``."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting on the child")
        for fd, _ in poller.poll(50):
            children.on_event(fd)


@pytest.fixture
def child_set():
    poller = select.poll()
    cs = ChildSet(poller)
    started = []
    yield cs, poller, started
    for c in started:
        c.kill(9)
        c.proc.wait(5)
        cs.release(c)


def test_state_lines_reach_on_line_and_eof_stops_the_child(child_set):
    cs, poller, started = child_set
    got: list[dict] = []
    child = cs.start([sys.executable, "-c", ECHO], "echo",
                     on_line=lambda c, line: got.append(state_line(c, line)))
    started.append(child)
    pump(cs, poller, lambda: got)
    assert got == [{"state": "ready"}]
    assert child.send(b"hello\n")
    pump(cs, poller, lambda: len(got) == 2)
    assert got[1] == {"state": "echo", "line": "hello"}
    child.close_stdin()  # EOF: the child's own exit
    assert not child.send(b"late\n")
    child.proc.wait(10)
    code = cs.reap(child)
    assert code == 0
    # reap read what was left: the last state line and the two bad ones (None)
    assert got[2:] == [{"state": "bye"}, None, None]
    assert cs.fds == {}


def test_reap_is_none_while_running_then_gives_the_exit_code(child_set):
    cs, _, started = child_set
    child = cs.start([sys.executable, "-c", "import time; time.sleep(60)"], "sleeper")
    started.append(child)
    assert cs.reap(child) is None
    assert len(cs.fds) == 2  # stdout and stderr in the poll set
    child.kill(15)
    child.proc.wait(10)
    assert cs.reap(child) == -15
    assert cs.fds == {}
    child.kill(9)  # gone already: no error


def test_start_with_socket_passes_a_listening_descriptor(child_set):
    cs, _, started = child_set
    code = ("import socket, sys; fd = int(sys.argv[sys.argv.index('--fd') + 1]); "
            "s = socket.socket(fileno=fd); c, _ = s.accept(); c.sendall(b'hi'); c.close()")
    child, port = cs.start_with_socket([sys.executable, "-c", code, "--fd", "-1"], "sock")
    started.append(child)
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        assert s.recv(2) == b"hi"
    child.proc.wait(10)
    assert cs.reap(child) == 0


def test_start_of_a_missing_program_raises_oserror(child_set):
    cs, _, _ = child_set
    with pytest.raises(OSError):
        cs.start(["/nonexistent/ggmux-child"], "missing")
    assert cs.fds == {}
