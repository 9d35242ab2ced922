"""Image prompts on ggmux and llama-server, side by side, in one run.

Both serve the same GGUFs: Gemma 3 270M and :mod:`bench.vision_model`'s
projector in its ``--heavy`` form (Gemma 3's 896-pixel images, 256
embeddings an image, a tower whose encode costs about what a real one's
does on this CPU), with the same slots and threads. Figures:

* **TTFT, one image, cold**: a new image each request (nothing cached);
* **TTFT, cached**: the same conversation and image again (the prefix,
  image included, in a slot);
* **4 at once**: four requests with four new images sent together, tokens
  generated per second of wall time;
* **stall**: a text stream is running when a request with a new image
  arrives; the text stream's longest gap between two tokens while the
  image is read, against its longest gap without (llama-server encodes on
  its one server thread; ggmux on a thread of its own).

    python -m bench.vision                      # 5 rounds, prints a table
    python -m bench.vision --rounds 10 --threads 2 --json out.json

The llama-server is the engine-source build when there is one
(``python -m bench.llama_server --build --source engine``), else any found.
"""

from __future__ import annotations

import argparse
import http.client
import io
import itertools
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from . import llama_server, vision_model
from . import vision_parity as vp


def new_image(seed: int, size: tuple[int, int] = (640, 480)) -> bytes:
    """A PNG no earlier request sent (smooth colours and noise, by ``seed``)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    x, y = np.meshgrid(np.linspace(0, 1, w), np.linspace(0, 1, h))
    a, b, c = rng.uniform(0.5, 3, 3)
    rgb = np.stack([np.sin(a * x + c), np.cos(b * y), x * y], -1) * 100 + 120
    rgb += rng.normal(0, 12, rgb.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(out, "PNG")
    return out.getvalue()


def stream(port: int, body: dict) -> tuple[float, list[float], str]:
    """POST a streamed chat completion: ``(seconds to the first content,
    arrival time of each content chunk (monotonic), text)``."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                 {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise RuntimeError(f"{port}: {r.status} {r.read()[:300]!r}")
    arrivals, text, buf = [], [], b""
    while True:
        chunk = r.read1(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                d = json.loads(line[6:])
                choices = d.get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content")
                if piece:
                    arrivals.append(time.monotonic())
                    text.append(piece)
    conn.close()
    ttft = arrivals[0] - t0 if arrivals else float("nan")
    return ttft, arrivals, "".join(text)


def image_body(data: bytes, words: str, max_tokens: int) -> dict:
    return {"model": vision_model.NAME, "temperature": 0, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": [vp.text_part(words),
                                                      vp.image_part(data)]}]}


def text_body(words: str, max_tokens: int) -> dict:
    return {"model": vision_model.NAME, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True, "messages": [{"role": "user", "content": words}]}


def measure(port: int, rounds: int, seed0: int) -> dict:
    """Every figure of the module docstring for the server on ``port``."""
    cold, warm, rates, stall, calm = [], [], [], [], []
    for i in range(rounds):
        seed = seed0 + 10 * i
        words = f"Round {seed}: what does this picture show?"
        ttft, _, _ = stream(port, image_body(new_image(seed), words, 8))
        cold.append(ttft)
        ttft, _, _ = stream(port, image_body(new_image(seed), words, 8))
        warm.append(ttft)
        # four at once, four new images
        out: list = [None] * 4
        t0 = time.monotonic()

        def one(k: int, seed=seed, out=out) -> None:
            out[k] = stream(port, image_body(new_image(seed + 1 + k), f"Round {seed} #{k}: "
                                             "describe it.", 48))
        threads = [threading.Thread(target=one, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rates.append(sum(len(o[1]) for o in out) / (time.monotonic() - t0))
        # stall: a text stream, and halfway through, a new image request
        _, quiet, _ = stream(port, text_body(f"Round {seed}: count to fifty.", 60))
        calm.append(max(np.diff(quiet)) if len(quiet) > 2 else float("nan"))
        arrivals: list[float] = []
        holder: dict = {}

        def text_stream(seed=seed, holder=holder) -> None:
            holder["r"] = stream(port, text_body(f"Round {seed}: list fifty animals.", 60))
        t = threading.Thread(target=text_stream)
        t.start()
        time.sleep(0.8)  # the text stream is generating
        t_img = time.monotonic()
        stream(port, image_body(new_image(seed + 9), f"Round {seed}: and this?", 1))
        t_done = time.monotonic()
        t.join()
        arrivals = holder["r"][1]
        gaps = [b - a for a, b in itertools.pairwise(arrivals) if b >= t_img and a <= t_done]
        stall.append(max(gaps) if gaps else float("nan"))
    return {"ttft_cold_s": cold, "ttft_cached_s": warm, "tokens_per_s_4": rates,
            "stall_max_gap_s": stall, "calm_max_gap_s": calm}


def med(values: list[float]) -> float:
    v = [x for x in values if not math.isnan(x)]
    return statistics.median(v) if v else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None, help="write every sample here")
    a = ap.parse_args(argv)
    binary = a.llama_server or llama_server.find_engine() or llama_server.find()
    if binary is None:
        print(f"no llama-server: {llama_server.HOW_TO_GET}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="vision-bench-"))
    folder = vision_model.write_folder(work, audio=False, **vision_model.HEAVY)
    pg, pl = vp.free_port(), vp.free_port()
    procs = [vp.start_ggmux(work, pg, a.threads), vp.start_llama_server(
        binary, folder, pl, threads=a.threads)]
    try:
        vp.wait_up(f"http://127.0.0.1:{pg}")
        vp.wait_up(f"http://127.0.0.1:{pl}")
        load0 = Path("/proc/loadavg").read_text().split()[:3]
        results: dict[str, dict] = {"ggmux": {}, "llama-server": {}}
        for name, port in (("ggmux", pg), ("llama-server", pl)):  # warm both (loads, first images)
            stream(port, image_body(new_image(99999), "warm up", 2))
        for r in range(a.rounds):  # alternate, so both see the same machine
            for name, port in (("ggmux", pg), ("llama-server", pl)):
                got = measure(port, 1, 1000 * r)
                for k, v in got.items():
                    results[name].setdefault(k, []).extend(v)
        load1 = Path("/proc/loadavg").read_text().split()[:3]
        print(f"llama-server: {binary} ({llama_server.version(binary)}); threads {a.threads}; "
              f"rounds {a.rounds}; load {' '.join(load0)} -> {' '.join(load1)}")
        print(f"{'figure (median)':30} {'ggmux':>10} {'llama-server':>13} {'ratio':>7}")
        for k in ("ttft_cold_s", "ttft_cached_s", "tokens_per_s_4", "stall_max_gap_s",
                  "calm_max_gap_s"):
            g, ls = med(results["ggmux"][k]), med(results["llama-server"][k])
            print(f"{k:30} {g:10.3f} {ls:13.3f} {g / ls:7.2f}")
        if a.json:
            a.json.write_text(json.dumps({"load": [load0, load1], "threads": a.threads,
                                          "results": results}, indent=1))
        return 0
    finally:
        vp.stop_all(procs)


if __name__ == "__main__":
    sys.exit(main())
