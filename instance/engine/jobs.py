"""Requests to the engine and the handle of a submitted one.

:class:`Generation` and :class:`Embedding` are what the HTTP side builds
from a request body (in tokens); :meth:`Engine.submit
<ggmux.instance.engine.Engine.submit>` returns a :class:`Job`, whose events
(below) go to a callback or queue up for
:meth:`Job.result`. No llama.cpp here.

Events, tuples whose first item names them:

* ``("text", choice, text, logprobs)``: more text of one choice (``logprobs``
  a list of per-token dicts when asked for, else None);
* ``("end", choice, finish_reason)``: the choice ended (``stop``, ``length``);
* ``("embedding", index, vector)``: one input's embedding (list of floats);
* ``("progress", dict, timings)``: prompt evaluation so far, when the
  request asked for it, and the timings then (:meth:`Job.progress`);
* ``("done", usage, timings)``: the request ended (also after a cancel);
* ``("error", message)``: the request failed (the engine is stopping, or a
  decode failed); nothing follows.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .sampling import Sampling

log = logging.getLogger(__name__)


RAISE_CTX = ("raise it with 'ctx-size = N' in the model's preset section or "
             "'ggmux serve --ctx-size N' (0: the model's own)")
"""How a user raises the context: the end of every over-the-context error."""


class InvalidRequest(ValueError):
    """The request cannot be served as given (a prompt longer than the
    context, a bad token id, ``n`` above the slot count, a bad grammar):
    the client's fault, answered with 400."""


class ContextExceeded(InvalidRequest):
    """The prompt does not fit the context: llama-server's
    ``exceed_context_size_error`` (400 with ``n_prompt_tokens`` and
    ``n_ctx``, ``tools/server/server-common.cpp``)."""

    def __init__(self, message: str, n_prompt_tokens: int, n_ctx: int) -> None:
        super().__init__(message)
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def error_fields(self) -> dict:
        """The error envelope's fields beside ``message``."""
        return {"type": "exceed_context_size_error", "code": 400,
                "n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx}


class EngineError(RuntimeError):
    """A request failed inside the engine (``result()`` raises it)."""


class EngineAsleep(EngineError):
    """The weights are freed (``sleep``); answered with 503 until ``wake``."""


class EngineStopped(EngineError):
    """The engine was closed; nothing more is served."""


@dataclass(slots=True)
class Generation:
    """A completion request in tokens. ``max_tokens`` None or <= 0 means
    up to the context (llama-cpp-python's rule); more than the context
    allows is cut to it. ``stop`` strings end a choice and are not part of
    its text. ``logprobs`` None: none; k >= 0: the chosen token's and the k
    best (with ``post_sampling_probs``, llama-server's: probabilities left by
    the sampler chain, ``prob`` and ``top_probs``, instead of the model's
    log-probabilities). ``cache_prompt`` False evaluates the whole prompt again.
    ``tenant``: who asked (the proxy's ``x-ggmux-tenant``, ``""`` for
    none): slots are shared round robin by tenant, and the engine's
    ``cache_scope`` may keep a tenant's prompt cache its own.

    ``preserved``: special tokens whose text the answer shows (a tool-call
    format's markers, llama-server's ``preserved_tokens``); other control
    tokens show as nothing.

    ``media``: the prompt's images and audio
    (:class:`~ggmux.instance.media.spans.MediaSpan`, in order), whose
    placeholder ids are in ``prompt``; the engine reads their embeddings
    where their spans start (:mod:`.media_steps`)."""

    prompt: list[int]
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None
    stop: list[str] | tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    cache_prompt: bool = True
    logprobs: int | None = None
    request_id: str = ""
    tenant: str = ""
    preserved: frozenset[int] = frozenset()
    return_progress: bool = False  # ("progress", ...) events while the prompt is evaluated
    post_sampling_probs: bool = False  # logprobs as probabilities after the sampler chain
    checkpoint_at: tuple[int, ...] = ()  # user-message starts (token counts): checkpoints there
    media: tuple = ()  # the prompt's media spans (media.spans.MediaSpan), in order


@dataclass(slots=True)
class Embedding:
    """One embedding per input (token lists, each at most the context)."""

    inputs: list[list[int]]
    request_id: str = ""
    tenant: str = ""


class Job:
    """A submitted request. ``cancel()`` (any thread) ends it at the next
    step. Without an ``on_event`` callback its events queue up and
    ``result()`` gathers them."""

    def __init__(self, request, on_event: Callable[[tuple], None] | None, jid: int,
                 kick: Callable[[], None], outbox: list | None = None) -> None:
        self.id = jid
        self.request = request
        self._kick = kick
        self.cancelled = False
        self.ended = False
        self.queue: queue.SimpleQueue | None = None
        if on_event is None:
            self.queue = queue.SimpleQueue()
            on_event = self.queue.put
        self._on_event = on_event
        self._outbox = outbox  # the engine's events of this step: (job, event)
        self.samplers: list = []
        self.stops = None  # the request's StopStrings automaton (a Generation)
        self.sampling = 0  # tokens being drawn on worker threads (its samplers are in use)
        self.slots: list = []  # the engine's slots serving it
        self.left = 0
        self.footprint = 0
        self.max_gen = 0
        self.n_cached = 0
        self.n_checkpoint = 0  # of the cached prompt tokens, those a context checkpoint served
        self.n_decoded = 0
        self.n_drafted = 0  # draft tokens verified (speculative decoding)
        self.drafts = False  # speculative decoding is on: draft_n is reported, 0 included
        self.no_drafts = False  # this request never drafts (media in its slot's tokens)
        self.n_draft_accepted = 0  # of those, accepted
        self.t_submit = time.monotonic()
        self.t_start = 0.0
        self.t_first = 0.0
        self.n_read = 0  # prompt tokens in the slot so far (cached ones too)
        self.t_read = 0.0  # when the last prompt batch was read (0: none yet)
        self.restore = None  # a KV tier's entry to restore into its slot (cache_steps.Hit)
        self.cache_tier = ""  # where its cached prompt tokens came from: slot, ram, disk

    def emit(self, event: tuple) -> None:
        """Queue one event for the consumer (decode thread): the engine
        hands a step's events on together (:func:`deliver`); a job made
        without an outbox hands it on at once."""
        if self._outbox is None:
            self.dispatch(event)
        else:
            self._outbox.append((self, event))

    def dispatch(self, event: tuple) -> None:
        """Run the consumer's callback on one event (any one thread at a
        time, in the order emitted); a consumer that raises is logged,
        never allowed to stop the engine."""
        try:
            self._on_event(event)
        except Exception:
            log.exception("event callback of job %d failed", self.id)

    def progress(self, processed: int) -> None:
        """A ``("progress", {"total", "cache", "processed", "time_ms"},
        timings)`` event when the request asked for it: prompt tokens in the
        slot so far (llama-server's ``return_progress``,
        ``result_prompt_progress``) and :meth:`timings` at that moment."""
        r = self.request
        if processed > self.n_cached:  # a batch was read (the first call: the cached part)
            self.n_read, self.t_read = processed, time.monotonic()
        if getattr(r, "return_progress", False):  # with the timings as of now
            now = time.monotonic()
            self.emit(("progress", {"total": len(r.prompt), "cache": self.n_cached,
                                    "processed": processed,
                                    "time_ms": int((now - self.t_start) * 1000)},
                       self.timings(now)))

    def cancel(self) -> None:
        """End the request at the next step; its slots are freed."""
        self.cancelled = True
        self._kick()

    def result(self, timeout: float | None = None) -> dict:
        """Wait for the end and gather the events: ``{"choices": [{"text",
        "finish_reason", "logprobs"}], "usage", "timings"}`` or, for an
        embedding request, ``{"embeddings", "usage", "timings"}``. Raises
        :class:`EngineError` on an ``error`` event, ``queue.Empty`` past
        ``timeout`` seconds."""
        assert self.queue is not None, "result() needs a job submitted without on_event"
        deadline = None if timeout is None else time.monotonic() + timeout
        n = getattr(self.request, "n", 1)
        texts = [[] for _ in range(n)]
        logprobs: list[list] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        embeddings: dict[int, list[float]] = {}
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ev = self.queue.get(timeout=left)
            kind = ev[0]
            if kind == "text":
                texts[ev[1]].append(ev[2])
                if ev[3]:
                    logprobs[ev[1]].extend(ev[3])
            elif kind == "end":
                reasons[ev[1]] = ev[2]
            elif kind == "embedding":
                embeddings[ev[1]] = ev[2]
            elif kind == "error":
                raise EngineError(ev[1])
            elif kind == "done":
                if isinstance(self.request, Embedding):
                    return {"embeddings": [embeddings[i] for i in sorted(embeddings)],
                            "usage": ev[1], "timings": ev[2]}
                choices = [{"text": "".join(texts[i]), "finish_reason": reasons[i],
                            "logprobs": logprobs[i] if self.request.logprobs is not None else None}
                           for i in range(n)]
                return {"choices": choices, "usage": ev[1], "timings": ev[2]}

    def usage(self) -> dict:
        """OpenAI's ``usage`` (``prompt_tokens_details.cached_tokens``: prompt
        tokens reused from the slot's cache or a KV tier; ``checkpoint_tokens``:
        of them, those a context checkpoint served, present when any did:
        issue 35; ``image_tokens``/``audio_tokens``: the prompt's media
        embeddings, counted in ``prompt_tokens``, present when it had any)."""
        r = self.request
        if isinstance(r, Embedding):
            n = sum(len(x) for x in r.inputs)
            return {"prompt_tokens": n, "total_tokens": n}
        n = len(r.prompt)
        details = {"cached_tokens": self.n_cached}
        if self.n_checkpoint:
            details["checkpoint_tokens"] = self.n_checkpoint
        for sp in r.media:  # OpenAI's audio_tokens, and image_tokens beside it
            key = f"{sp.kind}_tokens"
            details[key] = details.get(key, 0) + sp.n_tokens
        return {"prompt_tokens": n, "completion_tokens": self.n_decoded,
                "total_tokens": n + self.n_decoded, "prompt_tokens_details": details}

    def timings(self, now: float) -> dict:
        """llama-server's ``timings`` (milliseconds): ``queue_ms`` (waiting
        for a slot or KV), ``prompt_n``/``prompt_ms`` (prompt tokens
        evaluated, time to the first token; while the prompt is read, the
        batches read so far and the time to the last of them, 0 before the
        first, as ``server_slot_stats``), ``cache_n``,
        ``predicted_n``/``predicted_ms`` (tokens generated, time after the
        first); ``checkpoint_n`` (of ``cache_n``, the tokens a context
        checkpoint served; present when one did); with speculative decoding, ``draft_n`` and
        ``draft_n_accepted`` (draft tokens verified, and accepted: llama-server's
        ``server_slot_stats``; 0 and 0 when speculation is on and nothing was
        drafted)."""
        started = self.t_start > 0
        out = {"queue_ms": _ms((self.t_start if started else now) - self.t_submit)}
        if isinstance(self.request, Embedding):
            out.update(prompt_n=self.n_decoded, prompt_ms=_ms(now - self.t_start) if started else 0.0)
            return out
        first = self.t_first > 0
        if first:
            prompt_n, prompt_ms = len(self.request.prompt) - self.n_cached, _ms(
                self.t_first - self.t_start)
        elif self.t_read and started:
            prompt_n, prompt_ms = self.n_read - self.n_cached, _ms(self.t_read - self.t_start)
        else:
            prompt_n, prompt_ms = 0, 0.0
        out.update(cache_n=self.n_cached, prompt_n=prompt_n, prompt_ms=prompt_ms,
                   predicted_n=self.n_decoded,
                   predicted_ms=_ms(now - self.t_first) if first else 0.0)
        if self.cache_tier:
            out["cache_tier"] = self.cache_tier
        if self.n_checkpoint:
            out["checkpoint_n"] = self.n_checkpoint
        if self.n_drafted or self.drafts:
            # 0 when nothing was drafted: a user checking that speculation is
            # on sees it is, and that it drafted nothing (issue 37)
            out.update(draft_n=self.n_drafted, draft_n_accepted=self.n_draft_accepted)
        return out


def deliver(batch: list[tuple[Job, tuple]]) -> None:
    """Dispatch ``(job, event)`` pairs in order (one engine step's events,
    on whatever thread the engine's ``deliver`` hook runs this)."""
    for job, event in batch:
        job.dispatch(event)


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)
