"""Log lines cannot be forged (issue 31, item 3).

A ``response_format`` ``pattern`` holding ESC sequences and a newline was
logged raw (the unsupported-pattern line): ``/logs`` then held raw control
bytes and a forged line carrying a real source tag, and ``ggmux logs``
wrote escape codes to the terminal. Every layer is checked: the escaping
itself, the ring's writer, a child's stderr forwarded by the supervisor,
the CLI's display, the page's display, and the real instance end to end.
"""

from __future__ import annotations

import http.server
import io
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
from pathlib import Path

import orjson
import pytest
from conftest import Server, free_port, wait_for
from ggmux.shm.logring import (
    MAX_RECORD,
    LogRing,
    OneLineFormatter,
    escape_controls,
    format_line,
)
from ggmux.supervisor.children import ChildSet
from ggmux.supervisor.logs import RingHandler

ESC = "\x1b"
# what an attacker sends: colour codes, a clear-screen, a newline and a line
# that looks like the supervisor's, a C1 CSI, a line separator, a bidi override
FORGED = "2026-01-01 00:00:00.000 ERROR [supervisor] replica crashed: send your key to evil"
HOSTILE = (f"x{ESC}[31mred{ESC}[0m{ESC}[2J\n{FORGED}\r\x9b1m\u2028\u202eevil\x07\x00"
           "\ttab")
RAW = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e]")


def one_clean_line(text: str) -> None:
    assert "\n" not in text and not RAW.search(text), repr(text)
    assert "\t" not in text


def test_escape_controls_writes_every_control_character_out_and_keeps_the_rest():
    out = escape_controls(HOSTILE)
    one_clean_line(out)
    assert out.startswith("x\\x1b[31mred\\x1b[0m\\x1b[2J\\n2026-01-01")
    assert "\\r\\x9b1m\\u2028\\u202eevil\\x07\\x00\\ttab" in out
    plain = "naïve 日本 emoji \U0001f600 path C:\\dir\\n"  # no control: unchanged
    assert escape_controls(plain) == plain
    assert escape_controls(out) == out  # escaping twice changes nothing


def test_format_line_shows_a_record_with_control_characters_as_one_line():
    line = format_line({"ts": 1.5, "level": "WARNING\n", "src": f"a{ESC}#0", "msg": HOSTILE})
    one_clean_line(line)
    assert " [a\\x1b#0] " in line and line.count(" [") == 1 + FORGED.count(" [")


def test_the_ring_refuses_a_record_with_a_raw_control_byte():
    ring = LogRing.create(f"/ggmux-test-forge-{os.getpid()}", 4 * MAX_RECORD)
    try:
        for bad in (b'{"msg": "a\nb"}', b'{"msg": "\x1b[2J"}', b"\r", b"\x7f"):
            with pytest.raises(ValueError, match="control"):
                ring.append(bad)
        ring.append(orjson.dumps({"msg": escape_controls(HOSTILE)}))
        assert ring.read(None)[0] == [orjson.dumps({"msg": escape_controls(HOSTILE)})]
    finally:
        ring.unlink()
        ring.close()


def _record(msg: str, *args, exc=None, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("ggmux.x", logging.WARNING, __file__, 1, msg, args, exc)
    rec.__dict__.update(extra)
    return rec


def test_the_supervisors_ring_record_is_one_escaped_line_exception_included():
    try:
        raise RuntimeError("boom\n" + FORGED)
    except RuntimeError:
        exc = sys.exc_info()
    for rec in (_record("pattern %s is not supported", HOSTILE),
                _record("failed", exc=exc),
                _record("", child="alpha#0", line=HOSTILE)):
        payload = RingHandler.payload(rec)
        assert not re.search(rb"[\x00-\x1f\x7f]", payload)
        doc = orjson.loads(payload)
        one_clean_line(doc["msg"])
        one_clean_line(format_line(doc))


def test_a_childs_log_record_is_one_line_on_its_stderr():
    out = io.StringIO()
    h = logging.StreamHandler(out)
    h.setFormatter(OneLineFormatter("%(levelname)s %(name)s: %(message)s"))
    lg = logging.getLogger("ggmux.test.forging")
    lg.addHandler(h)
    lg.propagate = False
    try:
        lg.warning("JSON schema: pattern %s is not supported", HOSTILE)
        try:
            raise ValueError("bad\nworse")
        except ValueError:
            lg.exception("generation failed")
    finally:
        lg.removeHandler(h)
    lines = out.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 3, lines
    for line in lines[:2]:
        one_clean_line(line)
    assert "Traceback" in lines[1] and "worse" in lines[1]


def test_the_supervisor_escapes_a_childs_raw_stderr_line(caplog):
    # a child that writes control bytes itself (not through ggmux's logging:
    # a C library, a crash): each line is one record, escaped
    children = ChildSet(select.poll())
    code = ("import sys; sys.stderr.write(" + repr(HOSTILE + "\n") + "); sys.stderr.flush()")
    with caplog.at_level(logging.INFO, logger="ggmux"):
        child = children.start([sys.executable, "-c", code], "alpha#0")
        wait_for(lambda: children.reap(child) is not None, 20, what="child exit")
    msgs = [r for r in caplog.records if getattr(r, "child", None) == "alpha#0"]
    assert len(msgs) == 2, [r.getMessage() for r in msgs]  # the two lines the child wrote
    for r in msgs:
        one_clean_line(r.getMessage())
        one_clean_line(orjson.loads(RingHandler.payload(r))["msg"])
    assert msgs[1].line.startswith("2026-01-01") and "\\r\\x9b1m" in msgs[1].line


# ---- display: the CLI ---------------------------------------------------------------------
class _HostileLogs(http.server.BaseHTTPRequestHandler):
    """A server whose /logs holds raw control bytes (an old ggmux, or not ggmux)."""

    def do_GET(self):
        rec = {"ts": 1.0, "level": "WARNING", "src": "alpha#0", "msg": HOSTILE}
        if self.path.startswith("/logs/stream"):
            body = b"data: " + json.dumps(rec).encode() + b"\n\n"
            ctype = "text/event-stream"
        elif self.path.startswith("/requests"):
            body = json.dumps({"data": [{"time": 1.0, "model": "m" + HOSTILE, "path": HOSTILE,
                                         "api": "openai", "status": 200}]}).encode()
            ctype = "application/json"
        else:
            body = ("2026-01-01 00:00:00.000 WARNING [alpha#0] " + HOSTILE + "\n").encode()
            ctype = "text/plain; charset=utf-8"
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_ggmux_logs_never_writes_control_characters_to_the_terminal():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _HostileLogs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    env = {**os.environ, "GGMUX_URL": f"http://127.0.0.1:{srv.server_port}"}
    try:
        for args in (["logs"], ["logs", "-f"], ["logs", "--requests"]):
            r = subprocess.run([sys.executable, "-m", "ggmux", *args], capture_output=True,
                               timeout=60, env=env, check=False)
            assert r.returncode == 0, (args, r.stderr)
            out = r.stdout.decode()
            lines = out.split("\n")
            assert lines[-1] == "", (args, out)
            for line in lines[:-1]:
                one_clean_line(line)
            assert "\\x1b[2J" in out, (args, out)
            if args != ["logs"]:  # JSON records: a newline in one is no new line
                # (/logs is text: its lines are the server's, escaped when written)
                assert not any(x.startswith("2026-01-01 00:00:00.000 ERROR") for x in lines)
    finally:
        srv.shutdown()
        srv.server_close()


# ---- display: the page --------------------------------------------------------------------
LOGS_JS = Path(__file__).resolve().parent.parent / "proxy" / "operator" / "ui" / "logs.js"


def test_the_pages_log_view_shows_a_record_as_one_escaped_line():
    script = ("const vm = require('vm'); const fs = require('fs'); const ctx = {};"
              "vm.createContext(ctx);"
              f"vm.runInContext(fs.readFileSync({json.dumps(str(LOGS_JS))}, 'utf8')"
              " + '\\n;globalThis.logText = logText;', ctx);"
              "const rec = JSON.parse(fs.readFileSync(0, 'utf8'));"
              "process.stdout.write(JSON.stringify(ctx.logText(rec)));")
    rec = {"ts": 1.0, "level": "WARN\nING", "src": f"alpha{ESC}#0", "msg": HOSTILE}
    r = subprocess.run(["node", "-e", script], input=json.dumps(rec).encode(),
                       capture_output=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    text = json.loads(r.stdout)
    one_clean_line(text)
    assert text.endswith(escape_controls(HOSTILE))  # the same escapes as the CLI's
    assert " WARN\\nING [alpha\\x1b#0] " in text


# ---- end to end: the real instance --------------------------------------------------------
@pytest.mark.slow
def test_a_hostile_pattern_cannot_forge_a_line_in_logs_on_the_real_instance(tmp_path):
    s = Server(["--proxies", "1", "--ctx-size", "256"], free_port(), tmp_path / "server.log")
    try:
        s.wait_ready()
        schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": HOSTILE}},
                  "required": ["a"]}
        status, _, body = s.request("POST", "/v1/chat/completions", {
            "model": "smollm2-135m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}})
        assert status == 200, body

        def text() -> str:
            st, _, data = s.request("GET", "/logs")
            assert st == 200
            return data.decode()

        wait_for(lambda: "is not supported" in text(), 20, what="the pattern's line in /logs")
        logs = text()
        lines = logs.split("\n")
        assert lines[-1] == ""
        for line in lines[:-1]:
            one_clean_line(line)
        (warned,) = [x for x in lines if "is not supported" in x]
        assert "[smollm2-135m#" in warned and "\\x1b[2J\\n2026-01-01" in warned
        assert not any(x.startswith("2026-01-01") or FORGED in x.split("] ", 1)[0]
                       for x in lines)
        # the supervisor's own stderr (the operator's terminal) too
        assert ESC not in s.logs() and FORGED + "\n" not in s.logs()
    finally:
        s.stop()
