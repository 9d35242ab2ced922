"""Images and audio in the built-in engine, end to end, on the test model
of bench/vision_model.py (Gemma 3 270M with a random-weight gemma3 +
qwen2a projector) served from a models folder as a user's would be.

* Every client API's image (or audio) prompt gets llama-server's greedy
  answer: the answers tests/data/vision_parity.json recorded from
  llama-server built from the engine's own llama.cpp (``python -m
  bench.vision_parity --record``), compared while the installed
  llama-cpp-python and the model files are those it was recorded with.
* Four image requests at once answer as each does alone.
* A media item is cached like text: the same image again is a hit that
  covers it, after an unload too (the disk tier); another image at the
  same place is never a hit; one tenant's image cache serves no other.
* Bad media are a 400 in the client API's envelope and reach no engine.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from conftest import Server, free_port, open_stream, wait_for

from bench import vision_parity as vp
from bench.vision_model import IMAGE_TOKENS, NAME, write_folder

RECORD = Path(__file__).parent / "data" / "vision_parity.json"
KEYS = "[alice]\nkey = sk-alice\n\n[bob]\nkey = sk-bob\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_folder(tmp_path_factory.mktemp("vision-models"))


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """One ggmux serve of the folder, with a disk tier (stopped at the end)."""
    work = tmp_path_factory.mktemp("vision-serve")
    s = Server(["--models-dir", str(folder.parent), "--no-hf-cache", "--cache-disk",
                str(work / "kv")], free_port(), work / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def record() -> dict:
    """The recorded llama-server answers, or a skip saying why they do not apply."""
    doc = json.loads(RECORD.read_text())
    now = vp.depends_on()
    for k in ("llama_cpp_python", "text_model_sha256", "projector_sha256"):
        if doc.get(k) != now[k]:
            pytest.skip(f"llama-server's answers were recorded with {k} {doc.get(k)}, this "
                        f"machine has {now[k]}: record them again (python -m "
                        "bench.vision_parity --record tests/data/vision_parity.json)")
    return doc["answers"]


def ask(s: Server, case: vp.Case, headers: dict | None = None) -> dict:
    path, body = case.ggmux
    if case.kind == "completion":  # this server's own marker (/props' media_marker)
        marker = s.json("GET", f"/props?model={NAME}")[1]["media_marker"]
        p = body["prompt"]
        body = {**body, "prompt": {**p, "prompt_string": p["prompt_string"].replace(
            vp.MARKER, marker)}}
    st, doc = s.json("POST", path, body, headers=headers, timeout=300)
    assert st == 200, doc
    return doc


CASES = {c.name: c for c in vp.cases()}


@pytest.fixture(scope="module")
def four(record) -> dict:
    """llama-server's answers to the four-at-once cases."""
    return json.loads(RECORD.read_text())["four_at_once"]


@pytest.mark.parametrize("name", list(CASES))
def test_each_api_answers_a_media_prompt_as_llama_server_does(server, record, name):
    case = CASES[name]
    assert vp.answer(case.kind, ask(server, case)) == record[name]


def test_four_media_requests_at_once_answer_as_llama_server_does(server, record, four):
    """Four slots at once, each read cold (``cache_prompt`` false), in
    batches of four sequences: llama-server's answers to the same four at
    once (bench/vision_parity.CONCURRENT, whose answers are also each one's
    alone)."""
    got = vp.concurrently(server.base + "#g", vp.CONCURRENT, CASES)
    assert dict(zip(vp.CONCURRENT, got, strict=True)) == four


def chat(s: Server, content: list, headers: dict | None = None, **extra) -> dict:
    body = {"model": NAME, "temperature": 0, "max_tokens": 6,
            "messages": [{"role": "user", "content": content}], **extra}
    st, doc = s.json("POST", "/v1/chat/completions", body, headers=headers, timeout=300)
    assert st == 200, doc
    return doc


def cached(doc: dict) -> int:
    return doc["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_an_image_is_cached_like_text_and_another_image_is_never_a_hit(server):
    question = [vp.text_part("Which colours are there?")]
    first = chat(server, [*question, vp.image_part(vp.gradient_png())])
    details = first["usage"]["prompt_tokens_details"]
    assert details["image_tokens"] == IMAGE_TOKENS
    assert first["usage"]["prompt_tokens"] > IMAGE_TOKENS
    again = chat(server, [*question, vp.image_part(vp.gradient_png())])
    assert cached(again) == again["usage"]["prompt_tokens"] - 1  # all but the last token
    other = chat(server, [*question, vp.image_part(vp.stripes_png())])
    # the text before the image is shared; the image is not
    assert 0 < cached(other) < first["usage"]["prompt_tokens"] - IMAGE_TOKENS


def test_a_cached_image_comes_back_from_the_disk_tier_after_an_unload(server):
    content = [vp.text_part("After the swap, what is this?"),
               vp.image_part(vp.photo_jpeg(), "image/jpeg")]
    chat(server, content)
    hit = chat(server, content)  # the slot's own cache: its last token read alone
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1
    assert server.json("POST", "/models/unload", {"model": NAME})[0] == 200
    wait_for(lambda: server.models()[NAME]["status"]["value"] == "unloaded", 60,
             what="the model unloaded")
    after = chat(server, content)
    assert after["timings"].get("cache_tier") == "disk"
    assert cached(after) == cached(hit)  # the image and its text, from disk
    assert after["choices"][0]["message"] == hit["choices"][0]["message"]


def test_audio_is_counted_in_usage_and_cached(server):
    content = [vp.text_part("Listen."), vp.audio_part(vp.tone_wav(1.0, 330))]
    first = chat(server, content)
    n_audio = first["usage"]["prompt_tokens_details"]["audio_tokens"]
    assert n_audio > 0 and "image_tokens" not in first["usage"]["prompt_tokens_details"]
    assert cached(chat(server, content)) > n_audio


def test_models_list_show_and_props_say_what_the_projector_reads(server):
    wait_for(lambda: "modalities" in server.models()[NAME], 60, what="the model measured")
    m = server.models()[NAME]
    assert m["modalities"] == {"vision": True, "audio": True}
    assert m["capabilities"] == ["vision", "audio"]
    st, show = server.json("POST", "/api/show", {"model": NAME})
    assert st == 200 and {"completion", "vision", "audio"} <= set(show["capabilities"])
    chat(server, [vp.text_part("hi")])  # loaded: its /props
    st, props = server.json("GET", f"/props?model={NAME}")
    assert st == 200 and props["modalities"]["vision"] and props["modalities"]["audio"]
    assert re.fullmatch(r"<__media_[0-9a-f]{16}__>", props["media_marker"])
    st, ps = server.json("GET", "/ps")
    assert next(x for x in ps["models"] if x["id"] == NAME)["modalities"]["vision"] is True


def _bomb() -> str:
    """A PNG header declaring 60,000 x 60,000 pixels (10.8 GB decoded)."""
    from test_media_inputs import png_header_only

    return base64.b64encode(png_header_only(60_000, 60_000)).decode()


def _image(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


BAD = [  # (the part, words of the message)
    (_image("data:image/png;base64," + base64.b64encode(b"not an image at all").decode()),
     "not an image or audio"),
    (_image("data:image/png;base64," + _bomb()), "--max-image-pixels"),
    (_image("http://169.254.169.254/latest/meta-data"), "--media-fetch"),
    (_image("data:image/png;base64,!!!"), "base64"),
]


def _encoded(s: Server) -> float:
    st, _, body = s.request("GET", f"/metrics?model={NAME}")
    assert st == 200
    m = re.search(rb"^ggmux_media_encoded_total (\S+)$", body, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_bad_media_are_400s_in_each_apis_envelope_and_reach_no_engine(server):
    chat(server, [vp.text_part("warm")])
    before = _encoded(server)
    bomb = _bomb()
    # another client's stream runs meanwhile and ends as a stream ends
    other = open_stream(server.port, {"model": NAME, "stream": True, "max_tokens": 24,
                                      "temperature": 0, "ignore_eos": True,
                                      "messages": [{"role": "user", "content": "Go on."}]},
                        timeout=300)
    for part, words in BAD:
        body = {"model": NAME, "max_tokens": 4,
                "messages": [{"role": "user", "content": [vp.text_part("x"), part]}]}
        st, doc = server.json("POST", "/v1/chat/completions", body)
        assert st == 400, (words, doc)
        assert words in doc["error"]["message"], (words, doc)
        assert doc["error"]["type"] == "invalid_request_error"
    # Anthropic's envelope, Ollama's, Responses'
    st, doc = server.json("POST", "/v1/messages", {
        "model": NAME, "max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": bomb}}]}]})
    assert st == 400 and doc["type"] == "error" and "--max-image-pixels" in \
        doc["error"]["message"], doc
    st, doc = server.json("POST", "/api/chat", {"model": NAME, "stream": False, "messages": [
        {"role": "user", "content": "x", "images": [base64.b64encode(b"junk").decode()]}]})
    assert st == 400 and "not an image or audio" in doc["error"], doc
    assert doc["error"].startswith("messages[0].images[0]"), doc  # the Ollama request's place
    st, doc = server.json("POST", "/api/generate", {"model": NAME, "stream": False,
                                                    "prompt": "x", "system": "s", "images": [
        vp.b64(vp.stripes_png()), base64.b64encode(b"junk").decode()]})
    assert st == 400 and doc["error"].startswith("images[1]"), doc
    st, doc = server.json("POST", "/v1/responses", {"model": NAME, "input": [
        {"role": "user", "content": [{"type": "input_image",
                                      "image_url": "https://example.com/x.png"}]}]})
    assert st == 400 and "--media-fetch" in doc["error"]["message"], doc
    too_many = [vp.text_part("x")] + [vp.image_part(vp.stripes_png())] * 17
    st, doc = server.json("POST", "/v1/chat/completions", {
        "model": NAME, "messages": [{"role": "user", "content": too_many}]})
    assert st == 400 and "--max-media-items" in doc["error"]["message"], doc
    assert _encoded(server) == before  # nothing reached the projector
    streamed = b""
    while chunk := other.recv(65536):
        streamed += chunk
    other.close()
    assert streamed.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in streamed
    assert streamed.count(b'"content":') >= 24
    # the replica counts none of them as its fault, and still answers
    assert vp.answer("chat", chat(server, [vp.text_part("Still here?")]))


def test_one_tenants_cached_image_serves_no_other_tenant(folder, serve, tmp_path):
    kf = tmp_path / "keys.ini"
    kf.touch(mode=0o600)  # its secrets readable by no one else, as ggmux requires
    kf.write_text(KEYS)
    s = serve("--models-dir", str(folder.parent), "--no-hf-cache", "--keys", str(kf))
    content = [vp.text_part("Whose picture?"), vp.image_part(vp.gradient_png())]
    alice, bob = {"authorization": "Bearer sk-alice"}, {"authorization": "Bearer sk-bob"}
    chat(s, content, alice)
    assert cached(chat(s, content, bob)) == 0  # another key: not even the shared text
    assert cached(chat(s, content, alice)) > IMAGE_TOKENS


def test_a_model_whose_projector_is_turned_off_reads_text_only(folder, serve, tmp_path):
    preset = tmp_path / "p.ini"
    preset.write_text(f"[{NAME}]\nmmproj-auto = false\n")
    s = serve("--models-dir", str(folder.parent), "--models-preset", str(preset),
              "--no-hf-cache")
    st, doc = s.json("POST", "/v1/chat/completions", {
        "model": NAME, "max_tokens": 2,
        "messages": [{"role": "user", "content": [vp.text_part("x"),
                                                  vp.image_part(vp.stripes_png())]}]})
    assert st == 400 and "projector" in doc["error"]["message"], doc
    wait_for(lambda: "has_chat_template" in s.models()[NAME], 60, what="measured")
    assert "modalities" not in s.models()[NAME]


def test_record_is_what_bench_writes():
    """The recorded file names what it depends on and holds every case."""
    doc = json.loads(RECORD.read_text())
    assert set(doc["answers"]) == set(CASES)
    assert set(doc["four_at_once"]) == set(vp.CONCURRENT)
    assert doc["max_tokens"] == vp.MAX_TOKENS
    assert {"llama_cpp_python", "text_model_sha256", "projector_sha256"} <= set(doc)


def test_anthropic_count_tokens_counts_an_image_as_its_embeddings(server):
    content = [{"type": "text", "text": "Count me."},
               {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                            "data": vp.b64(vp.stripes_png())}}]
    st, doc = server.json("POST", "/v1/messages/count_tokens",
                          {"model": NAME, "messages": [{"role": "user", "content": content}]})
    assert st == 200, doc
    st, answer = server.json("POST", "/v1/messages", {
        "model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": content}]})
    assert st == 200, answer
    assert doc["input_tokens"] == answer["usage"]["input_tokens"] + answer["usage"].get(
        "cache_read_input_tokens", 0) > IMAGE_TOKENS


def test_a_cached_image_comes_back_after_the_server_restarts(folder, serve, tmp_path):
    """A whole new ggmux serve on the same disk tier restores the
    conversation's image from the entry the first one's stop wrote."""
    args = ("--models-dir", str(folder.parent), "--no-hf-cache", "--cache-disk",
            str(tmp_path / "kv"))
    content = [vp.text_part("Across a restart: what is it?"), vp.image_part(vp.stripes_png())]
    first = serve(*args)
    chat(first, content)
    hit = chat(first, content)
    assert cached(hit) == hit["usage"]["prompt_tokens"] - 1
    first.stop()
    again = serve(*args)
    after = chat(again, content)
    assert after["timings"].get("cache_tier") == "disk"
    assert cached(after) == cached(hit) > IMAGE_TOKENS
    assert after["choices"][0]["message"] == hit["choices"][0]["message"]
