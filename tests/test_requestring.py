"""The request ring (shm/requestring.py, issue 22 item 8) in-process: per-proxy
regions merged on read, a bounded ring that overwrites its oldest records,
half-written records never read, excerpts cut to the ring's size; and the
pieces that fill a record: the usage line, the answer's tail, the excerpts,
the route table."""

from __future__ import annotations

import os

import numpy as np
import pytest
from ggmux.http1.usage import (
    parse_usage,
    usage_from_tail,
    usage_line,
    usage_trailer,
)
from ggmux.proxy import activity, apis
from ggmux.proxy.inference_paths import INFERENCE
from ggmux.shm import requestring as Q
from ggmux.shm.requestring import RequestRing, RingShape


@pytest.fixture
def ring():
    name = f"/ggmux-test-req-{os.getpid()}"
    r = RequestRing.create(name, RingShape(proxies=2, rows=4, excerpt=16))
    yield r
    r.unlink()
    r.close()


def values(wall: int, model: int = 0, status: int = 200, prompt: bytes = b"",
           answer: bytes = b"", rid: bytes = b"r", key: int = -1) -> tuple:
    return (wall, model, 0, 1, status, 5, 1, 7, 10, 20, 300, Q.F_STREAM, 99,
            len(prompt), len(answer), rid, key)


def test_each_proxy_writes_its_region_and_a_read_merges_them(ring):
    ring.write(0, values(3, rid=b"a"))
    ring.write(1, values(1, rid=b"b"))
    ring.write(0, values(2, rid=b"c"))
    found, cursor = ring.read()
    assert sorted((int(r[Q.Q_WALL_NS]), p) for p, r, _, _ in found) == [(1, 1), (2, 0), (3, 0)]
    assert cursor.tolist() == [2, 1]
    # a cursor gives what came after it, from every region
    ring.write(1, values(4))
    found, cursor = ring.read(cursor)
    assert [(p, int(r[Q.Q_WALL_NS])) for p, r, _, _ in found] == [(1, 4)]
    assert ring.read(cursor)[0] == []


def test_the_ring_keeps_the_last_rows_of_each_proxy(ring):
    for i in range(10):
        ring.write(0, values(i))
    found, _ = ring.read()
    assert sorted(int(r[Q.Q_WALL_NS]) for _, r, _, _ in found) == [6, 7, 8, 9]
    # a cursor older than the ring holds: what it still holds
    found, _ = ring.read(np.array([2, 0]))
    assert sorted(int(r[Q.Q_WALL_NS]) for _, r, _, _ in found) == [6, 7, 8, 9]


def test_a_record_being_written_or_left_half_written_is_never_read(ring):
    ring.write(0, values(1))
    ring.write(0, values(2))
    # a writer that died mid-record: its sequence word stayed odd, its count unmoved
    ring.rows[0, 2, Q.Q_SEQ] = 2 * 2 + 1
    found, cursor = ring.read()
    assert [int(r[Q.Q_WALL_NS]) for _, r, _, _ in found] == [1, 2] and cursor[0] == 2
    # the next writer (a replacement proxy) carries on there
    ring.write(0, values(3))
    assert sorted(int(r[Q.Q_WALL_NS]) for _, r, _, _ in ring.read()[0]) == [1, 2, 3]
    # a row overwritten by a newer record is not the old one any more
    ring.rows[0, 0, Q.Q_SEQ] = 2 * 4 + 2
    assert sorted(int(r[Q.Q_WALL_NS]) for _, r, _, _ in ring.read()[0]) == [2, 3]


def test_excerpts_are_cut_to_the_rings_size(ring):
    ring.write(1, values(1, prompt=b"p" * 40, answer=b"an answer"), b"p" * 40, b"an answer")
    (_, row, prompt, answer), = ring.read()[0]
    assert prompt == b"p" * 16 and answer == b"an answer"
    assert row[Q.Q_RID : Q.Q_RID + 2].tobytes().rstrip(b"\0") == b"r"


def test_a_second_attach_sees_the_same_records_and_a_foreign_segment_is_refused(ring):
    ring.write(0, values(5))
    other = RequestRing.attach(ring.name)
    try:
        assert other.shape == ring.shape
        assert [int(r[Q.Q_WALL_NS]) for _, r, _, _ in other.read()[0]] == [5]
    finally:
        other.close()
    with pytest.raises(ValueError):
        RequestRing.create(ring.name + "x", RingShape(proxies=1, rows=0))


def test_the_usage_line_round_trips_and_bad_ones_are_ignored():
    usage = {"prompt_tokens": 12, "completion_tokens": 8, "total_tokens": 20,
             "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage_line(usage) == b"12 4 8"
    assert usage_trailer(usage) == b"x-ggmux-usage: 12 4 8\r\n"
    assert parse_usage(b"12 4 8") == (12, 4, 8)
    for bad in (None, b"", b"12 4", b"a b c", b"1 2 3 4", b"-1 2 3"):
        assert parse_usage(bad) is None
    assert usage_line({"prompt_tokens": "x"}) == b"" and usage_trailer(None) == b""


def test_usage_is_read_from_an_answers_tail_openai_or_llama_server():
    chat = (b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":9,'
            b'"completion_tokens":3,"total_tokens":12,"prompt_tokens_details":'
            b'{"cached_tokens":2}}}')
    assert usage_from_tail(chat) == (9, 2, 3)
    stream = (b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":7}}\n\n'
              b"data: [DONE]\n\n")
    assert usage_from_tail(stream) == (5, 0, 7)
    # llama-server: prompt_n counts what it evaluated, cache_n what it reused
    llama = b'data: {"timings":{"cache_n":3,"prompt_n":6,"predicted_n":11}}\n\n'
    assert usage_from_tail(llama) == (9, 3, 11)
    assert usage_from_tail(b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n') is None
    assert usage_from_tail(b'{"usage": {"prompt_tok') is None  # cut: not whole there


def test_every_routed_path_has_a_name_in_the_records():
    for path in (*INFERENCE, *apis.ROUTES, b"/upstream/m/v1/x"):
        assert activity.route_index(path) > 0, path
    assert activity.route_index(b"/nope") == 0


def test_excerpts_take_the_last_message_and_the_answers_text():
    chat = b'{"messages":[{"role":"system","content":"be brief"},{"role":"user","content":' \
           b'[{"type":"text","text":"hello"},{"type":"image_url"}]}]}'
    assert activity.prompt_excerpt(chat) == "hello"
    assert activity.prompt_excerpt(b'{"prompt":"once upon"}') == "once upon"
    assert activity.prompt_excerpt(b'{"input":["a","b"]}') == "a"
    assert activity.prompt_excerpt(b"not json") == ""
    sse = (b'data: {"choices":[{"delta":{"role":"assistant","content":"Hi"}}]}\n\n'
           b'data: {"choices":[{"delta":{"content":" there"}}]}\n\ndata: [DONE]\n\n'
           b'data: {"choices":[{"delta":{"cont')  # (cut where the kept bytes ended)
    assert activity.answer_excerpt(sse, True) == "Hi there"
    assert activity.answer_excerpt(b'{"choices":[{"text":"abc"}]}', False) == "abc"
    assert activity._cut("é" * 10, 5) == "é".encode() * 2  # never half a character


def test_a_malformed_answer_or_a_count_beyond_64_bits_never_breaks_a_record(ring):
    # issue 31 item 4: {"choices": 5} raised a TypeError in the excerpt and a usage of
    # 2**64 - 1 one in the pack: either dropped the request from /requests
    assert activity.answer_excerpt(b'{"choices": 5}', False) == ""
    assert activity.answer_excerpt(b'data: {"choices": "x"}\n\n', True) == ""
    huge = {"prompt_tokens": 2 ** 64 - 1, "completion_tokens": 1}
    assert usage_line(huge) == b"" and parse_usage(b"%d 0 1" % (2 ** 63)) is None
    assert usage_from_tail(b'{"usage": {"prompt_tokens": 18446744073709551615, '
                           b'"completion_tokens": 1}}') is None
