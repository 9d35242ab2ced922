"""The serving harness's records (:mod:`bench.serving`): what a run does
(:class:`BenchConfig`), one planned request (:class:`RequestSpec`) and what
came of it (:class:`RequestResult`)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from bench.stats import (
    SLO_METRICS,
)

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


