"""The instance process: one model behind an OpenAI-compatible HTTP server.

Shared by the built-in llama-cpp-python instance and the fake instance used
in tests; they differ only in their :class:`Backend`. The process:

1. keeps stdout for state lines and starts the stdin command thread
   (:mod:`ggmux.instance.protocol`);
2. emits ``loading``, loads the backend, emits ``ready`` with ``n_ctx`` and
   ``effective`` memory (bytes), or ``error`` and exits 1;
3. serves HTTP on the listening socket the supervisor passed (``--fd``) or
   on ``--host``/``--port`` when run by hand, one generation at a time
   (llama.cpp contexts are not re-entrant), stopping a generation when its
   client disconnects.

Issue 11: with a secret (from the supervisor's ``--keys-fd`` pipe, or a
spare's ``load`` command) every route but ``/health`` needs it as the bearer
token (401 otherwise), so no local user can go around ggmux's API key. On
``exit`` the generation in progress finishes, and every request not yet
started, or arriving after, gets 503 at once, marked ``refused`` in
:data:`~ggmux.proxy.balancer.REPLICA_HEADER` (the proxy may send it to
another replica). A :class:`ReplicaFault` is answered 500 marked ``fault``
(it counts against the replica's circuit); any other error is the request's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

import orjson
from setproctitle import setproctitle

from ..proxy.auth import authorized, read_keys
from ..proxy.balancer import REPLICA_HEADER
from ..proxy.http import HttpConnection, Request, json_object
from ..proxy.limits import (
    INSTANCE_LIMIT_NAMES,
    add_http_limit_options,
    instance_limits,
    limits_from_args,
)
from . import protocol
from .validate import BadRequest, RequestLimits, add_request_limit_options

log = logging.getLogger("ggmux.instance")

__all__ = ["Backend", "BadRequest", "InstanceApp", "ReplicaFault", "main"]


class ReplicaFault(RuntimeError):
    """The instance itself failed, whatever the request (a broken context,
    a decode error): answered 500 marked ``fault``, so the replica's circuit
    counts it (issue 11)."""


FAULT = [(REPLICA_HEADER, b"fault")]
REFUSED = [(REPLICA_HEADER, b"refused"), (b"retry-after", b"1")]


class Backend:
    """What an instance serves. Methods other than ``load`` run on the one
    generation thread; ``cancel`` is set when the client went away."""

    name: str = "model"

    def load(self) -> dict:
        """Load the model; return the ``ready`` payload (n_ctx, effective)."""
        raise NotImplementedError

    def chat(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        raise NotImplementedError

    def completion(self, body: dict, cancel: threading.Event) -> dict | Iterator[dict]:
        raise NotImplementedError

    def embedding(self, body: dict, cancel: threading.Event) -> dict:
        """OpenAI embeddings; stops early (its answer is dropped) once
        ``cancel`` is set."""
        raise NotImplementedError

    def tokenize(self, body: dict) -> dict:
        """llama.cpp ``/tokenize``: ``{"content", "add_special"}`` -> ``{"tokens"}``."""
        raise BadRequest("tokenize is not supported by this backend")

    def detokenize(self, body: dict) -> dict:
        """llama.cpp ``/detokenize``: ``{"tokens"}`` -> ``{"content"}``."""
        raise BadRequest("detokenize is not supported by this backend")

    def props(self) -> dict:
        """llama.cpp ``/props``-like facts about the loaded model."""
        return {"model_alias": self.name}

    def sleep(self) -> None:
        """Free the weights, keep the process (``--sleep-idle-seconds``)."""

    def wake(self) -> dict:
        """Reload the weights after :meth:`sleep`; the ``ready`` payload."""
        return self.load()


ROUTES = {
    b"/v1/chat/completions": "chat",
    b"/chat/completions": "chat",
    b"/v1/completions": "completion",
    b"/completions": "completion",
    b"/v1/embeddings": "embedding",
    b"/embeddings": "embedding",
    b"/embedding": "embedding",
    b"/completion": "native",  # llama.cpp's own completion format
    b"/tokenize": "tokenize",
    b"/detokenize": "detokenize",
}
# llama-server routes this backend has no implementation for (a `cmd`
# instance running llama-server serves them)
UNSUPPORTED = frozenset(
    (b"/infill", b"/rerank", b"/v1/rerank", b"/reranking", b"/v1/responses", b"/v1/messages",
     b"/v1/messages/count_tokens", b"/apply-template")
)


def native_request(body: dict) -> dict:
    """llama.cpp ``/completion`` body -> OpenAI completion body."""
    out = {k: v for k, v in body.items() if k not in ("n_predict", "content")}
    n = body.get("n_predict")
    if isinstance(n, int) and not isinstance(n, bool) and n >= -1:
        out["max_tokens"] = max(n, 0)  # -1: until the context is full, as 0 is here
    elif n is not None:
        out["n_predict"] = n  # for the checks to name it
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


class InstanceApp:
    """HTTP handler of one instance; see the module docstring."""

    def __init__(self, backend: Backend, secret: str | None = None) -> None:
        self.backend = backend
        self.loop = asyncio.get_event_loop()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="generate")
        self.lock = asyncio.Lock()
        self.ready = False
        self.rss0 = 0
        self.requests = 0
        self.secret = secret.encode() if secret else None
        self.stopping = False  # `exit` came: start nothing new
        self._queued: set[asyncio.Task] = set()  # handlers waiting for the lock
        self._stopped: set[asyncio.Task] = set()  # ... and cancelled by stop()

    def stop(self) -> None:
        """``exit``: no request starts from now on; those queued behind the
        generation in progress are woken to answer 503 at once."""
        self.stopping = True
        for t in self._queued:
            self._stopped.add(t)
            t.cancel()

    async def _turn(self) -> bool:
        """Take the generation lock; False, without it, when the instance
        stops first (a request queued behind a generation must not wait
        for one it will never get)."""
        if self.stopping:
            return False
        task = asyncio.current_task()
        self._queued.add(task)
        try:
            await self.lock.acquire()
        except asyncio.CancelledError:
            if task not in self._stopped:
                raise
            self._stopped.discard(task)
            task.uncancel()
            return False
        finally:
            self._queued.discard(task)
        if self.stopping:  # its turn came with the stop: not started
            self.lock.release()
            return False
        return True

    async def sleep_or_wake(self, cmd: str) -> None:
        """``sleep``: free the weights, keep the process (state ``sleeping``);
        ``wake``: load them again (``loading`` then ``ready``). Runs between
        generations, on the generation thread."""
        async with self.lock:
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
        if self.stopping:
            conn.send_error(req, 503, "the instance is stopping", code="shutting_down",
                            headers=REFUSED)
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
            conn.send_json(req, 200, [{"id": 0, "is_processing": self.lock.locked()}])
            return
        if path == b"/metrics" and req.method == b"GET":
            text = (
                "# TYPE ggmux_instance_requests_total counter\n"
                f"ggmux_instance_requests_total {self.requests}\n"
                "# TYPE ggmux_instance_busy gauge\n"
                f"ggmux_instance_busy {int(self.lock.locked())}\n"
            )
            conn.send_response(req, 200, text.encode(), b"text/plain; version=0.0.4")
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
        body = json_object(conn, req)
        if body is None:
            return
        if not await self._turn():
            conn.send_error(req, 503, "the instance is stopping", code="shutting_down",
                            headers=REFUSED)
            return
        try:
            if req.disconnected:
                conn.finish(req)
                return
            if not self.ready:
                conn.send_error(req, 503, "model is asleep", headers=REFUSED)
                return
            self.requests += 1
            if kind in ("tokenize", "detokenize"):
                fn = getattr(self.backend, kind)
                try:
                    out = await self.loop.run_in_executor(self.executor, fn, body)
                except ValueError as e:
                    conn.send_error(req, 400, str(e), param=getattr(e, "param", None))
                    return
                conn.send_json(req, 200, out)
                return
            await self._generate(conn, req, kind, body)
        finally:
            self.lock.release()

    async def _generate(self, conn: HttpConnection, req: Request, kind: str, body: dict) -> None:
        cancel = threading.Event()
        req.on_disconnect = cancel.set
        loop = self.loop
        backend = self.backend
        native = kind == "native"
        if native:
            kind, body = "completion", native_request(body)
        fn = getattr(backend, kind)

        def encode(chunk: dict) -> bytes:
            if native:
                chunk = native_chunk(chunk, False)
            return b"data: " + orjson.dumps(chunk) + b"\n\n"

        def first():
            out = fn(body, cancel)
            if isinstance(out, dict):
                return out, None
            it = iter(out)
            try:
                chunk = next(it)
            except StopIteration:
                return None, iter(())
            return chunk, it

        try:
            head, it = await loop.run_in_executor(self.executor, first)
        except ValueError as e:  # BadRequest, and llama-cpp-python's (prompt too long)
            conn.send_error(req, 400, str(e), param=getattr(e, "param", None))
            return
        except Exception as e:
            log.exception("generation failed")
            conn.send_error(req, 500, f"generation failed: {e}",
                            headers=FAULT if isinstance(e, ReplicaFault) else ())
            return
        if req.disconnected:  # an embedding batch cut short: nobody to answer
            conn.finish(req)
            return
        if it is None:
            conn.send_json(req, 200, native_chunk(head, True) if native else head)
            return
        conn.start_stream(req)
        if head is not None:
            conn.send_chunk(encode(head))

        def rest() -> None:
            send = conn.send_chunk
            try:
                for chunk in it:
                    if cancel.is_set():
                        break
                    loop.call_soon_threadsafe(send, encode(chunk))
            except Exception as e:  # mid-stream: an error event, never a clean end
                log.exception("generation failed mid-stream")
                err = {"error": {"message": str(e), "type": "server_error", "code": 500}}
                loop.call_soon_threadsafe(send, b"data: " + orjson.dumps(err) + b"\n\n")
                failed.append(e)
                return
            finally:
                close = getattr(it, "close", None)
                if close is not None:
                    close()
            if not cancel.is_set() and not native:  # llama.cpp's /completion has no [DONE]
                loop.call_soon_threadsafe(send, b"data: [DONE]\n\n")

        failed: list[Exception] = []
        await loop.run_in_executor(self.executor, rest)
        if req.disconnected:
            conn.finish(req)
        elif failed:
            conn.close()  # no terminating chunk: the client cannot take it for a clean end
            conn.finish(req)
        else:
            conn.end_stream(req)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ggmux.instance")
    ap.add_argument("--model", default=None, help="GGUF file (or fake behaviour file)")
    ap.add_argument("--spare", action="store_true",
                    help="start, import everything, then wait for a 'load {json}' command")
    ap.add_argument("--name", default=None, help="model name reported in responses")
    ap.add_argument("--fd", type=int, default=None, help="listening socket from the supervisor")
    ap.add_argument("--keys-fd", type=int, default=None,
                    help='inherited pipe holding {"secret": HEX} as JSON (from the supervisor)')
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ctx-size", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--fake", action="store_true", help="use the fake backend (tests)")
    ap.add_argument("--mmproj", default=None, help="multimodal projector (not used yet)")
    ap.add_argument("--llama-args", type=json.loads, default=[],
                    help="other llama.cpp options as a JSON list, e.g. "
                         '\'["--batch-size", "256", "--flash-attn", "on"]\'')
    ap.add_argument("--measure", action="store_true", help="report memory needs and exit")
    add_request_limit_options(ap)
    ap.add_argument("--slot", type=int, default=None,
                    help="the supervisor's replica slot, for the process title")
    # the supervisor passes the header and body limits that fit its proxies'
    add_http_limit_options(ap, instance_limits())
    return ap.parse_args(argv)


def process_title(args: argparse.Namespace) -> str:
    """What ``ps`` shows for this process: ``ggmux: instance NAME #SLOT``,
    ``ggmux: measure NAME`` or ``ggmux: spare`` (issue 15: a spare that took
    a model must not look like one)."""
    if args.spare and not args.model:
        return "ggmux: spare"
    name = args.name or os.path.basename(args.model or "?")
    if args.measure:
        return f"ggmux: measure {name}"
    return f"ggmux: instance {name}" + (f" #{args.slot}" if args.slot is not None else "")


def make_backend(args: argparse.Namespace) -> Backend:
    if args.fake:
        from .fake import FakeBackend

        return FakeBackend(args)
    from .llama import LlamaBackend

    return LlamaBackend(args)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m ggmux.instance``; returns the exit code."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s"
    )
    args = parse_args(argv)
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
    signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
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
        args.threads = la.get("threads")
        args.n_gpu_layers = int(la.get("n_gpu_layers", 0))
        args.fake = bool(la.get("fake"))
        args.mmproj = la.get("mmproj")
        args.llama_args = la.get("llama_args") or []
        # the request and HTTP limits of `ggmux serve` (ModelEntry.instance_args)
        given = parse_args(la.get("instance_args") or [])
        for name in (*(f.name for f in fields(RequestLimits)), *INSTANCE_LIMIT_NAMES):
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
        loop.create_server(lambda: HttpConnection(app.handle, limits), sock=sock)
    )
    port = sock.getsockname()[1]
    state["loading"] = False
    app.ready = True
    protocol.emit("ready", port=port, **payload)

    stop_event = asyncio.Event()
    state["stop_event"] = stop_event
    if stop.is_set():
        stop_event.set()

    async def wait_stop() -> None:
        await stop_event.wait()
        app.stop()  # requests not started get 503 now
        server.close()
        # let the generation in progress finish (stop-timeout bounds it)
        async with app.lock:
            pass

    try:
        loop.run_until_complete(wait_stop())
    except KeyboardInterrupt:
        pass
    return 0
