"""A request's media before the engine sees it (no model): references to
bytes and their bounds (instance/media/sources.py), what the bytes are and
how big, read from the header only (probe.py), the placeholder ids that
stand for a media item in every prefix cache (spans.py), and chat content
parts joined as llama.cpp joins them around media markers (parts.py)."""

from __future__ import annotations

import base64
import io
import struct
import wave
import zlib

import numpy as np
import pytest
from ggmux.instance.media.parts import has_media, join_parts
from ggmux.instance.media.probe import AUDIO, IMAGE, probe
from ggmux.instance.media.sources import media_bytes
from ggmux.instance.media.spans import MediaSpan, floor_outside, next_start, placeholders, span_at
from ggmux.instance.validate import BadRequest, RequestLimits
from PIL import Image

LIMITS = RequestLimits()


def png(width: int = 8, height: int = 6, color=(10, 20, 30)) -> bytes:
    b = io.BytesIO()
    Image.new("RGB", (width, height), color).save(b, "PNG")
    return b.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares ``width x height`` pixels but whose data
    is a few bytes: what a decompression bomb looks like to a reader of
    headers."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))


def wav(seconds: float, rate: int = 16000) -> bytes:
    b = io.BytesIO()
    with wave.open(b, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"\x00\x00" * int(seconds * rate))
    return b.getvalue()


def data_url(data: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


# ---- sources --------------------------------------------------------------------------
def test_a_data_url_and_bare_base64_give_the_same_bytes():
    raw = png()
    assert media_bytes(data_url(raw), "f", LIMITS.max_media_bytes) == raw
    assert media_bytes(base64.b64encode(raw).decode(), "f", LIMITS.max_media_bytes) == raw


def test_a_media_url_is_refused_unless_fetching_is_allowed_and_file_urls_always():
    with pytest.raises(BadRequest, match="--media-fetch") as e:
        media_bytes("https://example.com/cat.png", "messages[0].content[1]", 1 << 20)
    assert e.value.param == "messages[0].content[1]"
    with pytest.raises(BadRequest, match="file: URLs are not allowed"):
        media_bytes("file:///etc/passwd", "f", 1 << 20, fetch=True)


def test_media_over_the_byte_limit_is_refused_before_its_base64_is_decoded(monkeypatch):
    decoded = []
    real = base64.b64decode
    monkeypatch.setattr(base64, "b64decode", lambda *a, **k: decoded.append(1) or real(*a, **k))
    big = base64.b64encode(b"\x00" * 4000).decode()
    with pytest.raises(BadRequest, match="--max-media-bytes"):
        media_bytes(big, "f", 1000)
    assert decoded == []  # refused by the text's length alone


def test_bad_data_urls_name_what_is_wrong():
    with pytest.raises(BadRequest, match="base64-encoded"):
        media_bytes("data:image/png,abc", "f", 1000)
    with pytest.raises(BadRequest, match="unsupported media type"):
        media_bytes("data:text/html;base64,PGI+", "f", 1000)
    with pytest.raises(BadRequest, match="invalid base64|empty"):
        media_bytes("data:image/png;base64,@@@@", "f", 1000)


# ---- probe ----------------------------------------------------------------------------
def test_an_image_is_probed_by_its_header():
    p = probe(png(40, 30), "f", LIMITS.max_image_pixels, LIMITS.max_audio_seconds)
    assert (p.kind, p.format, p.width, p.height) == (IMAGE, "PNG", 40, 30)


def test_a_pixel_bomb_is_refused_from_its_header_before_any_decoding():
    bomb = png_header_only(50_000, 50_000)  # 7.5 GB of RGB, in about 100 bytes
    assert len(bomb) < 200
    with pytest.raises(BadRequest, match="50000 x 50000 pixels.*--max-image-pixels"):
        probe(bomb, "f", LIMITS.max_image_pixels, LIMITS.max_audio_seconds)


def test_bytes_that_are_neither_image_nor_audio_are_refused():
    with pytest.raises(BadRequest, match="not an image or audio") as e:
        probe(b"this is plain text, not a picture", "f", 1 << 30, 60)
    assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)  # no Python repr


def test_audio_is_probed_for_its_length_and_a_long_clip_refused():
    p = probe(wav(2.0), "f", LIMITS.max_image_pixels, 60)
    assert p.kind == AUDIO and p.format == "wav" and abs(p.seconds - 2.0) < 0.01
    with pytest.raises(BadRequest, match="--max-audio-seconds"):
        probe(wav(3.0), "f", LIMITS.max_image_pixels, 2)


# ---- placeholders and spans -------------------------------------------------------------
def test_placeholders_are_negative_repeatable_and_differ_between_media():
    a, a2, b = placeholders("aa" * 32, 70), placeholders("aa" * 32, 70), placeholders("ab" * 32, 70)
    assert a == a2 and len(a) == 70
    assert all(t < 0 for t in a) and all(t >= -(1 << 31) for t in a)
    assert a[0] != b[0]  # another image differs at its first placeholder: never a hit
    assert len(set(a)) > 60  # each position carries other bits of the hash


def test_a_prefix_never_ends_inside_a_media_span():
    spans = (MediaSpan(5, 10, 10, "image", "x"), MediaSpan(20, 4, 4, "audio", "y"))
    assert [floor_outside(spans, n) for n in (3, 5, 6, 14, 15, 16, 21, 24)] == \
        [3, 5, 5, 5, 15, 16, 20, 24]
    assert span_at(spans, 5) is spans[0] and span_at(spans, 6) is None
    assert next_start(spans, 6) == 20 and next_start(spans, 21) is None


def test_a_span_frees_its_chunk_once_whether_released_or_collected():
    freed = []
    s = MediaSpan(0, 1, 1, "image", "x")
    s.own("chunk", freed.append)
    s.release()
    s.release()
    assert freed == ["chunk"] and s.chunk is None
    t = MediaSpan(0, 1, 1, "image", "y")
    t.own("other", freed.append)
    del t
    assert freed == ["chunk", "other"]


# ---- content parts ----------------------------------------------------------------------
def test_parts_join_with_newlines_except_beside_a_media_marker():
    """llama.cpp's concat_content_parts: "\\n" between text parts, none
    before or after a marker."""
    refs: list = []
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
             {"type": "text", "text": "c"},
             {"type": "input_audio", "input_audio": {"data": "BB", "format": "wav"}},
             {"type": "image_url", "image_url": "data:image/png;base64,CC"}]
    text = join_parts(parts, "messages[0].content", "<M>", refs,
                      {"image_url": True, "input_audio": True})
    assert text == "a\nb<M>c<M><M>"
    assert [(k, r) for k, r, _ in refs] == [("image_url", "data:image/png;base64,AA"),
                                            ("input_audio", "BB"),
                                            ("image_url", "data:image/png;base64,CC")]
    assert refs[1][2] == "messages[0].content[4]"


def test_a_part_the_projector_cannot_read_is_a_400_naming_it():
    with pytest.raises(BadRequest, match="audio input is not supported") as e:
        join_parts([{"type": "input_audio", "input_audio": {"data": "AA"}}], "m[1].content",
                   "<M>", [], {"image_url": True, "input_audio": False})
    assert e.value.param == "m[1].content[0]"
    assert has_media([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    assert not has_media([{"role": "user", "content": "no"}])


def test_the_byte_limit_counts_decoded_bytes_not_base64_text():
    raw = np.random.default_rng(0).bytes(3000)
    text = base64.b64encode(raw).decode()  # 4000 characters
    assert media_bytes(text, "f", 3000) == raw
    with pytest.raises(BadRequest):
        media_bytes(text, "f", 2999)
