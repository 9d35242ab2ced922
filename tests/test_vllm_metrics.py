"""``GET /metrics`` under vLLM's names (``--metrics-compat vllm``, the
default): what an InferencePool's endpoint picker scrapes, with the values
it should read under load (fake instances: one slot, a KV cache of 1000
cells), and the same from a real model's engine."""

from __future__ import annotations

import re

import pytest
from conftest import chat_body, open_stream, wait_for

LINE = re.compile(r'^(vllm:[a-z_]+)(?:\{(.*)\})? (\S+)$')


def vllm_series(text: str) -> dict[tuple[str, tuple], float]:
    """``(family, ((label, value), ...)) -> value`` of the ``vllm:`` lines."""
    out = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            labels = tuple(re.findall(r'([a-z_]+)="([^"]*)"', m.group(2) or ""))
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def first_series(text: str, family: str) -> str:
    """The first sample line of ``family``: what a picker that names no label reads."""
    return next(line for line in text.splitlines() if line.startswith(
        (family + " ", family + "{")))


def test_metrics_say_running_waiting_kv_use_and_the_loaded_models_as_vllm_does(serve, fakes):
    fakes.add("hot", parallel=1, kv_size=1000, ttft_s=60)
    fakes.add("cold", load_s=60)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--models-max", "3")
    socks = [open_stream(s.port, chat_body("hot", stream=True)) for _ in range(3)]
    cold = open_stream(s.port, chat_body("cold", stream=True))
    try:
        def loaded():
            v = vllm_series(s.request("GET", "/metrics")[2].decode())
            return v if v.get(("vllm:num_requests_running", (("model_name", "hot"),))) == 1 \
                and v.get(("vllm:num_requests_waiting", (("model_name", "hot"),))) == 2 \
                and v.get(("vllm:num_requests_waiting", (("model_name", "cold"),))) == 1 \
                else None

        v = wait_for(loaded, 20, 0.05, "one running and two waiting on hot, one on cold")
        text = s.request("GET", "/metrics")[2].decode()
        # the pod's series come first (no label): what a picker without labels reads
        assert first_series(text, "vllm:num_requests_running") == \
            "vllm:num_requests_running 1"
        assert first_series(text, "vllm:num_requests_waiting") == \
            "vllm:num_requests_waiting 3"
        # the one busy slot reserves all 1000 cells of hot's cache
        assert v[("vllm:kv_cache_usage_perc", (("model_name", "hot"),))] == 1.0
        assert first_series(text, "vllm:kv_cache_usage_perc") == "vllm:kv_cache_usage_perc 1.000000"
        info = [k for k in v if k[0] == "vllm:cache_config_info"]
        assert info == [("vllm:cache_config_info", (("block_size", "16"),
                                                    ("enable_prefix_caching", "True"),
                                                    ("num_gpu_blocks", "62")))]
        lora = [k for k in v if k[0] == "vllm:lora_requests_info"]
        assert lora == [("vllm:lora_requests_info", (("max_lora", "3"),
                                                     ("running_lora_adapters", "hot"),
                                                     ("waiting_lora_adapters", "cold")))]
        assert v[lora[0]] > 1e9  # the update's time, Unix seconds
    finally:
        for c in [*socks, cold]:
            c.close()
    idle = wait_for(lambda: (v := vllm_series(s.request("GET", "/metrics")[2].decode())).get(
        ("vllm:num_requests_running", ())) == 0 and v, 20, 0.05, "the requests to end")
    assert idle[("vllm:kv_cache_usage_perc", ())] == 0.0


def test_metrics_compat_none_leaves_out_the_vllm_names(serve, fakes):
    fakes.add("a")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--metrics-compat", "none")
    assert s.request("POST", "/v1/chat/completions", chat_body("a"))[0] == 200
    text = s.request("GET", "/metrics")[2].decode()
    assert "ggmux_requests_total" in text and "vllm:" not in text


@pytest.mark.slow
def test_a_real_engines_kv_use_is_its_running_requests_reservation(serve):
    """smollm2 with 2 slots of 512 tokens: one long-running request reserves
    its prompt plus max_tokens of the 1024 cells; its prompt cache afterwards
    is evictable, so the use goes back to 0 while the cache stays."""
    s = serve("--ctx-size", "512", "--parallel", "2", "--cache-ram", "0")
    body = {"model": "smollm2-135m", "stream": True, "max_tokens": 400,
            "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
            "temperature": 0, "ignore_eos": True}
    sock = open_stream(s.port, body)
    try:
        def busy():
            v = vllm_series(s.request("GET", "/metrics")[2].decode())
            return v if v.get(("vllm:num_requests_running", ())) == 1 else None

        v = wait_for(busy, 120, 0.05, "the request to run")
        use = v[("vllm:kv_cache_usage_perc", (("model_name", "smollm2-135m"),))]
        assert 400 / 1024 < use <= 512 / 1024, use
        assert v[("vllm:kv_cache_usage_perc", ())] == use  # the pod's: one model loaded
    finally:
        sock.close()
    v = wait_for(lambda: (v := vllm_series(s.request("GET", "/metrics")[2].decode())).get(
        ("vllm:num_requests_running", ())) == 0 and v, 60, 0.05, "the request to end")
    assert v[("vllm:kv_cache_usage_perc", ())] == 0.0
