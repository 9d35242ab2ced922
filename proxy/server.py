"""A proxy worker process: the public HTTP surface.

N identical workers bind the public address with ``SO_REUSEPORT``; the
kernel spreads connections over them. A worker resolves the request's model
through the registry blob, picks a ready replica from the shared-memory
replica table, and forwards bytes (:mod:`ggmux.proxy.upstream`). It never
decides to load or evict: for a model with no ready replica it registers a
waiter in its waiters row and asks the supervisor through the command queue,
then waits to be woken (the supervisor writes a byte on the worker's stdin
after every generation bump; stdin EOF means the supervisor is gone and the
worker exits).

Counters: the worker is the only writer of ``counters[index]`` and
``waiters[index]``. A request counts as in flight from just before it is
forwarded until its response ended; a waiter is removed only after its
request counts as in flight, so a freshly loaded model is never without
either and cannot be evicted before it serves the request that loaded it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time

import numpy as np
import orjson
import posix_ipc

from ..shm import layout as L
from ..shm.segment import Segment
from ..shm.seqlock import read_table
from .http import HttpConnection, HttpLimits, Request
from .upstream import UpstreamError, UpstreamPool, request_head

log = logging.getLogger("ggmux.proxy")

NS = 1_000_000_000

INFERENCE = frozenset(
    (
        b"/v1/chat/completions",
        b"/chat/completions",
        b"/v1/completions",
        b"/completions",
        b"/v1/embeddings",
        b"/embeddings",
    )
)

TTFT_ALPHA = 0.2  # EWMA weight of the newest sample


class Proxy:
    """State of one worker; ``handle`` is the HTTP handler."""

    def __init__(self, index: int, shm: str, mq: str, load_wait: float) -> None:
        self.index = index
        self.seg = Segment.attach(shm)
        self.mq = posix_ipc.MessageQueue(mq)
        self.mq.block = False
        self.cnt = self.seg.counters[index]  # (replicas, C_WORDS), ours alone
        self.wait = self.seg.waiters[index]  # (models, W_WORDS), ours alone
        self.load_wait = load_wait
        self.loop = asyncio.get_event_loop()
        self.pool = UpstreamPool(self.loop)
        self.gen = -1
        self.reg_version = -1
        self.names: dict[str, int] = {}
        self.reg_models: list[dict] = []
        self.errors: dict[str, str] = {}
        self.ready: dict[int, list[tuple[int, int, int]]] = {}  # model -> [(slot, port, incarnation)]
        self.model_rows = np.zeros((self.seg.sizes.models, L.M_WORDS), dtype=np.int64)
        self.replica_rows = np.zeros((self.seg.sizes.replicas, L.R_WORDS), dtype=np.int64)
        self.waiting: dict[int, set[asyncio.Future]] = {}
        self.active = 0
        self.refresh()

    # ---- shared-memory snapshot ------------------------------------------
    def refresh(self) -> None:
        """Re-read tables when the supervisor's generation moved; wake waiters."""
        seg = self.seg
        g = seg.generation
        if g == self.gen:
            return
        self.gen = g
        version, doc = seg.read_registry()
        if version != self.reg_version:
            self.reg_version = version
            self.names = doc.get("names", {})
            self.reg_models = doc.get("models", [])
            self.errors = doc.get("errors", {})
        self.model_rows = read_table(seg.models)
        reps = read_table(seg.replicas)
        self.replica_rows = reps
        ready: dict[int, list[tuple[int, int, int]]] = {}
        for slot in np.flatnonzero(reps[:, L.R_STATUS] == L.ReplicaStatus.READY):
            r = reps[slot]
            ready.setdefault(int(r[L.R_MODEL]), []).append(
                (int(slot), int(r[L.R_PORT]), int(r[L.R_INCARNATION]))
            )
        alive = {p for lst in ready.values() for _, p, _ in lst}
        for port in list(self.pool.idle):
            if port not in alive:
                self.pool.drop_port(port)
        self.ready = ready
        if self.waiting:
            now = time.monotonic_ns()
            for m, futs in list(self.waiting.items()):
                if m in ready:
                    outcome = "ready"
                elif self._in_backoff(m, now):
                    outcome = "failed"
                else:
                    continue
                for f in futs:
                    if not f.done():
                        f.set_result(outcome)

    def _in_backoff(self, m: int, now: int) -> bool:
        row = self.model_rows[m]
        return bool(row[L.M_FAILED]) and int(row[L.M_RETRY_AT_NS]) > now

    def on_notify(self) -> None:
        try:
            data = os.read(0, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            log.info("proxy %d: supervisor gone, exiting", self.index)
            self.loop.stop()
            return
        self.refresh()

    # ---- waiters -------------------------------------------------------------------
    def _join(self, m: int) -> None:
        w = self.wait
        if w[m, L.W_COUNT] == 0:
            w[m, L.W_FIRST_NS] = time.monotonic_ns()
        w[m, L.W_COUNT] += 1
        try:
            self.mq.send(b'{"op":"want","model":%d}' % m, timeout=0)
        except posix_ipc.BusyError:
            pass  # demand is in the waiters table; the supervisor's tick sees it

    def _leave(self, m: int) -> None:
        w = self.wait
        w[m, L.W_COUNT] -= 1
        if w[m, L.W_COUNT] <= 0:
            w[m, L.W_COUNT] = 0
            w[m, L.W_FIRST_NS] = 0

    async def _wait_ready(self, m: int, req: Request) -> str:
        """Wait for model ``m``: ``"ready"``, ``"failed"``, ``"timeout"`` or
        ``"gone"`` (client disconnected). The caller must ``_leave(m)``."""
        fut = self.loop.create_future()
        self.waiting.setdefault(m, set()).add(fut)
        req.on_disconnect = lambda: fut.done() or fut.set_result("gone")
        try:
            return await asyncio.wait_for(fut, self.load_wait)
        except TimeoutError:
            return "timeout"
        finally:
            req.on_disconnect = None
            s = self.waiting.get(m)
            if s is not None:
                s.discard(fut)
                if not s:
                    del self.waiting[m]

    # ---- HTTP ------------------------------------------------------------------------
    async def handle(self, conn: HttpConnection, req: Request) -> None:
        path = req.path
        if path in INFERENCE:
            if req.method != b"POST":
                conn.send_error(req, 405, f"{path.decode()} needs POST")
                return
            await self._inference(conn, req)
        elif path == b"/health":
            conn.send_response(req, 200, b'{"status":"ok"}')
        elif path in (b"/v1/models", b"/models"):
            if b"reload=1" in req.query or b"reload=true" in req.query:
                try:
                    self.mq.send(b'{"op":"reload"}', timeout=0)
                except posix_ipc.BusyError:
                    conn.send_error(req, 503, "supervisor queue is full, try again",
                                    headers=[(b"retry-after", b"1")])
                    return
            self.refresh()
            conn.send_json(req, 200, self.models_list())
        elif path in (b"/models/load", b"/models/unload"):
            if req.method != b"POST":
                conn.send_error(req, 405, f"{path.decode()} needs POST")
                return
            self._load_unload(conn, req, path.rsplit(b"/", 1)[1].decode())
        else:
            conn.send_error(req, 404, f"no route for {req.method.decode()} {path.decode('latin-1')}")

    async def _inference(self, conn: HttpConnection, req: Request) -> None:
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            conn.send_error(req, 400, f"request body is not valid JSON: {e}")
            return
        if not isinstance(body, dict):
            conn.send_error(req, 400, "request body must be a JSON object")
            return
        name = body.get("model")
        if name is None:
            conn.send_error(req, 400, "missing 'model' in the request body")
            return
        if not isinstance(name, str):
            conn.send_error(req, 400, "'model' must be a string")
            return
        self.refresh()
        m = self.names.get(name)
        if m is None:
            conn.send_error(req, 404, f"model '{name}' not found", code="model_not_found")
            return
        await self._forward(conn, req, m, name)

    def _load_unload(self, conn: HttpConnection, req: Request, op: str) -> None:
        """``POST /models/load`` / ``/models/unload`` with ``{"model": name}``:
        asks the supervisor and returns at once (llama.cpp router's
        ``{"success": true}``); progress shows in ``/v1/models``."""
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as e:
            conn.send_error(req, 400, f"request body is not valid JSON: {e}")
            return
        name = body.get("model") if isinstance(body, dict) else None
        if not isinstance(name, str):
            conn.send_error(req, 400, "body must be {\"model\": \"<name>\"}")
            return
        self.refresh()
        m = self.names.get(name)
        if m is None:
            conn.send_error(req, 404, f"model '{name}' not found", code="model_not_found")
            return
        try:
            self.mq.send(orjson.dumps({"op": op, "model": m}), timeout=0)
        except posix_ipc.BusyError:
            conn.send_error(req, 503, "supervisor queue is full, try again",
                            headers=[(b"retry-after", b"1")])
            return
        conn.send_json(req, 200, {"success": True, "model": name, "op": op})

    def _failure(self, conn: HttpConnection, req: Request, m: int, name: str) -> None:
        row = self.model_rows[m]
        retry = max(1, -(-(int(row[L.M_RETRY_AT_NS]) - time.monotonic_ns()) // NS))
        cause = self.errors.get(str(m), "load failed")
        conn.send_error(
            req, 503, f"model '{name}' failed to load: {cause}", code="model_load_failed",
            headers=[(b"retry-after", str(retry).encode())],
        )

    def _loading_error(self, conn: HttpConnection, req: Request, m: int, name: str) -> None:
        row = self.model_rows[m]
        status = L.ModelStatus.NAMES[int(row[L.M_STATUS])]
        eta = int(row[L.M_ETA_MS])
        loading = {"model": name, "state": status, "progress": int(row[L.M_PROGRESS]) / 1000,
                   "eta_seconds": eta / 1000 if eta >= 0 else None}
        conn.send_error(
            req, 503, f"model '{name}' is still loading after {self.load_wait:g} s (--load-wait)",
            code="model_loading", headers=[(b"retry-after", b"5")], loading=loading,
        )

    async def _forward(self, conn: HttpConnection, req: Request, m: int, name: str) -> None:
        for attempt in range(3):
            reps = self.ready.get(m)
            waited = False
            if not reps:
                now = time.monotonic_ns()
                if self._in_backoff(m, now):
                    self._failure(conn, req, m, name)
                    return
                self._join(m)
                outcome = await self._wait_ready(m, req)
                waited = True
                if outcome != "ready":
                    self._leave(m)
                    if outcome == "gone":
                        conn.finish(req)
                    elif outcome == "failed":
                        self._failure(conn, req, m, name)
                    else:
                        self._loading_error(conn, req, m, name)
                    return
                reps = self.ready.get(m)
                if not reps:
                    self._leave(m)
                    continue
            slot, port, inc = self._pick(reps)
            cnt = self.cnt[slot]
            if cnt[L.C_INCARNATION] != inc:
                cnt[:] = 0
                cnt[L.C_INCARNATION] = inc
            cnt[L.C_IN_FLIGHT] += 1
            cnt[L.C_LAST_USED_NS] = time.monotonic_ns()
            if waited:
                self._leave(m)  # only now: the request already counts as in flight
            sent_ns = 0
            up = None
            try:
                up = await self.pool.acquire(port)
                if req.disconnected:
                    self.pool.release(up)
                    conn.finish(req)
                    return
                data = request_head(req, port, len(req.body)) + bytes(req.body)
                sent_ns = time.monotonic_ns()
                status = await up.send(conn, req, data)
            except UpstreamError as e:
                cnt[L.C_ERRORS] += 1
                log.warning("proxy %d: %s (attempt %d)", self.index, e, attempt + 1)
                self.gen = -1  # force a re-read: the replica may be gone
                self.refresh()
                if attempt < 2 and not req.disconnected:
                    continue
                conn.send_error(req, 502, f"replica for '{name}' failed: {e}")
                return
            finally:
                if cnt[L.C_INCARNATION] == inc:
                    cnt[L.C_IN_FLIGHT] -= 1
                    cnt[L.C_LAST_USED_NS] = time.monotonic_ns()
                    if up is not None and sent_ns and up.first_byte_ns:
                        self._ttft(cnt, (up.first_byte_ns - sent_ns) // 1000)
            cnt[L.C_REQUESTS] += 1
            if status >= 500:
                cnt[L.C_ERRORS] += 1
            return
        conn.send_error(req, 503, f"no replica of '{name}' stayed available")

    @staticmethod
    def _ttft(cnt: np.ndarray, us: int) -> None:
        if us <= 0:
            return
        old = int(cnt[L.C_TTFT_EWMA_US])
        cnt[L.C_TTFT_EWMA_US] = us if old == 0 else int(old + TTFT_ALPHA * (us - old))
        cnt[L.C_TTFT_LAST_US] = us
        cnt[L.C_TTFT_SUM_US] += us
        cnt[L.C_TTFT_COUNT] += 1

    def _pick(self, reps: list[tuple[int, int, int]]) -> tuple[int, int, int]:
        """Replica with the fewest requests in flight over all proxies."""
        if len(reps) == 1:
            return reps[0]
        inflight = self.seg.counters[:, :, L.C_IN_FLIGHT].sum(axis=0)
        return min(reps, key=lambda r: inflight[r[0]])

    def models_list(self) -> dict:
        """OpenAI model list with llama.cpp router's ``status`` object."""
        data = []
        rows = self.model_rows
        for i, mdl in enumerate(self.reg_models):
            if mdl.get("removed"):
                continue
            row = rows[i]
            st = int(row[L.M_STATUS])
            status: dict = {"value": L.ModelStatus.NAMES[st], "args": mdl.get("args", [])}
            if row[L.M_FAILED]:
                status["failed"] = True
                status["exit_code"] = int(row[L.M_EXIT_CODE])
                if str(i) in self.errors:
                    status["error"] = self.errors[str(i)]
            if st == L.ModelStatus.LOADING:
                status["progress"] = int(row[L.M_PROGRESS]) / 1000
            data.append({
                "id": mdl["name"],
                "object": "model",
                "created": 0,
                "owned_by": "ggmux",
                "aliases": mdl.get("aliases", []),
                "status": status,
            })
        return {"object": "list", "data": data}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ggmux.proxy")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--mq", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--load-wait", type=float, default=300.0)
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format=f"%(asctime)s %(levelname)s proxy-{args.index}: %(message)s",
    )
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    proxy = Proxy(args.index, args.shm, args.mq, args.load_wait)
    limits = HttpLimits()
    server = loop.run_until_complete(
        loop.create_server(
            lambda: HttpConnection(proxy.handle, limits), args.host, args.port,
            reuse_port=True, backlog=2048,
        )
    )
    os.set_blocking(0, False)
    loop.add_reader(0, proxy.on_notify)
    loop.add_signal_handler(signal.SIGTERM, loop.stop)
    os.write(1, b"ready\n")
    try:
        loop.run_forever()
    finally:
        server.close()
    return 0
