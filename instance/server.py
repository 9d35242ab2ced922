"""The instance process: one model behind an OpenAI-compatible HTTP server.

Shared by the built-in llama-cpp-python instance and the fake instance used
in tests; they differ only in their :class:`Backend`. The process:

1. keeps stdout for state lines and starts the stdin command thread
   (:mod:`ggmux.instance.protocol`);
2. emits ``loading``, loads the backend, emits ``ready`` with ``n_ctx`` and
   ``effective`` memory (bytes), or ``error`` and exits 1;
3. serves HTTP on the listening socket the supervisor passed (``--fd``) or
   on ``--host``/``--port`` when run by hand: every request goes to the
   backend at once (the built-in one batches up to ``--parallel`` of them,
   issue 12; the rest wait in its queue), and a client that disconnects
   cancels its request;
4. on ``exit``: stops taking requests (503), refuses those still queued in
   the backend (503: nothing was done for them), lets running ones finish
   for up to ``--stop-timeout`` less one second, then ends the rest with an
   SSE error event (never a clean end) and exits, before the supervisor's
   SIGTERM.

Issue 11: with a secret (from the supervisor's ``--keys-fd`` pipe, or a
spare's ``load`` command) every route but ``/health`` needs it as the bearer
token (401 otherwise), so no local user can go around ggmux's API key. An
answer that did nothing for its request (stopping, asleep) is 503 marked
``refused`` in :data:`~ggmux.http1.verdict.REPLICA_HEADER` (the proxy may
send it to another replica); a :class:`ReplicaFault` is answered 500 marked
``fault`` (it counts against the replica's circuit); any other error is the
request's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import orjson
from setproctitle import setproctitle

from .. import compiled
from ..http1 import HttpConnection, Request, json_object
from ..http1.auth import authorized, read_keys
from ..http1.limits import (
    INSTANCE_LIMIT_NAMES,
    limits_from_args,
)
from ..http1.request import TENANT
from ..http1.usage import USAGE_HEADER, cache_tier, usage_line, usage_trailer
from ..http1.verdict import REPLICA_HEADER
from ..shm.logring import log_to_stderr
from . import protocol
from .backend import Backend, ReplicaFault
from .cache.report import report_cache
from .metrics import metrics_text
from .options import make_backend, parse_args, process_title
from .token_routes import TOKEN_KINDS, TokenWork
from .validate import BadRequest, RequestLimits

log = logging.getLogger("ggmux.instance")

__all__ = ["Backend", "BadRequest", "InstanceApp", "ReplicaFault", "main"]


# an answer that did nothing for the request: the proxy may send it to another
# replica; a fault of the replica itself: it counts against its circuit
REFUSED = [(REPLICA_HEADER, b"refused"), (b"retry-after", b"1")]
FAULT = [(REPLICA_HEADER, b"fault")]

ROUTES = {
    b"/v1/chat/completions": "chat",
    b"/chat/completions": "chat",
    b"/v1/completions": "completion",
    b"/completions": "native",  # llama-server's /completions is its /completion
    b"/v1/embeddings": "embedding",
    b"/embeddings": "embedding",
    b"/embedding": "embedding",
    b"/completion": "native",  # llama.cpp's own completion format
    b"/tokenize": "tokenize",
    b"/detokenize": "detokenize",
    b"/apply-template": "apply_template",
    b"/v1/chat/completions/input_tokens": "input_tokens",
    b"/chat/completions/input_tokens": "input_tokens",
}
# llama-server routes this backend has no implementation for (a `cmd`
# instance running llama-server serves them)
UNSUPPORTED = frozenset(
    (b"/infill", b"/rerank", b"/v1/rerank", b"/reranking", b"/v1/responses", b"/v1/messages",
     b"/v1/messages/count_tokens")
)


def native_request(body: dict) -> dict:
    """llama.cpp ``/completion`` body -> OpenAI completion body."""
    out = {k: v for k, v in body.items() if k != "content"}
    n = body.get("n_predict")
    if isinstance(n, int) and not isinstance(n, bool) and n >= -1:
        # n_predict wins over max_tokens (llama-server); -1 and 0: the server's
        # --n-predict, else up to the context. Kept under its own name, which
        # the checks name (and a limit's 400)
        out.pop("max_tokens", None)
        out["n_predict"] = max(n, 0)
    if "mirostat" in body:
        out["mirostat_mode"] = body["mirostat"]
    if "prompt" not in out and "content" in body:
        out["prompt"] = body["content"]
    return out


def native_chunk(chunk: dict, final: bool) -> dict:
    """OpenAI completion (chunk) -> llama.cpp ``/completion`` answer."""
    choice = (chunk.get("choices") or [{}])[0]
    usage = chunk.get("usage") or {}
    out = {"content": choice.get("text") or "", "model": chunk.get("model"),
           "stop": final or choice.get("finish_reason") is not None}
    if usage:
        out["tokens_predicted"] = usage.get("completion_tokens")
        out["tokens_evaluated"] = usage.get("prompt_tokens")
    if choice.get("finish_reason"):
        out["stop_type"] = "limit" if choice["finish_reason"] == "length" else "eos"
    return out


def error_fields(e: Exception) -> dict:
    """A request error's envelope fields beside ``message`` (``param``,
    llama-server's own ``type`` where it has one)."""
    if hasattr(e, "error_fields"):
        return e.error_fields()
    return {"param": getattr(e, "param", None)}


def answer_usage(answer: dict) -> dict | None:
    """OpenAI's ``usage`` of a whole answer (a llama.cpp ``/completion``
    answer has its counts as ``tokens_evaluated``/``tokens_predicted``)."""
    if "usage" in answer or "tokens_evaluated" not in answer:
        return answer.get("usage")
    p, c = answer.get("tokens_evaluated") or 0, answer.get("tokens_predicted") or 0
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


class InstanceApp:
    """HTTP handler of one instance; see the module docstring."""

    def __init__(self, backend: Backend, secret: str | None = None) -> None:
        self.backend = backend
        self.secret = secret.encode() if secret else None
        self.loop = asyncio.get_event_loop()
        # sleep/wake and request set-up (templates, tokenizing, grammars)
        # off the event loop; generation itself runs on the backend's threads
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="instance")
        self.ready = False
        self.stopping = False
        self.rss0 = 0
        self.requests = 0
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self._flushing: set[HttpConnection] = set()  # closed after an error event, not yet gone
        self._flushed = asyncio.Event()
        self._flushed.set()
        self._switching = asyncio.Lock()  # one sleep or wake at a time
        self._loop_thread = threading.get_ident()
        # the token routes on a thread of their own (issue 31, item 1)
        self.tokens = TokenWork(backend, error_fields)
        backend.use_loop(self.loop)

    async def sleep_or_wake(self, cmd: str) -> None:
        """``sleep``: free the weights once the requests in progress end,
        keep the process (state ``sleeping``); ``wake``: load them again
        (``loading`` then ``ready``)."""
        async with self._switching:
            if cmd == "sleep" and self.ready:
                self.ready = False
                await self.loop.run_in_executor(self.executor, self.backend.sleep)
                protocol.emit("sleeping", effective={"host": max(0, protocol.rss_bytes() - self.rss0)})
            elif cmd == "wake" and not self.ready:
                protocol.emit("loading", progress=0.0)
                t0 = time.monotonic()
                try:
                    payload = await self.loop.run_in_executor(self.executor, self.backend.wake)
                except Exception as e:
                    log.exception("wake failed")
                    protocol.emit("error", error=f"{type(e).__name__}: {e}")
                    os._exit(1)
                payload.setdefault("effective", {"host": max(0, protocol.rss_bytes() - self.rss0)})
                payload["load_seconds"] = round(time.monotonic() - t0, 4)
                self.ready = True
                protocol.emit("ready", **payload)

    async def stop(self, drain_s: float) -> None:
        """``exit``: refuse what is not started, give the running requests
        ``drain_s`` seconds (less the KV tiers' ``--cache-save-timeout``
        when they have a disk), write the slots' caches to disk within that
        timeout (issue 29), then end what still runs with an error event."""
        self.stopping = True
        await self.loop.run_in_executor(self.executor, self.backend.refuse_queued,
                                        "the instance is stopping")
        save_s = self.backend.cache_save_timeout()
        drain_s = max(0.0, drain_s - save_s) if save_s else drain_s
        try:
            await asyncio.wait_for(self.idle.wait(), drain_s)
        except TimeoutError:
            log.info("stopping: %d requests still running after %.1f s get an error",
                     self.in_flight, drain_s)
        if save_s:
            await self.loop.run_in_executor(self.executor, self.backend.save_cache)
        await self.loop.run_in_executor(self.executor, self.backend.close,
                                        "the instance is stopping")
        try:  # let the error events reach their clients before the process ends
            await asyncio.wait_for(self.idle.wait(), 1.0)
            await asyncio.wait_for(self._flushed.wait(), 1.0)
        except TimeoutError:
            pass

    def connection_closed(self, conn: HttpConnection) -> None:
        """``on_close`` of every connection (its output is flushed or dropped)."""
        self._flushing.discard(conn)
        if not self._flushing:
            self._flushed.set()

    async def handle(self, conn: HttpConnection, req: Request) -> None:
        path = req.path
        if path == b"/health":
            if self.ready:
                conn.send_json(req, 200, {"status": "ok"})
            else:
                conn.send_error(req, 503, "Loading model", headers=[(b"retry-after", b"1")])
            return
        if not authorized(req, self.secret):
            conn.send_error(req, 401, "this instance takes requests from ggmux's proxies only",
                            code="invalid_api_key", headers=[(b"www-authenticate", b"Bearer")])
            return
        if path in (b"/v1/models", b"/models"):
            conn.send_json(
                req,
                200,
                {
                    "object": "list",
                    "data": [{"id": self.backend.name, "object": "model", "owned_by": "ggmux"}],
                },
            )
            return
        if path == b"/props" and req.method == b"GET":
            conn.send_json(req, 200, {**self.backend.props(), "is_sleeping": not self.ready})
            return
        if path == b"/slots" and req.method == b"GET":
            conn.send_json(req, 200, self.backend.slot_info())
            return
        if path == b"/metrics" and req.method == b"GET":
            conn.send_response(req, 200, self.metrics_text().encode(),
                               b"text/plain; version=0.0.4")
            return
        if path in (b"/cache", b"/cache/clear"):  # the KV tiers (issue 29)
            await self._cache(conn, req)
            return
        if path in UNSUPPORTED:
            conn.send_error(req, 501, f"{path.decode()} is not supported by the "
                            "llama-cpp-python instance (serve this model with a `cmd` "
                            "instance running llama-server)", code="not_implemented")
            return
        kind = ROUTES.get(path)
        if kind is None:
            conn.send_error(req, 404, f"no route for {path.decode('latin-1')}")
            return
        if req.method != b"POST":
            conn.send_error(req, 405, "use POST")
            return
        if kind in TOKEN_KINDS:
            if self._refused(conn, req):
                return
            self.requests += 1
            await self._counted(self.tokens.serve(conn, req, kind))  # body parsed off the loop
            return
        body = json_object(conn, req)
        if body is None:
            return
        if self._refused(conn, req):
            return
        self.requests += 1
        await self._counted(self._generate(conn, req, kind, body))

    async def _counted(self, work) -> None:
        """Await ``work`` counted in ``in_flight`` (a stop waits for it)."""
        self.in_flight += 1
        self.idle.clear()
        try:
            await work
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self.idle.set()

    async def _cache(self, conn: HttpConnection, req: Request) -> None:
        """``GET /cache`` (the KV tiers' figures: :meth:`Backend.cache_report`)
        and ``POST /cache/clear`` (empty them: ``{"cleared": {"ram", "disk"}}``);
        405 for another method (issue 29)."""
        clear = req.path == b"/cache/clear"
        if req.method != (b"POST" if clear else b"GET"):
            conn.send_error(req, 405, "use POST" if clear else "use GET")
            return
        if clear:
            cleared = await self.loop.run_in_executor(self.executor, self.backend.cache_clear)
            conn.send_json(req, 200, {"cleared": cleared})
            return
        conn.send_json(req, 200, self.backend.cache_report())

    def _refused(self, conn: HttpConnection, req: Request) -> bool:
        """Answer 503 marked refused (and True) while stopping or asleep."""
        if self.stopping:
            conn.send_error(req, 503, "the instance is stopping", code="shutting_down",
                            headers=REFUSED)
            return True
        if not self.ready:
            conn.send_error(req, 503, "model is asleep", headers=REFUSED)
            return True
        return False

    def metrics_text(self) -> str:
        """Prometheus text of this instance (:func:`~ggmux.instance.metrics.metrics_text`)."""
        return metrics_text(self.backend, self.requests, self.in_flight)

    async def _generate(self, conn: HttpConnection, req: Request, kind: str, body: dict) -> None:
        loop = self.loop
        native = kind == "native"
        if native:  # a backend with native_answers builds llama.cpp's own shape
            body = native_request(body)
            if getattr(self.backend, "native_answers", False):
                native = False
            else:
                kind = "completion"
        events: asyncio.Queue = asyncio.Queue()

        def sink(what: str, payload) -> None:  # any thread; the loop's most often
            if threading.get_ident() == here:
                events.put_nowait((what, payload))
            else:
                loop.call_soon_threadsafe(events.put_nowait, (what, payload))

        here = self._loop_thread

        rid = (req.header(b"x-request-id") or b"").decode("latin-1")[:64]
        tenant = (req.header(TENANT) or b"").decode("latin-1")[:64]
        try:
            cancel = await loop.run_in_executor(self.executor, self.backend.start, kind, body,
                                                sink, rid, tenant)
        except ValueError as e:  # BadRequest
            conn.send_error(req, 400, str(e), **error_fields(e))
            return
        except Exception as e:
            log.exception("generation failed")
            conn.send_error(req, 500, f"generation failed: {e}",
                            headers=FAULT if isinstance(e, ReplicaFault) else ())
            return

        def gone() -> None:
            cancel()
            events.put_nowait(("gone", None))

        req.on_disconnect = gone
        if req.disconnected:
            gone()
        started = False
        tier = None
        while True:
            what, payload = await events.get()
            if what == "gone" or req.disconnected:
                conn.finish(req)
                return
            if what == "result":
                # the usage line: the proxy's request ring reads it, not the body
                line = usage_line(answer_usage(payload), cache_tier(payload)) if isinstance(
                    payload, dict) else b""
                conn.send_json(req, 200, native_chunk(payload, True) if native else payload,
                               headers=[(USAGE_HEADER, line)] if line else ())
                return
            if what == "chunk":
                if not started:
                    conn.start_stream(req)
                    started = True
                if "timings" in payload:  # the KV tier its prefix came from (issue 29)
                    tier = cache_tier(payload) or tier
                if native:
                    payload = native_chunk(payload, False)
                conn.send_chunk(b"data: " + orjson.dumps(payload) + b"\n\n")
            elif what == "end":
                if not started:
                    conn.start_stream(req)
                if kind != "native" and not native:  # llama.cpp's /completion has no [DONE]
                    conn.send_chunk(b"data: [DONE]\n\n")
                conn.end_stream(req, usage_trailer(payload, tier))  # the usage line, as a trailer
                return
            elif what == "error":
                message = str(payload)
                if not started:  # nothing was sent: a plain answer, retryable when stopping
                    if self.stopping:
                        conn.send_error(req, 503, message, code="shutting_down",
                                        headers=REFUSED)
                    else:
                        conn.send_error(req, 500, f"generation failed: {message}",
                                        headers=FAULT if isinstance(payload, ReplicaFault)
                                        else ())
                    return
                err = {"error": {"message": message, "type": "server_error",
                                 "code": 503 if self.stopping else 500}}
                conn.send_chunk(b"data: " + orjson.dumps(err) + b"\n\n")
                self._flushing.add(conn)
                self._flushed.clear()
                conn.close()  # no terminating chunk: the client cannot take it for a clean end
                conn.finish(req)
                return


def _on_sigterm(supervised: bool) -> Callable[..., None]:
    """The SIGTERM handler: an instance the supervisor runs (``--fd``)
    ignores SIGTERM (logged once). Such a SIGTERM is a group-wide one
    (systemd's ``KillMode=control-group``, ``kill 0``) that reached the
    supervisor too, which drains every stream and then sends ``exit``
    (issue 37, item 9: instances that ``_exit`` on it cut their streams with
    no error event and saved no slot). The supervisor's own escalation past
    the stop-timeout is the ``term`` command (exit 143 at once), then
    SIGTERM, then SIGKILL; a dead supervisor still ends the instance (stdin
    EOF, PR_SET_PDEATHSIG). Run by hand, SIGTERM ends it at once (143).
    Python runs the handler when the main thread next runs, so "SIGTERM
    before ``exit``" cannot be told apart reliably: hence the command."""
    told: list[bool] = []

    def on_term(*_) -> None:
        if not supervised:
            os._exit(143)
        if not told:
            told.append(True)
            log.info("SIGTERM ignored: the supervisor stops this instance once its requests "
                     "are answered")

    return on_term

def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ggmux.instance``; returns the exit code."""
    # one line per record, control characters escaped: the supervisor reads
    # our stderr line by line into the log ring (issue 31, item 3)
    log_to_stderr(logging.INFO, "%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if not args.measure:  # a measure child serves nothing
        # the HTTP core it serves through (the proxy's forward path and
        # balancer are not imported here: numpy and more for nothing)
        compiled.log_status(log, tuple(n for n in compiled.HOT_MODULES if n in sys.modules))
    if not args.model and not args.spare:
        print("--model is required (or --spare)", file=sys.stderr)
        return 2
    setproctitle(process_title(args))
    protocol.claim_stdout()
    # the secret comes through a pipe, never argv or the environment (issue 11)
    secret = read_keys(args.keys_fd).get("secret") if args.keys_fd is not None else None
    state: dict = {"loading": True, "load_event": threading.Event()}
    stop = threading.Event()

    def on_command(cmd: str) -> None:
        if cmd in ("sleep", "wake"):
            loop, app_ = state.get("loop"), state.get("app")
            if loop is not None and app_ is not None:
                loop.call_soon_threadsafe(lambda: loop.create_task(app_.sleep_or_wake(cmd)))
            return
        if cmd.startswith("load ") and "load_args" not in state:
            try:
                state["load_args"] = json.loads(cmd[5:])
            except ValueError:
                log.error("bad load command %r", cmd[:200])
                os._exit(2)
            state["load_event"].set()
            return
        if cmd == "term":  # the supervisor's escalation: what SIGTERM was
            os._exit(143)
        if cmd == "exit":
            if state["loading"]:
                os._exit(0)  # nothing served yet: nothing to finish
            stop.set()
            loop, ev = state.get("loop"), state.get("stop_event")
            if loop is not None and ev is not None:
                loop.call_soon_threadsafe(ev.set)
        else:
            log.warning("unknown command %r", cmd)

    protocol.watch_stdin(on_command)
    signal.signal(signal.SIGTERM, _on_sigterm(supervised=args.fd is not None))
    if args.spare:
        # A spare: pay for the interpreter and the imports now, so that a cold
        # load later costs only the model's own load (the supervisor keeps one
        # ready; see --spares). The listening socket came with the spawn.
        import uvloop

        from . import fake, llama  # noqa: F401

        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            pass
        protocol.emit("spare")
        state["load_event"].wait()
        la = state["load_args"]
        args.model = la["model"]
        args.name = la.get("name")
        args.ctx_size = int(la.get("ctx_size", args.ctx_size))
        args.kv_size = int(la.get("kv_size") or 0)
        args.stop_timeout = float(la.get("stop_timeout", args.stop_timeout))
        args.threads = la.get("threads")
        args.n_gpu_layers = int(la.get("n_gpu_layers", 0))
        args.fake = bool(la.get("fake"))
        args.mmproj = la.get("mmproj")
        args.llama_args = la.get("llama_args") or []
        # the request and HTTP limits of `ggmux serve` (ModelEntry.instance_args)
        given = parse_args(la.get("instance_args") or [])
        for name in (*(f.name for f in fields(RequestLimits)), *INSTANCE_LIMIT_NAMES,
                     "cache_scope", "reasoning_format", "media_fetch"):
            setattr(args, name, getattr(given, name))
        args.slot = la.get("slot")
        setproctitle(process_title(args))
        secret = la.get("secret") or secret
    backend = make_backend(args)
    if args.measure:
        protocol.emit("measured", **backend.measure())
        return 0
    protocol.emit("loading", progress=0.0)
    t0 = time.monotonic()
    rss0 = protocol.rss_bytes()
    try:
        payload = backend.load()
    except Exception as e:
        log.exception("load failed")
        protocol.emit("error", error=f"{type(e).__name__}: {e}")
        return 1
    payload.setdefault("effective", {"host": max(0, protocol.rss_bytes() - rss0)})
    payload["load_seconds"] = round(time.monotonic() - t0, 4)

    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    state["loop"] = loop
    app = InstanceApp(backend, secret)
    app.rss0 = rss0
    state["app"] = app
    limits = limits_from_args(args)
    if args.fd is not None:
        sock = socket.socket(fileno=args.fd)
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((args.host, args.port))
        sock.listen(128)
    sock.setblocking(False)
    server = loop.run_until_complete(
        loop.create_server(lambda: HttpConnection(app.handle, limits,
                                                  on_close=app.connection_closed), sock=sock)
    )
    port = sock.getsockname()[1]
    state["loading"] = False
    app.ready = True
    protocol.emit("ready", port=port, **payload)
    threading.Thread(target=report_cache, args=(backend, stop), name="cache-report",
                     daemon=True).start()

    stop_event = asyncio.Event()
    state["stop_event"] = stop_event
    if stop.is_set():
        stop_event.set()

    async def wait_stop() -> None:
        await stop_event.wait()
        server.close()
        # before the supervisor's SIGTERM: finish, or end with an error event
        await app.stop(max(0.0, args.stop_timeout - 1.0))

    try:
        loop.run_until_complete(wait_stop())
    except KeyboardInterrupt:
        pass
    return 0
