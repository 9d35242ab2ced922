"""libmtmd beside the model: the multimodal projector (llama.cpp's
``mmproj``) through llama-cpp-python's ``mtmd_cpp`` bindings.

:class:`Projector` is loaded after the text model (libmtmd checks that the
projector's output width is the model's input width) and freed with it.
It does what llama-server does with a prompt that has media
(``process_mtmd_prompt``, tools/server/server-common.cpp): each item
becomes a bitmap (libmtmd's own decoders, stb_image for images and
miniaudio for audio, where they read the format, so the pixels and samples
are llama-server's; Pillow for the image formats stb does not read, WebP
and TIFF), the prompt text with one marker per item is cut by
``mtmd_tokenize`` into text and media chunks, and each media chunk becomes
a :class:`~.spans.MediaSpan` of placeholder ids. :meth:`Projector.encode`
runs the encoder on a span (the engine calls it on a worker thread, so
the other slots' tokens go on meanwhile); :meth:`Projector.decode` puts a
span's embeddings into a sequence of the llama context
(``mtmd_helper_decode_image_chunk``: non-causal attention where the model
wants it, in ``n_batch`` pieces).

The marker is random per process (llama-server's ``get_media_marker``; the
environment's ``LLAMA_MEDIA_MARKER`` pins it, as there), so a client's text
can never place or shift media; ``/props`` shows it for clients of
``/completion``'s ``multimodal_data``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import secrets
from dataclasses import dataclass

import numpy as np

from ..validate import BadRequest
from .probe import AUDIO, Probe
from .spans import MediaSpan, placeholders

log = logging.getLogger(__name__)

STB_FORMATS = frozenset(("PNG", "JPEG", "GIF", "BMP", "TGA", "PPM", "PSD"))
"""Pillow's names of the formats stb_image reads (libmtmd's decoder)."""


def media_marker() -> str:
    """This process's media marker (see the module docstring)."""
    env = os.environ.get("LLAMA_MEDIA_MARKER")
    return env if env else f"<__media_{secrets.token_hex(8)}__>"


@dataclass(slots=True)
class ProjectorConfig:
    """``path``: the projector GGUF; ``n_threads``: the encoder's threads;
    ``use_gpu``: llama-server's ``--mmproj-offload`` (on);
    ``image_min_tokens``/``image_max_tokens``: llama-server's options of
    those names (0: the projector's own; for dynamic-resolution models);
    ``flash_attn``: as the model's (None: llama.cpp's auto)."""

    path: str
    n_threads: int = 1
    use_gpu: bool = True
    image_min_tokens: int = 0
    image_max_tokens: int = 0
    flash_attn: bool | None = None


class Projector:
    """A loaded projector; see the module docstring. ``vision``/``audio``:
    what it reads; ``mrope``: its model places media by M-RoPE (Qwen2-VL
    and kin), which the engine does not serve yet; ``marker``."""

    def __init__(self, llama_cpp, config: ProjectorConfig) -> None:
        import llama_cpp.mtmd_cpp as mtmd

        self.L, self.M, self.cfg = llama_cpp, mtmd, config
        self.ctx = None
        self.marker = media_marker()
        self.vision = self.audio = self.mrope = False
        self.sample_rate = -1
        self.n_embd = 0

    @property
    def loaded(self) -> bool:
        return bool(self.ctx)

    def load(self, model) -> None:
        """Load it for ``model`` (a llama model pointer). Raises RuntimeError
        when libmtmd cannot (a missing or foreign file, a width that does
        not match the model's)."""
        M, cfg = self.M, self.cfg
        if not os.path.isfile(cfg.path):
            raise RuntimeError(f"projector file not found: {cfg.path}")
        from llama_cpp._logger import llama_log_callback  # llama.cpp's logs, filtered

        M.mtmd_helper_log_set(llama_log_callback, ctypes.c_void_p(0))
        p = M.mtmd_context_params_default()
        p.use_gpu = cfg.use_gpu
        p.print_timings = False
        p.n_threads = max(1, cfg.n_threads)
        p.media_marker = self.marker.encode()
        p.flash_attn_type = (self.L.LLAMA_FLASH_ATTN_TYPE_AUTO if cfg.flash_attn is None
                             else self.L.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn
                             else self.L.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if cfg.image_min_tokens > 0:
            p.image_min_tokens = cfg.image_min_tokens
        if cfg.image_max_tokens > 0:
            p.image_max_tokens = cfg.image_max_tokens
        ctx = M.mtmd_init_from_file(cfg.path.encode(), model, p)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not load the projector {cfg.path} (see the "
                               "log above: a projector made for another model?)")
        self.ctx = ctx
        self.vision = bool(M.mtmd_support_vision(ctx))
        self.audio = bool(M.mtmd_support_audio(ctx))
        self.sample_rate = int(M.mtmd_get_audio_sample_rate(ctx))
        self.mrope = bool(M.mtmd_decode_use_mrope(ctx))
        self.n_embd = int(self.L.llama_model_n_embd_inp(model))
        log.info("projector %s: %s", os.path.basename(cfg.path), self.modalities_text())

    def free(self) -> None:
        if self.ctx:
            self.M.mtmd_free(self.ctx)
        self.ctx = None

    def modalities(self) -> dict[str, bool]:
        """llama-server's ``/props`` ``modalities``: ``{"vision", "audio"}``."""
        return {"vision": self.vision, "audio": self.audio}

    def modalities_text(self) -> str:
        what = [k for k, v in self.modalities().items() if v]
        return ("reads " + " and ".join(what)) if what else "reads nothing"

    # ---- prompts ------------------------------------------------------------
    def _bitmap(self, data: bytes, probe: Probe, where: str):
        """A libmtmd bitmap of ``data`` (the caller frees it)."""
        M = self.M
        if probe.kind == AUDIO and not self.audio:
            raise BadRequest(f"{where}: audio input is not supported by this model's projector",
                             where)
        if probe.kind != AUDIO and not self.vision:
            raise BadRequest(f"{where}: image input is not supported by this model's projector",
                             where)
        if probe.kind == AUDIO or probe.format in STB_FORMATS:
            buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
            bm = M.mtmd_helper_bitmap_init_from_buf(self.ctx, buf, len(data), False)
            if not bm:
                raise BadRequest(f"{where}: the {probe.kind} could not be decoded "
                                 f"({probe.format})", where)
            return bm
        import io

        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as im:
                rgb = im.convert("RGB")
        except Exception as e:  # noqa: BLE001 - any decoder error is a bad image
            raise BadRequest(f"{where}: the image could not be decoded ({probe.format}): {e}",
                             where) from None
        px = rgb.tobytes()
        buf = (ctypes.c_ubyte * len(px)).from_buffer_copy(px)
        bm = M.mtmd_bitmap_init(rgb.width, rgb.height, buf)
        M.mtmd_bitmap_set_id(bm, hashlib.sha256(data).hexdigest().encode())
        return bm

    def tokenize(self, text: str, items: list[tuple[bytes, Probe, str]], add_special: bool,
                 max_audio_samples: int = 0) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """``(tokens, spans)`` of ``text`` whose markers stand for ``items``
        (``(bytes, probe, field)``, in order). ``max_audio_samples``: most
        samples a decoded clip may have (0: any), checked again after
        decoding. Raises BadRequest. Thread-safe (libmtmd's tokenizer is)."""
        M = self.M
        bitmaps = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for data, probe, where in items:
                bm = self._bitmap(data, probe, where)
                bitmaps.append(bm)
                if probe.kind == AUDIO and max_audio_samples and self.sample_rate > 0:
                    n = M.mtmd_bitmap_get_n_bytes(bm) // 4
                    if n > max_audio_samples:
                        raise BadRequest(f"{where}: the audio decodes to {n / self.sample_rate:.1f}"
                                         " s, more than this server's limit "
                                         f"(--max-audio-seconds)", where)
            raw = text.encode("utf-8")
            inp = M.mtmd_input_text()
            inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), \
                add_special, True
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            ret = M.mtmd_tokenize(self.ctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if ret == 1:
                raise BadRequest(f"the prompt has {text.count(self.marker)} media markers for "
                                 f"{len(bitmaps)} media items", "messages")
            if ret != 0:
                raise BadRequest("the media could not be preprocessed for this model", "messages")
            return self._spans(chunks)
        finally:
            M.mtmd_input_chunks_free(chunks)
            for bm in bitmaps:
                M.mtmd_bitmap_free(bm)

    def _spans(self, chunks) -> tuple[list[int], tuple[MediaSpan, ...]]:
        M = self.M
        tokens: list[int] = []
        spans: list[MediaSpan] = []
        for i in range(M.mtmd_input_chunks_size(chunks)):
            c = M.mtmd_input_chunks_get(chunks, i)
            kind = M.mtmd_input_chunk_get_type(c)
            if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                n = ctypes.c_size_t(0)
                p = M.mtmd_input_chunk_get_tokens_text(c, ctypes.byref(n))
                tokens.extend(p[:n.value] if n.value else ())
                continue
            n_tokens = int(M.mtmd_input_chunk_get_n_tokens(c))
            raw_id = M.mtmd_input_chunk_get_id(c)
            media_id = raw_id.decode("ascii", "replace") if raw_id else os.urandom(16).hex()
            span = MediaSpan(len(tokens), n_tokens, int(M.mtmd_input_chunk_get_n_pos(c)),
                             "audio" if kind == M.MTMD_INPUT_CHUNK_TYPE_AUDIO else "image",
                             media_id)
            span.own(M.mtmd_input_chunk_copy(c), M.mtmd_input_chunk_free)
            spans.append(span)
            tokens.extend(placeholders(media_id, n_tokens))
        return tokens, tuple(spans)

    # ---- the encoder and the decode -------------------------------------------
    def encode(self, span: MediaSpan) -> np.ndarray:
        """Run the encoder on ``span``: its embeddings, ``(n_tokens,
        n_embd)`` float32 (a copy). Raises RuntimeError when it fails. One
        thread at a time (the encoder's buffers are the context's)."""
        M = self.M
        if span.chunk is None:
            raise RuntimeError("the media chunk was released before it was encoded")
        if M.mtmd_encode_chunk(self.ctx, span.chunk) != 0:
            raise RuntimeError(f"the projector failed to encode the {span.kind}")
        out = M.mtmd_get_output_embd(self.ctx)
        n = span.n_tokens * self.n_embd
        return np.ctypeslib.as_array(out, shape=(n,)).reshape(span.n_tokens, self.n_embd).copy()

    def non_causal(self, span: MediaSpan) -> bool:
        return bool(self.M.mtmd_decode_use_non_causal(self.ctx, span.chunk))

    def decode(self, lctx, span: MediaSpan, n_past: int, seq: int, n_batch: int) -> int:
        """Decode ``span``'s embeddings (:attr:`MediaSpan.embd`) into
        sequence ``seq`` at positions ``n_past ..`` of ``lctx``, in
        ``n_batch`` pieces, as llama-server does. Returns llama_decode's
        code (0: done; 1: no KV room; 2: interrupted)."""
        M = self.M
        embd = np.ascontiguousarray(span.embd, np.float32)
        new_past = self.L.llama_pos(0)
        return int(M.mtmd_helper_decode_image_chunk(
            self.ctx, lctx, span.chunk, embd.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
            n_past, seq, n_batch, ctypes.byref(new_past), M.mtmd_helper_post_decode_callback(),
            None))
