"""A tiny OpenAI-compatible server for testing the benchmark harness.

Standard library only (asyncio streams). It answers:

* ``POST /v1/chat/completions`` and ``POST /v1/completions``, streaming
  (SSE over chunked transfer encoding) or not: ``max_tokens`` tokens
  (default 16), the first after ``ttft`` seconds, the rest ``token_delay``
  seconds apart;
* ``GET /health`` (200 ``{"status": "ok"}``), ``GET /v1/models`` (with
  llama.cpp router's ``status.value``);
* ``POST /tokenize`` (llama.cpp's shape): one token per whitespace-separated
  word of ``content``;
* ``POST /models/load`` and ``POST /models/unload`` with ``{"model": name}``:
  a request for an unloaded model first waits ``load_delay`` seconds, so the
  cold-switch part of ``bench.compare`` can be exercised without a model.

Requests for a model outside ``models`` (when given) get 404 in OpenAI's
error envelope. Connections are HTTP/1.1 keep-alive.

Use in a test::

    with FakeServerThread() as server:
        run(BenchConfig(base_url=server.base_url, ...))

or from a shell: ``python -m bench.fake_openai --port 8081``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Self

logger = logging.getLogger(__name__)

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


@dataclass(slots=True)
class FakeOpenAIServer:
    """The fake server; times in seconds.

    Attributes:
        host: address to bind.
        port: port to bind, 0 for a free one (read ``port`` after ``start``).
        ttft: delay before the first token.
        token_delay: delay between later tokens.
        load_delay: extra delay of the first request to an unloaded model.
        models: model names served; ``None`` accepts any name (loaded).
        served: completion requests answered so far (for tests).
        prompts: the prompt of each completion request, in arrival order
            (a chat's last message content; for tests).
    """

    host: str = "127.0.0.1"
    port: int = 0
    ttft: float = 0.02
    token_delay: float = 0.005
    load_delay: float = 0.2
    models: Sequence[str] | None = None
    served: int = 0
    prompts: list[str] = field(default_factory=list)
    _unloaded: set[str] = field(default_factory=set)
    _server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        """Start listening; returns the bound port."""
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        logger.info("fake OpenAI server on http://%s:%d", self.host, self.port)
        return self.port

    async def close(self) -> None:
        """Stop listening and drop open connections."""
        if self._server is not None:
            self._server.close()
            if hasattr(self._server, "close_clients"):  # Python 3.13+
                self._server.close_clients()
            await self._server.wait_closed()
            self._server = None

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return f"http://{self.host}:{self.port}"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, path, _ = lines[0].split(" ", 2)
                headers = {
                    k.strip().lower(): v.strip()
                    for k, _, v in (line.partition(":") for line in lines[1:] if line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                await self._route(method, path, body, writer)
                if headers.get("connection", "").lower() == "close":
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _route(
        self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter
    ) -> None:
        path = path.split("?", 1)[0]
        if method == "GET" and path == "/health":
            await _send_json(writer, 200, {"status": "ok"})
        elif method == "GET" and path in ("/v1/models", "/models"):
            await _send_json(writer, 200, self._model_list())
        elif method == "POST" and path in ("/models/load", "/models/unload"):
            name = _json_or_empty(body).get("model", "")
            if path.endswith("unload"):
                self._unloaded.add(name)
            else:
                self._unloaded.discard(name)
            await _send_json(writer, 200, {"success": True})
        elif method == "POST" and path == "/tokenize":
            words = str(_json_or_empty(body).get("content", "")).split()
            await _send_json(writer, 200, {"tokens": list(range(len(words)))})
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(path, _json_or_empty(body), writer)
        else:
            await _send_json(writer, 404, _error(f"no route {method} {path}", "not_found"))

    def _model_list(self) -> dict[str, Any]:
        names = list(self.models or ["fake"])
        return {
            "object": "list",
            "data": [
                {
                    "id": n,
                    "object": "model",
                    "owned_by": "fake",
                    "status": {"value": "unloaded" if n in self._unloaded else "loaded"},
                }
                for n in names
            ],
        }

    async def _complete(
        self, path: str, request: dict[str, Any], writer: asyncio.StreamWriter
    ) -> None:
        model = str(request.get("model", "fake"))
        if self.models is not None and model not in self.models:
            await _send_json(writer, 404, _error(f"model {model!r} not found", "model_not_found"))
            return
        n = int(request.get("max_tokens") or 16)
        chat = path.endswith("chat/completions")
        created = int(time.time())
        if model in self._unloaded:
            await asyncio.sleep(self.load_delay)
            self._unloaded.discard(model)
        self.served += 1
        messages = request.get("messages") or [{}]
        self.prompts.append(str(messages[-1].get("content", "") if chat else request.get("prompt")))
        if not request.get("stream"):
            await asyncio.sleep(self.ttft + self.token_delay * max(n - 1, 0))
            text = " ".join(f"tok{i}" for i in range(n))
            choice: dict[str, Any] = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "length",
                }
                if chat
                else {"index": 0, "text": text, "finish_reason": "length"}
            )
            await _send_json(
                writer,
                200,
                {
                    "id": "fake-1",
                    "object": "chat.completion" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                    "usage": {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n},
                },
            )
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
            b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        for i in range(n):
            await asyncio.sleep(self.ttft if i == 0 else self.token_delay)
            piece = f"tok{i} "
            choice = (
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                if chat
                else {"index": 0, "text": piece, "finish_reason": None}
            )
            event = {
                "id": "fake-1",
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [choice],
            }
            _write_chunk(writer, b"data: " + json.dumps(event).encode() + b"\n\n")
            await writer.drain()
        _write_chunk(writer, b"data: [DONE]\n\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()


def _error(message: str, code: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": code}}


def _json_or_empty(body: bytes) -> dict[str, Any]:
    try:
        value = json.loads(body or b"{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _write_chunk(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(b"%x\r\n%s\r\n" % (len(data), data))


async def _send_json(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    writer.write(
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()


class FakeServerThread:
    """Runs a :class:`FakeOpenAIServer` on its own event loop in a daemon thread.

    A context manager: entering starts the server and waits (up to 10 s)
    until it listens; leaving stops it and joins the thread.
    """

    def __init__(self, **options: Any) -> None:
        self.server = FakeOpenAIServer(**options)
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="fake-openai", daemon=True)

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running server."""
        return self.server.base_url

    def __enter__(self) -> Self:
        self._thread.start()
        if not self._ready.wait(10.0) or self._error is not None:
            raise RuntimeError(f"fake server did not start: {self._error}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10.0)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except Exception as exc:  # noqa: BLE001  # reported to __enter__
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        await self.server.start()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await self.server.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m bench.fake_openai``: serve until interrupted."""
    p = argparse.ArgumentParser(
        prog="python -m bench.fake_openai", description=__doc__.split("\n")[0]
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8081)
    p.add_argument("--ttft", type=float, default=0.02, help="seconds to the first token")
    p.add_argument("--token-delay", type=float, default=0.005, help="seconds between tokens")
    p.add_argument("--load-delay", type=float, default=0.2, help="seconds to 'load' a model")
    p.add_argument("--models", help="comma-separated model names (default: any)")
    p.add_argument("--uvloop", action="store_true",
                   help="run on uvloop (a cheaper upstream for bench.proxy_cost)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    server = FakeOpenAIServer(
        host=args.host,
        port=args.port,
        ttft=args.ttft,
        token_delay=args.token_delay,
        load_delay=args.load_delay,
        models=args.models.split(",") if args.models else None,
    )

    async def serve() -> None:
        await server.start()
        print(f"listening on {server.base_url}", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await server.close()

    if args.uvloop:
        import uvloop

        uvloop.install()
    try:
        asyncio.run(serve())
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
