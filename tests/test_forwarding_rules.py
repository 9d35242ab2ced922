"""The pure rules behind issue 11's forwarding findings: which answers are a
replica's fault, when open circuits answer at once, pass-through paths and
redaction, instance secrets and key hand-over. No processes."""

from __future__ import annotations

import os

import orjson
import pytest
from ggmux.http1.auth import keys_pipe, new_secret, read_keys, scrub_env, secret_header, secret_text
from ggmux.http1.verdict import replica_fault
from ggmux.proxy import passthrough
from ggmux.proxy.balancer import OPEN, Candidate, open_until
from ggmux.shm import layout as L


@pytest.mark.parametrize(("status", "mark", "fault"), [
    (200, None, False), (400, None, False), (404, b"fault", False), (500, None, False),
    (501, None, False), (505, None, False), (502, None, True), (503, None, True),
    (504, None, True), (500, b"fault", True), (503, b"refused", False),
    (502, b"request", False),
])
def test_only_replica_faults_count(status, mark, fault):
    assert replica_fault(status, mark) is fault


def test_open_until_only_when_every_replica_is_open():
    now = 1_000
    a = Candidate(slot=0, port=1, incarnation=1, circuit=OPEN, circuit_until_ns=5_000)
    b = Candidate(slot=1, port=2, incarnation=2, circuit=OPEN, circuit_until_ns=3_000)
    assert open_until([a, b], now) == 3_000
    half = Candidate(slot=2, port=3, incarnation=3, circuit=L.CircuitState.HALF_OPEN,
                     circuit_until_ns=9_000)  # a probe is out: wait for it instead
    assert open_until([a, half], now) == 0
    full = Candidate(slot=3, port=4, incarnation=4, max_concurrency=1, in_flight=1)
    assert open_until([a, full], now) == 0
    assert open_until([a], 6_000) == 0  # its cool-down is over: it may be tried


@pytest.mark.parametrize(("sub", "out"), [
    (b"/v1/chat/completions", b"/v1/chat/completions"),
    (b"/../admin", b"/admin"), (b"/%2e%2e/admin", b"/admin"), (b"/.%2E/admin", b"/admin"),
    (b"/a/b/../../../x", b"/x"), (b"/a/./b/..", b"/a/"), (b"/a/.", b"/a/"),
    (b"/a/%41", b"/a/%41"), (b"/", b"/"),
])
def test_dot_segments_are_resolved(sub, out):
    assert passthrough.normalize(sub) == out


@pytest.mark.parametrize("sub", [b"/..%2fadmin", b"/a%2F..", b"/a\\..", b"/%5c.."])
def test_encoded_separators_are_refused(sub):
    with pytest.raises(passthrough.BadPath):
        passthrough.normalize(sub)


def test_routes_keep_the_query_and_find_the_longest_name():
    names = {"org/m": 0, "org": 1}
    assert passthrough.route(b"/upstream/org/m/../props", b"x=1", names, ["org/m"]) == (
        "org/m", b"/props?x=1")
    assert passthrough.route(b"/upstream/org/props", b"", names, ["org/m"]) == ("org", b"/props")
    assert passthrough.route(b"/upstream/none/x", b"", names, ["org/m"]) is None


def test_redaction_keeps_base_names_and_other_values():
    body = orjson.dumps({"model_path": "/srv/m/x.gguf", "n_ctx": 512,
                         "data": [{"id": "/a/b/y.gguf"}, {"id": "plain"}],
                         "chat_template": "/ not a path"})
    doc = orjson.loads(passthrough.redact_paths(body))
    assert doc == {"model_path": "x.gguf", "n_ctx": 512,
                   "data": [{"id": "y.gguf"}, {"id": "plain"}], "chat_template": "/ not a path"}
    assert passthrough.redact_paths(b"not json") == b"not json"


def test_secret_words_round_trip_and_are_never_zero():
    seen = set()
    for _ in range(200):
        text, hi, lo = new_secret()
        assert len(text) == 32 and (hi, lo) != (0, 0)
        assert -(1 << 63) <= hi < 1 << 63 and -(1 << 63) <= lo < 1 << 63
        assert secret_text(hi, lo) == text
        assert secret_header(hi, lo) == b"authorization: Bearer " + text.encode() + b"\r\n"
        seen.add(text)
    assert len(seen) == 200
    assert secret_text(0, 0) == "" and secret_header(0, 0) == b""


def test_keys_go_through_a_pipe_and_leave_the_environment():
    fd = keys_pipe({"api_key": "k1", "admin_key": "k2"})
    assert read_keys(fd) == {"api_key": "k1", "admin_key": "k2"}
    with pytest.raises(OSError):
        os.fstat(fd)  # read_keys closed it
    env = {"GGMUX_API_KEY": "a", "GGMUX_ADMIN_KEY": "b", "GGMUX_CLUSTER_TOKEN_KEY": "c",
           "GGMUX_PORT": "8080", "HOME": "/root"}
    assert scrub_env(env) == {"GGMUX_PORT": "8080", "HOME": "/root"}


def test_cluster_and_nats_secrets_leave_the_environment():
    env = {"GGMUX_CLUSTER_TOKEN": "t", "GGMUX_NATS_PASSWORD": "p", "GGMUX_NATS_TOKEN": "n",
           "GGMUX_CLUSTER": "nats://u:p@nats:4222", "GGMUX_NATS_USER": "u",
           "GGMUX_NODE_NAME": "a", "PATH": "/bin"}
    assert scrub_env(env) == {"GGMUX_NATS_USER": "u", "GGMUX_NODE_NAME": "a", "PATH": "/bin"}
    plain = {"GGMUX_CLUSTER": "nats://nats:4222", "GGMUX_ADVERTISE": "http://me:8080"}
    assert scrub_env(plain) == plain
