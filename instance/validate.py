"""Checks of client requests for the built-in instance, before any of them
reaches llama.cpp.

A request that llama.cpp cannot take must be answered 400 naming the field
and the rule, never crash the replica or come back as a 500 with Python
internals (issue 11: an out-of-vocabulary id given to ``/detokenize``
aborted the process in ``std::out_of_range``; a 40 kB grammar of nested
groups overflowed the stack; ``"a"{3,2}`` exhausted memory; a schema with
``minLength: 10**8`` took 3.2 GB). Everything here is pure: plain request
dicts and ints (``n_vocab``, ``n_ctx``) in, checked values out, so that
today's llama-cpp-python backend (``instance/llama.py``) and the batching
engine (``instance/engine/loop.py``) share one set of rules. Every check raises
:class:`BadRequest`; its ``param`` is the field's path (OpenAI's error
``param``).

Rules follow OpenAI's API reference where it has one (types and ranges of
sampling fields, ``logit_bias`` from -100 to 100, at most 2048 embedding
inputs), llama.cpp's server where the field is its own (``grammar``,
``json_schema``, ``mirostat``, the ``[[id, bias]]`` form of
``logit_bias``), and llama.cpp's grammar parser for grammars. Grammars,
JSON schemas and forced tool calls have their own module,
:mod:`ggmux.instance.grammar.structured` (checks of GBNF syntax:
:mod:`ggmux.instance.grammar.gbnf`).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields

import orjson


class BadRequest(ValueError):
    """The request is invalid for this model (answered with 400).

    ``param``: the field it is about, as a path (``"messages[2].content"``),
    or None; ``fields``: more of the error envelope (llama-server's
    ``exceed_context_size_error`` type with ``n_prompt_tokens`` and
    ``n_ctx``)."""

    def __init__(self, message: str, param: str | None = None,
                 fields: dict | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.fields = fields or {}

    def error_fields(self) -> dict:
        """The error envelope's fields beside ``message`` (``param``, and a
        ``type`` of llama-server's where it has one of its own)."""
        return {"param": self.param, **self.fields}


@dataclass(slots=True, frozen=True)
class RequestLimits:
    """Work one request may ask of an instance (counts, bytes).

    ``max_embedding_inputs``: inputs of one embeddings request (OpenAI's
    limit is 2048 too); ``max_grammar_bytes``: size of a request's GBNF
    grammar, of its JSON schema (as JSON) and of the grammar the schema
    becomes; ``max_grammar_depth``: nested ``(`` groups in a grammar
    (llama.cpp's parser recurses once per group and overflowed an 8 MiB
    stack at 20,000); ``max_grammar_repetitions``: the largest repetition a
    grammar (``{m,n}``) or a schema (``minLength``, ``maxItems``, ...; counts
    nested in a ``pattern`` multiply) may ask for, since each one is written
    out in full (llama.cpp itself refuses ``{m,n}`` over 2000);
    ``max_schema_depth``: nesting of subschemas in a JSON schema;
    ``max_stops``: stop strings a request may give (OpenAI allows 4,
    llama-server any number; 64 lets SillyTavern-style group chats name
    every speaker, and matching costs the same whatever the count:
    :mod:`ggmux.instance.engine.stops`), ``max_stop_bytes``: UTF-8 bytes of one
    stop string (text that may become one is held back from the stream,
    so this bounds that lag too); ``max_tokens_limit``: tokens one request
    may generate, ``max_tokens`` above it refused (0: up to the context;
    llama-server has no limit, issue 18 finding 10: four requests without
    one held every slot of a model for six minutes; 32768 passes the
    largest limits common clients send, Claude Code's 32000 and Qwen3's
    recommended 32768 for reasoning). Media (a model with a multimodal
    projector): ``max_media_items`` images and audio clips in one request;
    ``max_media_bytes`` bytes of one, as sent (decoded from base64);
    ``max_image_pixels`` pixels of one decoded image, read from its header
    before anything is decoded (a few hundred bytes of PNG can declare
    50,000 x 50,000 pixels: 7.5 GB once decoded); ``max_audio_seconds``
    length of one clip, likewise from its header (16 kHz float samples:
    64 kB a second).
    """

    max_embedding_inputs: int = 2048
    max_grammar_bytes: int = 256 * 1024
    max_grammar_depth: int = 2048
    max_grammar_repetitions: int = 2000
    max_schema_depth: int = 64
    max_stops: int = 64
    max_stop_bytes: int = 256
    max_tokens_limit: int = 32768
    max_media_items: int = 16
    max_media_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 40_000_000
    max_audio_seconds: int = 600


_LIMIT_HELP = {
    "max_embedding_inputs": "inputs of one embeddings request; more get 400",
    "max_grammar_bytes": "largest grammar or JSON schema of one request (and the grammar the "
                         "schema becomes), bytes; larger get 400",
    "max_grammar_depth": "most nested groups in a request's grammar (llama.cpp parses each one "
                         "recursively); deeper get 400",
    "max_grammar_repetitions": "largest repetition a request's grammar ({m,n}) or JSON schema "
                               "(minLength, maxItems, pattern counts) may ask for; more get 400 "
                               "(llama.cpp itself refuses {m,n} over 2000)",
    "max_schema_depth": "most nested subschemas in a request's JSON schema; deeper get 400",
    "max_stops": "stop strings of one request (stop, Anthropic stop_sequences, Ollama "
                 "options.stop); more get 400 naming the field (OpenAI allows 4 and "
                 "llama-server any number; 64 covers group chats that name every speaker, and "
                 "matching costs the same per token whatever the count)",
    "max_stop_bytes": "longest stop string, UTF-8 bytes; longer get 400",
    "max_tokens_limit": "most tokens one request may generate (0: up to the context); a "
                        "request asking for more (max_tokens, n_predict, num_predict) gets 400, "
                        "one asking for none stops there (a preset's max-tokens-limit wins); "
                        "32768 passes the largest limits common clients send (Claude Code's "
                        "32000, Qwen3's recommended 32768 for reasoning) while a runaway request "
                        "on a long context stops; a shared model serving short answers wants "
                        "less",
    "max_media_items": "images and audio clips in one request (a model with a projector); "
                       "more get 400",
    "max_media_bytes": "largest image or audio clip, bytes as sent (after base64); larger get 400",
    "max_image_pixels": "most pixels of one image, read from its header before it is decoded; "
                        "more get 400",
    "max_audio_seconds": "longest audio clip, seconds, read from its header before it is "
                         "decoded; longer get 400",
}
CACHE_SCOPES = ("key", "global", "none")
"""``--cache-scope`` values: whose prompt cache a request may reuse (its own
tenant's, anyone's, nobody's; issue 18, finding 6)."""

# limits where 0 means "none" (the others must be at least 1)
_ZERO_IS_NONE = frozenset(("max_tokens_limit",))


def add_request_limit_options(
    parser: argparse.ArgumentParser, defaults: RequestLimits | None = None
) -> None:
    """One option per :class:`RequestLimits` field (``--max-embedding-inputs``,
    ``--max-grammar-bytes``, ...) in a "request limits" group; read them back
    with :func:`request_limits_from_args`."""
    d = defaults if defaults is not None else RequestLimits()
    group = parser.add_argument_group("request limits (built-in instance)")
    for name, help_ in _LIMIT_HELP.items():
        group.add_argument("--" + name.replace("_", "-"), dest=name,
                           type=_count if name in _ZERO_IS_NONE else _positive_int,
                           default=getattr(d, name), metavar="N",
                           help=help_ + " (default: %(default)s)")


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """:class:`RequestLimits` from :func:`add_request_limit_options` options."""
    return RequestLimits(**{f.name: getattr(args, f.name) for f in fields(RequestLimits)
                            if hasattr(args, f.name)})


def request_limit_argv(limits: RequestLimits) -> list[str]:
    """Options that recreate ``limits`` in an instance (only those that
    differ from the defaults, so an instance's command line stays short)."""
    argv: list[str] = []
    default = RequestLimits()
    for f in fields(RequestLimits):
        if getattr(limits, f.name) != getattr(default, f.name):
            argv += ["--" + f.name.replace("_", "-"), str(getattr(limits, f.name))]
    return argv


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {v}")
    return v


def _count(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {v}")
    return v


# ---- small type checks ---------------------------------------------------

def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def shown(v) -> str:
    """A value as the client wrote it (JSON), shortened for a message."""
    if isinstance(v, dict):
        return "an object"
    if isinstance(v, list):
        return "a list"
    text = orjson.dumps(v).decode()
    return text if len(text) <= 40 else text[:37] + "..."


def function_parameters(params, field: str) -> dict:
    """A function tool's ``parameters`` as the schema its arguments are
    generated by, which is always an object schema: a function's arguments
    are one JSON object (what every tool-call format writes, and what
    Anthropic's ``input`` and Ollama's ``arguments`` must be), so a schema
    that let the grammar write a string or ``null`` would make the answer
    untranslatable, a replica's 502 for a client's choice. None or ``{}``:
    an object of no declared properties; no ``type``: ``"object"`` added
    (llama-server takes such schemas); another ``type`` (a list naming
    ``"object"`` becomes it): :class:`BadRequest`, as OpenAI refuses it."""
    if params is None or params == {}:
        return {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise BadRequest(f"{field} must be a JSON schema object", field)
    kind = params.get("type")
    if kind == "object":
        return params
    if kind is None or (isinstance(kind, list) and "object" in kind):
        return {**params, "type": "object"}
    raise BadRequest(f"{field} must be a JSON schema of type \"object\" (a function's "
                     f"arguments are one object), not type {shown(kind)}", field)


# ---- sampling fields ------------------------------------------------------

# field -> (low, high), inclusive
_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
            "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
            "repeat_penalty": (0.0, 10.0), "typical_p": (0.0, 1.0), "tfs_z": (0.0, 1.0),
            "mirostat_tau": (0.0, 100.0), "mirostat_eta": (0.0, 1.0),
            "dry_multiplier": (0.0, 100.0), "dry_base": (0.0, 100.0)}
MAX_TOP_LOGPROBS = 20
"""Most alternatives per token a request may ask for, ``top_logprobs``
(OpenAI's own limit) and llama.cpp's ``n_probs`` alike (issue 37, item 10:
``n_probs: 100000`` sent the whole 49,152-token vocabulary per token,
150 MB for 32 tokens, and slowed another tenant's stream 4x)."""
# field -> (low, high or None)
_INTEGERS = {"max_tokens": (0, None), "max_completion_tokens": (0, None), "top_k": (0, 2**31 - 1),
             "seed": (-(2**63), 2**64 - 1), "top_logprobs": (0, MAX_TOP_LOGPROBS),
             "n_probs": (0, MAX_TOP_LOGPROBS), "n": (1, None),
             "mirostat": (0, 2), "mirostat_mode": (0, 2), "n_predict": (-1, None),
             "repeat_last_n": (-1, None), "dry_allowed_length": (0, 2**31 - 1),
             "dry_penalty_last_n": (-1, None)}
_BOOLEANS = ("stream", "echo")
MAX_DRY_BREAKERS = 64
"""Most ``dry_sequence_breakers`` of one request (llama.cpp reads at most
40 characters of each; the sampler's set-up grows with them, its work
per token does not)."""
_STRINGS = ("suffix", "user")


def check_sampling(body: dict, max_n: int = 1) -> None:
    """Types and ranges of the sampling fields of a chat or completion
    request, as OpenAI checks them (``mirostat_*`` and ``tfs_z`` as
    llama.cpp defines them), so that a client mistake is a 400 naming the
    field (llama-cpp-python would fail inside ctypes with a 500). A field
    given as ``null`` counts as not given. ``n`` must be at most ``max_n``
    (the batching engine serves each choice in a slot). ``stream`` and
    ``echo`` must be booleans (a string would be taken as true). Raises
    :class:`BadRequest`."""
    for k, (lo, hi) in _NUMBERS.items():
        v = body.get(k)
        if v is not None and (not _is_number(v) or not lo <= v <= hi):
            raise BadRequest(f"'{k}' must be a number from {lo:g} to {hi:g}, not {shown(v)}", k)
    for k, (lo, hi) in _INTEGERS.items():
        v = body.get(k)
        if v is None:
            continue
        if not is_int(v) or v < lo or (hi is not None and v > hi):
            rule = (f">= {lo}" if hi is None else "of 64 bits" if hi > 2**32 else
                    f"from {lo} to {hi}")
            raise BadRequest(f"'{k}' must be an integer {rule}, not {shown(v)}", k)
    if body.get("n") not in (None, 1) and body["n"] > max_n:
        raise BadRequest("'n' > 1 is not supported (one generation per request)" if max_n == 1
                         else f"'n' must be from 1 to {max_n} (the instance's slots)", "n")
    for k in _BOOLEANS:
        v = body.get(k)
        if v is not None and not isinstance(v, bool):
            raise BadRequest(f"'{k}' must be true or false, not {shown(v)}", k)
    for k in _STRINGS:
        v = body.get(k)
        if v is not None and not isinstance(v, str):
            raise BadRequest(f"'{k}' must be a string, not {shown(v)}", k)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
        isinstance(stop, list) and all(isinstance(x, str) for x in stop)
    ):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    opts = body.get("stream_options")
    if opts is not None and not (isinstance(opts, dict) and isinstance(
            opts.get("include_usage", False), bool)):
        raise BadRequest("'stream_options' must be an object whose 'include_usage' is true or "
                         "false", "stream_options")
    dsb = body.get("dry_sequence_breakers")
    if dsb is not None and not (isinstance(dsb, list) and 0 < len(dsb) <= MAX_DRY_BREAKERS and all(
            isinstance(x, str) and 0 < len(x) <= 40 for x in dsb)):
        raise BadRequest(f"'dry_sequence_breakers' must be a non-empty list of at most "
                         f"{MAX_DRY_BREAKERS} strings of 1 to 40 characters", "dry_sequence_breakers")
    lp = body.get("logprobs")
    if lp is not None and not isinstance(lp, bool) and not (is_int(lp) and 0 <= lp <= 5):
        raise BadRequest("'logprobs' must be true or false (chat) or an integer from 0 to 5 "
                         "(completions)", "logprobs")


# ---- request limits of the decode thread -----------------------------------

STOP_FIELDS = "'stop' (Anthropic's stop_sequences, Ollama's options.stop)"


def stop_strings(body: dict, limits: RequestLimits) -> list[str]:
    """The request's ``stop`` as a list (a string is one), checked against
    ``limits.max_stops`` and ``limits.max_stop_bytes`` (issue 18, finding
    2: a request with 100,000 stop strings slowed every other client's
    stream fivefold). The Anthropic and Ollama adapters hand theirs on as
    ``stop``, so the message names all three. Raises :class:`BadRequest`."""
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(x, str) for x in stops):
        raise BadRequest("'stop' must be a string or a list of strings", "stop")
    if len(stops) > limits.max_stops:
        raise BadRequest(f"{STOP_FIELDS} has {len(stops)} strings, over the limit of "
                         f"{limits.max_stops} per request (--max-stops)", "stop")
    for i, x in enumerate(stops):
        n = len(x.encode("utf-8", "surrogatepass"))
        if n > limits.max_stop_bytes:
            raise BadRequest(f"{STOP_FIELDS}[{i}] is {n} bytes, over the limit of "
                             f"{limits.max_stop_bytes} bytes per stop string "
                             "(--max-stop-bytes)", f"stop[{i}]")
    return stops


LIMIT_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict")


def generation_limit(body: dict, limits: RequestLimits, default: int = -1) -> int | None:
    """Tokens the request may generate: its ``max_tokens`` (else
    ``max_completion_tokens``, else llama.cpp's ``n_predict``; a value of 0
    or -1 asks for no limit), else ``default`` (llama-server's
    ``--n-predict``; -1: none), and never more than
    ``limits.max_tokens_limit`` (0: no limit). None: up to the context.
    A request asking for more than the limit is refused, so that no client
    can hold a slot for longer than the operator allows (issue 18, finding
    10). Raises :class:`BadRequest` naming the field and the option."""
    cap = limits.max_tokens_limit
    for k in LIMIT_FIELDS:
        v = body.get(k)
        if not is_int(v):
            continue
        if v > 0:
            if cap and v > cap:
                raise BadRequest(
                    f"'{k}' is {v}, over this server's limit of {cap} generated tokens per "
                    "request (--max-tokens-limit; the same for Anthropic's max_tokens and "
                    "Ollama's options.num_predict)", k)
            return v
        break
    if default > 0:
        return min(default, cap) if cap else default
    return cap or None


# ---- token ids ------------------------------------------------------------

def token_ids(tokens, n_vocab: int, field: str) -> list[int]:
    """``tokens`` checked as a list of token ids of a model with ``n_vocab``
    tokens (0 to n_vocab - 1; llama.cpp aborts the process on any other,
    ``std::out_of_range``). Raises :class:`BadRequest` naming the first bad
    element (``tokens[0]: 999999999 is not a token id of this model
    (vocabulary size 49152)``)."""
    if not isinstance(tokens, list):
        raise BadRequest(f"'{field}' must be a list of token ids, not {shown(tokens)}", field)
    for i, t in enumerate(tokens):
        if not is_int(t):
            raise BadRequest(f"{field}[{i}]: {shown(t)} is not a token id (an integer)",
                             f"{field}[{i}]")
        if not 0 <= t < n_vocab:
            raise BadRequest(f"{field}[{i}]: {t} is not a token id of this model (vocabulary "
                             f"size {n_vocab})", f"{field}[{i}]")
    return tokens


def completion_prompt(body: dict, n_vocab: int) -> str | list[int]:
    """The ``prompt`` of a completion: a string or a non-empty list of token
    ids (a list holding one of those is taken as that one; OpenAI's batch of
    several prompts is refused, one generation per request)."""
    p = body.get("prompt")
    field = "prompt"
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p, field = p[0], "prompt[0]"
    if isinstance(p, str):
        return p
    if isinstance(p, list) and p and all(is_int(t) for t in p):
        return token_ids(p, n_vocab, field)
    if isinstance(p, list) and not p:
        raise BadRequest(f"'{field}' is an empty list of token ids", field)
    raise BadRequest(f"'{field}' must be a string or a list of token ids (one prompt per "
                     f"request), not {shown(p)}", field)


def logit_bias(body: dict, n_vocab: int,
               tokenize: Callable[[str], list[int]] | None = None) -> dict[int, float] | None:
    """``logit_bias`` as ``{token id: bias}``: OpenAI's object of token ids
    (as strings) to numbers from -100 to 100, or llama.cpp's list of
    ``[id, bias]`` pairs; a bias of ``false`` bans the token (-inf). As
    llama-server (``tools/server/server-schema.cpp``), a key or first item
    that is a text, not a token id, biases every token of that text
    (``tokenize(text)``: without special tokens; refused when None). None
    when not given. Raises :class:`BadRequest`."""
    lb = body.get("logit_bias")
    if lb is None:
        return None
    if isinstance(lb, dict):
        pairs = list(lb.items())
    elif isinstance(lb, list) and all(isinstance(p, list) and len(p) == 2 for p in lb):
        pairs = [(p[0], p[1]) for p in lb]
    else:
        raise BadRequest("'logit_bias' must be an object mapping token ids to numbers from "
                         f"-100 to 100, not {shown(lb)}", "logit_bias")
    out: dict[int, float] = {}
    for k, v in pairs:
        key = k if is_int(k) else int(k) if isinstance(k, str) and re.fullmatch(
            r"-?[0-9]{1,12}", k) else None
        if key is None and isinstance(k, str) and k and tokenize is not None:
            keys = tokenize(k)
        elif key is None:
            raise BadRequest(f"logit_bias: {shown(k)} is not a token id", "logit_bias")
        elif not 0 <= key < n_vocab:
            raise BadRequest(f"logit_bias: {key} is not a token id of this model (vocabulary "
                             f"size {n_vocab})", f"logit_bias[{key}]")
        else:
            keys = [key]
        if v is False:
            v = float("-inf")
        elif not _is_number(v) or not -100 <= v <= 100:
            raise BadRequest(f"logit_bias[{shown(k)}] must be a number from -100 to 100 or "
                             f"false, not {shown(v)}", f"logit_bias[{k}]")
        for t in keys:
            out[t] = float(v)
    return out


# ---- chat messages ------------------------------------------------------

ROLES = frozenset(("system", "developer", "user", "assistant", "tool"))


def chat_messages(messages) -> list[dict]:
    """OpenAI chat messages as llama-cpp-python's templates take them:
    content parts (``[{"type": "text", "text": ...}]``, what many clients
    send) are joined into one string. Each message needs a known ``role``
    and a string (or text parts) ``content``: ``null`` content, which
    OpenAI allows beside ``tool_calls``, is refused, since the chat
    templates render content as text. Raises :class:`BadRequest` naming
    the message."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", "messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'",
                             f"messages[{i}]")
        if msg["role"] not in ROLES:
            raise BadRequest(f"messages[{i}].role {shown(msg['role'])} is not one of "
                             f"{', '.join(sorted(ROLES))}", f"messages[{i}].role")
        if msg.get("name") is not None and not isinstance(msg["name"], str):
            raise BadRequest(f"messages[{i}].name must be a string", f"messages[{i}].name")
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in ("text", "input_text"):
                    raise BadRequest(f"messages[{i}].content[{j}]: only text parts are "
                                     "supported", f"messages[{i}].content[{j}]")
                if not isinstance(part.get("text"), str):
                    raise BadRequest(f"messages[{i}].content[{j}]: a text part needs a string "
                                     "'text'", f"messages[{i}].content[{j}]")
                texts.append(part["text"])
            msg = {**msg, "content": "".join(texts)}
        elif not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string or a list of text parts, "
                             f"not {shown(content)}", f"messages[{i}].content")
        out.append(msg)
    return out


# ---- embeddings, tokenize, detokenize -------------------------------------

def embedding_inputs(body: dict, n_vocab: int, limits: RequestLimits) -> list[str | list[int]]:
    """The inputs of an embeddings request, each a non-empty string or a
    non-empty list of token ids: OpenAI's ``input`` is a string, a list of
    strings, a list of token ids (one input) or a list of such lists; at
    most ``limits.max_embedding_inputs`` of them. ``truncate`` must be a
    boolean, ``encoding_format`` ``float`` or ``base64``; ``dimensions``
    cannot be honoured. Raises :class:`BadRequest`."""
    inp = body.get("input")
    if isinstance(inp, str):
        inputs: list = [inp]
    elif isinstance(inp, list) and inp and all(is_int(t) for t in inp):
        inputs = [inp]
    elif isinstance(inp, list) and inp:
        inputs = inp
    else:
        raise BadRequest("'input' must be a non-empty string, list of strings, list of token "
                         f"ids or list of token-id lists, not {shown(inp)}", "input")
    if len(inputs) > limits.max_embedding_inputs:
        raise BadRequest(f"'input' has {len(inputs)} inputs, over the limit of "
                         f"{limits.max_embedding_inputs} per request (--max-embedding-inputs)",
                         "input")
    one = len(inputs) == 1 and inputs[0] is inp
    for i, x in enumerate(inputs):
        where = "input" if one else f"input[{i}]"
        if isinstance(x, str):
            if not x:
                raise BadRequest(f"{where} is an empty string", where)
        elif isinstance(x, list):
            if not x:
                raise BadRequest(f"{where} is an empty list of token ids", where)
            token_ids(x, n_vocab, where)
        else:
            raise BadRequest(f"{where}: {shown(x)} is neither a string nor a list of token ids",
                             where)
    if body.get("truncate") is not None and not isinstance(body["truncate"], bool):
        raise BadRequest("'truncate' must be true or false", "truncate")
    if body.get("encoding_format") not in (None, "float", "base64"):
        raise BadRequest("'encoding_format' must be \"float\" or \"base64\"", "encoding_format")
    if body.get("dimensions") is not None:
        raise BadRequest("'dimensions' is not supported (the model's vectors have one size)",
                         "dimensions")
    return inputs


def fit_embedding_input(tokens: list[int], n_max: int, truncate: bool, field: str) -> list[int]:
    """``tokens`` of one embedding input cut to ``n_max`` when ``truncate``
    was asked, else checked to fit (a 400, where llama-cpp-python cut it
    silently)."""
    if len(tokens) <= n_max:
        return tokens
    if truncate:
        return tokens[:n_max]
    raise BadRequest(f"{field} is {len(tokens)} tokens, over this model's {n_max} per input "
                     "(send \"truncate\": true to cut it)", field)


def tokenize_request(body: dict) -> tuple[str, bool, bool]:
    """llama.cpp ``/tokenize``: ``(content, add_special, with_pieces)``."""
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest(f"'content' must be a string, not {shown(content)}", "content")
    flags = []
    for k in ("add_special", "with_pieces"):
        v = body.get(k, False)
        if not isinstance(v, bool):
            raise BadRequest(f"'{k}' must be true or false, not {shown(v)}", k)
        flags.append(v)
    return content, flags[0], flags[1]
