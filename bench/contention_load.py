"""The four workloads of ``bench/contention.py`` (issue 34): more demand
than ``--models-max`` allows, as clients send it, and the figures of one run.

Every request is a streamed chat completion; its **wait** is the client's
time to the first content token (TTFT): on the fake instance (no prefill)
that is the time the request waited for capacity and a load, on the real
models it adds the prompt's prefill (small but for ``agents``). The four:

``hog``
    Three clients keep the first model busy (closed loop, ``hog_s``
    seconds, started ``stagger_s`` apart after its first answer); ``one_at`` seconds after its first answer, one request for
    the second model.
    Its wait is the figure (issue 34: 40.1 s on today's policy).
``roundrobin``
    ``clients`` clients each send ``requests`` requests one after the
    other, client ``i``'s ``k``-th to model ``(i + k) % M``, with a think
    time of 0 to ``think_s`` seconds (seeded) after each answer: every
    client cycles over all M models (M > ``--models-max``), the order LRU
    swaps on most. (Without the think time the clients fall into step,
    all waiting for the same model, and each load serves all three.)
``bursts``
    ``bursts`` bursts, one every ``gap_s`` seconds, each of 10 to 20
    requests (seeded) for one model drawn at random, arriving over
    ``spread_s`` (> ``gap_s``) seconds, so one model's burst overlaps the
    next's: requests arrive A A B A B.
``agents``
    One agent session per model (two), each a conversation of ``turns``
    turns whose system prompt is ``words`` words of tool descriptions
    (about 2 tokens a word), the whole history sent again each turn,
    ``think_s`` seconds between a turn's answer and the next question.
    With ``--models-max 1`` every turn of one session wants the capacity
    the other holds; the KV tiers make the swapped-back prefix cheap.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.agentic import tools_text
from bench.prompts import make_prompt
from bench.serving import BenchConfig, RequestResult, RequestSpec
from bench.serving import _Client as Client  # the harness's streaming HTTP/1.1 client
from bench.stats import percentile

WORKLOADS = ("hog", "roundrobin", "bursts", "agents")

QUESTIONS = ("Which tool reads a file?", "Summarise the last answer.", "What is step two?",
             "Name one risk.", "Which tool would you call next?", "Say it shorter.")


@dataclass(slots=True)
class Workload:
    """One workload on one model set.

    ``models``: names in the order the workload uses them (the hog is the
    first); ``models_max``: the servers' ``--models-max``; ``tiers``: KV
    tiers on (RAM and disk) for ggmux; ``params``: the workload's knobs
    (see the module's docstring; seconds and counts); ``max_tokens``
    output tokens per request; ``prompt_words`` of a one-shot prompt.
    """

    name: str
    kind: str  # "fake" or "real"
    models: list[str]
    models_max: int
    max_tokens: int
    tiers: bool = False
    prompt_words: int = 24
    params: dict[str, float] = field(default_factory=dict)


def workloads(kind: str, quick: bool, models: list[str]) -> dict[str, Workload]:
    """The four workloads for ``kind`` (``fake``: models ``a b c`` that load
    in a second; ``real``: the two demo models), short (``quick``: about
    15 s each) or full (about a minute each on the fake models). Round
    robin cycles over every model with ``--models-max 1`` (three fake, as
    the issue's 18 requests that cost 14 loads; two real)."""
    q, fake = quick, kind == "fake"
    # the demo models on one llama.cpp thread make 3-10 tokens/s on 2 busy
    # cores: fewer tokens and requests keep a real run near 4 minutes a peer
    tok = 16 if fake else 8
    two = models[:2]
    return {
        # the hog's answers are 3x longer than others, so its three
        # staggered clients are never all between two requests at once
        "hog": Workload("hog", kind, two, 1, 3 * tok, params={
            "clients": 3, "hog_s": 20.0 if q else 60.0, "one_at": 2.0,
            "stagger_s": 0.8 if fake else 2.0}),
        "roundrobin": Workload("roundrobin", kind, models, 1, tok, params={
            "clients": 3, "requests": 4 if q else 12 if fake else 6,
            "think_s": 1.0 if fake else 2.0}),
        "bursts": Workload("bursts", kind, two, 1, tok // 2, params={
            "bursts": 4 if q else 16 if fake else 8, "gap_s": 2.0 if fake else 8.0,
            "spread_s": 3.0 if fake else 12.0}),
        "agents": Workload("agents", kind, two, 1, tok, tiers=True, params={
            "turns": 3 if q else 8 if fake else 5, "words": 600 if fake else 400,
            "think_s": 0.5}),
    }


# --------------------------------------------------------------------------
# drivers: each sends one workload to ``base_url`` and returns its records


Send = Callable[[str, str | list[dict[str, Any]]], Awaitable[RequestResult]]


class Sender:
    """Sends one workload's requests and keeps their :class:`RequestResult`
    (``t_sent`` seconds after :meth:`start`)."""

    def __init__(self, base_url: str, w: Workload, timeout: float, seed: int) -> None:
        self.w = w
        self.rng = random.Random(seed)
        self.config = BenchConfig(
            base_url=base_url, stream=True, temperature=0.0, timeout=timeout, progress=False,
            ignore_eos=w.kind == "real", extra_body={"stream_options": {"include_usage": True}})
        self.records: list[RequestResult] = []
        self.lanes: dict[int, Client] = {}
        self.t0 = 0.0

    def start(self) -> None:
        self.t0 = asyncio.get_running_loop().time()

    def now(self) -> float:
        return asyncio.get_running_loop().time() - self.t0

    async def send(self, model: str, messages: list[dict[str, Any]] | None = None,
                   lane: int | None = None) -> RequestResult:
        """One streamed request for ``model``: a fresh short prompt, or
        ``messages`` when given. A ``lane`` (one closed-loop client) keeps
        its keep-alive connection from one request to its next, as an SDK
        client does; without one, each request has a connection of its own."""
        config = self.config
        if messages is not None:
            config = replace(config, extra_body={**config.extra_body, "messages": messages})
        client = self.lanes.get(lane) if lane is not None else None
        if client is None:
            client = Client(config)
            if lane is not None:
                self.lanes[lane] = client
        client.config = config
        spec = RequestSpec(len(self.records), self.now(), model,
                           make_prompt(self.rng, self.w.prompt_words), self.w.max_tokens)
        result = RequestResult(spec.index, model, spec.at)
        self.records.append(result)
        try:
            await client.send(spec, result)
        finally:
            if lane is None:
                await client.pool.close()
        return result

    async def close(self) -> None:
        """Close the lanes' connections."""
        for client in self.lanes.values():
            await client.pool.close()


async def drive(w: Workload, base_url: str, seed: int = 0, timeout: float = 900.0
                ) -> tuple[list[RequestResult], float]:
    """Send workload ``w`` to ``base_url``; its records and its wall time
    (seconds from the first request to the end of the last)."""
    s = Sender(base_url, w, timeout, seed)
    s.start()
    try:
        await DRIVERS[w.name](s, w)
    finally:
        await s.close()
    return s.records, s.now()


async def _hog(s: Sender, w: Workload) -> None:
    p = w.params
    hog, other = w.models[0], w.models[1]
    serving = asyncio.Event()  # the hog model answered: it holds the capacity

    async def client(i: int) -> None:
        # staggered, so the three are never between two requests at once:
        # a replica with nothing in flight for an instant is idle to both
        # policies, and synchronised clients let it go (issue 34's hog keeps
        # the model busy)
        if i:  # from the first answer on: waiting out the first load lines them up
            await serving.wait()
            await asyncio.sleep(i * p["stagger_s"])
        while s.now() < p["hog_s"]:
            await s.send(hog, lane=i)
            serving.set()

    async def one() -> None:
        # counted from the hog's first answer, not from the start: a first
        # load slower than one_at (5 s here under load) would let the other
        # model's request join the queue before the hog is served at all
        await serving.wait()
        await asyncio.sleep(p["one_at"])
        await s.send(other)

    await asyncio.gather(*(client(i) for i in range(int(p["clients"]))), one())


async def _roundrobin(s: Sender, w: Workload) -> None:
    p, m = w.params, w.models

    async def client(i: int) -> None:
        rng = random.Random(i)
        for k in range(int(p["requests"])):
            await s.send(m[(i + k) % len(m)], lane=i)
            await asyncio.sleep(rng.uniform(0, p["think_s"]))

    await asyncio.gather(*(client(i) for i in range(int(p["clients"]))))


def burst_plan(w: Workload, seed: int) -> list[tuple[float, str]]:
    """``(seconds after start, model)`` of every request of ``bursts``, in
    arrival order (the same for every peer of a seed)."""
    p, rng = w.params, random.Random(seed)
    out = []
    for j in range(int(p["bursts"])):
        model = rng.choice(w.models)
        out += [(j * p["gap_s"] + rng.uniform(0, p["spread_s"]), model)
                for _ in range(rng.randint(10, 20))]
    return sorted(out)


async def _bursts(s: Sender, w: Workload) -> None:
    async def at(t: float, model: str) -> None:
        await asyncio.sleep(max(0.0, t - s.now()))
        await s.send(model)

    await asyncio.gather(*(at(t, m) for t, m in burst_plan(w, s.rng.randrange(1 << 30))))


async def _agents(s: Sender, w: Workload) -> None:
    p = w.params

    async def session(model: str, n: int) -> None:
        history: list[dict[str, Any]] = [
            {"role": "system", "content": tools_text(f"agent{n}", int(p["words"]))}]
        for t in range(int(p["turns"])):
            history.append({"role": "user", "content": f"{QUESTIONS[t % len(QUESTIONS)]} ({t})"})
            await s.send(model, list(history), lane=n)
            # the answer's text is not kept: a fixed one holds the history's shape
            history.append({"role": "assistant", "content": f"Answer {t}."})
            await asyncio.sleep(p["think_s"])

    await asyncio.gather(*(session(m, n) for n, m in enumerate(w.models[:2])))


DRIVERS: dict[str, Callable[[Sender, Workload], Awaitable[None]]] = {
    "hog": _hog, "roundrobin": _roundrobin, "bursts": _bursts, "agents": _agents}


# --------------------------------------------------------------------------
# figures


def figures(records: list[RequestResult], wall_s: float, loads: int | None,
            load_s: float | None) -> dict[str, Any]:
    """The issue's figures of one run: per model ``n``, ``failed``, wait
    ``max`` / ``p99`` / ``p50`` (seconds, successful requests); in all:
    ``wait_max``, ``swaps`` (completed loads, the first ones included),
    ``req_per_min`` and ``tok_s`` (successful requests and their output
    tokens over the wall time), ``tpot`` (mean seconds per output token
    after the first: how fast the engines decoded, whatever the waits),
    ``load_share`` (seconds spent loading over the wall time; None when the
    server's loads are unknown)."""
    per_model: dict[str, dict[str, Any]] = {}
    for m in sorted({r.model for r in records}):
        mine = [r for r in records if r.model == m]
        waits = [r.ttft for r in mine if r.ok and r.ttft is not None]
        per_model[m] = {"n": len(mine), "failed": sum(not r.ok for r in mine),
                        "max": max(waits, default=None), "p99": percentile(waits, 99),
                        "p50": percentile(waits, 50)}
    ok = [r for r in records if r.ok]
    waits = [r.ttft for r in ok if r.ttft is not None]
    decode = [r.tpot for r in ok if r.tpot is not None]
    return {
        "requests": len(records), "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "wall_s": round(wall_s, 2), "wait_max": max(waits, default=None),
        "wait_p99": percentile(waits, 99), "per_model": per_model, "swaps": loads,
        "req_per_min": 60 * len(ok) / wall_s if wall_s > 0 else None,
        "tok_s": sum(r.output_tokens for r in ok) / wall_s if wall_s > 0 else None,
        "tpot": sum(decode) / len(decode) if decode else None,
        "load_s": load_s,
        "load_share": load_s / wall_s if load_s is not None and wall_s > 0 else None,
    }
