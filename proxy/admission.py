"""Admission of a request by its key's limits (issue 36), and the spend of
priced replicas: the proxy's side of the key table
(:mod:`ggmux.shm.keytable`).

Per request of a key of the keys file (``req.key_row`` >= 0, set by the
key check, :meth:`KeyAdmission.row_of`):

* :meth:`KeyAdmission.may_use`: the key's ``models`` (names or globs,
  matched against the model's name and aliases); a model outside it gets
  403 (``model_not_allowed``), not 404: the model exists, and a 404 would
  send its user looking for a typo or a missing file rather than at the
  key; the message names no other model.
* :meth:`KeyAdmission.admit`: under the key row's lock, windows rolled,
  checks in this order: ``max-parallel`` (in flight), ``rpm``, ``tpm``
  (prompt + completion tokens), ``tokens-per-day|week|month`` (weighed),
  ``spend-per-month``; then counts the request (one request, one in
  flight, its reservation: the prompt's estimate, a quarter of its
  body's bytes, plus the most tokens it may generate,
  :func:`requested_tokens`, or the key's ``reserve-tokens``).
  A refusal is 429 with ``Retry-After`` (when the window resets):
  ``rate_limit_exceeded`` for the per-minute and in-flight limits,
  ``insufficient_quota`` for the budgets.
* :meth:`KeyAdmission.settle` at the request's end (the request ring's
  record, :class:`~ggmux.proxy.activity.Activity`): the reservation is
  replaced by the answer's usage in the windows it went into (unless they
  rolled since), the in-flight count drops, and the cost of a priced
  replica's answer is added to the month's spend.

Priced replicas (preset ``price-input``, ``price-cached-input``,
``price-output``: currency per million tokens; ``spend-per-day|week|month``
the model's budget): a ``cmd`` model's replicas and any model's
``upstream`` replicas; a built-in instance is never priced. Their spend is
per proxy and model in the key table's spend rows, summed over proxies;
once a period's spend reaches the budget they are dropped from the
model's candidates (:meth:`KeyAdmission.over_budget`), so the next tier
(the local replicas) serves, as an open circuit is skipped. A price of 0
never blocks.
"""

from __future__ import annotations

import fnmatch
import hashlib
import logging
import re
from dataclasses import dataclass

from ..shm.keytable import (
    K_ADMITTED,
    K_DAY,
    K_IN_FLIGHT,
    K_MINUTE,
    K_MONTH,
    K_REFUSED,
    K_REQS,
    K_SPEND_MONTH_NANO,
    K_TOK_DAY,
    K_TOK_MONTH,
    K_TOK_WEEK,
    K_TOKENS,
    K_WEEK,
    NANO,
    KeyTable,
    period_end,
    periods,
    roll,
    weighed,
)

log = logging.getLogger(__name__)

PROMPT_BYTES_PER_TOKEN = 4
"""The prompt's tokens are estimated at admission as its body's bytes / this
(English text runs 4 bytes a token); the answer's usage settles it."""
MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict")
MEDIA_TOKENS = 1024
"""An image's or audio clip's tokens at admission: what a projector makes of
one (Gemma 3: 256 embeddings, LLaVA 576, a 30 s clip 750, a large
dynamic-resolution image more), not its base64 bytes / 4 (a 1 MB image
would reserve 340,000 tokens); the answer's usage settles it."""
_MEDIA_PARTS = frozenset(("image_url", "input_image", "image", "input_audio"))


def _media(body: dict) -> tuple[int, int]:
    """``(bytes, items)`` of the media a request body carries: content parts
    of :data:`_MEDIA_PARTS` in ``messages`` or ``input``, Ollama's
    ``images`` (a message's or ``/api/generate``'s) and ``/completion``'s
    ``multimodal_data``; their bytes as their strings' lengths."""
    size = items = 0

    def strings(v) -> int:
        if isinstance(v, str):
            return len(v)
        if isinstance(v, dict):
            return sum(strings(x) for x in v.values())
        return 0

    def lists(v) -> None:
        nonlocal size, items
        if isinstance(v, list):
            for x in v:
                if isinstance(x, str):
                    size, items = size + len(x), items + 1
    for conv in (body.get("messages"), body.get("input")):
        if not isinstance(conv, list):
            continue
        for m in conv:
            if not isinstance(m, dict):
                continue
            lists(m.get("images"))
            content = m.get("content")
            if isinstance(content, list):
                for p in content:
                    if isinstance(p, dict) and p.get("type") in _MEDIA_PARTS:
                        size, items = size + strings(p), items + 1
    lists(body.get("images"))
    prompt = body.get("prompt")
    for p in prompt if isinstance(prompt, list) else (prompt,):
        if isinstance(p, dict):
            lists(p.get("multimodal_data"))
    return size, items


def prompt_estimate(body: dict | None, body_bytes: int) -> int:
    """A request's prompt tokens at admission: its body's bytes /
    :data:`PROMPT_BYTES_PER_TOKEN`, each media item counted as
    :data:`MEDIA_TOKENS` instead of its bytes."""
    size, items = _media(body) if type(body) is dict else (0, 0)
    return max(0, body_bytes - size) // PROMPT_BYTES_PER_TOKEN + items * MEDIA_TOKENS


@dataclass(slots=True)
class Policy:
    """A key's policy as the proxy reads it from the key table."""

    name: str
    row: int
    models: tuple[re.Pattern, ...] | None  # None: every model
    rpm: int
    tpm: int
    max_parallel: int
    tok_day: int
    tok_week: int
    tok_month: int
    w_in: float
    w_cached: float
    w_out: float
    spend_nano: int
    reserve: int
    expires: float
    disabled: bool
    budgeted: bool = False  # any of tok_day, tok_week, tok_month


@dataclass(slots=True)
class Hold:
    """What a request of a key was counted for at admission: its row, the
    window ids, its raw (``tokens``) and weighed (``weighed``) reservation,
    its prompt estimate (tokens) and its worst-case cost on a priced
    replica (``spend``, nano-units: reserved in the key's month)."""

    row: int
    ids: tuple[int, int, int, int]
    tokens: int
    weighed: int
    prompt_est: int
    spend: int = 0


@dataclass(slots=True)
class SpendHold:
    """What a request reserved of a priced model's spending budgets: its
    worst-case cost (``nano``) in this proxy's spend row of the model, in
    the periods ``ids``."""

    nano: int
    ids: tuple[int, int, int, int]


@dataclass(slots=True)
class Refusal:
    """Why a request is not admitted: HTTP ``status``, ``code``
    (``rate_limit_exceeded``, ``insufficient_quota``), ``message`` (names the
    limit and its reset) and ``retry_after`` seconds (0: none)."""

    status: int
    code: str
    message: str
    retry_after: int = 0

    def headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", b"%d" % self.retry_after)] if self.retry_after else []


def _policy(d: dict) -> Policy:
    models = d.get("models") or ["*"]
    pats = None if "*" in models else tuple(re.compile(fnmatch.translate(m)) for m in models)
    return Policy(d["name"], int(d["row"]), pats, d["rpm"], d["tpm"], d["max_parallel"],
                  d["tokens_per_day"], d["tokens_per_week"], d["tokens_per_month"],
                  d["input_weight"], d["cached_weight"], d["output_weight"],
                  int(d["spend_per_month"] * NANO), d["reserve_tokens"],
                  float(d["expires"] or 0), bool(d["disabled"]),
                  bool(d["tokens_per_day"] or d["tokens_per_week"] or d["tokens_per_month"]))


def _reset(kind: str, pid: int, now: float) -> float:
    return max(period_end(kind, pid) - now, 0.0)


def _in(seconds: float) -> str:
    s = int(seconds + 0.999)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    if s < 172800:
        return f"{s // 3600} h"
    return f"{s // 86400} days"


def requested_tokens(body: dict | None, default: int) -> int:
    """The completion tokens a request may generate at most, for its
    reservation: the largest of ``max_tokens``, its other names
    (:data:`MAX_TOKEN_FIELDS`) and Ollama's ``options.num_predict``, since
    routes honour different ones (llama.cpp's ``/completion`` takes
    ``n_predict`` over ``max_tokens``, the OpenAI routes ``max_tokens``
    first: a body with ``"max_tokens": 1, "n_predict": 300`` reserved 1 and
    generated 300); ``default`` (the key's ``reserve-tokens``) when none is
    given, or when one asks for no limit (0 or less: llama.cpp's -1, a
    route that reads that one generates up to its context). Times the
    answers it asks for: ``n`` choices, and each prompt of a list of
    prompts (``/v1/completions``, ``/completion``)."""
    if type(body) is not dict:
        return default
    most = -1
    unlimited = False
    opts = body.get("options")
    values = [body.get(k) for k in MAX_TOKEN_FIELDS]
    if type(opts) is dict:
        values.append(opts.get("num_predict"))
    for v in values:
        if type(v) is int:
            if v > 0:
                most = max(most, v)
            else:
                unlimited = True
    if most < 0 or unlimited:
        most = max(most, default)
    n = body.get("n")
    answers = n if type(n) is int and n > 1 else 1
    prompt = body.get("prompt")
    if type(prompt) is list and prompt and type(prompt[0]) in (str, list):
        answers *= len(prompt)  # several prompts (a list of ids is one prompt)
    return most * answers


class KeyAdmission:
    """One proxy's view of the key table (module docstring); ``index`` is
    the proxy's (its spend rows)."""

    def __init__(self, table_name: str, index: int) -> None:
        self.table = KeyTable.attach(table_name)
        self.index = index
        self.gen = -1
        self.by_hash: dict[bytes, Policy] = {}
        self.by_row: dict[int, Policy] = {}
        self.done: dict[str, str | None] = {}  # admin edits by id -> their error
        # the key rows as int64 memoryviews: a word costs a fifth of a numpy scalar's
        self.rows = [memoryview(r) for r in self.table.keys]
        self.held = memoryview(self.table.held[index])  # our requests in flight per key
        self.refresh()

    def refresh(self) -> None:
        """Re-read the policies when the supervisor published new ones."""
        if self.table.generation() == self.gen:
            return
        gen, doc = self.table.policies()
        pols = [_policy(d) for d in doc.get("keys", ())]
        self.by_hash = {bytes.fromhex(d["sha256"]): p for d, p in zip(doc.get("keys", ()), pols)}
        self.by_row = {p.row: p for p in pols}
        self.done = doc.get("done") or {}
        self.gen = gen

    def row_of(self, given: bytes) -> int:
        """The row of the key whose secret is ``given``, or -1."""
        self.refresh()
        p = self.by_hash.get(hashlib.sha256(given).digest())
        return -1 if p is None else p.row

    def unusable(self, row: int) -> str | None:
        """Why key ``row`` opens nothing (disabled, expired), or None."""
        p = self.by_row.get(row)
        if p is None:
            return "the key was removed"
        if p.disabled:
            return f"key '{p.name}' is disabled"
        if p.expires and self.table.now() >= p.expires:
            return f"key '{p.name}' has expired"
        return None

    def may_use(self, row: int, names) -> bool:
        """Whether key ``row`` may use a model known by ``names`` (its name
        and aliases)."""
        p = self.by_row.get(row)
        if p is None:
            return False
        if p.models is None:
            return True
        return any(pat.match(n) for pat in p.models for n in names if isinstance(n, str))

    def name(self, row: int) -> str:
        p = self.by_row.get(row)
        return p.name if p is not None else "?"

    # ---- admission --------------------------------------------------------------------
    def admit(self, row: int, body: dict | None, body_bytes: int,
              mdl: dict | None = None) -> Hold | Refusal:
        """Count one request of key ``row`` if its limits allow (module
        docstring); ``body`` the request's JSON (the one the replica gets),
        ``body_bytes`` its size, ``mdl`` the registry entry of its model:
        with prices, the request's worst case (:func:`worst_cost`) is
        reserved in the key's ``spend-per-month`` as its tokens are, so
        that a burst of concurrent requests cannot spend past the budget
        (each checked against what the others reserved)."""
        p = self.by_row.get(row)
        if p is None:
            return Refusal(401, "invalid_api_key", "the key was removed")
        t = self.table
        now = t.now()
        ids = periods(now)
        est = prompt_estimate(body, body_bytes)
        gen = requested_tokens(body, p.reserve)
        raw = est + gen
        w = round(est * p.w_in + gen * p.w_out)  # weighed(), nothing cached yet
        spend = worst_cost(mdl, est, gen) if p.spend_nano and mdl is not None else 0
        t.lock(row)
        try:
            r = self.rows[row]
            if (r[K_MINUTE] != ids[0] or r[K_DAY] != ids[1] or r[K_WEEK] != ids[2]
                    or r[K_MONTH] != ids[3]):
                roll(r, ids)
            why = None
            if p.max_parallel and r[K_IN_FLIGHT] >= p.max_parallel:
                why = Refusal(429, "rate_limit_exceeded",
                              f"key '{p.name}': max-parallel {p.max_parallel} requests in flight "
                              "reached; retry when one ends", 1)
            elif p.rpm and r[K_REQS] >= p.rpm:
                s = _reset("minute", ids[0], now)
                why = Refusal(429, "rate_limit_exceeded",
                              f"key '{p.name}': rpm {p.rpm} requests per minute reached; "
                              f"resets in {_in(s / t.scale)}", t.real_seconds(s))
            elif p.tpm and r[K_TOKENS] + raw > p.tpm:
                s = _reset("minute", ids[0], now)
                why = Refusal(429, "rate_limit_exceeded",
                              f"key '{p.name}': tpm {p.tpm} tokens per minute reached "
                              f"({int(r[K_TOKENS])} used, this request reserves {raw}: prompt "
                              f"and max_tokens); resets in {_in(s / t.scale)}",
                              t.real_seconds(s))
            elif p.budgeted:
                for kind, cap, word, pid in (("day", p.tok_day, K_TOK_DAY, ids[1]),
                                             ("week", p.tok_week, K_TOK_WEEK, ids[2]),
                                             ("month", p.tok_month, K_TOK_MONTH, ids[3])):
                    if cap and r[word] + w > cap:
                        s = _reset(kind, pid, now)
                        why = Refusal(429, "insufficient_quota",
                                      f"key '{p.name}': tokens-per-{kind} {cap} used up "
                                      f"({int(r[word])} used, this request reserves {w}); "
                                      f"resets in {_in(s / t.scale)}", t.real_seconds(s))
                        break
            if why is None and p.spend_nano and (r[K_SPEND_MONTH_NANO] >= p.spend_nano or
                                                 r[K_SPEND_MONTH_NANO] + spend > p.spend_nano):
                s = _reset("month", ids[3], now)
                why = Refusal(429, "insufficient_quota",
                              f"key '{p.name}': spend-per-month {p.spend_nano / NANO:g} "
                              f"{'spent' if r[K_SPEND_MONTH_NANO] >= p.spend_nano else 'reached'}"
                              f" ({int(r[K_SPEND_MONTH_NANO]) / NANO:g} spent or reserved, "
                              f"this request may cost {spend / NANO:g}: its prompt and "
                              f"max_tokens at the model's prices); resets in "
                              f"{_in(s / t.scale)}", t.real_seconds(s))
            if why is not None:
                r[K_REFUSED] += 1
                return why
            r[K_REQS] += 1
            r[K_IN_FLIGHT] += 1
            self.held[row] += 1
            r[K_TOKENS] += raw
            r[K_TOK_DAY] += w
            r[K_TOK_WEEK] += w
            r[K_TOK_MONTH] += w
            r[K_SPEND_MONTH_NANO] += spend
            r[K_ADMITTED] += 1
        finally:
            t.unlock(row)
        return Hold(row, ids, raw, w, est, spend)

    def settle(self, hold: Hold, prompt: int, cached: int, completion: int,
               cost_nano: int) -> None:
        """The request of ``hold`` ended with usage ``prompt``, ``cached``,
        ``completion`` tokens (-1: unknown; an unknown prompt counts as its
        estimate) and ``cost_nano`` of spend: replace the reservation by the
        usage in the windows it went into, and it is no longer in flight."""
        p = self.by_row.get(hold.row)
        t = self.table
        if prompt < 0:
            prompt = hold.prompt_est if completion >= 0 else 0
        raw = prompt + max(completion, 0)
        w = (weighed(p.w_in, p.w_cached, p.w_out, prompt, cached, completion)
             if p is not None else hold.weighed)
        t.lock(hold.row)
        try:
            r = self.rows[hold.row]
            if self.held[hold.row] > 0:  # else the supervisor gave it back already
                self.held[hold.row] -= 1
                if r[K_IN_FLIGHT] > 0:
                    r[K_IN_FLIGHT] -= 1
            ids = hold.ids
            if r[K_MINUTE] == ids[0]:
                r[K_TOKENS] = max(0, r[K_TOKENS] + raw - hold.tokens)
            d = w - hold.weighed
            if r[K_DAY] == ids[1]:
                r[K_TOK_DAY] = max(0, r[K_TOK_DAY] + d)
            if r[K_WEEK] == ids[2]:
                r[K_TOK_WEEK] = max(0, r[K_TOK_WEEK] + d)
            if r[K_MONTH] == ids[3]:
                r[K_TOK_MONTH] = max(0, r[K_TOK_MONTH] + d)
            if cost_nano or hold.spend:  # the reservation becomes the cost
                roll(r, periods(t.now()))
                back = hold.spend if r[K_MONTH] == ids[3] else 0  # (else it rolled away)
                r[K_SPEND_MONTH_NANO] = max(0, r[K_SPEND_MONTH_NANO] + cost_nano - back)
        finally:
            t.unlock(hold.row)

    def usage(self, row: int) -> dict:
        """Key ``row``'s current windows (``GET /keys``)."""
        ids = periods(self.table.now())
        r = self.table.keys[row].copy()
        return {
            "requests_this_minute": int(r[K_REQS]) if r[K_MINUTE] == ids[0] else 0,
            "tokens_this_minute": int(r[K_TOKENS]) if r[K_MINUTE] == ids[0] else 0,
            "in_flight": int(r[K_IN_FLIGHT]),
            "tokens_today": int(r[K_TOK_DAY]) if r[K_DAY] == ids[1] else 0,
            "tokens_this_week": int(r[K_TOK_WEEK]) if r[K_WEEK] == ids[2] else 0,
            "tokens_this_month": int(r[K_TOK_MONTH]) if r[K_MONTH] == ids[3] else 0,
            "spend_this_month": (int(r[K_SPEND_MONTH_NANO]) / NANO
                                 if r[K_MONTH] == ids[3] else 0.0),
            "admitted": int(r[K_ADMITTED]),
            "refused": int(r[K_REFUSED]),
        }

    # ---- priced replicas ------------------------------------------------------------------
    def add_spend(self, m: int, nano: int) -> None:
        """This proxy's answer from a priced replica of model ``m`` cost ``nano``."""
        if m < self.table.spend.shape[1]:
            self.table.add_spend(self.index, m, nano, periods(self.table.now()))

    def over_budget(self, m: int, mdl: dict, nano: int = 0) -> Refusal | None:
        """A refusal naming the budget when model ``m``'s priced replicas
        spent their budget (``mdl``: its registry entry), or when a request
        that may cost ``nano`` more would pass it, else None."""
        if m >= self.table.spend.shape[1]:
            return None
        t = self.table
        now = t.now()
        ids = periods(now)
        spent = t.spent(m, ids)
        for kind, i, pid in (("day", 0, ids[1]), ("week", 1, ids[2]), ("month", 2, ids[3])):
            cap = mdl.get(f"spend_per_{kind}") or 0
            if cap and (spent[i] >= cap * NANO or spent[i] + nano > cap * NANO):
                s = _reset(kind, pid, now)
                what = ("is spent" if spent[i] >= cap * NANO else
                        f"would be passed by this request (up to {nano / NANO:g}: its prompt "
                        "and max_tokens at the model's prices)")
                return Refusal(429, "insufficient_quota",
                               f"the spend-per-{kind} budget ({cap:g}) of '{mdl['name']}''s "
                               f"priced replicas {what}; resets in {_in(s / t.scale)}",
                               t.real_seconds(s))
        return None

    def reserve_budget(self, m: int, mdl: dict, nano: int) -> SpendHold | Refusal:
        """Reserve ``nano`` (a request's worst-case cost) of model ``m``'s
        spending budgets, checked against every proxy's spend and
        reservations under the model's budget lock
        (:meth:`~ggmux.shm.keytable.KeyTable.budget_locked`): the
        :class:`SpendHold` to settle, or the refusal (:meth:`over_budget`)."""
        t = self.table
        if m >= t.spend.shape[1]:
            return SpendHold(0, periods(t.now()))
        with t.budget_locked(m):
            why = self.over_budget(m, mdl, nano)
            if why is not None:
                return why
            ids = periods(t.now())
            t.add_spend(self.index, m, nano, ids)
        return SpendHold(nano, ids)

    def settle_budget(self, m: int, hold: SpendHold, cost: int) -> None:
        """The request of ``hold`` cost ``cost`` nano-units (0: a replica
        that is not priced served it)."""
        t = self.table
        if m < t.spend.shape[1]:
            t.settle_spend(self.index, m, hold.nano, hold.ids, cost, periods(t.now()))


def worst_cost(mdl: dict | None, prompt_est: int, completion: int) -> int:
    """What a request may cost at most on a priced replica of ``mdl`` (its
    registry entry; None or no prices: 0), nano-units: its prompt estimate
    at the input price (nothing cached) and its output limit at the output
    price."""
    if mdl is None or not (mdl.get("price_input") or mdl.get("price_output")):
        return 0
    return cost_nano(mdl, prompt_est, 0, completion)


def cost_nano(mdl: dict, prompt: int, cached: int, completion: int) -> int:
    """The cost of an answer of a priced replica of ``mdl`` (its registry
    entry's prices per million tokens), nano-units of currency."""
    prompt = max(prompt, 0)
    cached = min(max(cached, 0), prompt)
    c = ((prompt - cached) * (mdl.get("price_input") or 0.0)
         + cached * (mdl.get("price_cached_input") or 0.0)
         + max(completion, 0) * (mdl.get("price_output") or 0.0))
    return int(c * 1000)  # per million tokens: currency * 1e-6 = nano * 1e3


__all__ = ["Hold", "KeyAdmission", "Policy", "Refusal", "SpendHold", "cost_nano",
           "requested_tokens", "worst_cost"]
