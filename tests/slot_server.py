"""A `cmd` replica for tests that speaks llama-server's slot routes, and
records what happens to it in order.

``python tests/slot_server.py --port PORT --slot-save-path DIR --log FILE
[--slots N] [--control JSON]``: ``GET /health`` 200;
``POST /v1/chat/completions`` answers ``ok`` and fills slot 0 with the
request's last message (``n_prompt_tokens``: its words); ``GET /slots`` as
llama-server lists its slots (``n_prompt_tokens`` only for a slot that held
a task); ``POST /slots/{id}?action=save|restore`` with ``{"filename"}``
writes or reads ``DIR/filename`` (llama-server's ``n_saved`` /
``n_restored``), after ``delay`` seconds, or answers 500 when ``fail``
names the action (``delay``, ``fail``: read from the ``--control`` JSON file
at each call, when it exists, so a test changes them while the command line,
and so the slot files' names, stay). FILE gets one line per event: ``chat``,
``save ID NAME``,
``restore ID NAME N``, ``fail ACTION``, ``sigterm``. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

LOCK = threading.Lock()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--slot-save-path", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--control", default="")
    args = ap.parse_args()
    held = [""] * args.slots

    def note(line: str) -> None:
        with LOCK, open(args.log, "a") as f:
            f.write(line + "\n")

    def on_term(*_):
        note("sigterm")
        os._exit(0)

    signal.signal(signal.SIGTERM, on_term)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def _send(self, status: int, doc) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif self.path == "/slots":
                self._send(200, [{"id": i, "n_ctx": 512, "is_processing": False,
                                  **({"n_prompt_tokens": len(t.split())} if t else {})}
                                 for i, t in enumerate(held)])
            else:
                self._send(404, {"error": {"message": "no route", "code": 404}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0))
                              or b"{}")
            path, _, query = self.path.partition("?")
            if path == "/v1/chat/completions":
                held[0] = str(body["messages"][-1]["content"])
                note("chat")
                self._send(200, {"choices": [{"index": 0, "message": {
                    "role": "assistant", "content": "ok"}, "finish_reason": "stop"}]})
                return
            if path.startswith("/slots/"):
                sid = int(path.rsplit("/", 1)[1])
                action = query.removeprefix("action=")
                try:
                    with open(args.control) as f:
                        control = json.load(f)
                except (OSError, ValueError):
                    control = {}
                time.sleep(float(control.get("delay", 0)))
                if control.get("fail") == action:
                    note(f"fail {action}")
                    self._send(500, {"error": {"message": f"Unable to {action} slot"}})
                    return
                name = os.path.join(args.slot_save_path, body["filename"])
                if action == "save":
                    with open(name, "w") as f:
                        f.write(held[sid])
                    note(f"save {sid} {body['filename']}")
                    self._send(200, {"id_slot": sid, "n_saved": len(held[sid].split())})
                else:
                    with open(name) as f:
                        held[sid] = f.read()
                    note(f"restore {sid} {body['filename']} {len(held[sid].split())}")
                    self._send(200, {"id_slot": sid, "n_restored": len(held[sid].split())})
                return
            self._send(404, {"error": {"message": "no route", "code": 404}})

    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
