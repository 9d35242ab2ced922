"""Do answers restored from the KV tiers under concurrency part from the
cold prefill, and is it the restore? (issue 37, item 13).

Six chat prompts sharing a 100-token system prompt, greedy, 24 tokens, on
smollm2-135m at the default batch (one thread, six slots). The cold answer
of each comes from a fresh engine with ``cache_prompt`` false. Then one
engine answers every prompt once and stops (``persist``: its slots go to a
disk-tier folder), and a second engine on that folder answers each prompt
six times at once; the control does the same on an engine with no tiers at
all. Each answer is compared with the cold one and tallied by where its
cached prompt tokens came from (``timings.cache_tier``) and how many.

Run: ``python -m bench.kv_numerics`` (a few minutes on 2 busy cores).
"""

from __future__ import annotations

import tempfile
from collections import Counter

from ggmux.bench.kv_restore import smollm2
from ggmux.instance.cache.tiers import CacheSettings
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: be brief." for i in range(12))
QUESTIONS = ("Name a colour.", "What is the capital of Italy?", "Explain why the sky is blue.",
             "Write a haiku about rain.", "List three prime numbers.", "What does a compiler do?")
PROMPTS = [f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
           "<|im_start|>assistant\n" for q in QUESTIONS]


def engine(path: str, disk: str | None = None) -> Engine:
    e = Engine(EngineConfig(path, ctx_size=1024, parallel=6, n_threads=1,
                            cache=CacheSettings(ram_mib=0, disk_dir=disk)))
    e.load()
    return e


def answers(e: Engine, prompt: str, cache_prompt: bool, n: int = 1) -> list[tuple]:
    """``[(text, cached tokens, tier)]`` of ``n`` requests sent at once."""
    jobs = [e.submit(Generation(e.tokenize(prompt), Sampling(temperature=0), max_tokens=24,
                                cache_prompt=cache_prompt)) for _ in range(n)]
    out = []
    for j in jobs:
        r = j.result(900)
        out.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"],
                    r["timings"].get("cache_tier") or "none"))
    return out


def run(path: str, cold: dict[str, str], disk: bool) -> None:
    if disk:
        folder = tempfile.mkdtemp(prefix="kv-numerics-")
        first = engine(path, folder)
        for p in PROMPTS:
            answers(first, p, True)
        first.persist(60)
        first.close()
        e = engine(path, folder)
    else:
        e = engine(path)
    rows = [(tier, cached, text == cold[p]) for p in PROMPTS
            for text, cached, tier in answers(e, p, True, n=6)]
    e.close()
    print(f"{'disk tier' if disk else 'no tiers (control)'}: "
          f"{sum(r[2] for r in rows)}/{len(rows)} equal the cold answer")
    for (tier, cached), n in sorted(Counter((t, c) for t, c, _ in rows).items()):
        same = sum(1 for t, c, eq in rows if (t, c) == (tier, cached) and eq)
        print(f"  cache_tier {tier:5s} cached {cached:3d}: {same}/{n} equal")


def main() -> None:
    path = smollm2()
    e = engine(path)
    cold = {p: answers(e, p, False)[0][0] for p in PROMPTS}
    e.close()
    run(path, cold, disk=True)
    run(path, cold, disk=False)


if __name__ == "__main__":
    main()
