"""The built-in instance's engine: parallel slots with continuous batching.

One llama context holds ``kv_size`` tokens of KV cache (default ``ctx_size
x parallel``) shared by ``parallel`` slots; slot ``i`` is llama sequence
``i``. One decode thread runs llama-server's ``update_slots`` loop
(``tools/server/server-context.cpp``) as a few named steps:

1. ``_reap``: cancelled requests leave their slots (a client that left
   frees its slot at the next step);
2. ``_admit``: queued requests take free slots, round robin by tenant
   (:mod:`ggmux.instance.engine.fairness`: the oldest request of the tenant
   holding the fewest slots goes first). A request goes to the free slot
   whose cached tokens share the longest prefix with its prompt
   (llama-server's ``cache_prompt``; below ``slot_prompt_similarity`` of
   the prompt, the least recently used slot) and only the rest is
   evaluated; with ``cache_scope`` ``key`` only a slot whose cache its own
   tenant made counts, with ``none`` no cache is reused (issue 18, finding
   6: ``cached_tokens`` told one client another's prompt). It starts only
   when every running slot's
   *reservation* (prompt + the most tokens it may generate) and its own fit
   in the KV cache, evicting idle slots' caches first: a full cache makes
   new requests wait and never aborts a running one (llama.cpp #23652);
3. ``_generate``: one batch holds the pending token of every generating slot
   and then chunks of prompts still being read, up to ``n_batch`` tokens, so
   a long prompt never stops the others' tokens (chunked prefill); one
   ``llama_decode`` (:mod:`ggmux.instance.engine.generate_steps`); then every
   slot whose logits came out samples with its own ``llama_sampler`` chain
   (the greedy ones together, in one ``argmax``) and hands its text on
   (:mod:`ggmux.instance.engine.sample_steps`: a grammar's draw, whose cost grows
   with the grammar, runs on a worker thread while the others go on);
4. ``_embed``: one batch of embedding chunks, decoded with embeddings on.

``n > 1`` evaluates the prompt once and copies its KV to the other choices'
sequences (``llama_memory_seq_cp``: the cells are shared). There is no HTTP
here: requests are submitted from other threads (:meth:`Engine.submit`) and
their events come back through a callback. A step's events of every request
are handed on together at its end (issue 21: one hand-off per step, not one
per token): by default the decode thread runs the callbacks then (keep them
short and thread-safe); with :attr:`Engine.deliver` set (the instance's
server: one ``loop.call_soon_threadsafe`` per step) the callbacks run
wherever that hook sends the batch, off the decode thread.

The events a request's consumer gets are listed in :mod:`ggmux.instance.engine.jobs`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ..backend import ReplicaFault
from .admission import AdmissionSteps, tenant_of
from .batch import Batch
from .cache_steps import CacheSteps
from .checkpoints import CheckpointSteps
from .embedding import EmbeddingSteps
from .fairness import FairQueue
from .generate_steps import GenerateSteps
from .interrupt import Interrupt
from .jobs import (
    RAISE_CTX,
    ContextExceeded,
    Embedding,
    EngineAsleep,
    EngineError,
    EngineStopped,
    Generation,
    InvalidRequest,
    Job,
    deliver,
)
from .media_steps import MediaSteps
from .model import EngineConfig, ModelContext
from .model_lock import ModelLock
from .sample_steps import SampleSteps
from .sampling import SamplerError, Sampling, sampler_chain
from .slots import EMBED, ENCODE, IDLE, SAMPLE, STATE_NAMES, Slot
from .speculation import make_drafter, spec_summary
from .stops import StopStrings
from .token_calls import TokenCalls
from .tokenizing import read_facts_soon
from .verify_steps import VerifySteps

log = logging.getLogger(__name__)

PREFILL_WAIT_SHARE = 0.05
"""An idle engine waits for more requests at most this share of the
expected prefill time of those it holds (:meth:`Engine._gather`): a lone
request's TTFT grows by at most 5%."""

__all__ = ["Embedding", "Engine", "EngineAsleep", "EngineConfig", "EngineError",
           "EngineStopped", "Generation", "InvalidRequest", "Job", "Sampling"]


class Engine(AdmissionSteps, CacheSteps, CheckpointSteps, EmbeddingSteps, GenerateSteps,
             MediaSteps, SampleSteps, TokenCalls, VerifySteps):
    """Continuous batching over ``parallel`` slots of one llama context; see
    the module docstring. Life cycle: ``load()``, then ``submit`` from any
    thread, ``sleep()``/``wake()`` to free and restore the weights,
    ``close()`` to end (queued and running requests get an ``error``).

    ``deliver``: None, or ``deliver(batch)`` called on the decode thread
    once per step with that step's events, ``[(job, event), ...]`` in
    order; it must return at once and later run
    :func:`~ggmux.instance.engine.jobs.deliver` on the batch, on one thread
    (e.g. ``lambda b: loop.call_soon_threadsafe(jobs.deliver, b)``)."""

    deliver: Callable[[list[tuple[Job, tuple]]], None] | None = None
    kv_events = None
    """None, or the :class:`~ggmux.instance.kv_events.KVEvents` hook (``--kv-events``):
    its ``sync(slots)`` runs on the decode thread once per loop turn."""

    def __init__(self, config: EngineConfig,
                 on_progress: Callable[[float], None] | None = None) -> None:
        """``on_progress``: called with the weights' load progress (0.0 ..
        1.0) while :meth:`load` or :meth:`wake` reads them."""
        import llama_cpp

        logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)  # llama.cpp's chatter
        self.L = llama_cpp
        self.cfg = config
        self.slots = [Slot(i) for i in range(max(1, config.parallel))]
        self.m = ModelContext(llama_cpp, config, len(self.slots), on_progress)
        self.drafter = make_drafter(llama_cpp, config, len(self.slots))
        self._cond = threading.Condition()
        # shared by readers (tokenizing, submit), exclusive for load/free (issue 37, item 1)
        self._model_lock = ModelLock()
        self._submitting = threading.Lock()  # submit's own state (_next_id)
        self._inbox: list[Job] = []
        self._waiting: FairQueue[Job] = FairQueue(tenant_of)
        self._kicked = False
        self._results: list = []  # tokens drawn on worker threads (sample_steps)
        self._outbox: list[tuple[Job, tuple]] = []  # this step's events (decode thread)
        self._close_reason: str | None = None
        self._refuse: str | None = None
        self._sleep_done: threading.Event | None = None
        self._asleep = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._next_id = 0
        self._batch: Batch | None = None
        self._interrupt = Interrupt()  # stops a decode for a save, a clear, a close
        self.stats = {"requests_total": 0, "prompt_tokens_total": 0, "prompt_seconds_total": 0.0,
                      "cached_tokens_total": 0, "predicted_tokens_total": 0,
                      "predicted_seconds_total": 0.0, "decode_calls_total": 0,
                      "decode_seconds_total": 0.0, "batch_tokens_total": 0,
                      "busy_slots_total": 0, "tokens_max": 0, "draft_tokens_total": 0,
                      "draft_accepted_total": 0, "draft_verifications_total": 0,
                      "checkpoints_made_total": 0, "checkpoints_restored_total": 0,
                      "checkpoint_bytes_made_total": 0, "checkpoint_tokens_total": 0,
                      "media_encoded_total": 0, "media_encode_seconds_total": 0.0,
                      "media_decode_seconds_total": 0.0, "media_tokens_total": 0,
                      "media_hold_seconds_total": 0.0}
        self._media_init()

    @property
    def n_ctx(self) -> int:
        """Tokens one request may hold (prompt and answer)."""
        return self.m.n_ctx

    @property
    def kv_size(self) -> int:
        """KV cache cells for all slots together."""
        return self.m.kv_size

    @property
    def metadata(self) -> dict[str, str]:
        return self.m.metadata

    # ---- model life cycle ---------------------------------------------------
    def load(self) -> dict:
        """Load the weights and create the context (caller's thread), start
        the decode thread. Returns ``{"n_ctx", "kv_size", "slots"}``. Raises
        RuntimeError when llama.cpp cannot load the file or make the context."""
        with self._model_lock.exclusive():
            self._load()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
            self._thread.start()
        return self.info()

    def info(self) -> dict:
        """``{"n_ctx", "kv_size", "slots"}`` of the loaded model."""
        return {"n_ctx": self.n_ctx, "kv_size": self.kv_size, "slots": len(self.slots)}

    def _load(self) -> None:
        self.m.load()
        self._interrupt.arm(self.L, self.m.ctx)
        if self.drafter is not None:
            try:
                self.drafter.load(self.m)
            except Exception:
                self.m.free()
                raise
            log.info("speculative decoding: %s", spec_summary(self.cfg.spec))
        self._open_cache()
        self._batch = Batch(self.L, self.m.n_batch, len(self.slots))
        for s in self.slots:
            s.tokens = []
            s.checkpoints = []
            s.t_used = 0.0
        self._asleep = False
        read_facts_soon(self._model_lock.shared, lambda: self.m.tokenizer)

    def _free(self) -> None:
        self._drain_media()  # the encoder reads the projector the model frees
        if self.drafter is not None:
            self.drafter.free()
        self.m.free()
        for s in self.slots:
            s.tokens = []
            s.checkpoints = []

    def sleep(self, timeout: float | None = None) -> bool:
        """Free the weights and the context once no request is queued or
        running (the decode thread does it between steps). Returns False if
        that did not happen within ``timeout`` seconds."""
        done = threading.Event()
        with self._cond:
            if self._asleep or self._closed:
                return True
            self._sleep_done = done
            self._cond.notify()
        return done.wait(timeout)

    def wake(self) -> dict:
        """Load the weights again after :meth:`sleep`; as :meth:`load`."""
        with self._model_lock.exclusive():
            if self._asleep:
                self._load()
        return self.info()

    @property
    def asleep(self) -> bool:
        return self._asleep

    def close(self, reason: str = "the model is being unloaded", timeout: float = 10.0) -> None:
        """End the engine: every queued and running request gets ``("error",
        reason)`` at the next step, then the context and weights are freed.
        Waits up to ``timeout`` seconds for the decode thread."""
        with self._cond:
            if self._close_reason is None:
                self._close_reason = reason
            self._interrupt.set()  # a long prompt step ends now, not at its end
            self._cond.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        elif t is None:
            with self._model_lock.exclusive():
                self._closed = True
                self._free()

    def refuse_waiting(self, reason: str) -> None:
        """Requests not yet started (queued for a slot or KV room) end now
        with ``("error", reason)``; running ones go on (a stop that lets
        them finish, issue 11: nothing accepted is dropped silently)."""
        with self._cond:
            self._refuse = reason
            self._cond.notify()

    def _check_loaded(self) -> None:
        if self._closed or self._close_reason is not None:
            raise EngineStopped("the engine is stopped")
        if self._asleep or not self.m.loaded:
            raise EngineAsleep("the model is asleep")

    # ---- submission ---------------------------------------------------------
    def submit(self, request: Generation | Embedding,
               on_event: Callable[[tuple], None] | None = None) -> Job:
        """Queue a request (any thread); returns its :class:`Job` at once.
        Raises InvalidRequest for a request this model cannot serve as
        given, EngineAsleep / EngineStopped when nothing is served."""
        # the stop strings' automaton: on the caller's thread, before the lock
        stops = StopStrings(request.stop) if isinstance(request, Generation) else None
        with self._model_lock.shared(), self._submitting:
            self._check_loaded()
            job = Job(request, on_event, self._next_id, self._kick, self._outbox)
            job.stops = stops
            job.drafts = self.drafter is not None and isinstance(request, Generation)
            self._next_id += 1
            if isinstance(request, Generation):
                self._prepare_generation(job, request)
            else:
                self._prepare_embedding(job, request)
            with self._cond:
                self._inbox.append(job)
                self._cond.notify()
        return job

    def _prepare_generation(self, job: Job, r: Generation) -> None:
        if self.m.pooled:
            raise InvalidRequest("this model is loaded for embeddings only")
        if not r.prompt:
            raise InvalidRequest("the prompt is empty")
        if r.media:
            self._check_media(r)
            job.drafts = False  # drafts are not made beside media (the draft model reads none)
        else:
            self.m.check_tokens(r.prompt, "prompt")
        if not isinstance(r.n, int) or not 1 <= r.n <= len(self.slots):
            raise InvalidRequest(f"'n' must be from 1 to {len(self.slots)} (the slot count)")
        room = self.n_ctx - len(r.prompt)
        if room < 1:
            raise ContextExceeded(f"the request exceeds the available context size: the prompt "
                                  f"has {len(r.prompt)} tokens; this model's context (ctx-size) "
                                  f"is {self.n_ctx} tokens per request; {RAISE_CTX}",
                                  len(r.prompt), self.n_ctx)
        self.m.check_tokens(list(r.sampling.logit_bias), "logit_bias")
        job.max_gen = room if r.max_tokens is None or r.max_tokens <= 0 else min(r.max_tokens, room)
        job.footprint = len(r.prompt) + job.max_gen
        if job.footprint * r.n > self.kv_size:
            raise InvalidRequest(f"n={r.n} choices of up to {job.footprint} tokens do not fit "
                                 f"the KV cache (kv-size {self.kv_size})")
        seed = r.sampling.seed
        try:
            for i in range(r.n):
                s = self.cfg.seed if seed is None else seed + i
                job.samplers.append(sampler_chain(
                    self.L, self.m.vocab, self.m.n_vocab, r.sampling, s,
                    r.logprobs or 0 if r.post_sampling_probs else 0))
        except SamplerError as e:
            self._free_samplers(job)
            raise InvalidRequest(str(e)) from None
        job.left = r.n

    def _kick(self) -> None:
        with self._cond:
            self._kicked = True
            self._cond.notify()

    # ---- observation --------------------------------------------------------
    def slot_info(self) -> list[dict]:
        """One dict per slot (llama-server's ``/slots`` fields plus ours):
        ``id``, ``id_task``, ``request_id``, ``tenant``, ``state``, ``is_processing``,
        ``n_ctx``, ``n_past`` (tokens in its KV), ``n_cached`` (prompt tokens
        its current or last request reused), ``n_decoded``. A snapshot read
        without locking, exact between steps."""
        out = []
        for s in self.slots:
            job = s.job
            out.append({"id": s.id, "id_task": job.id if job else -1,
                        "request_id": job.request.request_id if job else "",
                        "tenant": job.request.tenant if job else "",
                        "state": STATE_NAMES[s.state], "is_processing": s.state != IDLE,
                        "n_ctx": self.n_ctx, "n_past": len(s.tokens), "n_cached": s.n_cached,
                        "n_decoded": s.n_decoded})
        return out

    def metrics(self) -> dict:
        """Counters since load (tokens, seconds) and gauges: ``slots_busy``,
        ``slots_total``, ``queue_depth`` (requests waiting for a slot or KV),
        ``kv_used`` (cells reserved or cached, of ``kv_size``), ``kv_busy``
        (cells reserved by running requests: idle slots' caches are
        evictable), ``checkpoint_bytes`` (the slots' context checkpoints)."""
        busy = [s for s in self.slots if s.state != IDLE]
        reserved = sum(s.reserved for s in busy)
        used = reserved + sum(len(s.tokens) for s in self.slots if s.state == IDLE)
        return {**self.stats, "slots_busy": len(busy), "slots_total": len(self.slots),
                "queue_depth": len(self._waiting) + len(self._inbox),
                "kv_used": min(used, self.kv_size), "kv_size": self.kv_size,
                "kv_busy": min(reserved, self.kv_size),
                "checkpoint_bytes": self._ckpt_bytes()}

    # ---- the decode thread --------------------------------------------------
    def _busy(self) -> bool:
        """Whether any request is queued or running."""
        return bool(self._waiting) or any(s.state != IDLE for s in self.slots)

    def _runnable(self) -> bool:
        """Whether a step has work: a slot reading, generating or embedding
        (not only waiting for a worker's token), or a request queued while a
        slot is free."""
        free = False
        for s in self.slots:
            if s.state == IDLE:
                free = True
            elif s.state != SAMPLE and s.state != ENCODE:
                return True
        # a disk entry being read for the next request: its reader kicks when done
        return free and bool(self._waiting) and not (self.cache and self.cache.reading)

    def _idle(self) -> bool:
        """Whether no slot holds a request (nothing is read or generated)."""
        return all(s.state == IDLE for s in self.slots)

    def _gather(self) -> None:
        """With ``_cond`` held, on an idle engine: wait while requests keep
        arriving, each within :data:`PREFILL_WAIT_SHARE` of the expected
        prefill time of those gathered (this engine's measured seconds per
        prompt token, times the tokens no slot has cached:
        :meth:`_uncached`), and at most ``prefill_wait_ms`` in all, so
        requests sent together start in one prefill batch
        (:class:`EngineConfig`). Before the first prompt is measured, nothing
        waits. Why the uncached tokens, not the prompt's: a regenerated or
        edited turn reads a few tokens of a long cached prompt, and a wait
        sized by its whole prompt would be the whole ``prefill_wait_ms``
        added to a TTFT of a few decode steps."""
        st = self.stats
        if self.cfg.prefill_wait_ms <= 0 or st["prompt_tokens_total"] <= 0:
            return
        per_token = st["prompt_seconds_total"] / st["prompt_tokens_total"]
        end = time.monotonic() + self.cfg.prefill_wait_ms / 1000.0
        uncached: dict[int, int] = {}  # id(job) -> tokens to read, computed once
        while self._close_reason is None:
            n = len(self._inbox)
            tokens = 0
            for j in self._inbox:
                if isinstance(j.request, Generation):
                    if id(j) not in uncached:
                        uncached[id(j)] = self._uncached(j.request)
                    tokens += uncached[id(j)]
            left = min(PREFILL_WAIT_SHARE * tokens * per_token, end - time.monotonic())
            if left <= 0:
                return
            self._cond.wait(left)
            if len(self._inbox) == n:
                return

    def _run(self) -> None:
        try:
            while True:
                self._flush()
                if self.kv_events is not None:  # what the slots' caches hold now
                    self.kv_events.sync(self.slots)
                with self._cond:
                    while not (self._inbox or self._kicked or self._close_reason is not None
                               or self._sleep_done is not None or self._refuse is not None
                               or self._results or self._encoded or self._runnable()
                               or self._persist_done is not None
                               or self._clear_done is not None):
                        self._cond.wait()
                    if self._inbox and not self._waiting and self._idle():
                        self._gather()
                    self._waiting.extend(self._inbox)
                    self._inbox = []
                    kicked, self._kicked = self._kicked, False
                    reason = self._close_reason
                    refuse, self._refuse = self._refuse, None
                if reason is not None:
                    self._shutdown(reason)
                    self._flush()
                    if self.kv_events is not None:  # the slots' blocks are gone
                        self.kv_events.sync(self.slots)
                    return
                while refuse is not None and self._waiting:
                    self._fail(self._waiting.popleft(), refuse)
                if self._clear_done is not None:
                    self._do_clear()
                if self._persist_done is not None:
                    self._do_persist()
                if self._sleep_done is not None and not self._busy():
                    self._do_sleep()
                    continue
                if self._asleep:
                    continue
                self._step(kicked)
        except BaseException as e:  # a bug: fail every request rather than hang them
            log.exception("engine loop failed")
            self._shutdown(f"engine failure: {type(e).__name__}: {e}")
            self._flush()

    def _flush(self) -> None:
        """Hand this step's events on: to :attr:`deliver` in one call, or to
        their callbacks here."""
        out = self._outbox
        if not out:
            return
        batch = out.copy()
        out.clear()
        if self.deliver is None:
            deliver(batch)
            return
        try:
            self.deliver(batch)
        except Exception:  # the consumer's loop is gone: nobody is left to tell
            log.exception("handing %d events on failed", len(batch))

    def _do_sleep(self) -> None:
        with self._model_lock.exclusive():
            with self._cond:
                if self._inbox:  # a request came in: serve it first
                    return
                done, self._sleep_done = self._sleep_done, None
                self._asleep = True
            self._drain_samples()
            self._save_idle()  # the KV tiers keep the slots' caches past the sleep
            self._free()
        log.info("asleep: weights and KV cache freed")
        done.set()

    def _shutdown(self, reason: str) -> None:
        with self._model_lock.exclusive():
            with self._cond:
                self._waiting.extend(self._inbox)
                self._inbox = []
                self._closed = True
            for s in self.slots:
                if s.job is not None and not s.job.ended:
                    self._fail(s.job, reason)
            while self._waiting:
                self._fail(self._waiting.popleft(), reason)
            self._drain_samples()
            self._free()
            if self._sleep_done is not None:
                self._sleep_done.set()

    def _step(self, kicked: bool = True) -> None:
        self._collect()
        self._reap(kicked)
        self._drop_forgotten()  # a cache clear's slots that ran then (issue 37)
        self._admit()
        self._media()  # images and audio into their slots (one span a step)
        self._generate()
        self._flush()  # the tokens go out before an embedding batch decodes
        self._embed()

    def _reap(self, kicked: bool) -> None:
        for s in self.slots:
            if s.job is not None and s.job.cancelled and not s.job.ended:
                self._end_job(s.job, cancelled=True)
        # only a cancel kicks: the queue is looked through only after one
        if kicked and any(j.cancelled for j in self._waiting):
            for j in [j for j in self._waiting if j.cancelled]:
                self._waiting.remove(j)
                self._end_job(j, cancelled=True)

    def _clear(self, s: Slot) -> None:
        self._tier_save(s)  # an idle slot's cache about to go: into the KV tiers
        self.L.llama_memory_seq_rm(self.m.mem, s.id, -1, -1)
        s.tokens = []
        s.checkpoints = []
        s.t_used = 0.0

    # -- ends
    def _end_job(self, job: Job, cancelled: bool = False) -> None:
        """The request is over (all choices ended, or cancelled): free its
        slots and samplers, count it, send ``done``."""
        for s in job.slots:
            if s.job is job:
                if s.state == EMBED:
                    self._clear(s)
                s.release()
        job.ended = True
        self._free_samplers(job)
        self._release_media(job)
        usage, timings = job.usage(), job.timings(time.monotonic())
        st = self.stats
        st["prompt_tokens_total"] += timings["prompt_n"]
        st["prompt_seconds_total"] += timings["prompt_ms"] / 1000.0
        st["cached_tokens_total"] += timings.get("cache_n", 0)
        st["predicted_tokens_total"] += timings.get("predicted_n", 0)
        st["predicted_seconds_total"] += timings.get("predicted_ms", 0.0) / 1000.0
        if isinstance(job.request, Generation):  # the longest sequence a slot held
            st["tokens_max"] = max(st["tokens_max"], len(job.request.prompt) + job.n_decoded)
        if cancelled:
            timings["cancelled"] = True
        job.emit(("done", usage, timings))

    def _fail(self, job: Job, message: str | ReplicaFault) -> None:
        """End ``job`` with ``("error", message)``; a :class:`ReplicaFault`
        (a decode error) is the replica's own failure, answered so."""
        for s in job.slots:
            if s.job is job:
                s.release()
        job.ended = True
        self._free_samplers(job)
        self._release_media(job)
        job.emit(("error", message))

