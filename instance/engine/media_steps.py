"""The engine's media step: a prompt's images and audio (its media spans,
:mod:`ggmux.instance.media.spans`) into its slot, part of
:class:`~ggmux.instance.engine.Engine`'s step 3, before the batch.

llama-server encodes a slot's media on its one server thread
(``process_mtmd_chunk``): while an image is encoded every other slot
waits. Here the encoder runs on a worker thread of its own
(:meth:`MediaSteps._encode_off`), so a slot whose prompt reaches a media
span it has no embeddings for sits out of the batches (state ``encoding``)
while the others' tokens go on; when the embeddings are ready, at the
start of a step, they are decoded into the slot's sequence
(``mtmd_helper_decode_image_chunk``: llama-server's call, with its
non-causal attention and ``n_batch`` pieces); the other slots' tokens
wait for that decode (about a prompt chunk of as many tokens), never for
an encode. The text after the span joins the same step's batch. A
request's spans are sent to the encoder as soon as it has a slot
(:meth:`MediaSteps._prefetch`), so their encodes overlap the reading of
the text before them.

Embeddings are kept a while by content hash (:data:`EMBD_CACHE_BYTES`): the
same image in requests sent together, or in a conversation's next turn
whose cached prefix ended before it, is encoded once. A span's libmtmd
chunk is released when its slot has read it, or when its request ends,
never while the encoder holds it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np

from ..backend import ReplicaFault
from ..media.spans import MediaSpan, span_at
from .jobs import RAISE_CTX, ContextExceeded, Generation, InvalidRequest
from .slots import ENCODE, IDLE, PROMPT, Slot

log = logging.getLogger(__name__)

EMBD_CACHE_BYTES = 64 << 20
"""Most bytes of recent media embeddings kept by content hash (an image of
Gemma 3 4B: 256 x 2560 floats, 2.5 MiB)."""
MEDIA_HOLD_S = 30.0
"""Most seconds ready media wait for other slots' encodes (:meth:`MediaSteps._hold`)."""
MEDIA_HOLD_SHARE = 1.5
"""Ready media wait for at most this many times the measured encode time of
each encode still out."""
MEDIA_FAILED = "failed to process mtmd chunk"
"""llama-server's message when a media chunk cannot be encoded or decoded."""


class MediaSteps:
    """Mixed into :class:`~ggmux.instance.engine.Engine`: uses ``m`` (its
    ``projector``, ``ctx``, ``mem``, ``n_batch``), ``L``, slots, ``stats``,
    ``_cond`` and ``_fail``, ``_clear_idle_cells``."""

    _encoder: ThreadPoolExecutor | None = None
    _encoded: list  # (media_id, embeddings or the error) from the worker, under _cond
    _waiting_embd: dict  # media_id -> spans waiting for that encode
    _in_flight: dict  # media_id -> Future of its encode
    _embd_cache: OrderedDict
    _embd_bytes = 0
    _hold_until = 0.0  # monotonic s: ready media wait for other slots' encodes until then

    # ---- the HTTP side's calls (any thread) ------------------------------------------
    def modalities(self) -> dict[str, bool]:
        """What the model reads beside text: ``{"vision", "audio"}``
        (llama-server's ``/props`` ``modalities``); both False without a
        projector or while asleep."""
        p = self.m.projector
        return p.modalities() if p is not None else {"vision": False, "audio": False}

    @property
    def media_marker(self) -> str | None:
        """The marker that stands for a media item in prompt text (None
        without a projector)."""
        p = self.m.projector
        return p.marker if p is not None else None

    def tokenize_media(self, text: str, items: list, add_special: bool = True,
                       max_audio_samples: int = 0) -> tuple[list[int], tuple[MediaSpan, ...]]:
        """``(prompt ids, media spans)`` of ``text`` whose markers
        (:attr:`media_marker`) stand for ``items`` (``(bytes, probe,
        field)``), through the projector
        (:meth:`~ggmux.instance.media.projector.Projector.tokenize`). Raises
        InvalidRequest (no projector), ContextExceeded (the prompt does not
        fit ``n_ctx``), BadRequest (a bad item), EngineAsleep."""
        with self._model_lock.shared():
            self._check_loaded()
            proj = self.m.projector
            if proj is None:
                raise InvalidRequest("this model has no multimodal projector: it reads text only")
            if proj.mrope:
                raise InvalidRequest("this model places media with M-RoPE (the Qwen2-VL family), "
                                     "which the built-in engine does not serve yet; serve it "
                                     "with llama-server as a 'cmd' instance")
            tokens, spans = proj.tokenize(text, items, add_special, max_audio_samples)
        if len(tokens) >= self.n_ctx:
            for sp in spans:
                sp.release()
            raise ContextExceeded(
                f"the request exceeds the available context size: the prompt has {len(tokens)} "
                f"tokens ({sum(sp.n_tokens for sp in spans)} of them media); this model's "
                f"context (ctx-size) is {self.n_ctx} tokens per request; {RAISE_CTX}",
                len(tokens), self.n_ctx)
        return tokens, spans

    def _check_media(self, r: Generation) -> None:
        """A prompt with media spans: the spans in order inside the prompt,
        the text around them in the vocabulary, and a text token last (the
        answer starts from a token's logits). Raises InvalidRequest."""
        if self.m.projector is None:
            raise InvalidRequest("this model has no multimodal projector: it reads text only")
        prompt = np.asarray(r.prompt, np.int64)
        text = np.ones(len(prompt), bool)
        end = 0
        for sp in r.media:
            if sp.start < end or sp.end > len(prompt) or sp.n_tokens <= 0:
                raise InvalidRequest("the prompt's media spans are out of order")
            text[sp.start:sp.end] = False
            end = sp.end
        if end >= len(prompt):
            raise InvalidRequest("the prompt ends with an image or audio: it must end with text "
                                 "(the chat template's turn, or any text after the media)")
        self.m.check_tokens(prompt[text], "prompt")

    def _media_init(self) -> None:
        self._encoded = []
        self._waiting_embd = {}
        self._in_flight = {}
        self._embd_cache = OrderedDict()
        self._embd_bytes = 0

    # ---- the step -------------------------------------------------------------------
    def _media(self) -> None:
        """Take the encoder's results, then read every prompt slot's span
        whose embeddings are ready into it (each its own decode, as
        llama-server reads a step's media chunks, so the text batches
        around them are llama-server's too); a prompt slot at a span
        without embeddings waits for the encoder (``encoding``)."""
        if self._encoded:
            self._collect_encoded()
        waiting = [s for s in self.slots if s.state in (PROMPT, ENCODE) and s.job is not None
                   and s.job.request.media]
        ready = []
        for s in sorted(waiting, key=lambda s: s.id):
            span = span_at(s.job.request.media, len(s.tokens))
            if span is None:
                s.state = PROMPT
            elif span.embd is None and not self._embd_for(span):
                s.state = ENCODE
            else:
                s.state = PROMPT
                ready.append((s, span))
        if not ready or self._hold(waiting):
            return
        for s, span in ready:
            self._media_decode(s, span)

    def _hold(self, waiting: list[Slot]) -> bool:
        """Whether ready media wait for the encodes of the other media
        slots' images, while no slot has other work (every busy slot is one
        of ``waiting``, the media prompt slots): requests that came together
        start generating together, as on llama-server (one batch of every
        slot a step), where the first one alone would take its steps beside
        the encoder, which on few cores slows both. Never while a slot
        generates or reads a text-only prompt: their tokens do not wait for
        an encode (a media slot's text before its image may wait for one).
        At most :data:`MEDIA_HOLD_SHARE` of the encodes still out (their
        measured time) and :data:`MEDIA_HOLD_S`; one wait lasts until the
        encoder's next result, so a request that comes meanwhile is taken
        after at most one encode."""
        pending = sum(1 for s in waiting for sp in s.job.request.media
                      if sp.embd is None and sp.media_id in self._in_flight)
        now = time.monotonic()
        busy = sum(1 for s in self.slots if s.state != IDLE)
        if not pending or busy > len(waiting):
            self._hold_until = 0.0
            return False
        if not self._hold_until:
            st = self.stats
            per = (st["media_encode_seconds_total"] / st["media_encoded_total"]
                   if st["media_encoded_total"] else MEDIA_HOLD_S)
            self._hold_until = now + min(MEDIA_HOLD_S, MEDIA_HOLD_SHARE * pending * per)
        if now < self._hold_until:
            with self._cond:  # woken by the encoder's next result, or at the bound
                if not self._encoded:
                    self._cond.wait(self._hold_until - now)
            self.stats["media_hold_seconds_total"] += time.monotonic() - now
            return True
        self._hold_until = 0.0
        return False

    def _prefetch(self, job, keep: int) -> None:
        """Ask the encoder for the media spans of ``job``'s prompt past its
        ``keep`` cached tokens now (the request has its slot): the encodes
        run while its text before them is read, so the slot seldom waits at
        a span; a cached span is never encoded."""
        for span in job.request.media:
            if span.start >= keep and span.embd is None:
                self._embd_for(span)

    def _embd_for(self, span: MediaSpan) -> bool:
        """Give ``span`` its embeddings from the cache (True), or have the
        encoder make them (False: it will)."""
        mid = span.media_id
        cached = self._embd_cache.get(mid)
        if cached is not None and cached.shape[0] == span.n_tokens:
            self._embd_cache.move_to_end(mid)
            span.embd = cached
            return True
        spans = self._waiting_embd.setdefault(mid, [])
        if span not in spans:
            spans.append(span)
        if mid not in self._in_flight:
            if self._encoder is None:
                self._encoder = ThreadPoolExecutor(1, thread_name_prefix="encoder")
            self._in_flight[mid] = self._encoder.submit(self._encode_off, span)
        return False

    def _encode_off(self, span: MediaSpan) -> None:
        """The worker: encode ``span``; the result goes to the decode thread."""
        t0 = time.perf_counter()
        try:
            out: np.ndarray | BaseException = self.m.projector.encode(span)
        except BaseException as e:  # noqa: BLE001 - handed to the decode thread
            out = e
        dt = time.perf_counter() - t0
        with self._cond:
            self._encoded.append((span.media_id, out, dt))
            self._cond.notify()

    def _collect_encoded(self) -> None:
        with self._cond:
            done, self._encoded = self._encoded, []
        st = self.stats
        for mid, out, dt in done:
            self._in_flight.pop(mid, None)
            spans = self._waiting_embd.pop(mid, [])
            if isinstance(out, BaseException):
                log.error("encoding a media chunk failed: %s", out)
                for sp in spans:
                    self._fail_span(sp)
                continue
            st["media_encoded_total"] += 1
            st["media_encode_seconds_total"] += dt
            self._remember(mid, out)
            for sp in spans:
                sp.embd = out
                if self._span_job(sp) is None:
                    sp.release()  # its request ended while the encoder held it

    def _remember(self, mid: str, embd: np.ndarray) -> None:
        cache = self._embd_cache
        if mid in cache:
            self._embd_bytes -= cache.pop(mid).nbytes
        cache[mid] = embd
        self._embd_bytes += embd.nbytes
        while self._embd_bytes > EMBD_CACHE_BYTES and cache:
            _, old = cache.popitem(last=False)
            self._embd_bytes -= old.nbytes

    def _span_job(self, span: MediaSpan):
        """The running request whose prompt holds ``span``, or None."""
        for s in self.slots:
            job = s.job
            if job is not None and not job.ended and span in job.request.media:
                return job
        return None

    def _fail_span(self, span: MediaSpan) -> None:
        job = self._span_job(span)
        span.release()
        if job is not None:
            self._fail(job, ReplicaFault(MEDIA_FAILED))

    def _media_decode(self, s: Slot, span: MediaSpan) -> None:
        """Decode ``span``'s embeddings at the slot's next position (the
        span's start); on success its placeholders join ``s.tokens``."""
        job = s.job
        pos = len(s.tokens)
        proj = self.m.projector
        for attempt in (0, 1):
            t0 = time.perf_counter()
            ret = proj.decode(self.m.ctx, span, pos, s.id, self.m.n_batch)
            dt = time.perf_counter() - t0
            st = self.stats
            st["media_decode_seconds_total"] += dt
            st["decode_calls_total"] += 1
            st["decode_seconds_total"] += dt
            st["batch_tokens_total"] += span.n_tokens
            self._timed(dt)
            if ret == 0:
                s.tokens.extend(job.request.prompt[span.start:span.end])
                st["media_tokens_total"] += span.n_tokens
                job.progress(len(s.tokens))
                span.release()
                span.embd = None  # the cache keeps them a while
                return
            self.L.llama_memory_seq_rm(self.m.mem, s.id, pos, -1)
            if ret == 2:
                return  # interrupted (a save, a clear, a close): read again later
            if ret == 1 and attempt == 0 and self._clear_idle_cells():
                continue
            break
        log.error("decoding a %s of %d tokens failed (%d)", span.kind, span.n_tokens, ret)
        self._fail(job, ReplicaFault(MEDIA_FAILED))

    def _release_media(self, job) -> None:
        """Free the libmtmd chunks of ``job``'s spans that the encoder does
        not hold (those go when its result comes back)."""
        for sp in getattr(job.request, "media", ()):
            if sp.media_id not in self._in_flight:
                sp.release()

    def _drain_media(self) -> None:
        """Wait for the encoder (before the projector is freed)."""
        futures: list[Future] = list(self._in_flight.values())
        if futures:
            wait(futures)
        if self._encoded:
            self._collect_encoded()
        self._embd_cache.clear()
        self._embd_bytes = 0


__all__ = ["MEDIA_FAILED", "MediaSteps"]
