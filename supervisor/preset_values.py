"""Parsers of preset values (llama.cpp's preset keys ggmux reads itself,
and ggmux's own keys): :data:`FIELDS` maps each canonical key to the
function that turns its text into a typed value or raises ``ValueError``
with the reason (:func:`~.presets.parse_item` adds ``FILE:LINE``), plus the
llama.cpp options ggmux drops (:data:`RESERVED`) or refuses
(:data:`DOWNLOADS`).
"""

from __future__ import annotations

import math
import os
import re
import shlex
from collections.abc import Callable
from urllib.parse import urlsplit

_TRUE = ("on", "enabled", "true", "1")  # llama.cpp common_arg_utils::is_truthy
_FALSE = ("off", "disabled", "false", "0")  # is_falsey


class _Bad(ValueError):
    """A value a parser rejects; the caller adds file, line and key."""


def parse_bool(v: str) -> bool:
    """llama.cpp's truthy/falsey words (case-insensitive here); raises
    ``ValueError`` for anything else."""
    s = v.strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise _Bad(f"bad boolean {v!r} (expected one of {', '.join(_TRUE + _FALSE)})")


def _int(lo: int | None = None) -> Callable[[str], int]:
    def parse(v: str) -> int:
        try:
            n = int(v.strip())
        except ValueError:
            raise _Bad(f"bad number {v!r} (expected an integer)") from None
        if lo is not None and n < lo:
            raise _Bad(f"bad number {v!r} (must be at least {lo})")
        return n

    return parse


def _float(lo: float | None = None, positive: bool = False) -> Callable[[str], float]:
    def parse(v: str) -> float:
        try:
            x = float(v.strip())
        except ValueError:
            raise _Bad(f"bad number {v!r} (expected a number)") from None
        if not math.isfinite(x):
            raise _Bad(f"bad number {v!r} (must be finite)")
        if positive and x <= 0:
            raise _Bad(f"bad number {v!r} (must be greater than 0)")
        if lo is not None and x < lo:
            raise _Bad(f"bad number {v!r} (must be at least {lo:g})")
        return x

    return parse


def _n_gpu_layers(v: str) -> int:
    """An integer, or llama.cpp's ``all``/``auto`` (both -1: every layer;
    llama-cpp-python has no automatic fit)."""
    if v.strip().lower() in ("all", "auto"):
        return -1
    return _int()(v)


def _text(v: str) -> str:
    if not v:
        raise _Bad("empty value")
    return v


def _path(v: str) -> str:
    return os.path.abspath(os.path.expanduser(_text(v)))


def _aliases(v: str) -> list[str]:
    """Comma-separated, each stripped, empty ones dropped (llama.cpp)."""
    return [a for a in (s.strip() for s in v.split(",")) if a]


_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env(v: str) -> dict[str, str]:
    """``KEY=VALUE`` pairs separated by spaces, shell-quoted where needed:
    ``env = CUDA_VISIBLE_DEVICES=0,1 "GREETING=hello world"``."""
    try:
        words = shlex.split(v)
    except ValueError as e:
        raise _Bad(f"bad env {v!r}: {e}") from None
    out: dict[str, str] = {}
    for w in words:
        k, eq, val = w.partition("=")
        if not eq or not _ENV_NAME_RE.match(k):
            raise _Bad(f"bad env entry {w!r} (expected NAME=VALUE)")
        out[k] = val
    if not out:
        raise _Bad("empty value")
    return out


def _endpoint(v: str) -> str:
    """A path starting ``/``, or ``none`` (stored as ``""``: no check)."""
    if v.strip().lower() == "none":
        return ""
    if not v.startswith("/"):
        raise _Bad(f"bad check-endpoint {v!r} (expected a path starting with / or 'none')")
    return v


_HOST_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]")


def _upstream_url(u: str) -> str:
    """One ``http://HOST[:PORT][/PATH]`` (``user:password@`` allowed; the
    path is the prefix every forwarded target gets), without a trailing
    ``/``. ``https://`` is an error until ggmux speaks TLS to upstreams."""
    try:
        p = urlsplit(u)
        port = p.port
    except ValueError as e:
        raise _Bad(f"bad upstream {u!r}: {e}") from None
    scheme = p.scheme.lower()
    if scheme == "https":
        raise _Bad(f"upstream {u!r}: https:// is not supported yet (ggmux speaks plain "
                   f"http:// to upstreams; put a TLS-terminating proxy beside it)")
    if scheme != "http" or not u.lower().startswith("http://"):
        raise _Bad(f"bad upstream {u!r} (expected http://HOST[:PORT][/PATH])")
    netloc_host = p.netloc.rpartition("@")[2]
    host = netloc_host.rsplit(":", 1)[0] if not netloc_host.endswith("]") else netloc_host
    if not p.hostname or not _HOST_RE.fullmatch(host):
        raise _Bad(f"bad upstream {u!r}: no valid host (expected http://HOST[:PORT][/PATH])")
    if port == 0:
        raise _Bad(f"bad upstream {u!r}: port 0")
    if p.query or p.fragment or "?" in u or "#" in u:
        raise _Bad(f"bad upstream {u!r}: a query or fragment is not allowed")
    if any(c.isspace() for c in u):
        raise _Bad(f"bad upstream {u!r}: whitespace in the URL")
    return u.rstrip("/")


def _upstreams(v: str) -> list[str]:
    """``upstream = URL[, URL...]``: each ``http://`` URL one remote replica
    of the model (several GPU boxes serving one model; issue 11, finding 12)."""
    urls = [u.strip() for u in v.split(",")]
    if not any(urls):
        raise _Bad("empty value")
    out: list[str] = []
    for u in urls:
        if not u:
            raise _Bad(f"empty URL in the list {v!r}")
        url = _upstream_url(u)
        if url in out:
            raise _Bad(f"upstream {url!r} is listed twice")
        out.append(url)
    return out


def _cache_scope(v: str) -> str:
    """``key``, ``global`` or ``none`` (``--cache-scope``)."""
    s = v.strip().lower()
    if s not in ("key", "global", "none"):
        raise _Bad(f"bad cache-scope {v!r} (expected key, global or none)")
    return s


def _cache_disk(v: str) -> str:
    """``--cache-disk DIR``: the KV disk tier's directory (absolute), or
    ``off`` / ``none`` / empty for none (issue 29)."""
    t = v.strip()
    return "" if t.lower() in ("", "off", "none") else _path(t)


def _repo(v: str) -> str:
    repo = v.partition(":")[0]
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise _Bad(f"bad hf-repo {v!r} (expected ORG/REPO[:QUANT])")
    return v


# Keys ggmux reads itself (canonical key -> parser). llama.cpp options among
# them are also in the table below, which maps their other spellings here.
FIELDS: dict[str, Callable[[str], object]] = {
    # llama.cpp options
    "model": _path,
    "hf-repo": _repo,
    "hf-file": _text,
    "mmproj": _path,
    "mmproj-auto": parse_bool,
    "ctx-size": _int(0),
    "threads": _int(),
    "n-gpu-layers": _n_gpu_layers,
    "alias": _aliases,
    "api-key": _text,
    "tags": str,  # llama.cpp: informational only; accepted and not used
    # llama.cpp preset-only options (common_params_add_preset_options)
    "load-on-startup": parse_bool,
    "stop-timeout": _float(0),
    "dedup-cache-models": parse_bool,
    # ggmux (and llama-swap) keys
    "ttl": _float(),
    "replicas": _int(1),
    "weight": _float(positive=True),
    "priority": _int(),
    "max-concurrency": _int(0),
    "kv-size": _int(0),
    "first-byte-timeout": _float(positive=True),
    "cmd": _text,
    "cmd-stop": _text,
    "env": _env,
    "check-endpoint": _endpoint,
    "upstream": _upstreams,
    "translate": parse_bool,
    # contention (issue 34): llama.cpp router's pin (PR #18373), an eviction
    # priority (llama-swap PR #611), the bounded wait and the time slice
    "pin": parse_bool,
    "eviction-priority": _int(),
    "max-wait": _float(0),
    "min-residency": _float(0),
    # ggmux's limits and scopes of a built-in instance (issue 18)
    "max-tokens-limit": _int(0),
    "cache-scope": _cache_scope,
    # prices of a cmd model's or an upstream's answers (currency per million
    # tokens) and the spending budget of those replicas (issue 36)
    "price-input": _float(0),
    "price-cached-input": _float(0),
    "price-output": _float(0),
    "spend-per-day": _float(0),
    "spend-per-week": _float(0),
    "spend-per-month": _float(0),
    # ggmux's engine settings, passed on to the built-in instance as options
    "prefill-wait-ms": _float(0),
    # the KV tiers' disk side (issue 29; cache-ram is llama-server's own option)
    "cache-disk": _cache_disk,
    "cache-disk-max": _float(0),
    "cache-save-timeout": _float(0),
    "cache-checkpoints": _int(0),  # context checkpoints per tier entry (issue 35)
    "cache-checkpoint-max": _int(0),
}

PRICE_KEYS = frozenset({"price-input", "price-cached-input", "price-output", "spend-per-day",
                        "spend-per-week", "spend-per-month"})
"""Prices and spending budgets of priced replicas (issue 36: proxy/admission.py)."""

ENGINE_KEYS = frozenset({"prefill-wait-ms", "cache-disk", "cache-disk-max",
                         "cache-save-timeout", "cache-checkpoints",
                         "cache-checkpoint-max"})
"""ggmux keys (in :data:`FIELDS`) that go to the built-in instance as
``--KEY VALUE`` among the llama-server options (instance/llama_args.py)."""

# llama.cpp options the router itself controls: dropped with a warning
# (server-models.cpp unset_reserved_args / update_args).
RESERVED = frozenset(
    {
        "host",
        "port",
        "reuse-port",
        "api-key-file",
        "ssl-key-file",
        "ssl-cert-file",
        "models-dir",
        "models-max",
        "models-preset",
        "models-autoload",
        "hf-token",
    }
)
# llama.cpp options that download: ggmux serves local files only.
DOWNLOADS = frozenset({"model-url", "mmproj-url", "docker-repo"})


