"""Speculation off and on, in process, over the prompt classes that decide
whether it pays (issue 45): the engine alone (no HTTP), one slot, one
thread, ``ngram-simple``, the two engines alternating (which goes first
alternates by round), the same prompts and seeds for both.

Classes: ``bar`` (tests/test_spec_decoding.py's edit: six functions
written back with one change, 160 tokens: an imperfect copy), ``area``
(``bench.spec``'s regular file of 12 functions: an exact copy, 256
tokens), ``random`` (its default file of 16 functions, which
smollm2-135m copies with slips) and ``story`` (a story at temperature 0.8:
nothing to draft; the two engines do the same work, so its ratio is the
run's noise).

``python -m bench.spec_classes [--rounds 3] [--classes bar,area,random,story]``
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compare import demo_model_paths
from bench.spec import area_prompt, chatml, edit_prompt

CODE = "".join(f"def area_{i}(width, height):\n    total = width * height + {i}\n"
               f"    return total\n\n" for i in range(6))
BAR = chatml("Here is a Python file:\n\n```python\n" + CODE + "```\n\nRewrite the whole "
             "file, unchanged except that area_3 returns total * 2. Output only the code.") \
    + "```python\n"


def cases(rnd: int):
    """Per class: (prompt, max_tokens, temperature, seed) for round ``rnd``."""
    return {
        "bar": (BAR, 160, 0.0, 0),
        "area": (area_prompt(random.Random(rnd), 12)[1], 256, 0.0, 0),
        "random": (edit_prompt(random.Random(rnd), 16)[1], 256, 0.0, 0),
        "story": (chatml(f"Write a short story about an otter {rnd} who learns to sail."),
                  128, 0.8, rnd),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--classes", default="bar,area,random,story")
    args = ap.parse_args(argv)
    from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
    from ggmux.instance.engine.spec_options import SpecConfig

    path = str(demo_model_paths()["smollm2-135m"])
    engines = {name: Engine(EngineConfig(path, ctx_size=2048, parallel=1, n_threads=1,
                                         spec=sp))
               for name, sp in (("off", None), ("on", SpecConfig(types=("ngram-simple",))))}
    for e in engines.values():
        e.load()
    names = args.classes.split(",")
    res: dict[str, dict[str, list]] = {c: {"off": [], "on": []} for c in names}
    print(f"start {time.strftime('%H:%M:%S', time.gmtime())} UTC, load "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    try:
        for rnd in range(args.rounds):
            for c in names:
                text, n, temp, seed = cases(rnd)[c]
                for who in (("off", "on") if rnd % 2 == 0 else ("on", "off")):
                    e = engines[who]
                    t0 = time.perf_counter()
                    out = e.submit(Generation(e.tokenize(text), Sampling(temperature=temp,
                                                                         seed=seed),
                                              max_tokens=n)).result(900)
                    t = out["timings"]
                    res[c][who].append((time.perf_counter() - t0, t["predicted_ms"],
                                        t["predicted_n"], t.get("draft_n", 0),
                                        t.get("draft_n_accepted", 0)))
    finally:
        for e in engines.values():
            e.close()
    print(f"end {time.strftime('%H:%M:%S', time.gmtime())} UTC, load "
          f"{os.getloadavg()[0]:.2f}")
    print("| class | decode tok/s off | on | on / off | wall off / on (s) | drafts accepted |")
    print("| --- | --- | --- | --- | --- | --- |")
    for c in names:
        off, on = res[c]["off"], res[c]["on"]
        d_off = 1e3 * sum(x[2] for x in off) / sum(x[1] for x in off)
        d_on = 1e3 * sum(x[2] for x in on) / sum(x[1] for x in on)
        w_off, w_on = (sum(x[0] for x in off) / len(off), sum(x[0] for x in on) / len(on))
        print(f"| {c} | {d_off:.1f} | {d_on:.1f} | {d_on / d_off:.2f}x | {w_off:.2f} / "
              f"{w_on:.2f} | {sum(x[4] for x in on)} / {sum(x[3] for x in on)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
