"""One decode step of the built-in engine, timed in parts (issue 21, item 4).

The engine (``instance/engine/loop.py``) in-process on smollm2-135m, ``--slots``
streams of ``--tokens`` greedy tokens each (``ignore_eos``), their answers
built by the instance's own :class:`~ggmux.instance.answers.Answer` and
handed to an asyncio loop on another thread, as ``instance/server.py``
does (the loop turns each chunk into its SSE bytes with orjson). Every
step of the decode thread is timed (``time.perf_counter_ns``) and split
into ``llama_decode`` and the rest: the Python of the step (batch fill,
sampler calls, stop matching, detokenization, the hand-off to the loop),
as wall time and as the decode thread's own CPU time
(``time.thread_time_ns``: what a loaded machine's preemption does not
inflate). Only steps in which every slot generates are counted.

``--profile`` also runs the decode thread's steps under cProfile and
prints the functions with the most own time (cProfile's overhead inflates
the Python share; read the split from a run without it).

Usage (repository root)::

    python -m bench.engine_step --slots 4,8 --tokens 128
    python -m bench.engine_step --slots 8 --profile
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import orjson
from ggmux.instance.answers import Answer
from ggmux.instance.engine import Engine, EngineConfig, Generation, Sampling
from ggmux.instance.engine.slots import GENERATE

from bench.targets import demo_model_paths


def _loop_thread() -> tuple[asyncio.AbstractEventLoop, list[int]]:
    try:  # the instance server's loop
        import uvloop

        loop = uvloop.new_event_loop()
    except ImportError:
        loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, name="loop", daemon=True)
    t.start()
    return loop, [t.ident]


def run(slots: int, tokens: int, threads: int, profile: bool) -> dict:
    """One measurement: ``{"slots", "steps", "step_us", "decode_us",
    "python_us"}`` (medians and p99 of the full steps, microseconds)."""
    path = str(demo_model_paths()["smollm2-135m"])
    e = Engine(EngineConfig(path, ctx_size=512, parallel=slots, n_threads=threads))
    e.load()
    loop, loop_tid = _loop_thread()
    if hasattr(e, "deliver"):  # as LlamaBackend.use_loop: one hand-off per step
        from ggmux.instance.engine.jobs import deliver

        e.deliver = lambda batch: loop.call_soon_threadsafe(deliver, batch)
    prof = cProfile.Profile() if profile else None
    steps: list[tuple[int, int, int]] = []
    decode_ns = [0, 0]
    orig_step, orig_decode = Engine._step, Engine._decode

    def decode(self):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        out = orig_decode(self)
        decode_ns[0] = time.perf_counter_ns() - t0
        decode_ns[1] = time.thread_time_ns() - c0
        return out

    def step(self, kicked=True):
        full = all(s.state == GENERATE for s in self.slots)
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        if prof is not None:
            prof.runcall(orig_step, self, kicked)
        else:
            orig_step(self, kicked)
        if full:
            cpu = time.thread_time_ns() - c0 - decode_ns[1]
            steps.append((time.perf_counter_ns() - t0, decode_ns[0], cpu))

    Engine._step, Engine._decode = step, decode
    try:
        done = threading.Event()
        left = [slots]
        sent = [0]

        def consume(what, payload):  # the loop thread: as the server's stream
            if what == "chunk":
                sent[0] += len(b"data: " + orjson.dumps(payload) + b"\n\n")
            elif what in ("end", "error", "result"):
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        def sink(what, payload):  # as the server's sink
            if threading.get_ident() == loop_tid[0]:
                consume(what, payload)
            else:
                loop.call_soon_threadsafe(consume, what, payload)

        prompt = e.tokenize("<|im_start|>user\nTell me a long story about a lighthouse."
                            "<|im_end|>\n<|im_start|>assistant\n")
        for i in range(slots):
            a = Answer(sink, "chat", "m", stream=True, include_usage=True)
            e.submit(Generation(prompt + [i + 1], Sampling(temperature=0), max_tokens=tokens,
                                ignore_eos=True), a.on_event)
        if not done.wait(600):
            raise RuntimeError("the streams did not end")
    finally:
        Engine._step, Engine._decode = orig_step, orig_decode
        e.close()
        loop.call_soon_threadsafe(loop.stop)
    total = sorted(t for t, _, _ in steps)
    dec = sorted(d for _, d, _ in steps)
    py = sorted(t - d for t, d, _ in steps)
    cpu = sorted(c for _, _, c in steps)
    out = {"slots": slots, "steps": len(steps), "step_us": _q(total), "decode_us": _q(dec),
           "python_us": _q(py), "python_cpu_us": _q(cpu)}
    if prof is not None:
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
        out["profile"] = buf.getvalue()
    return out


def _q(v: list[int]) -> dict:
    if not v:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": v[len(v) // 2] / 1000, "p99": v[min(len(v) - 1, int(len(v) * 0.99))] / 1000,
            "mean": sum(v) / len(v) / 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_step",
                                description=__doc__.split("\n")[0])
    p.add_argument("--slots", default="4,8", help="comma-separated slot counts")
    p.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--profile", action="store_true", help="cProfile the steps")
    args = p.parse_args(argv)
    print(f"# {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  load "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}  {os.cpu_count()} cores")
    print(f"{'slots':>5} {'steps':>5}  {'step p50/p99 us':>18}  {'decode p50/p99':>16}  "
          f"{'python p50/p99/mean us':>24}  {'python CPU p50/mean us':>22}")
    for n in (int(x) for x in args.slots.split(",")):
        r = run(n, args.tokens, args.threads, args.profile)
        s, d, y, c = r["step_us"], r["decode_us"], r["python_us"], r["python_cpu_us"]
        print(f"{n:>5} {r['steps']:>5}  {s['p50']:>8.0f} / {s['p99']:<7.0f}  "
              f"{d['p50']:>7.0f} / {d['p99']:<6.0f}  "
              f"{y['p50']:>7.0f} / {y['p99']:<6.0f} / {y['mean']:<6.0f}  "
              f"{c['p50']:>9.0f} / {c['mean']:<6.0f}")
        if args.profile:
            print(r["profile"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
