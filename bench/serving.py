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
import json
import logging
import math
import random
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.prompts import TokenCounter, make_counter, make_prompt, sized_prompt
from bench.report import format_summary, format_sweep, plot
from bench.serving_client import _Client
from bench.serving_config import (
    ENDPOINTS,
    BenchConfig,
    RequestResult,
    RequestSpec,
)
from bench.stats import (
    describe,
    parse_slo,
    percentile,
    summarize,
)

__all__ = ["BenchConfig", "RequestResult", "RequestSpec", "describe", "format_summary",
           "format_sweep", "make_prompt", "percentile", "plan", "run", "summarize", "sweep"]

logger = logging.getLogger(__name__)

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
