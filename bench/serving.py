"""Open-loop load generator for OpenAI-compatible servers.

Requests arrive as a Poisson process at ``rate`` requests per second (or all
at once, gated by ``max_concurrency``, when the rate is infinite: a closed
loop of that many connections). Each request names a model drawn from a
weighted mix and carries a synthetic prompt. Per request it records:

* ``ttfb``: seconds from writing the request to the end of the response
  headers;
* ``ttft``: seconds to the first SSE ``data:`` event that carries content
  (streaming only);
* ``tpot``: seconds per output token after the first,
  ``(e2e - ttft) / (output_tokens - 1)`` (streaming, two tokens or more);
* ``itl``: the gaps between successive content events (streaming; their
  pooled percentiles are the run's inter-token latency);
* ``e2e``: seconds from writing the request to the end of the response body;
* the HTTP status (0 when no response came), the model, the output token
  count and any error text.

The HTTP client is a small HTTP/1.1 keep-alive client on asyncio streams
(content-length and chunked bodies), so the generator needs nothing outside
the standard library and spends as little CPU as possible next to the
servers it measures. uvloop is used when installed; tqdm draws the progress
bar when installed; matplotlib draws ``--plot`` charts when installed.

Usage (from the repository root)::

    python -m bench.serving --base-url http://127.0.0.1:8080 \\
        --models smollm2-135m:3,gemma3-270m:1 --rate 2 --duration 30 \\
        --max-tokens 64 --out out.json --plot bench/out

``--concurrency 1,4,8`` runs a closed-loop sweep, one run per level
(``--requests`` or ``--duration`` each), and ``--slo ttft=1s,tpot=50ms``
adds goodput (requests per second that met every bound), as ``vllm bench
serve`` does; statistics live in :mod:`bench.stats`. ``--prompt-tokens
100`` makes every prompt exactly 100 tokens of text, counted by the
server's ``/tokenize`` or a GGUF file's tokenizer (``--tokenizer``;
:mod:`bench.prompts`), so every target serving a model gets the same input.

Library use::

    from bench.serving import BenchConfig, run
    results = run(BenchConfig(base_url=..., models=[("m", 1.0)], requests=10))
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prompts import TokenCounter, make_counter, make_prompt, sized_prompt
from bench.report import format_summary, format_sweep, plot
from bench.stats import (
    SLO_METRICS,
    describe,
    inter_token_gaps,
    parse_slo,
    percentile,
    summarize,
    tpot,
)

__all__ = ["BenchConfig", "RequestResult", "RequestSpec", "describe", "format_summary",
           "format_sweep", "make_prompt", "percentile", "plan", "run", "summarize", "sweep"]

logger = logging.getLogger(__name__)

ENDPOINTS = ("chat", "completions", "get")
"""``chat``: POST /v1/chat/completions; ``completions``: POST /v1/completions;
``get``: GET ``path`` (a cheap path such as /health, for proxy overhead)."""

DEFAULT_PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "get": "/health",
}

# --------------------------------------------------------------------------
# configuration


@dataclass(slots=True)
class BenchConfig:
    """One benchmark run.

    Attributes:
        base_url: server root, ``http://host:port`` (a trailing ``/v1`` is
            accepted and folded into the endpoint path). HTTPS is not
            supported.
        models: ``(name, weight)`` pairs; each request draws a model with
            probability proportional to its weight.
        rate: mean arrival rate in requests per second (Poisson process);
            ``math.inf`` sends as fast as ``max_concurrency`` allows.
        duration: seconds over which arrivals are generated; with an
            infinite rate, seconds during which new requests are started.
        requests: number of requests (overrides ``duration`` when set).
        max_concurrency: most requests in flight (and so connections);
            ``None`` for no limit (required with an infinite rate and a
            duration).
        max_tokens: ``(low, high)`` output tokens requested, uniform.
        prompt_words: ``(low, high)`` words of synthetic prompt, uniform.
        prompt_tokens: when set, every prompt is this many tokens instead
            (:func:`bench.prompts.sized_prompt`; the text alone, without the
            chat template), counted by ``tokenizer``; the whole plan is then
            made before the first request, so it must be finite (``requests``,
            or a finite ``rate`` with a ``duration``).
        tokenizer: ``server`` (the target's ``POST /tokenize``) or the path
            of a GGUF file whose tokenizer counts (:func:`bench.prompts.make_counter`).
        stream: request SSE streaming (TTFT is measured only then).
        endpoint: one of :data:`ENDPOINTS`.
        path: request path overriding the endpoint's default.
        temperature: sampling temperature sent with each request.
        ignore_eos: send ``ignore_eos: true`` (llama.cpp's server honours
            it; others ignore or reject it).
        extra_body: fields merged into every JSON request body.
        drain: for a closed loop over a duration, wait for the requests
            still in flight when the duration ends (True), or cancel them
            and leave them out (False): the run then lasts ``duration``
            seconds and its throughput counts completions inside that
            window only, however slow the tail.
        warmup: requests sent (one model each, round robin) before
            measuring, excluded from the results; they also open the first
            keep-alive connections.
        seed: seed of the arrival times, model draws and prompts; equal
            seeds give equal workloads.
        timeout: seconds one request may take in all before it is recorded
            as failed (status 0).
        api_key: sent as ``Authorization: Bearer`` when set.
        progress: draw a progress bar on stderr.
        slo: bounds in seconds per metric (:data:`bench.stats.SLO_METRICS`)
            a request must meet to count for goodput; empty for no goodput.
    """

    base_url: str = "http://127.0.0.1:8080"
    models: list[tuple[str, float]] = field(default_factory=lambda: [("default", 1.0)])
    rate: float = 1.0
    duration: float | None = 10.0
    requests: int | None = None
    max_concurrency: int | None = None
    max_tokens: tuple[int, int] = (64, 64)
    prompt_words: tuple[int, int] = (32, 32)
    prompt_tokens: int | None = None
    tokenizer: str = "server"
    stream: bool = True
    endpoint: str = "chat"
    path: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    drain: bool = True
    warmup: int = 0
    seed: int = 0
    timeout: float = 300.0
    api_key: str | None = None
    progress: bool = True
    slo: dict[str, float] = field(default_factory=dict)

    def validate(self) -> None:
        """Raise ``ValueError`` when the configuration cannot run."""
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, not {self.endpoint!r}")
        if not self.models or any(w <= 0 for _, w in self.models):
            raise ValueError("models needs at least one model with a positive weight")
        if self.rate <= 0:
            raise ValueError("rate must be positive (use math.inf for a closed loop)")
        if self.requests is None and self.duration is None:
            raise ValueError("set requests or duration")
        if self.requests is None and math.isinf(self.rate) and not self.max_concurrency:
            raise ValueError("an infinite rate over a duration needs max_concurrency")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be at least 1")
        for name, (lo, hi) in (
            ("max_tokens", self.max_tokens),
            ("prompt_words", self.prompt_words),
        ):
            if lo < 0 or hi < lo:
                raise ValueError(f"{name} must be a range low <= high, not {(lo, hi)}")
        if self.prompt_tokens is not None:
            if self.prompt_tokens < 1:
                raise ValueError(f"prompt_tokens must be at least 1, not {self.prompt_tokens}")
            if self.requests is None and math.isinf(self.rate):
                raise ValueError(
                    "prompt_tokens needs a finite plan: set requests, or a finite rate"
                )
        for name in self.slo:
            if name not in SLO_METRICS:
                raise ValueError(f"unknown SLO metric {name!r} (one of {', '.join(SLO_METRICS)})")
            if name in ("ttft", "itl", "tpot") and not self.stream:
                raise ValueError(f"an SLO on {name} needs streaming requests")
        if urlsplit(self.base_url).scheme != "http":
            raise ValueError(f"base_url must be http://host:port, not {self.base_url!r}")


@dataclass(slots=True)
class RequestSpec:
    """One planned request: when (seconds after start), which model, what body.

    ``prompt_text_tokens``: the prompt's tokens as the tokenizer counted
    them when it was sized (``BenchConfig.prompt_tokens``), else None.
    """

    index: int
    at: float
    model: str
    prompt: str
    max_tokens: int
    prompt_text_tokens: int | None = None


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds, ``t_sent`` since start.

    ``prompt_tokens`` is the server's count (``usage``, chat template
    included); ``prompt_text_tokens`` the planned count of the text alone.
    ``itl`` holds the gaps between successive content events.
    """

    index: int
    model: str
    t_sent: float
    status: int = 0
    ok: bool = False
    error: str | None = None
    queue_delay: float = 0.0
    ttfb: float | None = None
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    prompt_text_tokens: int | None = None
    itl: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------
# workload


def _uniform_int(rng: random.Random, bounds: tuple[int, int]) -> int:
    lo, hi = bounds
    return lo if lo == hi else rng.randint(lo, hi)


def plan(config: BenchConfig, counter: TokenCounter | None = None) -> Iterator[RequestSpec]:
    """Yield the requests of ``config`` in arrival order (deterministic per seed).

    Arrival times are seconds after the start: exponential gaps of mean
    ``1 / rate`` (a Poisson process), or all 0 for an infinite rate. With
    ``requests`` unset the plan ends after ``duration`` seconds of arrivals;
    for an infinite rate it is endless and the caller stops dispatching.
    With ``config.prompt_tokens`` the prompts are sized by ``counter``
    (``ValueError`` without one); the arrival times and models stay those
    of the same seed without it.
    """
    if config.prompt_tokens is not None and counter is None:
        raise ValueError("prompt_tokens needs a token counter")
    rng = random.Random(config.seed)
    names = [name for name, _ in config.models]
    weights = [weight for _, weight in config.models]
    at = 0.0
    index = 0
    while config.requests is None or index < config.requests:
        if not math.isinf(config.rate):
            at += rng.expovariate(config.rate)
            if config.requests is None and config.duration is not None and at > config.duration:
                return
        model = rng.choices(names, weights)[0]
        words = _uniform_int(rng, config.prompt_words)
        max_tokens = _uniform_int(rng, config.max_tokens)
        # the prompt has its own generator: however many values sizing it
        # draws, the arrival times and models of a seed stay the same
        prompt_rng = random.Random(rng.getrandbits(64))
        if config.prompt_tokens is None:
            yield RequestSpec(index, at, model, make_prompt(prompt_rng, words), max_tokens)
        else:
            text, n = sized_prompt(prompt_rng, config.prompt_tokens, model, counter)
            yield RequestSpec(index, at, model, text, max_tokens, n)
        index += 1


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


# --------------------------------------------------------------------------
# progress


class _Progress:
    """tqdm when installed, else one line on stderr rewritten once a second."""

    def __init__(self, enabled: bool, total: int | None) -> None:
        self.enabled = enabled
        self.total = total
        self.done = 0
        self.failed = 0
        self._bar: Any = None
        self._last = 0.0
        self._start = time.monotonic()
        if not enabled:
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._bar = tqdm(total=total, unit="req", dynamic_ncols=True, leave=False)

    def update(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
            if not ok:
                self._bar.set_postfix(failed=self.failed, refresh=False)
            return
        now = time.monotonic()
        if now - self._last >= 1.0:
            self._last = now
            of = f"/{self.total}" if self.total else ""
            sys.stderr.write(
                f"\r{self.done}{of} done, {self.failed} failed, {now - self._start:.0f} s"
            )
            sys.stderr.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled and self.done:
            sys.stderr.write("\n")


# --------------------------------------------------------------------------
# the run


async def run_async(config: BenchConfig) -> dict[str, Any]:
    """Run ``config`` on the current event loop; see :func:`run` for the result."""
    config.validate()
    client = _Client(config)
    try:
        specs: Iterable[RequestSpec] = plan(config)
        counter = None
        if config.prompt_tokens is not None:
            # sized before the first request: counting may ask the server
            counter = await asyncio.to_thread(
                make_counter, config.tokenizer, config.base_url, config.api_key
            )
            specs = await asyncio.to_thread(list, plan(config, counter))
        if config.warmup:
            await _warmup(client, config, counter)
        return await _measure(client, config, specs)
    finally:
        await client.pool.close()


def _warmup_specs(config: BenchConfig, counter: TokenCounter | None) -> list[RequestSpec]:
    rng = random.Random(config.seed ^ 0x5EED)
    specs = []
    for i in range(config.warmup):
        model = config.models[i % len(config.models)][0]
        if config.prompt_tokens is None or counter is None:
            prompt, n = make_prompt(rng, config.prompt_words[0]), None
        else:
            prompt, n = sized_prompt(rng, config.prompt_tokens, model, counter)
        specs.append(RequestSpec(-1 - i, 0.0, model, prompt, config.max_tokens[0], n))
    return specs


async def _warmup(client: _Client, config: BenchConfig, counter: TokenCounter | None) -> None:
    width = config.max_concurrency or config.warmup
    specs = await asyncio.to_thread(_warmup_specs, config, counter)
    for i in range(0, len(specs), width):
        batch = specs[i : i + width]
        results = [RequestResult(s.index, s.model, 0.0) for s in batch]
        await asyncio.gather(*(client.send(s, r) for s, r in zip(batch, results, strict=True)))
        for r in results:
            if not r.ok:
                logger.warning("warm-up request to %s failed: %s", r.model, r.error)


async def _measure(
    client: _Client, config: BenchConfig, specs: Iterable[RequestSpec]
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    limit = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    progress = _Progress(config.progress, config.requests)
    records: list[RequestResult] = []
    running: dict[asyncio.Task[None], RequestResult] = {}
    closed_loop_until = (
        config.duration if config.requests is None and math.isinf(config.rate) else None
    )

    async def one(spec: RequestSpec, result: RequestResult) -> None:
        try:
            await client.send(spec, result)
            progress.update(result.ok)
        finally:
            if limit is not None:
                limit.release()

    async def dispatch() -> None:
        for spec in specs:
            delay = t0 + spec.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            arrived = loop.time()
            if limit is not None:
                await limit.acquire()
            now = loop.time()
            if closed_loop_until is not None and now - t0 >= closed_loop_until:
                limit.release()  # type: ignore[union-attr]  # set by validate()
                return
            result = RequestResult(spec.index, spec.model, now - t0, queue_delay=now - arrived)
            records.append(result)
            task = asyncio.create_task(one(spec, result))
            running[task] = result
            task.add_done_callback(running.pop)

    started_at = datetime.now(UTC).isoformat(timespec="seconds")
    t0 = loop.time()
    dispatcher = asyncio.create_task(dispatch())
    cut: list[RequestResult] = []
    try:
        if closed_loop_until is not None and not config.drain:
            await asyncio.sleep(closed_loop_until)
            cut = list(running.values())
        else:
            await dispatcher
            while running:
                await asyncio.gather(*list(running))
    finally:
        dispatcher.cancel()
        pending = list(running)
        for task in pending:
            task.cancel()
        await asyncio.gather(dispatcher, *pending, return_exceptions=True)
        progress.close()
    elapsed = closed_loop_until if cut else loop.time() - t0
    if cut:  # in flight at the end of the window: neither done nor failed
        cut_ids = {id(r) for r in cut}
        records = [r for r in records if id(r) not in cut_ids]
    per_model = {
        name: summarize([r for r in records if r.model == name], elapsed, config.slo)
        for name, _ in config.models
    }
    return {
        "config": asdict(config),
        "started_at": started_at,
        "connections_opened": client.pool.opened,
        "cut_at_window_end": len(cut),
        "summary": summarize(records, elapsed, config.slo),
        "per_model": per_model,
        "requests": [asdict(r) for r in records],
    }


def run(config: BenchConfig) -> dict[str, Any]:
    """Run one benchmark and return its results.

    Returns a JSON-serialisable dict: ``config``, ``started_at`` (UTC ISO
    time), ``connections_opened``, ``cut_at_window_end`` (requests left out
    by ``drain=False``), ``summary`` and ``per_model`` (see
    :func:`summarize`; latencies in seconds) and ``requests`` (one
    :class:`RequestResult` dict per measured request, in dispatch order).

    Uses uvloop when installed. Raises ``ValueError`` for an invalid config
    and ``RuntimeError`` when called from a running event loop (use
    :func:`run_async` there).
    """
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_async(config))
    return uvloop.run(run_async(config))


def sweep(
    config: BenchConfig, levels: Sequence[int], fresh_prompts: bool = False
) -> dict[str, Any]:
    """One closed-loop run of ``config`` per concurrency level, in the order given.

    Each run: rate infinite, ``max_concurrency`` = level, ``requests`` or
    ``duration`` as configured. Every level gets the same prompts (the
    same seed), as ``vllm bench serve`` does; a server with a prompt cache
    may then answer a later level's prompts from an earlier one's, so
    ``fresh_prompts`` gives level ``i`` the seed ``seed + i`` instead.
    Returns ``{"levels": [{"concurrency": c, **run result}]}``; see
    :func:`run`. Raises ``ValueError`` for a level below 1.
    """
    if any(c < 1 for c in levels):
        raise ValueError(f"concurrency levels must be at least 1, not {list(levels)}")
    out = []
    for i, c in enumerate(levels):
        seed = config.seed + i if fresh_prompts else config.seed
        cfg = replace(config, rate=math.inf, max_concurrency=c, seed=seed)
        out.append({"concurrency": c, **run(cfg)})
    return {"levels": out}


# --------------------------------------------------------------------------
# command line


def parse_models(text: str) -> list[tuple[str, float]]:
    """``"a:3,b:1"`` or ``"a,b"`` to ``[("a", 3.0), ("b", 1.0)]``."""
    models = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, weight = item.rpartition(":") if ":" in item else (item, "", "1")
        models.append((name, float(weight)))
    return models


def parse_range(text: str) -> tuple[int, int]:
    """``"64"`` to ``(64, 64)``, ``"32-128"`` to ``(32, 128)``."""
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def build_parser() -> argparse.ArgumentParser:
    """The ``bench.serving`` command line."""
    p = argparse.ArgumentParser(
        prog="python -m bench.serving",
        description="Open-loop load generator for OpenAI-compatible servers.",
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8080", help="server root URL")
    p.add_argument(
        "--models", default="default", help="comma-separated models with optional weights: a:3,b:1"
    )
    p.add_argument(
        "--rate",
        type=float,
        default=1.0,
        help="mean arrivals per second (Poisson); 'inf' for a closed loop",
    )
    p.add_argument("--duration", type=float, default=10.0, help="seconds of arrivals")
    p.add_argument("--requests", type=int, help="number of requests (overrides --duration)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight")
    p.add_argument(
        "--concurrency",
        type=lambda t: [int(x) for x in t.split(",") if x.strip()],
        help="closed-loop sweep: one run per level, e.g. 1,4,8 (rate is then infinite)",
    )
    p.add_argument(
        "--slo",
        type=parse_slo,
        default={},
        help="goodput bounds, e.g. ttft=1s,tpot=50ms (metrics: ttft, tpot, itl, e2e, ttfb)",
    )
    p.add_argument(
        "--max-tokens",
        type=parse_range,
        default=(64, 64),
        help="output tokens per request, N or LOW-HIGH",
    )
    p.add_argument(
        "--prompt-words",
        type=parse_range,
        default=(32, 32),
        help="synthetic prompt words, N or LOW-HIGH",
    )
    p.add_argument(
        "--prompt-tokens",
        type=int,
        help="every prompt exactly N tokens of text (instead of --prompt-words)",
    )
    p.add_argument(
        "--tokenizer",
        default="server",
        help="what counts --prompt-tokens: 'server' (its POST /tokenize) or a GGUF file",
    )
    p.add_argument(
        "--fresh-prompts",
        action="store_true",
        help="with --concurrency: new prompts for every level (else the same ones)",
    )
    p.add_argument("--endpoint", choices=ENDPOINTS, default="chat")
    p.add_argument("--path", help="request path overriding the endpoint's default")
    p.add_argument(
        "--no-stream", dest="stream", action="store_false", help="ask for whole responses (no TTFT)"
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON object merged into each request body",
    )
    p.add_argument(
        "--no-drain",
        dest="drain",
        action="store_false",
        help="closed loop: cancel what is in flight when --duration ends, count the window only",
    )
    p.add_argument("--warmup", type=int, default=0, help="unmeasured requests first")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    p.add_argument("--api-key")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, metavar="DIR", help="write PNG charts here")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("-v", "--verbose", action="store_true")
    return p


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """A :class:`BenchConfig` from parsed ``bench.serving`` arguments."""
    return BenchConfig(
        base_url=args.base_url,
        models=parse_models(args.models),
        rate=args.rate,
        duration=args.duration,
        requests=args.requests,
        max_concurrency=args.max_concurrency,
        max_tokens=args.max_tokens,
        prompt_words=args.prompt_words,
        prompt_tokens=args.prompt_tokens,
        tokenizer=args.tokenizer,
        stream=args.stream,
        endpoint=args.endpoint,
        path=args.path,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        drain=args.drain,
        warmup=args.warmup,
        seed=args.seed,
        timeout=args.timeout,
        api_key=args.api_key,
        progress=args.progress,
        slo=args.slo,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: run, print the tables, write JSON and charts; 1 if any request failed."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = config_from_args(args)
    try:
        if args.concurrency:
            swept = sweep(config, args.concurrency, args.fresh_prompts)
            print(format_sweep(swept))
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(swept, indent=1))
                print(f"results: {args.out}")
            return 0 if all(lv["summary"]["failed"] == 0 for lv in swept["levels"]) else 1
        results = run(config)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    print(format_summary(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))
        print(f"results: {args.out}")
    if args.plot:
        for path in plot(results, args.plot):
            print(f"chart: {path}")
    return 0 if results["summary"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
