"""KV events as vLLM publishes them (``--kv-events``): the instance's hook
(:mod:`ggmux.instance.kv_events`), the pod's merge
(:mod:`ggmux.supervisor.kv_publisher`), and a real server whose events,
decoded with vLLM's own classes (``vllm/distributed/kv_events.py``), build a
precise-prefix index that predicts the ``cached_tokens`` ggmux reports."""

from __future__ import annotations

import json
import time
import urllib.request
from types import SimpleNamespace

import pytest
import vllm_kv_events
from ggmux.instance.kv_events import KVEvents, seed
from ggmux.supervisor.kv_publisher import PodBlocks

msgpack = pytest.importorskip("msgpack")
VLLM = vllm_kv_events.load()
needs_vllm = pytest.mark.skipif(VLLM is None, reason="vllm is not installed "
                                "(pip install --no-deps vllm)")


def decode(events: list[dict]):
    """``events`` through msgpack and vLLM's ``KVEventBatch`` decoder, as a
    picker receives them."""
    return VLLM.decoder.decode(msgpack.packb([time.time(), events])).events


class Hook:
    """A :class:`KVEvents` whose batches land in a list (no socket)."""

    def __init__(self, model: str = "m", block_size: int = 4, scope_of=lambda t: "") -> None:
        self.sent: list[dict] = []
        self.ev = KVEvents(model, block_size, scope_of=scope_of, send=self.sent.extend)

    def sync(self, *slots: tuple[int, list[int], str]) -> list[dict]:
        n = len(self.sent)
        self.ev.sync([SimpleNamespace(id=i, tokens=t, owner=o) for i, t, o in slots])
        assert self.ev.flush()
        return self.sent[n:]


def kinds(events: list[dict]) -> list[tuple]:
    return [(e["type"], e.get("medium"), len(e.get("block_hashes", ()))) for e in events]


@needs_vllm
def test_a_slots_full_blocks_are_stored_once_and_decode_with_vllms_classes():
    h = Hook()
    out = h.sync((0, list(range(1, 11)), ""))  # 10 tokens: 2 full blocks of 4
    assert kinds(out) == [("BlockStored", "GPU", 2)]
    ev = decode(out)[0]
    assert type(ev).__name__ == "BlockStored"
    assert ev.token_ids == list(range(1, 9)) and ev.block_size == 4
    assert ev.parent_block_hash is None and ev.lora_name == "m" and ev.lora_id is None
    assert ev.medium == VLLM.MEDIUM_GPU
    assert [tuple(k) for k in ev.extra_keys] == [("m",), ("m",)]
    # the same tokens again: nothing; two more tokens: the third block, its parent the second
    assert h.sync((0, list(range(1, 11)), "")) == []
    more = h.sync((0, list(range(1, 13)), ""))
    assert kinds(more) == [("BlockStored", "GPU", 1)]
    assert more[0]["parent_block_hash"] == out[0]["block_hashes"][-1]


def test_a_prefix_two_slots_share_is_stored_once_and_removed_with_its_last_holder():
    h = Hook()
    a = list(range(1, 9))
    h.sync((0, a, ""))
    out = h.sync((0, a, ""), (1, a[:4] + [99, 98, 97, 96], ""))
    assert kinds(out) == [("BlockStored", "GPU", 1)]  # only the block slot 0 lacks
    out = h.sync((0, [], ""), (1, a[:4] + [99, 98, 97, 96], ""))
    assert kinds(out) == [("BlockRemoved", "GPU", 1)]  # block 0 is still slot 1's
    out = h.sync((0, [], ""), (1, [], ""))
    assert sorted(kinds(out)) == [("BlockRemoved", "GPU", 2)]


def test_a_slot_whose_tokens_change_midway_removes_the_blocks_after_the_change():
    h = Hook()
    first = h.sync((0, list(range(1, 13)), ""))
    out = h.sync((0, [1, 2, 3, 4, 5, 6, 70, 80, 9, 10, 11, 12], ""))
    assert kinds(out) == [("BlockRemoved", "GPU", 2), ("BlockStored", "GPU", 2)]
    assert out[0]["block_hashes"] == first[0]["block_hashes"][1:]
    assert out[1]["parent_block_hash"] == first[0]["block_hashes"][0]


@needs_vllm
def test_the_cache_scope_is_in_extra_keys_and_the_hash_so_tenants_never_match():
    h = Hook(scope_of=lambda tenant: tenant)
    toks = list(range(1, 9))
    out = h.sync((0, toks, "aaaaaaaaaaaaaaaa"), (1, toks, "bbbbbbbbbbbbbbbb"))
    stored = [e for e in decode(out)]
    assert len(stored) == 2 and {tuple(s.extra_keys[0]) for s in stored} == {
        ("m", "aaaaaaaaaaaaaaaa"), ("m", "bbbbbbbbbbbbbbbb")}
    assert not set(stored[0].block_hashes) & set(stored[1].block_hashes)
    idx = vllm_kv_events.prefix_index()
    for e in stored:
        idx.apply(e)
    assert idx.match("m", toks, ("aaaaaaaaaaaaaaaa",)) == 8
    assert idx.match("m", toks, ("cccccccccccccccc",)) == 0
    # cache-scope none: nothing is reused, so nothing is published
    none = Hook(scope_of=lambda tenant: None)
    assert none.sync((0, toks, "")) == []


@needs_vllm
def test_media_placeholders_go_as_token_0_with_their_id_and_offset_in_extra_keys():
    from ggmux.instance.media.spans import placeholders

    h = Hook()
    img = placeholders("ab" * 32, 5)  # an image of 5 embeddings, as the engine holds it
    out = decode(h.sync((0, [5, 6, *img, 7], "")))
    assert out[0].token_ids == [5, 6, 0, 0, 0, 0, 0, 7]
    first = f"{-img[0]:x}"
    assert [vllm_kv_events.freeze(k) for k in out[0].extra_keys] == [
        ("m", (first, 2)), ("m", (first, -2))]
    other = decode(h.sync((1, [5, 6, *placeholders("cd" * 32, 5), 7], "")))
    assert not set(out[0].block_hashes) & set(other[0].block_hashes)


@needs_vllm
def test_a_cache_clear_sends_all_blocks_cleared_and_forgets_what_was_published():
    h = Hook()
    h.sync((0, list(range(1, 9)), ""))
    h.ev.cleared()
    out = h.sync((0, [], ""))
    assert [type(e).__name__ for e in decode(out)] == ["AllBlocksCleared"]
    assert len(h.ev.counts) == 0


def test_tier_entries_are_published_under_their_own_medium():
    class Entry(SimpleNamespace):
        pass

    ram = {"k1": Entry(key="k1", scope="", tokens=list(range(1, 9)))}
    tiers = SimpleNamespace(lock=__import__("threading").Lock(),
                            ram=SimpleNamespace(entries=ram), _spill=[],
                            disk=SimpleNamespace(lock=__import__("threading").Lock(),
                                                 entries={}))
    sent: list[dict] = []
    ev = KVEvents("m", 4, tiers=lambda: tiers, send=sent.extend)
    assert ev.flush()  # the sender thread compares the tiers
    tiers.disk.entries["k1"] = ram.pop("k1")
    assert ev.flush()
    ev.close()
    assert kinds(sent) == [("BlockStored", "CPU", 2), ("BlockRemoved", "CPU", 2),
                           ("BlockStored", "STORAGE", 2)]
    assert sent[0]["block_hashes"] == sent[2]["block_hashes"]  # one prefix, two media


def stored(hashes, medium="GPU", model="m"):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
            "token_ids": list(range(4 * len(hashes))), "block_size": 4, "lora_id": None,
            "medium": medium, "lora_name": model, "extra_keys": [[model]] * len(hashes)}


def test_the_pod_stores_a_block_two_instances_hold_once_and_removes_it_with_the_last():
    pod = PodBlocks()
    assert kinds(pod.apply(b"1", "m", [stored([1, 2])])) == [("BlockStored", "GPU", 2)]
    out = pod.apply(b"2", "m", [stored([1, 2, 3])])
    assert kinds(out) == [("BlockStored", "GPU", 1)] and out[0]["parent_block_hash"] == 2
    assert out[0]["token_ids"] == list(range(8, 12))
    assert pod.apply(b"1", "m", [{"type": "BlockRemoved", "block_hashes": [1, 2],
                                  "medium": "GPU"}]) == []
    out = pod.apply(b"2", "m", [{"type": "BlockRemoved", "block_hashes": [1, 2, 3],
                                 "medium": "GPU"}])
    assert kinds(out) == [("BlockRemoved", "GPU", 3)]


def test_one_models_clear_removes_only_its_blocks_and_the_last_clear_clears_the_pod():
    pod = PodBlocks()
    pod.apply(b"1", "a", [stored([1, 2], model="a")])
    pod.apply(b"2", "b", [stored([7], model="b"), stored([8], "CPU", model="b")])
    out = pod.apply(b"1", "a", [{"type": "AllBlocksCleared"}])
    assert kinds(out) == [("BlockRemoved", "GPU", 2)]
    assert [e["type"] for e in pod.forget(b"2")] == ["AllBlocksCleared"]


def test_block_hashes_depend_on_the_model_and_the_scope():
    assert len({seed("a", ""), seed("b", ""), seed("a", "t")}) == 3


# ---- a real server --------------------------------------------------------------
def _post(base: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(base + path, json.dumps(body).encode(),
                                 {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


class Subscriber:
    """A picker's side: a SUB socket the server's publisher connects to, the
    replay socket for what it missed before it connected, and an index."""

    def __init__(self, zmq) -> None:
        self.zmq = zmq
        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.index = vllm_kv_events.prefix_index()
        self.next_seq = 0
        self.kinds: list[str] = []

    def replay(self, port: int, start: int) -> None:
        zmq = self.zmq
        req = zmq.Context.instance().socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{port}")
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                assert req.poll(10_000), "no replay answer"
                _, _topic, seq, payload = req.recv_multipart()
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return
                self._batch(int.from_bytes(seq, "big"), payload)
        finally:
            req.close(0)

    def _batch(self, seq: int, payload: bytes) -> None:
        if seq < self.next_seq:
            return
        assert seq == self.next_seq, f"gap: {self.next_seq} .. {seq}"
        self.next_seq = seq + 1
        for ev in VLLM.decoder.decode(payload).events:
            self.kinds.append(type(ev).__name__)
            self.index.apply(ev)

    def pump(self, replay_port: int, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if not self.sub.poll(50):
                continue
            _, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:  # missed some (before the connection): ask for them
                self.replay(replay_port, self.next_seq)
            self._batch(seq, payload)

    def close(self) -> None:
        self.sub.close(0)


@pytest.mark.slow
@needs_vllm
def test_an_index_built_from_the_events_predicts_the_cached_tokens_ggmux_reports(serve):
    zmq = pytest.importorskip("zmq")
    from conftest import free_port

    sub = Subscriber(zmq)
    replay = free_port()
    s = serve("--kv-events", f"tcp://127.0.0.1:{sub.port}",
              "--kv-events-replay", f"tcp://127.0.0.1:{replay}", "--cache-ram", "0",
              "--parallel", "2")
    try:
        model = "smollm2-135m"
        system = list(range(1000, 1000 + 150))  # a shared prefix of 150 token ids
        checked = 0
        for i, tail in enumerate([[7, 8, 9], [7, 8, 10], [50, 51], [7, 8, 9, 11]]):
            prompt = system + tail
            sub.pump(replay, 1.0)  # what the last answer's steps stored
            predicted = sub.index.match(model, prompt)
            doc = _post(s.base, "/v1/completions", {"model": model, "prompt": prompt,
                                                      "max_tokens": 4, "temperature": 0})
            cached = doc["usage"]["prompt_tokens_details"]["cached_tokens"]
            bs = sub.index.block_size or 16
            if i == 0:
                assert cached == 0 and predicted == 0
            else:
                # the index holds whole blocks: ggmux's cache ends within the next block
                assert predicted <= cached < predicted + bs, (i, predicted, cached)
                assert predicted >= 144  # the system prompt's 9 blocks at least
                checked += 1
        assert checked == 3
        sub.pump(replay, 0.5)
        assert sub.kinds[0] == "AllBlocksCleared"  # the publisher's start, got by replay
        status, _, _ = s.request("POST", "/cache/clear", {"model": model})
        assert status == 200
        deadline = time.monotonic() + 10
        while sub.index.blocks and time.monotonic() < deadline:
            sub.pump(replay, 0.2)
        assert not sub.index.blocks, "a cache clear left blocks in the picker's index"
        text = s.request("GET", "/metrics")[2].decode()
        assert 'vllm:cache_config_info{block_size="16"' in text
    finally:
        sub.close()


# ---- the supervisor's publisher child (fake instances: fast) ----------------------
def _publisher_pid(server_pid: int) -> int | None:
    from conftest import children_of

    for pid in children_of(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"kv_publisher" in f.read():
                    return pid
        except OSError:
            pass
    return None


def _first_message(zmq, replay: int) -> bytes:
    """The publisher's first batch (seq 0), asked from its replay socket."""
    req = zmq.Context.instance().socket(zmq.DEALER)
    req.connect(f"tcp://127.0.0.1:{replay}")
    try:
        req.send_multipart([b"", (0).to_bytes(8, "big")])
        assert req.poll(10_000), "no replay answer"
        _, _topic, seq, payload = req.recv_multipart()
        assert int.from_bytes(seq, "big") == 0
        return payload
    finally:
        req.close(0)


def test_a_publisher_that_dies_is_started_again_and_says_all_blocks_cleared(serve, fakes):
    zmq = pytest.importorskip("zmq")
    import os
    import signal

    from conftest import alive, free_port, wait_for

    fakes.add("a")
    replay = free_port()
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1",
              "--kv-events", f"tcp://127.0.0.1:{free_port()}",
              "--kv-events-replay", f"tcp://127.0.0.1:{replay}")
    first = wait_for(lambda: _publisher_pid(s.proc.pid), 20, 0.05, "the publisher")
    cleared = [{"type": "AllBlocksCleared"}]
    assert msgpack.unpackb(_first_message(zmq, replay))[1] == cleared
    with open(f"/proc/{first}/cmdline", "rb") as f:
        argv = f.read().split(b"\0")
    collect = next(a for a in argv if a.startswith(b"ipc://")).decode()[len("ipc://"):]
    os.kill(first, signal.SIGKILL)  # our server's child
    second = wait_for(lambda: (p := _publisher_pid(s.proc.pid)) not in (None, first) and p,
                      30, 0.05, "a new publisher")
    assert alive(second)
    assert msgpack.unpackb(wait_for(lambda: _first_message(zmq, replay), 20, 0.2,
                                    "the new publisher's replay"))[1] == cleared
    s.stop()
    assert not os.path.exists(os.path.dirname(collect)), "the collector's folder was left"


def test_a_bad_kv_events_address_is_refused_at_start_naming_the_option(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ggmux.supervisor", "serve", "--kv-events",
                        "localhost:5557", "--port", "1"], capture_output=True, text=True,
                       timeout=60, check=False)
    assert r.returncode == 2 and "--kv-events must be a ZMQ address" in r.stderr, r.stderr
