"""The built-in instance backend: a GGUF model served by the batching engine.

OpenAI requests become engine requests here: chat messages go through the
model's chat template (:mod:`.chat`), sampling fields become a
:class:`~ggmux.instance.engine.sampling.Sampling`, grammars and JSON schemas a GBNF
grammar (:mod:`.structured`, with the request limits), and the engine's
events come back as OpenAI answers (:mod:`.answers`). Every field is checked
by :mod:`.validate` before llama.cpp sees it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from . import protocol
from .answers import Answer, Extras, embedding_answer
from .backend import Backend, Sink
from .builtin_templates import render_builtin
from .cache.tiers import CacheSettings
from .chat import ChatTemplate
from .checkpoint_hints import delimiter_starts, user_starts
from .engine import Embedding, Engine, Generation, InvalidRequest
from .engine.jobs import deliver
from .engine.model import EngineConfig
from .grammar.structured import (
    forced_tool,
    grammar_text,
    response_schema,
    schema_grammar,
    structured_output,
)
from .kv_events import kv_events_hook
from .llama_args import llama_kwargs
from .measure_model import measure_model, model_parts
from .media import requests as media_req
from .messages import chat_messages as jinja_messages
from .messages import refuse_media
from .prefill import continuation
from .prompts import Batch, MediaPrompt, embedding_forms, native_prompts
from .reasoning import REASONING_FORMATS
from .settings import default_sampling, generation_settings
from .tools.request import tool_request
from .tools.stream import ChatStream
from .validate import (
    BadRequest,
    chat_messages,
    check_sampling,
    completion_prompt,
    embedding_inputs,
    fit_embedding_input,
    generation_limit,
    is_int,
    logit_bias,
    request_limits_from_args,
    stop_strings,
    token_ids,
    tokenize_request,
)

__all__ = ["BadRequest", "LlamaBackend", "chat_messages", "check_sampling", "llama_kwargs",
           "model_parts"]

log = logging.getLogger(__name__)

POOLING_TYPES = {"none": 0, "mean": 1, "cls": 2, "last": 3, "rank": 4}
"""llama-server's ``--pooling`` names -> llama.cpp's ``LLAMA_POOLING_TYPE_*``."""


def cache_settings(args, kw: dict) -> CacheSettings:
    """The KV tiers' options: the instance's flags (``--cache-ram`` ...),
    then a preset's (``kw``, from :func:`~.llama_args.llama_kwargs`; the
    ``cache_*`` keys are taken out of it)."""
    c = CacheSettings()
    for flag, key, name in (("cache_ram", "cache_ram", "ram_mib"),
                            ("cache_disk", "cache_disk", "disk_dir"),
                            ("cache_disk_max", "cache_disk_max", "disk_max_gib"),
                            ("cache_save_timeout", "cache_save_timeout", "save_timeout"),
                            ("cache_checkpoints", "cache_checkpoints", "checkpoints"),
                            ("cache_checkpoint_max", "cache_checkpoint_max", "checkpoint_mib")):
        v = kw.pop(key, None)
        if v is None:
            v = getattr(args, flag, None)
        if v is not None:
            setattr(c, name, v)
    c.disk_dir = c.disk_dir or None
    c.disk_max_gib = max(0.0, c.disk_max_gib)
    c.save_timeout = max(0.0, c.save_timeout)
    c.checkpoint_mib = max(0, c.checkpoint_mib)
    c.checkpoints = max(0, c.checkpoints)
    return c


class LlamaBackend(Backend):
    """Serves chat, completions and embeddings with the batching engine
    (:class:`~ggmux.instance.engine.loop.Engine`) on ``--parallel`` slots.

    ``start`` checks a request and submits it; its answer is built from
    the engine's events (on the server's loop once :meth:`use_loop` is
    called, else on the decode thread) and handed to the server's sink.
    ``native`` requests (llama.cpp's ``/completion``) are answered in
    llama.cpp's own shape (:class:`~ggmux.instance.answers.Extras`)."""

    native_answers = True

    def __init__(self, args) -> None:
        self.args = args
        self.path = args.model
        self.name = args.name or os.path.basename(args.model).rsplit(".", 1)[0]
        self.limits = request_limits_from_args(args)
        self.media_fetch = bool(getattr(args, "media_fetch", False))
        self.engine = None
        self.template = None
        self.slots = self._config().parallel
        self._deliver = None  # the engine's per-step hand-off (use_loop)
        self._marker_ids: dict[str, list[int]] = {}  # a user-turn marker's tokens

    def _config(self):
        kw = llama_kwargs(getattr(self.args, "llama_args", []) or [])
        self.chat_format = kw.pop("chat_format", None)
        self.chat_template_file = kw.pop("chat_template_file", None)
        self.jinja = kw.pop("jinja", True)
        # llama-server's --verbose: every answer carries __verbose
        self.verbose = kw.pop("verbose", False)
        # llama-server's --pooling: the context's pooling; "none" (a vector per
        # token) has no OpenAI answer: embeddings requests get a 400
        self.pooling = kw.pop("pooling", None)
        if self.pooling in POOLING_TYPES:
            kw["pooling"] = POOLING_TYPES[self.pooling]
        elif self.pooling is not None:
            log.warning("ignoring --pooling %s: not one of %s", self.pooling,
                        ", ".join(POOLING_TYPES))
        self.sampling_defaults = kw.pop("sampling", {})
        # llama-server's -n: the tokens a request that gives no limit generates
        self.n_predict = kw.pop("n_predict", -1)
        # a preset's reasoning-format (llama-server's option) over ggmux serve's
        rf = kw.pop("reasoning_format", None) or getattr(self.args, "reasoning_format", None)
        if rf not in REASONING_FORMATS:
            log.warning("ignoring --reasoning-format %s: not one of %s", rf,
                        ", ".join(REASONING_FORMATS))
            rf = "deepseek"
        self.reasoning_format = rf
        cfg = EngineConfig(self.path, ctx_size=self.args.ctx_size,
                           n_gpu_layers=self.args.n_gpu_layers,
                           kv_size=getattr(self.args, "kv_size", 0) or 0,
                           cache_scope=getattr(self.args, "cache_scope", "global"),
                           cache=cache_settings(self.args, kw))
        cfg.cache.model_name = self.name  # model.json names the registry's model (issue 37)
        cfg.mmproj = getattr(self.args, "mmproj", None) or None
        if self.args.threads:
            cfg.n_threads = self.args.threads
        for k, v in kw.items():
            if k in ("seed",) and v is not None and v < 0:
                continue  # llama.cpp: -1 = random
            if hasattr(cfg, k):
                setattr(cfg, k, v)
        cfg.parallel = max(1, cfg.parallel)
        for name in ("ctx_checkpoints", "checkpoint_min_step"):  # a preset's value
            if getattr(cfg, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be 0 or more, "
                                 f"not {getattr(cfg, name)}")
        return cfg

    def measure(self) -> dict:
        """The memory a load needs and what the model is
        (:func:`~.measure_model.measure_model`)."""
        return measure_model(self.path, self.args, self._config())

    def load(self) -> dict:
        # the weights' progress as llama-server reports it to its router
        self.engine = Engine(self._config(), on_progress=protocol.LoadProgress())
        self.engine.deliver = self._deliver
        self.engine.kv_events = kv_events_hook(self.args, self.name, self.engine)
        info = self.engine.load()
        e = self.engine
        special = e.special_tokens()
        source = None
        if self.chat_template_file:  # llama-server reads it at start; a bad path ends the load
            with open(self.chat_template_file, encoding="utf-8") as f:
                source = f.read()
        self.template = ChatTemplate(e.metadata, e.token_text(special["bos"]),
                                     e.token_text(special["eos"]), special["eos"],
                                     self.chat_format, self._raw_tokenize, source, self.jinja)
        return {"n_ctx": info["n_ctx"], "slots": info["slots"], "kv_size": info["kv_size"]}

    def use_loop(self, loop) -> None:
        """Answers are built on ``loop``'s thread: the engine hands a step's
        events there in one call, and its decode thread goes on."""
        def hand_off(batch: list) -> None:
            loop.call_soon_threadsafe(deliver, batch)

        self._deliver = hand_off
        if self.engine is not None:
            self.engine.deliver = hand_off

    def _raw_tokenize(self, raw: bytes, add_special: bool, parse_special: bool) -> list[int]:
        # what a chat template renders: a prompt, bounded by the context (issue 37, item 1)
        return self.engine.tokenize_prompt(raw.decode("utf-8", "replace"), add_special,
                                           parse_special)

    def sleep(self) -> None:
        if self.engine is not None:
            self.engine.sleep()

    def wake(self) -> dict:
        info = self.engine.wake()
        return {"n_ctx": info["n_ctx"], "slots": info["slots"], "kv_size": info["kv_size"]}

    def close(self, reason: str) -> None:
        if self.engine is not None:
            self.engine.close(reason)
            if self.engine.kv_events is not None:
                self.engine.kv_events.close()

    def refuse_queued(self, reason: str) -> None:
        """Requests still waiting for a slot end with ``("error", reason)``."""
        if self.engine is not None:
            self.engine.refuse_waiting(reason)

    # ---- requests -----------------------------------------------------------
    def start(self, kind: str, body: dict, sink: Sink, request_id: str = "",
              tenant: str = "") -> Callable[[], None]:
        try:
            if kind == "embedding":
                job = self._embedding(body, sink, request_id, tenant)
            elif kind == "native":
                job = self._native(body, sink, request_id, tenant)
            else:
                job = self._generation(kind, body, sink, request_id, tenant)
        except InvalidRequest as e:
            fields = e.error_fields() if hasattr(e, "error_fields") else None
            raise BadRequest(str(e), fields=fields) from None
        return job.cancel

    def _model(self, body: dict) -> str:
        return body["model"] if isinstance(body.get("model"), str) else self.name

    def _native(self, body: dict, sink: Sink, request_id: str, tenant: str):
        """llama.cpp's ``/completion``: each of its prompts (:mod:`.prompts`)
        a generation of its own; several are answered as a list."""
        prompts = native_prompts(body.get("prompt", body.get("content")),
                                 lambda t, special: self.engine.tokenize_prompt(t, special, True),
                                 self.engine.n_vocab, self._native_media)
        if len(prompts) == 1:
            return self._generation("completion", body, sink, request_id, tenant, prompts[0])
        if body.get("stream") is True:
            raise BadRequest("several prompts in one streamed /completion are not supported "
                             "(send them as requests of their own)", "prompt")
        return Batch(prompts, sink, lambda p, one: self._generation(
            "completion", body, one, request_id, tenant, p))

    def _native_media(self, p: dict, field: str) -> MediaPrompt:
        """A ``/completion`` prompt object with ``multimodal_data``."""
        text, refs = media_req.native_refs(p, field, self.engine.media_marker)
        tokens, spans = media_req.tokens(self.engine, text, refs, True, self.limits,
                                         self.media_fetch)
        out = MediaPrompt(tokens)
        out.media = spans
        return out

    def _media_tokenizer(self, media, spans: list) -> Callable[[str, bool], list[int]] | None:
        """A prompt tokenizer for messages whose media ``media`` (a
        :class:`~ggmux.instance.messages.MediaParts`) collected; the spans
        go to ``spans``. None without media."""
        if media is None or not media.refs:
            return None

        def tokenize(text: str, add_bos: bool) -> list[int]:
            tokens, got = media_req.tokens(self.engine, text, media.refs, add_bos, self.limits,
                                           self.media_fetch)
            spans.extend(got)
            return tokens
        return tokenize

    def _generation(self, kind: str, body: dict, sink: Sink, request_id: str, tenant: str = "",
                    native: list[int] | None = None):
        """Check and submit one chat or completion; ``native``: the prompt of
        a llama.cpp ``/completion``, answered in llama.cpp's shape."""
        check_sampling(body, max_n=self.slots)
        n_vocab = self.engine.n_vocab
        tool = None
        echo = None
        parser = None
        preserved: frozenset[int] = frozenset()
        triggers: tuple[list[str], list[int]] = ([], [])
        lazy = False
        hints: tuple[int, ...] = ()
        spans: list = []  # the prompt's media spans (a model with a projector)
        if kind == "chat" and self.template.jinja is not None:
            media = media_req.collector(self.engine, body.get("messages"))
            messages = jinja_messages(body.get("messages"), self._model(body), media)
            messages, prefill = continuation(body, messages)
            gbnf = structured_output(body, self.limits)
            req = tool_request(body, self.limits, self.reasoning_format,
                               response_schema(body) if gbnf is not None else None)
            if req.calls_tools and body.get("grammar") is not None:
                raise BadRequest("'grammar' cannot be combined with tools (give tool_choice "
                                 "\"none\" or no grammar)", "grammar")
            cp = self.template.chat(messages, req, prefill, self._media_tokenizer(media, spans))
            plan = cp.plan
            if plan.grammar is not None:
                gbnf = grammar_text(plan.grammar, self.limits, "tools")
                lazy = plan.lazy
                triggers = (cp.trigger_patterns, cp.trigger_tokens)
            prompt, stops = cp.tokens, list(plan.stops)
            if self.engine.checkpoints_wanted:  # user messages' starts (issue 35)
                hints = self._user_starts(messages, plan.prompt, prompt, req.tools, spans)
            preserved = cp.preserved
            fmt = cp.fmt
            parser = lambda: ChatStream(fmt, plan)
        elif kind == "chat":
            media = media_req.collector(self.engine, body.get("messages"))
            if media is None:
                refuse_media(body.get("messages"), self._model(body))
                messages = chat_messages(body.get("messages"))
            else:
                messages = jinja_messages(body.get("messages"), self._model(body), media)
            rest, prefill = continuation(body, messages)
            if self.template.builtin is not None:  # llama.cpp's: the prefill as llama-server's
                messages = rest
            tool = forced_tool(body, self.limits)
            gbnf = structured_output(body, self.limits)
            if tool is not None:
                if gbnf is not None:
                    raise BadRequest("a forced tool call cannot be combined with a grammar or "
                                     "JSON schema", "tool_choice")
                gbnf = schema_grammar(tool["parameters"], self.limits, "tool_choice")
            prompt, stops = self.template.prompt(messages, tool, prefill,
                                                 self._media_tokenizer(media, spans))
        elif native is not None:
            gbnf = structured_output(body, self.limits)
            prompt, stops = native, []
            spans = list(getattr(native, "media", ()))
        else:
            gbnf = structured_output(body, self.limits)
            p = completion_prompt(body, n_vocab)
            prompt = self.engine.tokenize_prompt(p) if isinstance(p, str) else p
            stops = []
            if body.get("echo"):
                echo = p if isinstance(p, str) else self.engine.detokenize(p, special=False)
        stops = stop_strings(body, self.limits) + stops
        lp = body.get("logprobs")
        if kind == "chat":
            if lp is not None and not isinstance(lp, bool):
                raise BadRequest("'logprobs' of a chat request must be true or false (the "
                                 "number of alternatives is 'top_logprobs')", "logprobs")
            top = (body.get("top_logprobs") or 0) if lp else None
        elif native is not None:  # llama.cpp's n_probs: that many alternatives of each token
            n_probs = body.get("n_probs")
            top = int(n_probs) if is_int(n_probs) and n_probs > 0 else None
        else:
            top = None if lp is None or lp is False else (0 if lp is True else int(lp))
        max_tokens = generation_limit(body, self.limits, self.n_predict)
        stream = body.get("stream") is True
        sampling = self._sampling(body, gbnf, n_vocab)
        if lazy:
            sampling.grammar_lazy = True
            sampling.grammar_patterns, sampling.grammar_tokens = triggers
        # a seeded draw repeats only if the logits do to the last digit: reusing a
        # cached prefix evaluates the prompt's end in another batch shape, which
        # changes them slightly, and a draw over the whole vocabulary feels it
        seeded = sampling.seed is not None and sampling.temperature > 0
        gen = Generation(prompt, sampling, max_tokens=max_tokens,
                         stop=stops, n=body.get("n") or 1,
                         ignore_eos=body.get("ignore_eos") is True,
                         cache_prompt=body.get("cache_prompt") is not False and not seeded,
                         logprobs=top, request_id=request_id, tenant=tenant,
                         preserved=preserved,
                         return_progress=body.get("return_progress") is True and stream,
                         post_sampling_probs=native is not None
                         and body.get("post_sampling_probs") is True, checkpoint_at=hints,
                         media=tuple(spans))
        opts = body.get("stream_options") or {}
        settings = generation_settings(
            sampling, max_tokens or -1, self.engine.cfg.seed if sampling.seed is None
            else sampling.seed, stream=stream, n_probs=top or 0, ignore_eos=gen.ignore_eos,
            timings_per_token=body.get("timings_per_token") is True,
            post_sampling_probs=gen.post_sampling_probs, reasoning_format=self.reasoning_format)
        extras = Extras(native=native is not None, verbose=self.verbose if body.get("verbose") is None
                        else body.get("verbose") is True,
                        timings_per_token=body.get("timings_per_token") is True,
                        settings=settings,
                        prompt=lambda: media_req.shown(self.engine, prompt, gen.media))
        answer = Answer(sink, kind, self._model(body), gen.n, stream=stream,
                        include_usage=opts.get("include_usage") is True,
                        logprobs=None if top is None else "native" if native is not None
                        else kind,
                        tool=tool["name"] if tool else None, echo=echo, parser=parser,
                        extras=extras)
        job = self.engine.submit(gen, answer.on_event)
        answer.job = job
        return job

    def _user_starts(self, messages: list[dict], text: str, prompt: list[int], tools,
                     spans: list) -> tuple[int, ...]:
        """Where the chat's user messages start in ``prompt`` (checkpoints
        and batch cuts there): where its tokens hold the template's user-turn
        marker, as llama-server finds its message spans (so both read the
        prompt in the same batches); else, for a template llama-server parses
        with its own code, where the messages' texts are
        (:mod:`.checkpoint_hints`)."""
        marker = self.template.user_marker(bool(tools))
        if marker:
            ids = self._marker_ids.get(marker)
            if ids is None:
                ids = self._marker_ids[marker] = self.engine.tokenize(marker, False, True)
            return delimiter_starts(prompt, ids)
        bos = not (self.template.bos and text.startswith(self.template.bos))
        hints = user_starts(messages, text, lambda t: self.engine.count_tokens(t, bos, True),
                            self.engine.cfg.checkpoint_min_step)
        if spans:  # counted on text: exact up to the first media item only
            hints = tuple(h for h in hints if h <= spans[0].start)
        return hints

    def _sampling(self, body: dict, gbnf: str | None, n_vocab: int):
        s = default_sampling(self.sampling_defaults)  # --temp, --top-k, ...
        s.grammar = gbnf
        # a text key is biased token by token, as llama-server tokenizes it
        s.logit_bias = logit_bias(body, n_vocab, lambda t: self.engine.tokenize(t, False, False))
        s.logit_bias = s.logit_bias or {}
        for k in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
                  "presence_penalty", "frequency_penalty", "mirostat_tau", "mirostat_eta"):
            if body.get(k) is not None:
                setattr(s, k, float(body[k]))
        if body.get("top_k") is not None:
            s.top_k = body["top_k"]
        mode = body.get("mirostat", body.get("mirostat_mode"))
        if mode is not None:
            s.mirostat = mode
        last_n = body.get("repeat_last_n")
        if is_int(last_n) and last_n >= -1:
            # no request holds more than n_ctx tokens: a longer window is the
            # same window, and llama.cpp allocates it whole (2**31 aborted)
            s.repeat_last_n = self.engine.n_ctx if last_n == -1 else min(last_n, self.engine.n_ctx)
        if body.get("dry_multiplier") is not None:
            s.dry_multiplier = float(body["dry_multiplier"])
        if body.get("dry_base") is not None and body["dry_base"] >= 1.0:
            s.dry_base = float(body["dry_base"])  # llama-server: below 1, the server's own
        if is_int(body.get("dry_allowed_length")):
            s.dry_allowed_length = body["dry_allowed_length"]
        if is_int(body.get("dry_penalty_last_n")):
            s.dry_penalty_last_n = body["dry_penalty_last_n"]
        if s.dry_penalty_last_n == -1:  # llama-server: the slot's whole context
            s.dry_penalty_last_n = self.engine.n_ctx
        if body.get("dry_sequence_breakers") is not None:
            s.dry_sequence_breakers = list(body["dry_sequence_breakers"])
        seed = body.get("seed")
        if seed is not None and seed >= 0:
            s.seed = seed
        return s

    def _embedding(self, body: dict, sink: Sink, request_id: str, tenant: str = ""):
        e = self.engine
        if self.pooling == "none":
            raise BadRequest("Pooling type 'none' is not OAI compatible. Please use a different "
                             "pooling type (this server runs with --pooling none: no pooled "
                             "vector per input)", "input")
        body = {**body, "input": embedding_forms(body.get("input"),
                                                 lambda t, special: e.tokenize(t, special, True),
                                                 e.n_vocab)}
        inputs = embedding_inputs(body, e.n_vocab, self.limits)
        truncate = bool(body.get("truncate"))
        n_max = min(e.n_ctx, e.m.n_batch) if e.m.pooled else e.n_ctx
        batch = []
        for i, x in enumerate(inputs):
            tokens = e.tokenize(x) if isinstance(x, str) else x
            field = "input" if len(inputs) == 1 else f"input[{i}]"
            batch.append(fit_embedding_input(tokens, n_max, truncate, field))
        model, encoding = self._model(body), body.get("encoding_format")

        def on_event(ev: tuple) -> None:
            if ev[0] == "done":
                if ev[2].get("cancelled"):
                    sink("error", "cancelled")
                else:
                    sink("result", embedding_answer(model, vectors, ev[1], encoding))
            elif ev[0] == "embedding":
                vectors.append(ev[2])
            elif ev[0] == "error":
                sink("error", ev[1])

        vectors: list[list[float]] = []
        return e.submit(Embedding(batch, request_id, tenant), on_event)

    def tokenize(self, body: dict) -> dict:
        """llama-server's ``/tokenize``; with ggmux's ``"count_only": true``
        (what the proxy sends for Anthropic's ``count_tokens``) the answer is
        ``{"n_tokens": N}``, no list of ids to build, send and parse
        (issue 31, item 1)."""
        content, add_special, with_pieces = tokenize_request(body)
        if body.get("count_only") is True:
            return {"n_tokens": self.engine.count_tokens(content, add_special=add_special)}
        tokens = self.engine.tokenize(content, add_special=add_special, parse_special=True)
        if not with_pieces:
            return {"tokens": tokens}
        out = []
        for t in tokens:
            raw = self.engine.m.piece(t, True)
            try:
                piece: str | list[int] = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)  # llama.cpp: the bytes of a partial character
            out.append({"id": t, "piece": piece})
        return {"tokens": out}

    def apply_template(self, body: dict) -> dict:
        """The prompt text a chat body renders to (llama-server's
        ``/apply-template``: the template with the tools and the format's
        system message, ``add_generation_prompt`` true unless given), for
        counting a request's tokens. A model without a Jinja template
        answers with the text its chat handler would tokenize. Media
        (a model with a projector) stand as the media marker."""
        media = media_req.collector(self.engine, body.get("messages"))
        if self.template.jinja is None:
            messages = (chat_messages(body.get("messages")) if media is None
                        else jinja_messages(body.get("messages"), self._model(body), media))
            rest, prefill = continuation(body, messages)
            if self.template.builtin is not None:
                return {"prompt": render_builtin(self.template.builtin, rest) + (prefill or "")}
            tokens, _ = self.template.prompt(messages, None)
            return {"prompt": self.engine.detokenize(tokens, special=True)}
        messages = jinja_messages(body.get("messages"), self._model(body), media)
        messages, prefill = continuation(body, messages)
        gbnf = structured_output(body, self.limits)
        req = tool_request(body, self.limits, self.reasoning_format,
                           response_schema(body) if gbnf is not None else None)
        _, plan = self.template.render(messages, req, prefill)
        return {"prompt": plan.prompt}

    def input_tokens(self, body: dict) -> dict:
        """As :meth:`Backend.input_tokens`, counting without listing the ids;
        media count as the embeddings the projector makes of them (each
        decoded and preprocessed, as a request would be, never encoded)."""
        prompt = self.apply_template(body)["prompt"]
        media = media_req.collector(self.engine, body.get("messages"))
        if media is not None:
            jinja_messages(body.get("messages"), self._model(body), media)  # the references
            add_bos = not (self.template.bos and prompt.startswith(self.template.bos))
            tokens, spans = media_req.tokens(self.engine, prompt, media.refs, add_bos,
                                             self.limits, self.media_fetch)
            for sp in spans:
                sp.release()
            return {"input_tokens": len(tokens)}
        return {"input_tokens": self.engine.count_tokens(prompt, add_special=True)}

    def detokenize(self, body: dict) -> dict:
        tokens = token_ids(body.get("tokens"), self.engine.n_vocab, "tokens")
        return {"content": self.engine.detokenize(tokens, special=True)}

    def props(self) -> dict:
        e = self.engine
        loaded = e is not None and not e.asleep
        return {
            "model_alias": self.name,
            "model_path": self.path,
            "n_ctx": e.n_ctx if loaded else self.args.ctx_size,
            "kv_size": e.kv_size if loaded else 0,
            "total_slots": self.slots,
            "chat_template": self.template.template if self.template else "",
            # llama-server's: what the model reads beside text, and the marker that
            # stands for a media item in /completion's prompt_string
            "modalities": {**(e.modalities() if loaded else {"vision": False, "audio": False}),
                           "video": False},
            "media_marker": (e.media_marker if loaded else None) or "",
        }

    def slot_info(self) -> list[dict]:
        return self.engine.slot_info() if self.engine is not None else []

    def cache_report(self) -> dict:
        return self.engine.cache_report() if self.engine is not None else super().cache_report()

    def cache_clear(self) -> dict:
        return self.engine.cache_clear() if self.engine is not None else super().cache_clear()

    def save_cache(self) -> int:
        return self.engine.persist() if self.engine is not None else 0

    def cache_save_timeout(self) -> float:
        c = self.engine.cache if self.engine is not None else None
        return c.settings.save_timeout if c is not None and c.disk is not None else 0.0

    def metrics(self) -> dict:
        return self.engine.metrics() if self.engine is not None else {}

