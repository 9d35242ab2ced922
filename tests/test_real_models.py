"""End to end on the real demo models (llama-cpp-python instances)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import children_of, open_stream, wait_for
from ggmux.shm import layout as L

pytestmark = pytest.mark.slow  # the demo models end to end

openai = pytest.importorskip("openai")

SMOL, GEMMA = "smollm2-135m", "gemma3-270m"


def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0,
                         timeout=120)


def stream_text(c, model: str, max_tokens: int = 16) -> str:
    out = []
    for chunk in c.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello in five words."}],
        max_tokens=max_tokens, stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            out.append(chunk.choices[0].delta.content)
    return "".join(out)


def test_models_max_1_switches_between_the_two_demo_models_through_the_sdk(serve):
    s = serve("--models-max", "1", "--proxies", "2", "--threads", "1")
    c = client(s)
    assert stream_text(c, SMOL).strip()
    r = c.chat.completions.create(model=GEMMA, max_tokens=8,
                                  messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None and r.model == GEMMA
    models = wait_for(lambda: (m := s.models())[SMOL]["status"]["value"] == "unloaded" and m,
                      10, what="smollm2 unloaded")
    assert models[GEMMA]["status"]["value"] == "loaded"
    assert "failed" not in models[SMOL]["status"]
    assert stream_text(c, SMOL).strip()
    assert {m.id for m in c.models.list().data} == {SMOL, GEMMA}
    # completions and embeddings through the SDK as well
    comp = c.completions.create(model=SMOL, prompt="Once upon a time", max_tokens=4)
    assert comp.choices[0].text is not None
    emb = c.embeddings.create(model=SMOL, input=["hello world", "goodbye"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 10


def test_eight_concurrent_first_requests_for_a_cold_real_model_start_one_instance(serve):
    s = serve("--proxies", "2", "--threads", "1")
    c = client(s)

    def ask(_):
        r = c.chat.completions.create(model=SMOL, max_tokens=4,
                                      messages=[{"role": "user", "content": "Hi"}])
        return r.choices[0].message.content

    with ThreadPoolExecutor(8) as ex:
        answers = list(ex.map(ask, range(8)))
    assert len(answers) == 8 and all(a is not None for a in answers)
    assert s.logs().count(f"loading {SMOL} in slot") == 1
    # two proxies, one instance, at most one spare
    assert len(children_of(s.proc.pid)) in (3, 4)


def test_dropped_real_stream_frees_the_replica(serve):
    s = serve("--proxies", "1", "--threads", "1")
    sock = open_stream(s.port, {"model": SMOL, "stream": True, "max_tokens": 1000,
                       "messages": [{"role": "user", "content": "Count from 1 to 500."}]})
    got = b""
    while got.count(b"data: ") < 4:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    sock.close()
    inflight = s.seg.counters[:, :, L.C_IN_FLIGHT]
    wait_for(lambda: inflight.sum() == 0, 10.0, what="in-flight 0 after the client left")
    r = client(s).chat.completions.create(model=SMOL, max_tokens=4, timeout=10,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert r.choices[0].message.content is not None
