"""A client's media reference to bytes, bounded before anything is decoded.

The forms llama-server's ``handle_media`` takes (tools/server/server-common.cpp):

* ``data:<type>;base64,<data>`` where ``<type>`` is ``image/...``,
  ``audio/...`` (or ``video/...``, refused here: no video);
* a bare base64 string (Ollama's ``images``, OpenAI's ``input_audio.data``);
* ``http://`` and ``https://`` URLs: fetched only when the instance runs
  with ``--media-fetch`` (off by default: a URL makes the server open a
  connection wherever the client points it, which on a machine inside a
  network reaches what the client cannot; llama-server fetches them, with
  10 MB and 10 s bounds, which apply here too);
* ``file://``: refused (llama-server needs ``--media-path`` for them).

Every size is checked before the work it would cost: the base64 text's
length before it is decoded (``max_media_bytes`` is the decoded size: the
text may be at most 4/3 of it, plus padding), a fetched body's announced
and actual length while it arrives. Errors are
:class:`~ggmux.instance.validate.BadRequest` naming the field.
"""

from __future__ import annotations

import base64
import binascii
import re
import urllib.error
import urllib.request

from ..validate import BadRequest

_WS = re.compile(r"\s+")
FETCH_TIMEOUT_S = 10.0
"""Seconds a ``--media-fetch`` download may take (llama-server's 10)."""
FETCH_MAX_BYTES = 10 * 1024 * 1024
"""Most bytes a ``--media-fetch`` download may bring (llama-server's 10 MB),
below ``max_media_bytes`` when that is larger."""


def _b64(text: str, where: str, max_bytes: int) -> bytes:
    # base64 is 4 characters per 3 bytes: refuse before decoding what cannot fit
    n = len(text)
    if n > (max_bytes + 2) // 3 * 4 + 4:
        raise BadRequest(f"{where}: the media is larger than this server's limit of "
                         f"{max_bytes} bytes (--max-media-bytes)", where)
    try:  # whitespace (a wrapped data URL) is allowed, any other stray character is not
        data = base64.b64decode(_WS.sub("", text), validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: invalid base64 data", where) from None
    if not data:
        raise BadRequest(f"{where}: the media is empty", where)
    if len(data) > max_bytes:
        raise BadRequest(f"{where}: the media is {len(data)} bytes, more than this server's "
                         f"limit of {max_bytes} (--max-media-bytes)", where)
    return data


def _fetch(url: str, where: str, max_bytes: int) -> bytes:
    limit = min(max_bytes, FETCH_MAX_BYTES)
    req = urllib.request.Request(url, headers={"User-Agent": "ggmux"})
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as r:
            announced = r.headers.get("Content-Length")
            if announced and announced.isdigit() and int(announced) > limit:
                raise BadRequest(f"{where}: the media at {url!r} is {announced} bytes, more than "
                                 f"the limit of {limit}", where)
            data = r.read(limit + 1)
    except BadRequest:
        raise
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise BadRequest(f"{where}: could not fetch {url!r}: {e}", where) from None
    if len(data) > limit:
        raise BadRequest(f"{where}: the media at {url!r} is more than the limit of {limit} "
                         "bytes", where)
    if not data:
        raise BadRequest(f"{where}: the media at {url!r} is empty", where)
    return data


def media_bytes(ref, where: str, max_bytes: int, fetch: bool = False) -> bytes:
    """The bytes of one media reference (the module docstring's forms).
    ``where``: the field, for errors; ``max_bytes``: ``max_media_bytes``;
    ``fetch``: ``--media-fetch``. Raises BadRequest."""
    if not isinstance(ref, str) or not ref:
        raise BadRequest(f"{where} must be a non-empty string (a data: URL or base64)", where)
    if ref.startswith("data:"):
        head, sep, data = ref.partition(",")
        if not sep:
            raise BadRequest(f"{where}: invalid data URL (no ',')", where)
        if not head.startswith(("data:image/", "data:audio/")):
            raise BadRequest(f"{where}: unsupported media type in {head[:64]!r} (images and "
                             "audio only)", where)
        if not head.endswith(";base64"):
            raise BadRequest(f"{where}: the data URL must be base64-encoded", where)
        return _b64(data, where, max_bytes)
    low = ref[:8].lower()
    if low.startswith(("http://", "https://")):
        if not fetch:
            raise BadRequest(f"{where}: this server does not fetch media from URLs (send the "
                             "media as a data: URL or base64; an administrator can allow "
                             "fetching with --media-fetch)", where)
        return _fetch(ref, where, max_bytes)
    if low.startswith("file:"):
        raise BadRequest(f"{where}: file: URLs are not allowed (send the media as a data: "
                         "URL or base64)", where)
    return _b64(ref, where, max_bytes)
