"""Prefix-aware routing (issue 20; DESIGN.md "Prefix-aware routing"): the
index, the hashing and the score on their own, then end to end on fake
replicas whose prompt cache (``prefix_cache``) answers a repeated prefix
faster and reports ``cached_tokens``."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from dataclasses import fields

import numpy as np
import pytest
from conftest import children_of, open_stream, served_by, wait_for
from ggmux.proxy.balancer import DEFAULT_CONFIG, MODES, Candidate, choose
from ggmux.proxy.prefix import ChainHasher, canonical
from ggmux.shm import layout as L
from ggmux.shm.prefixtable import PrefixTable, replica_salt
from ggmux.supervisor import routing

CHAT = "/v1/chat/completions"


# ---- the parts, no processes ---------------------------------------------------
def table(proxies: int = 2, buckets: int = 16, ways: int = 4, replicas: int = 4):
    t = np.zeros((proxies, buckets, ways, L.X_WORDS), dtype=np.int64)
    f = np.zeros((proxies, replicas), dtype=np.int64)
    return t, f


def test_a_chain_grows_with_its_prompt_and_depends_on_key_tenant_and_order():
    h = ChainHasher(64, b"secret")
    a, b = bytes(range(256)) * 2, bytes(range(255, -1, -1)) * 2
    ca, cab = h.chain(a), h.chain(a + b)
    assert len(ca) == 8 and len(cab) == 16 and (cab[:8] == ca).all()  # block i covers 0..i
    assert len(set(cab.tolist())) == 16 and (cab & 1).all()  # odd: never an empty key
    assert not (h.chain(b + a)[8:] == cab[8:]).any()  # blocks swapped: another prefix
    assert not (ChainHasher(64, b"other").chain(a) == ca).any()  # per server
    assert not (h.chain(a, seed=0x1234) == ca).any()  # per tenant
    assert len(h.chain(a[:63])) == 0  # a partial block is not hashed


def test_canonical_bytes_of_an_appended_turn_extend_the_turn_before():
    one = {"messages": [{"role": "system", "content": "S" * 300}, {"role": "user", "content": "a"}],
           "tools": [{"type": "function", "function": {"name": "f"}}], "temperature": 0.1}
    two = {**one, "messages": [*one["messages"], {"role": "assistant", "content": "b"},
                               {"role": "user", "content": "c"}], "temperature": 0.9}
    c1, c2 = canonical(one), canonical(two)
    assert c2.startswith(c1) and len(c2) > len(c1)
    assert canonical({"prompt": "x" * 10}).startswith(b'[null,null,null,"x')
    assert canonical({"model": "m"}) == b""


def test_canonical_bytes_count_an_image_as_its_content_hash():
    """A megabyte of base64 is one digest: the turns after it still count,
    the same image is the same bytes, another image other bytes, and every
    API's media part is hashed so (not Ollama's alone)."""
    big, other = "A" * 1_000_000, "B" * 1_000_000

    def chat(data, after="tell me"):
        return {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "look"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{data}"}}]},
            {"role": "user", "content": after}]}
    a, a2, b = canonical(chat(big)), canonical(chat(big)), canonical(chat(other))
    assert a == a2 and a != b and len(a) < 500
    assert canonical(chat(big, "another question")) != a  # a later turn still counts
    anth = {"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": big}}]}]}
    resp = {"input": [{"role": "user", "content": [{"type": "input_image",
                                                     "image_url": big}]}]}
    oll = {"messages": [{"role": "user", "content": "x", "images": [big]}]}
    gen = {"prompt": "x", "images": [big]}
    for body in (anth, resp, oll, gen):
        assert len(canonical(body)) < 500, body.keys()
    assert canonical(gen) != canonical({"prompt": "x", "images": [other]})
    plain = {"messages": [{"role": "user", "content": "hi"}]}
    assert canonical(plain) == b'[null,null,null,[{"role":"user","content":"hi"}'


def test_any_proxy_finds_what_another_recorded_and_a_forget_time_hides_older_entries():
    t, f = table()
    p0, p1 = PrefixTable(t, f, 0), PrefixTable(t, f, 1)
    chain = ChainHasher(64, b"k").chain(np.random.default_rng(1).bytes(64 * 6))
    salts = np.array([replica_salt(0, 7), replica_salt(1, 9)], dtype=np.int64)
    p1.record(chain[:4], 1, 9, 1000)  # replica 1 served the first 4 blocks, through proxy 1
    found = p0.lookup(chain, salts, [0, 1])
    assert found.depth == [0, 4] and found.used_ns == [0, 1000]
    assert (t[0] == 0).all()  # proxy 1 wrote only its own part
    # another incarnation of that replica (respawned: an empty cache) matches nothing
    other = np.array([replica_salt(1, 10)], dtype=np.int64)
    assert p0.lookup(chain, other, [1]).depth == [0]
    p0.forget_before(1, 1000)  # a miss seen by proxy 0: every reader distrusts those entries
    assert p1.lookup(chain, salts, [0, 1]).depth == [0, 0]
    p1.record(chain, 1, 9, 2000)  # served again since: trusted again, now 6 blocks deep
    assert p0.lookup(chain, salts, [0, 1]).depth == [0, 6]


def test_a_full_part_keeps_the_prefixes_used_last():
    t, f = table(proxies=1, buckets=8, ways=4)
    p = PrefixTable(t, f, 0)
    h = ChainHasher(64, b"k")
    rng = np.random.default_rng(2)  # fixed: which blocks share a bucket is the hash's
    chains = [h.chain(rng.bytes(64 * 8)) for _ in range(20)]  # 160 blocks into 32 entries
    salt = np.array([replica_salt(0, 1)], dtype=np.int64)
    for i, c in enumerate(chains):
        p.record(c, 0, 1, 1000 + i)
        assert p.entries() <= 32
    assert p.entries() > 24  # the table is used, not left empty
    assert p.lookup(chains[-1], salt, [0]).depth[0] >= 1  # the newest is still there
    assert int(t[0, :, :, L.X_USED_NS].min()) >= 1000 + 10  # the older half went first


def test_prompts_recorded_later_in_one_batch_are_what_recording_each_writes():
    """A request with no choice (one replica, the fast path) queues its
    prompt; a flush hashes and writes the queue in one go: the same
    chains (tenant seeds included) and the same entries, a prefix two
    prompts share written once with the later time, and a lookup flushes
    first, so it finds what was queued."""
    from ggmux.proxy.prefix import PrefixRouting

    h = ChainHasher(64, b"k")
    rng = np.random.default_rng(3)
    items = [(rng.bytes(64 * n + 17), seed) for n, seed in ((3, 0), (0, 5), (5, 0x1234), (1, 0))]
    chains, counts = h.chains(items)
    assert counts.tolist() == [3, 0, 5, 1]
    assert chains.tolist() == np.concatenate([h.chain(d, s) for d, s in items]).tolist()

    t1, f1 = table(proxies=1, buckets=64)
    t2, f2 = table(proxies=1, buckets=64)
    one, batch = PrefixTable(t1, f1, 0), PrefixRouting(PrefixTable(t2, f2, 0), 64, b"k")
    batch.hasher = h
    shared = {"messages": [{"role": "user", "content": "S" * 400}]}
    longer = {"messages": [*shared["messages"], {"role": "user", "content": "T" * 200}]}
    for i, (body, slot) in enumerate(((shared, 0), (longer, 0), (shared, 1))):
        one.record(h.chain(canonical(body)), slot, slot + 1, 1000 + i)
        assert batch.later(body, b"", "global", slot, slot + 1, 1000 + i) == (i == 0)
    assert not batch.later({"prompt": "short"}, b"", "global", 0, 1, 1)  # under a block
    assert not batch.later(shared, b"", "none", 0, 1, 1)  # scope none: never recorded
    assert (t2 == 0).all()  # nothing written until the flush
    assert batch.flush() == 3 and batch.pending == []
    assert (t1 == t2).all()
    batch.later(longer, b"", "global", 2, 3, 2000)
    pred = batch.predict(longer, b"", "global", [cand(2)])  # the queue goes in first
    assert pred.found.depth[0] == len(canonical(longer)) // 64


def cand(slot: int, **kw) -> Candidate:
    return Candidate(slot=slot, port=9000 + slot, incarnation=slot + 1, **kw)


def test_the_score_sends_a_prefix_to_the_replica_holding_it_unless_that_one_is_hot():
    rng = np.random.default_rng(0)

    class R:  # choose() wants random.Random's choice/sample
        def random(self):
            return rng.random()

        def choice(self, seq):
            return seq[int(rng.integers(len(seq)))]

        def sample(self, seq, k):
            return [seq[i] for i in rng.choice(len(seq), k, replace=False)]

    warm = {0: 0.9}
    idle = [cand(0, slots=2), cand(1, slots=2)]
    assert all(choose(idle, share=warm, rng=R()).slot == 0 for _ in range(20))
    # busier, but below the threshold: the prefill saved outweighs the queue
    busy = [cand(0, slots=2, in_flight=1), cand(1, slots=2)]
    assert all(choose(busy, share=warm, rng=R()).slot == 0 for _ in range(20))
    # at the threshold (in flight per slot): no cache bonus, the cold one serves
    hot = [cand(0, slots=2, in_flight=2), cand(1, slots=2)]
    assert all(choose(hot, share=warm, rng=R()).slot == 1 for _ in range(20))
    # mode load ignores the share; round-robin takes turns
    load = DEFAULT_CONFIG.__class__(mode="load")
    assert {choose(busy, share=warm, rng=R(), config=load).slot for _ in range(20)} == {1}
    rr = DEFAULT_CONFIG.__class__(mode="round-robin")
    assert [choose(idle, share=warm, config=rr, turn=k).slot for k in range(4)] == [0, 1, 0, 1]


def test_the_supervisors_routing_defaults_are_the_balancers():
    assert routing.MODES == MODES
    assert routing.DEFAULT_MODE == DEFAULT_CONFIG.mode
    assert routing.DEFAULT_PREFIX_WEIGHT == DEFAULT_CONFIG.prefix_weight
    assert routing.DEFAULT_LOAD_THRESHOLD == DEFAULT_CONFIG.prefix_load_threshold
    assert {"mode", "prefix_weight", "prefix_load_threshold"} <= {
        f.name for f in fields(DEFAULT_CONFIG)}


def test_routing_options_are_checked_and_size_the_index():
    import argparse

    ap = argparse.ArgumentParser()
    routing.add_routing_options(ap)
    args = ap.parse_args([])
    assert routing.check(args) is None
    assert routing.prefix_sizes(args) == {"prefix_buckets": 2048, "prefix_ways": 4,
                                          "prefix_block": 256}
    assert routing.prefix_sizes(ap.parse_args(["--prefix-index-entries", "100"]))[
        "prefix_buckets"] == 32  # rounded up to a power of two buckets
    for bad, name in ((["--prefix-weight", "1"], "--prefix-weight"),
                      (["--prefix-load-threshold", "0"], "--prefix-load-threshold"),
                      (["--prefix-block-bytes", "100"], "--prefix-block-bytes"),
                      (["--prefix-index-entries", "2"], "--prefix-index-entries")):
        assert name in routing.check(ap.parse_args(bad))
    assert routing.routing_argv(ap.parse_args(["--balance", "load"]), "key") == [
        "--balance", "load", "--prefix-weight", "0.9", "--prefix-disk-weight", "0.8",
        "--prefix-load-threshold", "1.0", "--cache-scope", "key"]


# ---- end to end, fake replicas ----------------------------------------------------
def long_body(i: int, stream: bool = False, turn: str = "go on", size: int = 120, **kw) -> dict:
    """A chat request whose system prompt (~2.4 KB at ``size`` 120: 9 index
    blocks) is ``i``'s own."""
    system = f"You are agent number {i}. " + " ".join(
        f"rule {i}.{k}: be brief." for k in range(size))
    return {"model": "m", "stream": stream, "max_tokens": 2,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": turn}], **kw}


def cached(body: bytes) -> int:
    return json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]


def mc(s, word: int, model: int = 0) -> int:
    return int(s.seg.mcounters[:, model, word].sum())


def routed(s, n: int, model: int = 0) -> None:
    """Wait until ``n`` requests have been judged by the index: the proxy
    learns from an answer after relaying it, so the client may be first."""
    wait_for(lambda: mc(s, L.MC_PREFIX_ROUTED, model) >= n, 10, what=f"{n} prefix-routed")


def slot_of(s, pid: int) -> int:
    return int(np.flatnonzero(s.seg.replicas[:, L.R_PID] == pid)[0])


def start(serve, fakes, tmp_path, *args, replicas: int = 2, **fake):
    # a cold prompt's prefill takes 0.1-0.4 s (2.5x the fake's default): the
    # balancer weighs each replica's measured prefill per token against the
    # cache bonus, and a loaded machine's 0.3 s pause in a replica's first
    # sample at the default made the holder look 6x slower than the other
    # (a restart test sent a held prompt to the other replica once)
    f = fakes.add("m", **{"prefix_cache": True, "tokens": 2, "prefill_token_s": 0.0005,
                          **fake})
    ini = tmp_path / "prefix.ini"
    ini.write_text(f"[m]\nmodel = {f}\nreplicas = {replicas}\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--models-max", str(replicas),
              "--spares", "0", *args)
    # the load's request carries a session key: never judged by the index, so
    # it cannot add to MC_PREFIX_ROUTED after a test read its base (the proxy
    # counts a judged request after relaying it, and the second replica may be
    # up by then, giving it a choice)
    assert s.request("POST", CHAT, long_body(-1), headers={"x-session-id": "load"})[0] == 200
    wait_for(lambda: s.seg.models[0, L.M_REPLICAS] == replicas, 30, what="replicas ready")
    return s


def test_repeated_prefixes_land_on_the_warm_replica_through_any_proxy(serve, fakes, tmp_path):
    s = start(serve, fakes, tmp_path, "--proxies", "2", parallel=8)
    base = mc(s, L.MC_PREFIX_ROUTED)
    first = {}
    # new prefixes go where the balancer's ties fall (no load, no hit): at
    # least six, and as many more as it takes for both replicas to hold some
    # (six in a row on one replica is a tie-break's 1 in 32)
    while len(first) < 6 or len(set(first.values())) < 2:
        i = len(first)
        assert i < 30, first
        st, _, b = s.request("POST", CHAT, long_body(i))
        assert st == 200, b
        first[i] = served_by(b)[1]
    routed(s, base + len(first))
    for rnd in range(3):  # new connections: both proxies take turns at random
        for i, warm in first.items():
            st, _, b = s.request("POST", CHAT, long_body(i, turn=f"turn {rnd}"))
            assert st == 200, b
            assert served_by(b)[1] == warm, (i, rnd)
            assert cached(b) > 0
    routed(s, base + 4 * len(first))
    # both proxies routed repeats by the index, each writing its own part
    assert (s.seg.mcounters[:, 0, L.MC_PREFIX_PREDICTED] > 0).all()
    assert (np.count_nonzero(s.seg.prefix[..., L.X_KEY], axis=(1, 2)) > 0).all()
    assert mc(s, L.MC_PREFIX_MISSED) == 0


def test_a_hot_replica_sheds_even_a_prefix_it_holds_to_a_cold_one(serve, fakes, tmp_path):
    s = start(serve, fakes, tmp_path, "--proxies", "1", parallel=1, tokens=400, token_s=0.05)
    base = mc(s, L.MC_PREFIX_ROUTED)
    st, _, b = s.request("POST", CHAT, long_body(0))
    warm = served_by(b)[1]
    slot = slot_of(s, warm)
    routed(s, base + 1)
    sock = open_stream(s.port, long_body(0, stream=True, turn="long", max_tokens=400), 30)
    try:
        got = b""
        while b"data: " not in got:
            got += sock.recv(65536)
        assert served_by(got)[1] == warm  # the warm replica took the stream of its prefix
        wait_for(lambda: s.seg.counters[:, slot, L.C_IN_FLIGHT].sum() == 1, 10, what="in flight")
        before = mc(s, L.MC_PREFIX_PREDICTED)
        b = s.request("POST", CHAT, long_body(0, turn="again"))[2]
        assert st == 200 and served_by(b)[1] != warm  # hot: no cache bonus
        st, _, b = s.request("POST", CHAT, long_body(1))
        assert st == 200 and served_by(b)[1] != warm  # a new prefix goes cold too
        routed(s, base + 3)
        assert mc(s, L.MC_PREFIX_PREDICTED) == before  # no prediction steered them
    finally:
        sock.close()


def proxy_pids(s) -> dict[int, int]:
    """Proxy index -> pid, from their process titles (``ggmux: proxy N ...``)."""
    out = {}
    for pid in children_of(s.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                m = re.match(rb"ggmux: proxy (\d+) ", f.read())
        except OSError:
            continue
        if m:
            out[int(m.group(1))] = pid
    return out


@pytest.mark.slow
def test_the_index_is_bounded_and_a_restarted_proxy_starts_with_its_part_zeroed(
        serve, fakes, tmp_path):
    s = start(serve, fakes, tmp_path, "--proxies", "2", "--prefix-index-entries", "64",
              parallel=16)
    assert s.seg.prefix.shape[1] * s.seg.prefix.shape[2] == 64  # per proxy, as asked
    # prompts of 3-15 blocks; an entry's X_BLOCKS is its depth in its chain, so any longer
    # prompt has entries of a shorter one's length too: whose an entry is, its time tells
    bodies = [long_body(i, size=40 + 12 * i) for i in range(12)]
    blocks = [len(canonical(b)) // s.seg.sizes.prefix_block for b in bodies]
    base = mc(s, L.MC_PREFIX_ROUTED)
    sent = []  # monotonic ns (the proxies' clock) each request was sent at
    for k, body in enumerate(bodies * 2):
        sent.append(time.monotonic_ns())
        assert s.request("POST", CHAT, body)[0] == 200
        routed(s, base + k + 1)
        # recorded (after the count): every entry it writes is timed in [sent[k], sent[k+1])
        wait_for(lambda: (s.seg.prefix[..., L.X_USED_NS] >= sent[-1]).any(), 10,
                 what="recorded")
    sent.append(time.monotonic_ns())

    def whose(used_ns: int) -> int:  # the body whose request wrote it, -1: the warm-up's
        k = int(np.searchsorted(sent, used_ns, side="right")) - 1
        return k % len(bodies) if 0 <= k < 2 * len(bodies) else -1

    keys = s.seg.prefix[..., L.X_KEY]
    assert (np.count_nonzero(keys, axis=(1, 2)) <= 64).all()
    assert np.count_nonzero(keys) > 64  # 12 prompts x 3-15 blocks filled both parts
    # what proxy 1's part holds whole (its last block's entry) survives proxy 0's restart
    part1 = s.seg.prefix[1].copy()
    kept = {}
    for i in range(12):
        rows = part1[(part1[..., L.X_BLOCKS] == blocks[i]) & (part1[..., L.X_KEY] != 0)]
        slots = {int(r[L.X_REPLICA]) & 0xFFFF for r in rows if whose(int(r[L.X_USED_NS])) == i}
        if slots:
            kept[i] = slots
    assert kept
    pids = proxy_pids(s)
    os.kill(pids[0], signal.SIGKILL)
    wait_for(lambda: proxy_pids(s).get(0, pids[0]) != pids[0], 60, what="new proxy 0")
    assert not s.seg.prefix[0].any()  # zeroed before the replacement started
    assert (s.seg.prefix[1] == part1).all()
    before = mc(s, L.MC_PREFIX_MISSED)
    for i, slots in sorted(kept.items()):
        st, _, b = s.request("POST", CHAT, bodies[i])
        assert st == 200 and slot_of(s, served_by(b)[1]) in slots and cached(b) > 0, i
    assert mc(s, L.MC_PREFIX_MISSED) == before


def test_a_wrong_prediction_is_corrected_by_the_replicas_cached_tokens(serve, fakes, tmp_path):
    s = start(serve, fakes, tmp_path, "--proxies", "1", parallel=1)
    base = mc(s, L.MC_PREFIX_ROUTED)
    b = s.request("POST", CHAT, long_body(0))[2]
    warm = served_by(b)[1]
    slot = slot_of(s, warm)
    routed(s, base + 1)
    # another prompt fills that replica's one cache slot behind the index's back: a
    # session-keyed request is routed by the key, and the index learns nothing of it
    for k in range(64):
        b = s.request("POST", CHAT, long_body(9), headers={"x-session-id": f"k{k}"})[2]
        if served_by(b)[1] == warm:
            break
    else:
        raise AssertionError("no session key landed on the warm replica")
    assert mc(s, L.MC_PREFIX_ROUTED) == base + 1 and mc(s, L.MC_PREFIX_MISSED) == 0
    b = s.request("POST", CHAT, long_body(0, turn="again"))[2]
    assert served_by(b)[1] == warm and cached(b) < 20  # predicted, and it was a miss
    routed(s, base + 2)
    assert mc(s, L.MC_PREFIX_MISSED) == 1
    assert s.seg.prefix_forget[:, slot].max() > 0  # its older entries are distrusted
    # it holds the prompt again now: the next repeat is a right prediction
    predicted = mc(s, L.MC_PREFIX_PREDICTED)
    b = s.request("POST", CHAT, long_body(0, turn="third"))[2]
    assert served_by(b)[1] == warm and cached(b) > 100
    routed(s, base + 3)
    assert mc(s, L.MC_PREFIX_PREDICTED) == predicted + 1 and mc(s, L.MC_PREFIX_MISSED) == 1
    text = s.request("GET", "/metrics")[2].decode()
    assert 'ggmux_prefix_missed_total{model="m"} 1\n' in text
    assert f'ggmux_prefix_predicted_total{{model="m"}} {predicted + 1}\n' in text


def test_a_prefix_learned_for_one_key_never_steers_another_keys_request(serve, fakes, tmp_path):
    f = fakes.add("m", prefix_cache=True, tokens=2, parallel=4)
    ini = tmp_path / "scope.ini"
    # m: the default scope with keys set (key); g: shared on purpose
    ini.write_text(f"[m]\nmodel = {f}\nreplicas = 2\n[g]\nmodel = {f}\nreplicas = 2\n"
                   "cache-scope = global\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--models-max", "4", "--spares", "0",
              "--proxies", "1", "--api-key", "key-a,key-b")
    alice, bob = {"authorization": "Bearer key-a"}, {"authorization": "Bearer key-b"}
    _, doc = s.seg.read_registry()
    m, g = doc["names"]["m"], doc["names"]["g"]
    for name in ("m", "g"):
        assert s.request("POST", CHAT, long_body(-1, model=name), headers=alice)[0] == 200
    wait_for(lambda: all(s.seg.models[i, L.M_REPLICAS] == 2 for i in (m, g)), 30,
             what="replicas ready")
    for name, idx in (("m", m), ("g", g)):
        base = mc(s, L.MC_PREFIX_ROUTED, idx)
        assert s.request("POST", CHAT, long_body(0, model=name), headers=alice)[0] == 200
        routed(s, base + 1, idx)
        p0 = mc(s, L.MC_PREFIX_PREDICTED, idx)
        st, _, b = s.request("POST", CHAT, long_body(0, model=name, turn="mine"), headers=alice)
        routed(s, base + 2, idx)
        assert cached(b) > 0 and mc(s, L.MC_PREFIX_PREDICTED, idx) == p0 + 1  # alice's own
        st, _, b = s.request("POST", CHAT, long_body(0, model=name, turn="bob"), headers=bob)
        assert st == 200, b
        routed(s, base + 3, idx)
        if name == "m":  # scope key: not steered by alice's entry, and nothing reused
            assert mc(s, L.MC_PREFIX_PREDICTED, idx) == p0 + 1 and cached(b) == 0
        else:  # scope global: shared as llama-server shares it
            assert mc(s, L.MC_PREFIX_PREDICTED, idx) == p0 + 2 and cached(b) > 0


def test_a_model_with_one_replica_records_every_prompt_on_every_forwarding_path(
        serve, fakes, tmp_path):
    """Issue 37, item 18: the one-replica shortcut (and the fast path) never
    recorded a prompt, so when a second replica came up a warm prefix went
    to it cold. Now every answered request is recorded for its replica."""
    s = start(serve, fakes, tmp_path, "--proxies", "1", replicas=1)
    known = np.count_nonzero(s.seg.prefix[..., L.X_KEY])
    blocks = len(canonical(long_body(0))) // s.seg.sizes.prefix_block
    for i in range(4):  # the first on a new pooled connection, the next ones on the fast path
        st, _, b = s.request("POST", CHAT, long_body(i))
        assert st == 200, b
        # recorded after the answer went out: wait for it
        wait_for(lambda i=i: np.count_nonzero(s.seg.prefix[..., L.X_KEY]) >= known + (
            i + 1) * blocks, 10, what=f"prompt {i} recorded")
    assert mc(s, L.MC_PREFIX_ROUTED) == 0  # recorded, not routed by the index
