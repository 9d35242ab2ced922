"""Context checkpoints measured in one process (issue 35): the time to a
one-token answer of a gemma3-270m prompt whose last user message changed,
restored from the disk tier by a new engine (a restart: the entry's state
and its checkpoint at the last user message, then the rest read) against
the same prompt's cold prefill, and what making and restoring one
checkpoint costs. No model load is timed (bench/swap_cache.py times swaps
through ``ggmux serve``, load included).

``python -m bench.checkpoint_restore [--words 900] [--threads 2]
[--rounds 2] [--hint question|none] [--out FILE]``

``--hint none``: no checkpoint hint, as a ``/v1/completions`` prompt or a
chat of one user message (its start is the only hint): the edited question
is then served by the checkpoints the entry carries from its window.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.agentic import tools_text
from bench.targets import demo_model_paths


def prompt(system: str, question: str) -> tuple[str, str]:
    """Gemma 3's chat rendering of one user turn (its template folds the
    system prompt into the first user message): the text, and the text
    before the question (where the checkpoint goes)."""
    head = f"<start_of_turn>user\n{system}\n\n"
    return head + f"{question}<end_of_turn>\n<start_of_turn>model\n", head


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.checkpoint_restore",
                                description=__doc__.split("\n")[0])
    p.add_argument("--words", type=int, default=900, help="words of tools text (about 2 tokens a word)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--hint", choices=("question", "none"), default="question",
                   help="a checkpoint hint at the question's start (a chat's last user "
                        "message), or none")
    p.add_argument("--out")
    args = p.parse_args(argv)
    from ggmux.instance.cache.tiers import CacheSettings
    from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling

    path = str(demo_model_paths()["gemma3-270m"])
    system = tools_text("checkpoints", args.words)
    started = time.time()
    report: dict = {"command": " ".join(["python -m bench.checkpoint_restore",
                                         *(argv or sys.argv[1:])]),
                    "machine": f"{platform.node()} {os.cpu_count()} cores",
                    "load_before": os.getloadavg(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
                    "rounds": []}

    def engine(disk: str | None, ram: int) -> Engine:
        e = Engine(EngineConfig(path, ctx_size=4096, parallel=1, n_threads=args.threads,
                                cache=CacheSettings(ram_mib=ram, disk_dir=disk)))
        e.load()
        return e

    def ttft(e: Engine, text: str, head: str, **kw) -> tuple[float, dict]:
        at = (e.count_tokens(head) - 2,) if args.hint == "question" else ()
        t0 = time.perf_counter()
        r = e.submit(Generation(e.tokenize(text), Sampling(temperature=0), max_tokens=1,
                                checkpoint_at=at, **kw)).result(3600)
        return time.perf_counter() - t0, r["usage"]

    for k in range(args.rounds):
        a, head = prompt(system, f"Which tool reads a file? ({k})")
        b, _ = prompt(system, f"Which tool writes a file? ({k})")
        with tempfile.TemporaryDirectory(prefix="ckpt-") as d:
            e = engine(d, 64)
            try:
                cold_a, _ = ttft(e, a, head)
                e.submit(Generation(e.tokenize("Something else."), max_tokens=1)).result(600)
                e.cache.flush(time.monotonic() + 60)  # A's entry and checkpoints to disk
            finally:
                e.close()
            e = engine(d, 0)  # restarted: disk only
            try:
                back, usage = ttft(e, b, head)
                # one checkpoint's cost, on the slot B left (not on A's before its save:
                # loading a partial state drops the cells past the window it saves from)
                L, m = e.L, e.m
                flag = L.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
                n = L.llama_state_seq_get_size_ext(m.ctx, 0, flag)
                buf = (ctypes.c_uint8 * n)()
                t0 = time.perf_counter()
                L.llama_state_seq_get_data_ext(m.ctx, buf, n, 0, flag)
                make_s = time.perf_counter() - t0
                t0 = time.perf_counter()
                L.llama_state_seq_set_data_ext(m.ctx, buf, n, 0, flag)
                load_s = time.perf_counter() - t0
            finally:
                e.close()
        e = engine(None, 0)
        try:
            cold_b, _ = ttft(e, b, head, cache_prompt=False)
        finally:
            e.close()
        row = {"cold_a_s": round(cold_a, 3), "cold_b_s": round(cold_b, 3),
               "restored_b_s": round(back, 3), "prompt_tokens": usage["prompt_tokens"],
               "cached": usage["prompt_tokens_details"]["cached_tokens"],
               "checkpoint_tokens": usage["prompt_tokens_details"].get("checkpoint_tokens", 0),
               "checkpoint_bytes": n, "checkpoint_make_s": round(make_s, 4),
               "checkpoint_load_s": round(load_s, 4)}
        print(json.dumps(row), flush=True)
        report["rounds"].append(row)
    rs = report["rounds"]
    report["summary"] = {
        "restored_over_cold": round(statistics.median(r["restored_b_s"] / r["cold_b_s"]
                                                      for r in rs), 4),
        "prompt_tokens_read_share": round(statistics.median(
            (r["prompt_tokens"] - r["cached"]) / r["prompt_tokens"] for r in rs), 4)}
    report["load_after"] = os.getloadavg()
    report["seconds"] = round(time.time() - started)
    print(json.dumps(report["summary"]))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
