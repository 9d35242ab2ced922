"""Image and audio prompts answered by ggmux and by llama-server, side by side.

The same GGUFs (the test model of :mod:`bench.vision_model`: Gemma 3 270M
and a random-weight gemma3 + qwen2a projector), the same greedy requests,
one :data:`CASES` entry per client API: OpenAI chat completions (images,
a JPEG, two images, audio), Anthropic messages, Responses, Ollama chat and
generate, llama.cpp's ``/completion`` with ``multimodal_data``. ggmux is
asked on each API's own route; llama-server on the same route where it has
one, else (Ollama's) the chat completion the adapter makes of it. Each
prompt opens with a word of its own, so that neither server finds more
than the template's first tokens of it in a slot's cache: both read it
with the same batch cuts (a prompt whose cached prefix is longer is read
in other batches, whose sums round otherwise, and a greedy token near a
tie can go the other way, on llama-server as on ggmux).

    python -m bench.vision_parity                      # compare, print a table
    python -m bench.vision_parity --record tests/data/vision_parity.json

The llama-server used is, by default, one built from the engine's own
llama.cpp (``python -m bench.llama_server --build --source engine``:
the same kernels; ``--llama-server PATH`` names another). ``--record``
writes llama-server's answers with what they depend on (the
llama-cpp-python version, the text model's hash, the projector's seed),
which tests/test_vision.py compares ggmux's live answers against.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
import wave
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import llama_server, vision_model
from .cluster import wait

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
PHOTO = DATA / "vision-photo.jpg"
"""A JPEG kept as bytes (an encoder of another version would make others)."""
MARKER = "<__media__>"
"""The media marker both servers are pinned to (``LLAMA_MEDIA_MARKER``) for
``/completion``'s ``prompt_string``."""
MAX_TOKENS = 12


def gradient_png() -> bytes:
    from PIL import Image

    x, y = np.meshgrid(np.arange(300), np.arange(200))
    rgb = np.stack([x % 256, y % 256, (x * y) % 256], -1).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, "PNG")
    return b.getvalue()


def stripes_png() -> bytes:
    from PIL import Image

    x = np.arange(256)
    row = np.stack([(x // 32) * 36, 255 - (x // 16) * 16, (x * 7) % 256], -1)
    rgb = np.repeat(row[None, :, :], 256, 0).astype(np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, "PNG")
    return b.getvalue()


def photo_jpeg() -> bytes:
    """The committed JPEG (written once by :func:`write_photo`)."""
    return PHOTO.read_bytes()


def write_photo(path: Path = PHOTO) -> None:
    from PIL import Image

    rng = np.random.default_rng(7)
    x, y = np.meshgrid(np.linspace(0, 1, 320), np.linspace(0, 1, 240))
    rgb = np.stack([x, y, 1 - x * y], -1) * 200 + rng.normal(0, 20, (240, 320, 3))
    Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=85)


def tone_wav(seconds: float = 2.0, hz: float = 440.0, rate: int = 16000) -> bytes:
    t = np.arange(int(seconds * rate)) / rate
    pcm = (0.3 * np.sin(2 * np.pi * hz * t) * 32767).astype("<i2")
    b = io.BytesIO()
    with wave.open(b, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return b.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def image_part(data: bytes, mime: str = "image/png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64(data)}"}}


def audio_part(data: bytes) -> dict:
    return {"type": "input_audio", "input_audio": {"data": b64(data), "format": "wav"}}


def text_part(text: str) -> dict:
    return {"type": "text", "text": text}


@dataclass
class Case:
    """One prompt: ``ggmux`` is ``(path, body)`` on ggmux, ``peer`` the same
    on llama-server; ``answer(doc)`` takes the text out of either answer."""

    name: str
    ggmux: tuple[str, dict]
    peer: tuple[str, dict]
    kind: str = "chat"  # chat | anthropic | responses | ollama-chat | ollama-generate | completion
    tags: list[str] = field(default_factory=list)


def _chat(model: str, content: list) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": MAX_TOKENS,
            "messages": [{"role": "user", "content": content}]}


def cases(model: str = vision_model.NAME) -> list[Case]:
    """Every case (see the module docstring)."""
    grad, stripes, photo, tone = gradient_png(), stripes_png(), photo_jpeg(), tone_wav()
    out = []
    for name, content in (
            ("chat-gradient", [text_part("Alpha. What is in this image?"), image_part(grad)]),
            ("chat-stripes", [text_part("Bravo. What is in this image?"),
                              image_part(stripes)]),
            ("chat-jpeg", [text_part("Charlie. Describe the photo."),
                           image_part(photo, "image/jpeg")]),
            ("chat-two-images", [text_part("Delta. Compare"), image_part(grad), text_part("with"),
                                 image_part(stripes), text_part("Which is brighter?")]),
            ("chat-audio", [text_part("Echo. What do you hear?"), audio_part(tone)]),
            ("chat-stripes-again", [text_part("Kilo. Which colours?"), image_part(stripes)])):
        body = _chat(model, content)
        out.append(Case(name, ("/v1/chat/completions", body), ("/v1/chat/completions", body)))
    anth = {"model": model, "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Foxtrot. What is in this image?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": b64(grad)}}]}]}
    out.append(Case("anthropic-gradient", ("/v1/messages", anth), ("/v1/messages", anth),
                    "anthropic"))
    resp = {"model": model, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "input": [{"role": "user", "content": [
                {"type": "input_text", "text": "Golf. What is in this image?"},
                {"type": "input_image", "image_url": f"data:image/png;base64,{b64(stripes)}"}]}]}
    out.append(Case("responses-stripes", ("/v1/responses", resp), ("/v1/responses", resp),
                    "responses"))
    oll = {"model": model, "stream": False, "options": {"temperature": 0,
                                                        "num_predict": MAX_TOKENS},
           "messages": [{"role": "user", "content": "Hotel. What is in this image?",
                         "images": [b64(grad)]}]}
    out.append(Case("ollama-chat-gradient", ("/api/chat", oll), (
        "/v1/chat/completions", _chat(model, [text_part("Hotel. What is in this image?"),
                                              image_part(grad)])), "ollama-chat"))
    gen = {"model": model, "stream": False, "prompt": "India. Describe the photo.",
           "images": [b64(photo)], "options": {"temperature": 0, "num_predict": MAX_TOKENS}}
    out.append(Case("ollama-generate-jpeg", ("/api/generate", gen), (
        "/v1/chat/completions", _chat(model, [text_part("India. Describe the photo."),
                                              image_part(photo, "image/jpeg")])),
        "ollama-generate"))
    comp = {"model": model, "temperature": 0, "n_predict": MAX_TOKENS, "prompt": {
        "prompt_string": f"Juliett. Image: {MARKER}\nThe image shows",
        "multimodal_data": [b64(grad)]}}
    out.append(Case("completion-gradient", ("/completion", comp), ("/completion", comp),
                    "completion"))
    return out


CONCURRENT = ("chat-stripes-again", "chat-stripes", "chat-jpeg", "chat-two-images")
"""Cases sent four at once (each read cold: ``cache_prompt`` false) to both
servers, whose answers are the same as alone. ``chat-gradient`` and
``chat-audio`` are left out: their greedy answers are near ties, and four at
once they change with which requests share a batch and when, on
llama-server as on ggmux (the same four requests, round after round: other
answers from each; bench/RESULTS.md)."""


def concurrently(base: str, names, cases_by_name: dict) -> list[str]:
    """Each case of ``names`` sent at once to ``base``, cold; their answers."""
    import concurrent.futures

    def one(n: str) -> str:
        c = cases_by_name[n]
        path, body = c.ggmux if base.endswith("#g") else c.peer
        return answer("chat", post(base.removesuffix("#g"), path, {**body, "cache_prompt": False}))
    with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
        return list(pool.map(one, names))


def answer(kind: str, doc: dict) -> str:
    """The answer's text of either server's JSON for a case of ``kind``
    (``peer``: llama-server's, whose Ollama cases are chat completions)."""
    if kind == "anthropic":
        return "".join(b.get("text", "") for b in doc["content"] if b.get("type") == "text")
    if kind == "responses":
        return "".join(c.get("text", "") for o in doc["output"] if o.get("type") == "message"
                       for c in o.get("content", []))
    if kind == "ollama-chat":
        return doc["message"]["content"] if "message" in doc and "role" in doc["message"] \
            and "choices" not in doc else doc["choices"][0]["message"]["content"]
    if kind == "ollama-generate":
        return doc["response"] if "response" in doc else doc["choices"][0]["message"]["content"]
    if kind == "completion":
        return doc["content"]
    return doc["choices"][0]["message"]["content"]


def post(base: str, path: str, body: dict, timeout: float = 600.0) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{base}{path}: {e.code} {e.read()[:500]!r}") from None


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def depends_on() -> dict:
    """What the recorded answers depend on: the engine's llama.cpp (the
    llama-cpp-python version), the text model's and the projector's bytes."""
    with tempfile.TemporaryDirectory() as d:
        proj = vision_model.write_projector(Path(d) / "p.gguf")
        return {"llama_cpp_python": llama_server.engine_version(),
                "text_model_sha256": file_sha256(vision_model.text_model()),
                "projector_sha256": file_sha256(Path(proj))}


def wait_up(base: str, timeout: float = 120.0) -> None:
    """Wait for ``base``'s ``/health`` (SystemExit past ``timeout`` s)."""
    def up() -> bool:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            return r.status == 200
    wait(up, timeout, f"{base}/health")


def stop_all(procs) -> None:
    """SIGTERM each server, wait up to a minute each, then SIGKILL."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()


def start_llama_server(binary: Path, folder: Path, port: int, parallel: int = 4,
                       ctx: int = 2048, threads: int = 1, log=subprocess.DEVNULL,
                       extra: list[str] | None = None):
    """llama-server on the test model, as ggmux's instance runs it (``ctx``
    tokens a slot, ``parallel`` slots, ``threads``)."""
    env = {**os.environ, "LLAMA_MEDIA_MARKER": MARKER}
    model = next(p for p in folder.iterdir() if "mmproj" not in p.name)
    proj = next(p for p in folder.iterdir() if "mmproj" in p.name)
    return subprocess.Popen(
        [str(binary), "-m", str(model), "--mmproj", str(proj), "-c", str(ctx * parallel),
         "-np", str(parallel), "--threads", str(threads), "--port", str(port),
         "--host", "127.0.0.1", *(extra or [])], env=env, stdout=log, stderr=subprocess.STDOUT)


def start_ggmux(models_dir: Path, port: int, threads: int = 1, log=subprocess.DEVNULL,
                extra: list[str] | None = None):
    env = {**os.environ, "LLAMA_MEDIA_MARKER": MARKER}
    return subprocess.Popen(
        [sys.executable, "-m", "ggmux.supervisor", "serve", "--models-dir", str(models_dir),
         "--port", str(port), "--threads", str(threads), "--spares", "0", "--no-hf-cache",
         *(extra or [])], env=env, stdout=log, stderr=subprocess.STDOUT)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path, default=None,
                    help="the peer (default: the engine-source build, else any found)")
    ap.add_argument("--record", type=Path, default=None,
                    help="write llama-server's answers here (tests/data/vision_parity.json)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the four-at-once cases")
    a = ap.parse_args(argv)
    binary = a.llama_server or llama_server.find_engine() or llama_server.find()
    if binary is None:
        print(f"no llama-server: {llama_server.HOW_TO_GET}", file=sys.stderr)
        return 1
    work = Path(tempfile.mkdtemp(prefix="vision-parity-"))
    folder = vision_model.write_folder(work)
    pg, pl = free_port(), free_port()
    g = start_ggmux(work, pg)
    ls = start_llama_server(binary, folder, pl)
    try:
        base_g, base_l = f"http://127.0.0.1:{pg}", f"http://127.0.0.1:{pl}"
        wait_up(base_g)
        wait_up(base_l)
        rows, record = [], {}
        for c in cases():
            mine = answer(c.kind, post(base_g, *c.ggmux))
            peer = answer(c.kind if c.kind in ("anthropic", "responses", "completion")
                          else "chat", post(base_l, *c.peer))
            record[c.name] = peer
            rows.append((c.name, mine == peer, mine, peer))
        by_name = {c.name: c for c in cases()}
        together = {}
        for r in range(a.rounds):  # four at once, cold
            mine = concurrently(base_g + "#g", CONCURRENT, by_name)
            peer = concurrently(base_l, CONCURRENT, by_name)
            for n, x, y in zip(CONCURRENT, mine, peer, strict=True):
                rows.append((f"{n} (4 at once, round {r})", x == y, x, y))
                together.setdefault(n, y)
        tie = [concurrently(base_l, ("chat-gradient", *CONCURRENT[1:]), by_name)[0]
               for _ in range(a.rounds)]
        print(f"llama-server: {binary} ({llama_server.version(binary)})")
        for name, same, mine, peer in rows:
            print(f"{'same' if same else 'DIFFERENT':9} {name:40} ggmux {mine!r}")
            if not same:
                print(f"{'':50} peer  {peer!r}")
        print(f"chat-gradient 4 at once on llama-server, {a.rounds} rounds: "
              f"{len(set(tie))} distinct answers {sorted(set(tie))!r}")
        if a.record:
            a.record.parent.mkdir(parents=True, exist_ok=True)
            a.record.write_text(json.dumps({**depends_on(), "llama_server": str(
                llama_server.version(binary)), "max_tokens": MAX_TOKENS, "answers": record,
                "four_at_once": together}, indent=1) + "\n")
            print(f"recorded {len(record) + len(together)} answers in {a.record}")
        return 0 if all(r[1] for r in rows) else 2
    finally:
        stop_all((g, ls))


if __name__ == "__main__":
    sys.exit(main())
