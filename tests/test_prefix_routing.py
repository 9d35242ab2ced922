"""Prefix-aware routing (issue 20; DESIGN.md "Prefix-aware routing"), on fake
replicas whose prompt cache (``prefix_cache``) answers a repeated prefix
faster and reports ``cached_tokens``, and on the index itself."""

from __future__ import annotations

import json
import os
import signal

import numpy as np

from conftest import children_of, open_stream, served_by, wait_for
from ggmux.proxy.prefix import ChainHasher, canonical
from ggmux.shm import layout as L
from ggmux.shm.prefixtable import PrefixTable, replica_salt

CHAT = "/v1/chat/completions"


def preset(tmp_path, fake, replicas: int = 2, extra: str = "") -> str:
    p = tmp_path / "prefix.ini"
    p.write_text(f"[m]\nmodel = {fake}\nreplicas = {replicas}\n{extra}")
    return str(p)


def long_body(i: int, stream: bool = False, turn: str = "go on") -> dict:
    """A chat request whose system prompt (~2 KB, 8 index blocks) is ``i``'s own."""
    system = f"You are agent number {i}. " + " ".join(f"rule {i}.{k}: be brief." for k in range(120))
    return {"model": "m", "stream": stream, "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": turn}]}


def cached(body: bytes) -> int:
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def mc(s, word: int) -> int:
    return int(s.seg.mcounters[:, 0, word].sum())


def start(serve, fakes, tmp_path, *args, replicas: int = 2, extra: str = "", **fake):
    f = fakes.add("m", prefix_cache=True, tokens=2, **fake)
    s = serve("--models-preset", preset(tmp_path, f, replicas, extra), "--no-hf-cache",
              "--models-max", str(replicas), "--spares", "0", *args)
    assert s.request("POST", CHAT, long_body(-1))[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == replicas, 30, what="replicas ready")
    return s


def test_repeated_prefixes_land_on_the_warm_replica_through_any_proxy(serve, fakes, tmp_path):
    s = start(serve, fakes, tmp_path, "--proxies", "2", parallel=8)
    first = {}
    for i in range(6):
        st, _, b = s.request("POST", CHAT, long_body(i))
        assert st == 200, b
        first[i] = served_by(b)[1]
    assert len(set(first.values())) == 2, first  # new prefixes spread by load
    for rnd in range(3):  # new connections: both proxies take turns at random
        for i in range(6):
            st, _, b = s.request("POST", CHAT, long_body(i, turn=f"turn {rnd}"))
            assert st == 200, b
            assert served_by(b)[1] == first[i], (i, rnd)
            assert cached(b) > 0
    # both proxies routed repeats by the index (each wrote its own part)
    pred = s.seg.mcounters[:, 0, L.MC_PREFIX_PREDICTED]
    assert (pred > 0).all(), pred
    assert mc(s, L.MC_PREFIX_MISSED) == 0
