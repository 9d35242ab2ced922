"""What a media item is, from its header, before anything is decoded.

A decoder allocates what the header declares: a 600-byte PNG can declare
50,000 x 50,000 pixels (7.5 GB of RGB once decoded), a few kilobytes of
FLAC hours of silence. So an item's kind and size are read first, with
well-kept readers that stop at the header (Pillow's ``Image.open`` reads
no pixels; mutagen reads a file's stream information), and refused past
``max_image_pixels`` or ``max_audio_seconds``
(:class:`~ggmux.instance.validate.RequestLimits`) with a 400 naming the
limit. Audio is recognised as libmtmd recognises it (``is_audio_file`` in
tools/mtmd/mtmd-helper.cpp: WAV, MP3, FLAC); anything else must be an
image Pillow can read.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

from ..validate import BadRequest

IMAGE, AUDIO = "image", "audio"


@dataclass(slots=True)
class Probe:
    """``kind``: :data:`IMAGE` or :data:`AUDIO`; ``format``: Pillow's format
    name (``PNG``, ``JPEG``, ...) or ``wav``/``mp3``/``flac``; ``width`` and
    ``height`` (pixels) of an image; ``seconds`` of a clip."""

    kind: str
    format: str
    width: int = 0
    height: int = 0
    seconds: float = 0.0


def audio_format(data: bytes) -> str | None:
    """``wav``, ``mp3`` or ``flac`` where libmtmd takes ``data`` for audio
    (the same magic numbers), else None."""
    if len(data) < 12:
        return None
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:4] == b"fLaC":
        return "flac"
    if data[:3] == b"ID3" or (data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def _audio_seconds(data: bytes, fmt: str, where: str) -> float:
    import mutagen

    try:
        f = mutagen.File(io.BytesIO(data))
    except Exception:  # noqa: BLE001 - any reader error is a bad file
        f = None
    length = getattr(getattr(f, "info", None), "length", None)
    if not isinstance(length, (int, float)) or length <= 0:
        raise BadRequest(f"{where}: the {fmt} audio could not be read (not a valid file, or "
                         "its length is unknown)", where)
    return float(length)


def probe(data: bytes, where: str, max_pixels: int, max_seconds: float) -> Probe:
    """The kind and size of ``data``; raises BadRequest for what is neither
    a readable image nor WAV/MP3/FLAC audio, and for an image over
    ``max_pixels`` pixels or a clip over ``max_seconds`` seconds."""
    fmt = audio_format(data)
    if fmt is not None:
        seconds = _audio_seconds(data, fmt, where)
        if seconds > max_seconds:
            raise BadRequest(f"{where}: the audio is {seconds:.1f} s long, more than this "
                             f"server's limit of {max_seconds:g} s (--max-audio-seconds)", where)
        return Probe(AUDIO, fmt, seconds=seconds)
    from PIL import Image, UnidentifiedImageError

    # Pillow's own bomb guard (a fixed 179 Mpx, then an error without the
    # size) gives way to this server's named limit, checked just below
    Image.MAX_IMAGE_PIXELS = None
    try:
        with Image.open(io.BytesIO(data)) as im:  # the header only: no pixels read
            width, height, name = im.size[0], im.size[1], im.format or "?"
    except (OSError, ValueError, SyntaxError) as e:  # (UnidentifiedImageError is an OSError)
        # an unidentified image's message names an in-memory object: no help
        why = "" if isinstance(e, UnidentifiedImageError) else f": {e}"
        raise BadRequest(f"{where}: not an image or audio this server can read (images: PNG, "
                         f"JPEG, GIF, BMP, WebP, ...; audio: WAV, MP3, FLAC){why}", where) from None
    if width <= 0 or height <= 0:
        raise BadRequest(f"{where}: the image has no pixels ({width} x {height})", where)
    if width * height > max_pixels:
        raise BadRequest(f"{where}: the image is {width} x {height} pixels, more than this "
                         f"server's limit of {max_pixels} (--max-image-pixels)", where)
    return Probe(IMAGE, name, width, height)
