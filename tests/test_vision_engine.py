"""The engine's media step on the test model (bench/vision_model.py), no
HTTP: the projector's encoder runs beside the decode loop, so a slot
waiting for its image never stops the other slots' tokens; an encode that
fails ends its own request only; the same image sent together is encoded
once; a request that leaves while its image is being encoded frees it
when the encoder gives it back."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from conftest import wait_for
from ggmux.instance.engine.jobs import InvalidRequest
from ggmux.instance.engine.loop import Engine, EngineConfig, Generation, Sampling
from ggmux.instance.media.probe import probe

from bench import vision_parity as vp
from bench.vision_model import write_folder

GREEDY = Sampling(temperature=0)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    folder = write_folder(tmp_path_factory.mktemp("vm"), audio=False)
    model = next(p for p in folder.iterdir() if "mmproj" not in p.name)
    proj = next(p for p in folder.iterdir() if "mmproj" in p.name)
    e = Engine(EngineConfig(str(model), ctx_size=512, parallel=4, n_threads=1,
                            mmproj=str(proj), prefill_wait_ms=0))
    e.load()
    yield e
    e.close()


def image_prompt(e: Engine, data: bytes, text: str = "Look: ") -> tuple[list[int], tuple]:
    p = probe(data, "f", 1 << 30, 60)
    return e.tokenize_media(f"{text}{e.media_marker} What is it?", [(data, p, "f")])


class Blocked:
    """The projector's encode, held until :meth:`release` (and counted)."""

    def __init__(self, e: Engine, fail: bool = False) -> None:
        self.e, self.fail = e, fail
        self.real = e.m.projector.encode
        self.entered = threading.Event()
        self.go = threading.Event()
        self.calls = 0

    def __call__(self, span):
        self.calls += 1
        self.entered.set()
        self.go.wait(120)
        if self.fail:
            raise RuntimeError("the encoder broke")
        return self.real(span)

    def __enter__(self):
        self.e.m.projector.encode = self
        return self

    def __exit__(self, *exc):
        self.go.set()
        self.e.m.projector.encode = self.real

    def release(self) -> None:
        self.go.set()


def test_a_slot_waiting_for_its_image_never_stops_the_others_tokens(engine):
    text = engine.submit(Generation(engine.tokenize("Count slowly: one, two,"), GREEDY,
                                    max_tokens=200, ignore_eos=True))
    tokens = []
    got = threading.Lock()

    def count():  # the text job's events, off the engine's queue
        while True:
            ev = text.queue.get(timeout=300)
            if ev[0] == "text":
                with got:
                    tokens.append(ev[2])
            if ev[0] in ("done", "error"):
                return ev
    reader = threading.Thread(target=count, daemon=True)
    reader.start()
    wait_for(lambda: len(tokens) >= 2, 120, what="the text request's first tokens")
    with Blocked(engine) as enc:
        prompt, spans = image_prompt(engine, vp.gradient_png())
        img = engine.submit(Generation(prompt, GREEDY, max_tokens=4, media=spans))
        assert enc.entered.wait(60), "the encoder was never asked"
        wait_for(lambda: any(s["state"] == "encoding media" for s in engine.slot_info()), 30,
                 what="a slot waiting for its image")
        before = len(tokens)
        # the encoder is held: the text request's tokens keep coming meanwhile
        wait_for(lambda: len(tokens) >= before + 5, 120,
                 what="text tokens while an image is being encoded")
        enc.release()
        out = img.result(300)
    assert out["usage"]["prompt_tokens_details"]["image_tokens"] == spans[0].n_tokens
    text.cancel()
    reader.join(60)


def test_an_encode_that_fails_ends_its_own_request_only(engine):
    other = engine.submit(Generation(engine.tokenize("Hello there"), GREEDY, max_tokens=8))
    with Blocked(engine, fail=True) as enc:
        prompt, spans = image_prompt(engine, vp.stripes_png(), "Broken: ")
        img = engine.submit(Generation(prompt, GREEDY, max_tokens=4, media=spans))
        enc.release()
        with pytest.raises(Exception, match="failed to process mtmd chunk"):
            img.result(300)
    assert other.result(300)["usage"]["completion_tokens"] == 8
    assert spans[0].chunk is None  # released


def test_the_same_image_sent_together_is_encoded_once(engine):
    data = vp.photo_jpeg()
    with Blocked(engine) as enc:
        jobs = []
        for word in ("One: ", "Two: ", "Three: "):
            prompt, spans = image_prompt(engine, data, word)
            jobs.append(engine.submit(Generation(prompt, GREEDY, max_tokens=2, media=spans)))
        assert enc.entered.wait(60)
        wait_for(lambda: sum(s["state"] == "encoding media" for s in engine.slot_info()) == 3,
                 60, what="three slots waiting for one encode")
        enc.release()
        for j in jobs:
            j.result(300)
    assert enc.calls == 1


def noise_png(seed: int) -> bytes:
    import io

    import numpy as np
    from PIL import Image

    rgb = np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    b = io.BytesIO()
    Image.fromarray(rgb).save(b, "PNG")
    return b.getvalue()


class HoldSecond(Blocked):
    """The projector's encode: the first call runs, the next ones are held
    until :meth:`release`."""

    def __call__(self, span):
        self.calls += 1
        if self.calls == 1:
            return self.real(span)
        return super().__call__(span)


def test_requests_that_came_together_wait_for_each_others_encode_to_start_together(engine):
    """Two images sent at once to an engine with nothing else to do: the
    first image's slot, ready, waits (counted in ``media_hold_seconds_total``)
    for the second's encode instead of taking its steps beside the encoder,
    and both answer once it is done."""
    held = engine.stats["media_hold_seconds_total"]
    with HoldSecond(engine) as enc:
        jobs = []
        for seed, word in ((1, "First: "), (2, "Second: ")):  # images no other test sent
            prompt, spans = image_prompt(engine, noise_png(seed), word)
            jobs.append(engine.submit(Generation(prompt, GREEDY, max_tokens=2, media=spans)))
        assert enc.entered.wait(60)  # the first image is encoded, the second held
        wait_for(lambda: engine.stats["media_hold_seconds_total"] > held, 60,
                 what="the ready image's slot holding for the other's encode")
        enc.release()
        for j in jobs:
            j.result(300)
    assert enc.calls >= 2  # (a request another test left may come first)


def test_a_request_that_leaves_during_its_encode_frees_its_media_later(engine):
    with Blocked(engine) as enc:
        prompt, spans = image_prompt(engine, vp.stripes_png(), "Gone: ")
        img = engine.submit(Generation(prompt, GREEDY, max_tokens=4, media=spans))
        assert enc.entered.wait(60)
        img.cancel()
        wait_for(lambda: img.ended, 30, what="the request ended")
        assert spans[0].chunk is not None  # the encoder still reads it
        enc.release()
        wait_for(lambda: spans[0].chunk is None, 30, what="the chunk freed after the encode")


def test_a_prompt_that_ends_with_media_is_refused(engine):
    data = vp.stripes_png()
    p = probe(data, "f", 1 << 30, 60)
    prompt, spans = engine.tokenize_media(f"End: {engine.media_marker}", [(data, p, "f")])
    cut = prompt[:spans[0].end]  # gemma's <end_of_image> left out: the image is last
    with pytest.raises(InvalidRequest, match="ends with an image"):
        engine.submit(Generation(cut, GREEDY, max_tokens=2, media=spans))


def test_a_model_without_projector_says_so(tmp_path: Path):
    from ggmux.supervisor.demo import demo_models

    path = next(e.path for e in demo_models() if e.name == "smollm2-135m")
    e = Engine(EngineConfig(str(path), ctx_size=256, parallel=1, n_threads=1))
    e.load()
    try:
        assert e.media_marker is None and e.modalities() == {"vision": False, "audio": False}
        with pytest.raises(InvalidRequest, match="no multimodal projector"):
            e.tokenize_media("x", [])
    finally:
        e.close()
