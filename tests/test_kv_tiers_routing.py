"""Prefix-aware routing with KV tiers (issue 29; DESIGN.md "KV tiers" and
"Prefix-aware routing"): the index's disk rows (a stopped replica's entries
become the node's, any replica of the model restores them), the score's
order (a RAM hit, then a disk hit, over a prefill; session keys first), and
end to end on fake replicas whose disk tier restores what another replica
of the model saved."""

from __future__ import annotations

import argparse
import json
import random

import numpy as np
from conftest import wait_for
from ggmux.proxy.balancer import DEFAULT_CONFIG, Candidate, choose
from ggmux.proxy.prefix import ChainHasher, PrefixRouting
from ggmux.shm import layout as L
from ggmux.shm.prefixtable import PrefixTable, disk_salt, disk_word, replica_salt
from ggmux.supervisor import routing
from test_prefix_routing import cached, long_body, mc, routed

CHAT = "/v1/chat/completions"


def table(proxies: int = 2, buckets: int = 64, ways: int = 4, replicas: int = 4,
          models: int = 2):
    t = np.zeros((proxies, buckets, ways, L.X_WORDS), dtype=np.int64)
    return t, np.zeros((proxies, replicas), dtype=np.int64), np.zeros((proxies, models),
                                                                      dtype=np.int64)


def chain(n: int = 6, seed: int = 1) -> np.ndarray:
    return ChainHasher(64, b"k").chain(np.random.default_rng(seed).bytes(64 * n))


def test_a_stopped_replicas_entries_become_disk_rows_every_replica_of_the_model_shares():
    t, f, fd = table()
    p0, p1 = PrefixTable(t, f, 0, fd), PrefixTable(t, f, 1, fd)
    c = chain()
    p0.record(c[:4], 1, 9, 1000)
    assert p0.to_disk(1, 9, 0, 0) == 4
    # the replica's own entries are gone; any replica of model 0 finds the disk's, 4 deep
    salts = np.array([replica_salt(1, 9), replica_salt(2, 3), disk_salt(0, 0)], dtype=np.int64)
    found = p1.lookup(c, salts, [1, 2], disk_model=0)
    assert found.depth == [0, 0, 4] and found.used_ns[2] == 1000  # its last use kept
    assert (t[0][..., L.X_REPLICA][t[0][..., L.X_KEY] != 0] == disk_word(0)).all()
    # another model's disk, or the same model's after its tiers were emptied (epoch 1): none
    for other in (disk_salt(1, 0), disk_salt(0, 1)):
        s = np.array([replica_salt(2, 3), other], dtype=np.int64)
        assert p1.lookup(c, s, [2], disk_model=0).depth == [0, 0]
    # an answer restored from disk records the whole prompt there; a miss forgets it
    p1.record_disk(c, 0, 0, 2000)
    assert p0.lookup(c, salts, [1, 2], disk_model=0).depth == [0, 0, 6]
    p1.forget_disk_before(0, 2000)
    assert p0.lookup(c, salts, [1, 2], disk_model=0).depth == [0, 0, 0]
    p0.record(c, 1, 9, 3000)  # a replica's own entries are not the disk's forget
    assert p0.lookup(c, salts, [1, 2], disk_model=0).depth == [6, 0, 0]


def test_retire_moves_only_gone_local_replicas_of_models_with_a_disk_tier():
    t, f, fd = table()
    routing = PrefixRouting(PrefixTable(t, f, 0, fd), 64, b"k")
    c = chain()
    for slot, inc in ((0, 5), (1, 6), (2, 7)):
        routing.table.record(c, slot, inc, 1000)
    old = np.zeros((4, L.R_WORDS), dtype=np.int64)
    for slot, (m, inc) in enumerate(((0, 5), (1, 6), (0, 7))):
        old[slot, [L.R_MODEL, L.R_INCARNATION, L.R_PID]] = m, inc, 100 + slot
    models = np.zeros((2, L.M_WORDS), dtype=np.int64)
    models[0, L.M_CACHE_FLAGS] = L.CACHE_DISK  # model 0 has a disk tier, model 1 none
    new = old.copy()
    assert routing.retire(old, new, models, {}) == 0  # nothing changed
    new[0, [L.R_MODEL, L.R_INCARNATION, L.R_PID]] = -1, 0, 0  # slot 0 (model 0) gone
    new[1, [L.R_INCARNATION]] = 8  # slot 1 (model 1): another incarnation
    assert routing.retire(old, new, models, {2: {}}) == 6  # slot 0's six blocks only
    salts = np.array([replica_salt(1, 6), replica_salt(2, 7), disk_salt(0, 0)], dtype=np.int64)
    assert routing.table.lookup(c, salts, [1, 2], disk_model=0).depth == [6, 6, 6]


def cand(slot: int, in_flight: int = 0) -> Candidate:
    return Candidate(slot=slot, port=1000 + slot, incarnation=slot + 1, in_flight=in_flight)


def test_the_score_takes_a_ram_hit_then_a_disk_hit_over_a_prefill_and_session_keys_first():
    rng = random.Random(7)
    a, b, c = cand(0), cand(1), cand(2)  # c: a remote upstream (no disk of this node)
    share, disk = {0: 0.9}, {0: 0.9, 1: 0.9}
    for _ in range(20):
        assert choose([a, b, c], share=share, disk=disk, rng=rng).slot == 0  # RAM
        assert choose([b, c], share=share, disk=disk, rng=rng).slot == 1  # disk over prefill
    # the RAM hit beats a disk hit of the same prompt; a hot replica loses its bonus
    hot = cand(0, in_flight=1)
    for _ in range(20):
        assert choose([hot, b, c], share=share, disk=disk, rng=rng).slot == 1
    assert DEFAULT_CONFIG.prefix_disk_weight < DEFAULT_CONFIG.prefix_weight
    assert routing.DEFAULT_DISK_WEIGHT == DEFAULT_CONFIG.prefix_disk_weight  # serve's default
    assert routing.check(argparse.Namespace(
        prefix_weight=0.9, prefix_disk_weight=1.0, prefix_load_threshold=1.0,
        prefix_block_bytes=256, prefix_index_entries=64)) == (
        "--prefix-disk-weight must be at least 0 and below 1")
    # a session key keeps precedence: the same replica whatever the bonuses say
    keyed = {choose([a, b, c], session_key="s-1", share=share, disk=disk, rng=rng).slot
             for _ in range(10)}
    plain = choose([a, b, c], session_key="s-1", rng=rng).slot
    assert keyed == {plain}


def test_a_prefix_saved_by_a_stopped_replica_is_predicted_on_disk_for_its_next_replicas(
        serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2, parallel=1)
    ini = tmp_path / "disk.ini"
    ini.write_text(f"[m]\nmodel = {f}\nreplicas = 2\ncache-disk = {tmp_path / 'kv'}\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--models-max", "2",
              "--proxies", "2", "--api-key", "key-a,key-b")
    alice, bob = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}

    def load() -> None:
        assert s.request("POST", "/models/load", {"model": "m"}, headers=alice)[0] == 200
        wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == 2, 30, what="two replicas")

    load()
    base = mc(s, L.MC_PREFIX_ROUTED)
    for k in range(2):  # the second: a turn of the same prompt, learned by the index
        assert s.request("POST", CHAT, long_body(0, turn=f"t{k}"), headers=alice)[0] == 200
    routed(s, base + 2)
    assert s.request("POST", "/models/unload", {"model": "m"}, headers=alice)[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_STATUS] == L.ModelStatus.UNLOADED, 30,
             what="unloaded")
    # the replicas saved their slots; the proxies moved their entries to disk rows
    keys = s.seg.prefix[..., L.X_KEY]
    wait_for(lambda: (s.seg.prefix[..., L.X_REPLICA][keys != 0] == disk_word(0)).all()
             and keys.any(), 10, what="disk rows")
    load()
    predicted = mc(s, L.MC_PREFIX_PREDICTED)
    st, _, b = s.request("POST", CHAT, long_body(0, turn="back"), headers=alice)
    assert st == 200 and json.loads(b)["timings"]["cache_tier"] == "disk" and cached(b) > 100
    routed(s, base + 3)
    assert mc(s, L.MC_PREFIX_PREDICTED) == predicted + 1 and mc(s, L.MC_PREFIX_MISSED) == 0
    # the cache scope holds on disk too: another key's request is neither steered nor served
    st, _, b = s.request("POST", CHAT, long_body(0, turn="bob"), headers=bob)
    assert st == 200 and cached(b) == 0
    routed(s, base + 4)
    assert mc(s, L.MC_PREFIX_PREDICTED) == predicted + 1
