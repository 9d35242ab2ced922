"""The serving harness's HTTP/1.1 client (:mod:`bench.serving`): a
keep-alive connection pool on asyncio streams, a response reader (chunked
and SSE), and the client that sends one planned request and times its
answer (TTFT, inter-token gaps, tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from bench.stats import (
    inter_token_gaps,
    tpot,
)

logger = logging.getLogger(__name__)

from bench.serving_config import DEFAULT_PATHS, BenchConfig, RequestResult, RequestSpec

# --------------------------------------------------------------------------
# HTTP/1.1 client


class HTTPError(Exception):
    """The server answered something this client cannot parse."""


@dataclass(slots=True)
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    reused: bool = False


class ConnectionPool:
    """Keep-alive HTTP/1.1 connections to one ``host:port``.

    Connections are opened on demand and kept idle for reuse; the number
    open is bounded by the caller's concurrency, not here.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._idle: list[_Connection] = []
        self.opened = 0

    async def acquire(self) -> _Connection:
        """An idle connection, or a new one (raises ``OSError`` on connect)."""
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                conn.reused = True
                return conn
            conn.writer.close()
        reader, writer = await asyncio.open_connection(self.host, self.port, limit=1 << 20)
        self.opened += 1
        return _Connection(reader, writer)

    def release(self, conn: _Connection, keep: bool) -> None:
        """Return ``conn`` for reuse when ``keep``, else close it."""
        if keep and not conn.writer.is_closing():
            self._idle.append(conn)
        else:
            conn.writer.close()

    async def close(self) -> None:
        """Close every idle connection."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.writer.close()
        for conn in idle:
            with contextlib.suppress(OSError):
                await conn.writer.wait_closed()


@dataclass(slots=True)
class _Response:
    status: int
    headers: dict[str, str]
    conn: _Connection
    keep_alive: bool


async def _read_head(conn: _Connection) -> _Response:
    raw = await conn.reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
        raise HTTPError(f"bad status line {lines[0]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    keep = parts[0] == "HTTP/1.1" and headers.get("connection", "").lower() != "close"
    return _Response(int(parts[1]), headers, conn, keep)


async def _iter_body(resp: _Response) -> AsyncIterator[bytes]:
    """Yield the response body as it arrives (content-length, chunked or to EOF)."""
    reader = resp.conn.reader
    if resp.status in (204, 304) or 100 <= resp.status < 200:
        return  # no body by definition (RFC 9112, 6.3)
    if "chunked" in resp.headers.get("transfer-encoding", "").lower():
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                # trailers, then the empty line that ends the message
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in resp.headers:
        remaining = int(resp.headers["content-length"])
        while remaining > 0:
            data = await reader.read(min(remaining, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
            yield data
    else:
        resp.keep_alive = False
        while data := await reader.read(1 << 16):
            yield data


async def _send(pool: ConnectionPool, head: bytes, body: bytes) -> _Response:
    """Write one request and read the response head, retrying once on a stale connection."""
    for attempt in (0, 1):
        conn = await pool.acquire()
        try:
            conn.writer.write(head + body)
            await conn.writer.drain()
            return await _read_head(conn)
        except (asyncio.IncompleteReadError, ConnectionError):
            pool.release(conn, keep=False)
            # A keep-alive connection the server closed while idle fails
            # before any byte comes back: try once more on a fresh one.
            if not conn.reused or attempt:
                raise
        except BaseException:
            pool.release(conn, keep=False)
            raise
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------
# one request


def _request_body(config: BenchConfig, spec: RequestSpec) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.max_tokens,
        "temperature": config.temperature,
        "stream": config.stream,
    }
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
    else:
        body["prompt"] = spec.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    body.update(config.extra_body)
    return body


def _chunk_content(event: dict[str, Any]) -> str:
    """The generated text in one streamed chunk (chat delta or completion text)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


class _Client:
    """Sends requests of one run and fills their :class:`RequestResult`."""

    def __init__(self, config: BenchConfig) -> None:
        url = urlsplit(config.base_url)
        self.config = config
        self.pool = ConnectionPool(url.hostname or "127.0.0.1", url.port or 80)
        prefix = url.path.rstrip("/")
        path = config.path or DEFAULT_PATHS[config.endpoint]
        if prefix.endswith("/v1") and path.startswith("/v1/"):
            prefix = prefix[: -len("/v1")]
        self.path = prefix + path
        self.method = "GET" if config.endpoint == "get" else "POST"
        host = url.netloc
        auth = f"Authorization: Bearer {config.api_key}\r\n" if config.api_key else ""
        self._head_prefix = f"{self.method} {self.path} HTTP/1.1\r\nHost: {host}\r\n{auth}"

    def _encode(self, spec: RequestSpec) -> tuple[bytes, bytes]:
        if self.method == "GET":
            return (self._head_prefix + "\r\n").encode(), b""
        body = json.dumps(_request_body(self.config, spec)).encode()
        accept = "text/event-stream" if self.config.stream else "application/json"
        head = (
            f"{self._head_prefix}Content-Type: application/json\r\nAccept: {accept}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode(), body

    async def send(self, spec: RequestSpec, result: RequestResult) -> None:
        """Send ``spec`` and record into ``result``; never raises but cancellation."""
        head, body = self._encode(spec)
        result.prompt_text_tokens = spec.prompt_text_tokens
        start = time.perf_counter()
        held: list[_Response] = []
        try:
            await asyncio.wait_for(
                self._exchange(head, body, start, result, held), self.config.timeout
            )
            result.e2e = time.perf_counter() - start
            result.ok = result.status == 200 and result.error is None
        except TimeoutError:
            result.error = f"timeout after {self.config.timeout:g} s"
        except (
            OSError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            HTTPError,
            ValueError,
        ) as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            for resp in held:
                self.pool.release(resp.conn, keep=resp.keep_alive and result.e2e is not None)
        result.tpot = tpot(result.ttft, result.e2e, result.output_tokens)

    async def _exchange(
        self, head: bytes, body: bytes, start: float, result: RequestResult, held: list[_Response]
    ) -> None:
        resp = await _send(self.pool, head, body)
        held.append(resp)
        result.ttfb = time.perf_counter() - start
        result.status = resp.status
        if resp.status == 200 and self.config.stream and self.method == "POST":
            await self._read_stream(resp, start, result)
        else:
            await self._read_whole(resp, result)

    async def _read_whole(self, resp: _Response, result: RequestResult) -> None:
        data = b"".join([chunk async for chunk in _iter_body(resp)])
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {data[:200].decode('utf-8', 'replace')}"
            return
        if self.method == "GET":
            return
        payload = json.loads(data)
        usage = payload.get("usage") or {}
        result.output_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = usage.get("prompt_tokens")

    async def _read_stream(self, resp: _Response, start: float, result: RequestResult) -> None:
        buffer = b""
        arrivals: list[float] = []  # of content events, seconds after ``start``
        usage: dict[str, Any] = {}
        async for data in _iter_body(resp):
            buffer = (buffer + data).replace(b"\r\n", b"\n")
            while (end := buffer.find(b"\n\n")) >= 0:
                event, buffer = buffer[:end], buffer[end + 2 :]
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    message = json.loads(payload)
                    if "error" in message:
                        result.error = json.dumps(message["error"])[:200]
                        continue
                    if _chunk_content(message):
                        arrivals.append(time.perf_counter() - start)
                    usage = message.get("usage") or usage
        if arrivals:
            result.ttft = arrivals[0]
            result.itl = inter_token_gaps(arrivals)
        result.output_tokens = int(usage.get("completion_tokens") or len(arrivals))
        result.prompt_tokens = usage.get("prompt_tokens")
        if result.ttft is None and result.error is None:
            result.error = "stream ended without content"


