"""A stop during the start is a stop, not a failed start (issue 31, item 10).

SIGTERM right after ``/health`` first answered 200 (one proxy listens, the
others may still be starting) used to log ``ERROR ... proxies did not start
listening`` and exit 1.
"""

from __future__ import annotations

import signal
import subprocess

from conftest import wait_for

ROUNDS = 4
PROXIES = 4


def test_sigterm_as_soon_as_health_answers_exits_0_without_an_error(serve, fakes):
    fakes.add("alpha")
    for i in range(ROUNDS):
        s = serve("--fake-models-dir", str(fakes), "--proxies", str(PROXIES), ready=False)

        def healthy(s=s):
            assert s.proc.poll() is None, s.logs()
            try:
                return s.request("GET", "/health", timeout=5)[0] == 200
            except OSError:
                return False

        wait_for(healthy, 60, 0.002, "server /health")
        s.proc.send_signal(signal.SIGTERM)
        try:
            code = s.proc.wait(60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"round {i}: no exit after SIGTERM: {s.logs()[-3000:]}")
        logs = s.logs()
        assert code == 0, f"round {i}: exit {code}: {logs[-3000:]}"
        assert " ERROR " not in logs and "Traceback" not in logs, f"round {i}: {logs[-3000:]}"
        assert "stopped" in logs
        s.stop()  # nothing of it is left: segments, queue, children
