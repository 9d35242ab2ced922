"""Limits of one HTTP server (:class:`HttpLimits`) and their options.

Every limit of the HTTP core is a field with a default;
``add_http_limit_options`` / ``limits_from_args`` turn them into
command-line options and back, ``http_limit_argv`` into a child's
arguments (the supervisor passes its limits to each proxy, and the header
and body limits to each instance, this way), ``fit_fd_limit`` fits
``max_connections`` to the open-file limit, ``instance_limits`` gives the
limits of an instance behind proxies with ``proxy`` limits.
"""

from __future__ import annotations

import argparse
import logging
import resource
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace

from .connections import ConnectionRegistry

log = logging.getLogger(__name__)

FORWARD_HEADROOM = 4096
"""Bytes a proxy may add to a request head it forwards (its own Host,
``x-request-id``, ``content-length``, a replica's key, the one-byte
``name: value`` spacing it restores per header line): an instance accepts
heads this much larger than its proxies do, so no head a proxy accepted is
answered 431 by the instance behind it (issue 11, finding 11)."""


@dataclass(slots=True)
class HttpLimits:
    """Limits of one HTTP server (bytes, seconds, counts).

    ``max_header_bytes``: request line plus headers (414 for the target
    alone, else 431), chunked trailers counted too; ``max_body_bytes``:
    request body, by Content-Length, by a chunk's announced size, or as
    chunks arrive (413); ``header_timeout``: time to receive a whole head
    once its first byte arrived (408); ``body_timeout``: time to receive the
    whole body after the head (408); ``body_read_timeout``: time between two
    successive reads of a body that is still arriving, the head's end
    counting as the first (408; nginx's ``client_body_timeout``, but 30 s,
    as ``header_timeout``, where nginx waits 60: issue 31, item 7);
    ``keepalive_timeout``: idle time before a
    keep-alive connection is closed; ``send_timeout``: time a client may
    leave the server's writes blocked (slow reader) before it is cut off;
    ``max_connections``: open connections of this server, one more is
    answered 503 and closed; ``max_connections_per_ip``: open connections
    from one client address, one more is answered 429 and closed (0: no
    cap); ``shed_idle_at``: above this fraction of ``max_connections``, each
    new connection closes the oldest idle one (idle keep-alive, or without a
    whole request head yet: issue 11, finding 10); at either cap a
    connection whose body stalled longest is closed (408) before a new one
    is refused (issue 31, item 7); ``max_pipelined``: queued
    requests before reading pauses; ``linger_timeout``: how long unread
    input is drained after an error response before the socket is dropped;
    ``max_json_depth``: deepest nesting of a JSON body the client APIs
    translate (400 past it; at most 250, what orjson can write back);
    ``max_tokenize_bytes``: request body of the token routes (``/tokenize``,
    ``/detokenize``, ``/apply-template``, ``.../input_tokens``, Anthropic's
    ``count_tokens``), checked before it is parsed (413 past it): their
    JSON is decoded and their ids listed in one process that also writes
    other tenants' streams (issue 31, item 1; llama-server has only its
    100 MiB payload limit); ``max_detokenize_tokens``: ids of one
    ``/detokenize`` (413 past it, counted before the body is parsed: a
    JSON list of ids costs ten times a string's bytes to decode, and
    ``orjson`` holds the GIL while it does; 262,144 is the largest context
    of common models); ``max_messages``, ``max_input_items``,
    ``max_token_ids``, ``max_content_parts``: items of one request body the
    proxy routes or translates: ``messages`` (Anthropic's own limit is
    100,000), ``input`` items (Responses, embeddings), token ids in
    ``prompt``/``input``/``tokens`` (four times the largest common
    context), content parts summed over the messages and input items (and
    Anthropic's ``system``), 413 past any of them,
    checked before the body is translated or forwarded (issue 37, item 11: a
    51.5 MB Responses body of 1.59 M items stopped other tenants' streams
    15-19 s); ``offloop_body_bytes``: a body larger than this is parsed, checked
    and translated on the proxy's worker thread, not on the event loop that
    writes every stream.

    One object is shared by all connections of one server: ``connections``
    is their registry (not an option), ``open_connections`` their count.
    """

    max_header_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024 * 1024
    header_timeout: float = 30.0
    body_timeout: float = 300.0
    body_read_timeout: float = 30.0
    keepalive_timeout: float = 75.0
    send_timeout: float = 300.0
    max_connections: int = 4096
    max_connections_per_ip: int = 1024
    shed_idle_at: float = 0.8
    max_pipelined: int = 16
    linger_timeout: float = 5.0
    max_json_depth: int = 128
    max_tokenize_bytes: int = 8 * 1024 * 1024
    max_detokenize_tokens: int = 262144
    max_messages: int = 100_000
    max_input_items: int = 100_000
    max_token_ids: int = 1_048_576
    max_content_parts: int = 100_000
    offloop_body_bytes: int = 1024 * 1024
    connections: ConnectionRegistry = field(
        default_factory=ConnectionRegistry, init=False, repr=False, compare=False
    )

    @property
    def open_connections(self) -> int:
        """Connections of this server that are open and counted."""
        return self.connections.count


# (field, help) for add_http_limit_options; the flag is the field with dashes
_OPTION_HELP = {
    "max_header_bytes": "largest request head (request line + headers) in bytes; 431 past it "
    "(instances take heads 4 KiB larger and the same bodies, so nothing a proxy took is refused "
    "behind it)",
    "max_body_bytes": "largest request body in bytes; 413 past it",
    "header_timeout": "seconds to receive a request head once it started; 408 past it",
    "body_timeout": "seconds to receive a request body after its head; 408 past it",
    "body_read_timeout": "seconds between two reads of a request body that is still arriving "
    "(nginx's client_body_timeout); 408 past it",
    "keepalive_timeout": "seconds an idle keep-alive connection stays open",
    "send_timeout": "seconds a client may leave a response unread before it is cut off",
    "max_connections": "open client connections per process; more are answered 503",
    "max_connections_per_ip": "open connections from one client address (ggmux serve: in all, "
    "each proxy allowing its share); a new one at the cap closes that address's oldest idle "
    "connection, and gets 429 only when none is idle; at this cap or --max-connections, the "
    "connection whose request body stalled longest is answered 408 and closed before a new one "
    "is refused; 0: no cap",
    "shed_idle_at": "fraction of --max-connections above which each new connection closes "
    "the oldest idle one (keep-alive, or without a whole request head), so idle connections "
    "cannot lock clients out",
    "max_pipelined": "pipelined requests queued per connection before reading pauses",
    "linger_timeout": "seconds to drain unread input after an error response",
    "max_json_depth": "deepest nesting of a translated API's JSON body (levels, at most 250); "
    "400 past it",
    "max_tokenize_bytes": "largest request body of /tokenize, /detokenize, /apply-template, "
    "input_tokens and Anthropic's count_tokens, bytes; 413 past it, before the body is parsed, "
    "by the proxy and the instance (llama-server has only its 100 MiB payload limit)",
    "max_detokenize_tokens": "most token ids of one /detokenize; 413 past it",
    "max_messages": "most messages of one request (chat, Anthropic, Ollama); 413 past it",
    "max_input_items": "most input items of one request (Responses, embeddings); 413 past it",
    "max_token_ids": "most token ids in one request's prompt or input; 413 past it",
    "max_content_parts": "most content parts of one request, over all its messages and input "
    "items; 413 past it",
    "offloop_body_bytes": "request bodies larger than this (bytes) are parsed and translated "
    "on a worker thread, off the loop that writes every stream",
}
_MAY_BE_ZERO = frozenset({"max_connections_per_ip"})


def _number(kind: type, zero: bool = False) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if v < 0 or (v == 0 and not zero):
            raise argparse.ArgumentTypeError(
                f"must be {'0 or more' if zero else 'positive'}: {text!r}")
        return v

    parse.__name__ = kind.__name__
    return parse


def add_http_limit_options(
    parser: argparse.ArgumentParser, defaults: HttpLimits | None = None
) -> None:
    """Add one option per :class:`HttpLimits` field (``--max-header-bytes``,
    ``--max-body-bytes``, ``--header-timeout``, ``--body-timeout``,
    ``--body-read-timeout``, ``--keepalive-timeout``, ``--send-timeout``, ``--max-connections``,
    ``--max-connections-per-ip``, ``--shed-idle-at``, ``--max-pipelined``,
    ``--linger-timeout``, ``--max-json-depth``, ``--max-tokenize-bytes``,
    ``--max-detokenize-tokens``) in an "HTTP limits" group; ``defaults`` overrides
    the dataclass defaults. Read them back with :func:`limits_from_args`."""
    d = defaults if defaults is not None else HttpLimits()
    group = parser.add_argument_group("HTTP limits")
    for name, help_ in _OPTION_HELP.items():
        value = getattr(d, name)
        group.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=_number(type(value), name in _MAY_BE_ZERO),
            default=value,
            metavar="N" if isinstance(value, int) else "X" if name == "shed_idle_at"
            else "SECONDS",
            help=help_ + " (default: %(default)s)",
        )


def limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """:class:`HttpLimits` from options added by :func:`add_http_limit_options`
    (a field whose option is missing keeps its default)."""
    kw = {
        f.name: getattr(args, f.name)
        for f in fields(HttpLimits)
        if f.init and hasattr(args, f.name)
    }
    return HttpLimits(**kw)


def http_limit_argv(limits: HttpLimits, names: tuple[str, ...] | None = None) -> list[str]:
    """The options that recreate ``limits`` (only the fields in ``names``,
    when given) in a child process whose parser has
    :func:`add_http_limit_options` (the supervisor passes its limits to
    each proxy this way)."""
    argv = []
    for name in _OPTION_HELP if names is None else names:
        argv += ["--" + name.replace("_", "-"), str(getattr(limits, name))]
    return argv


def proxy_share(limits: HttpLimits, proxies: int) -> HttpLimits:
    """The limits of one of ``proxies`` proxy processes of a server whose
    options are ``limits``: the same, except that each proxy allows its
    share (rounded up) of ``max_connections_per_ip``, which counts a client
    address's connections to the whole server. A copy."""
    per_ip = limits.max_connections_per_ip
    share = -(-per_ip // max(1, proxies)) if per_ip else 0
    return replace(limits, max_connections_per_ip=share)


INSTANCE_LIMIT_NAMES = ("max_header_bytes", "max_body_bytes", "max_tokenize_bytes",
                        "max_detokenize_tokens")
"""The limits an instance takes from its proxies (:func:`instance_limits`)."""


def instance_limits(proxy: HttpLimits | None = None) -> HttpLimits:
    """The limits of an instance served through proxies with ``proxy``
    limits (default: :class:`HttpLimits`'s): heads up to
    :data:`FORWARD_HEADROOM` bytes larger than a proxy accepts, the same
    body limits, and no cap per client address (every connection comes from
    the proxies, on 127.0.0.1)."""
    p = proxy if proxy is not None else HttpLimits()
    return HttpLimits(
        max_header_bytes=p.max_header_bytes + FORWARD_HEADROOM,
        max_body_bytes=p.max_body_bytes,
        max_tokenize_bytes=p.max_tokenize_bytes,
        max_detokenize_tokens=p.max_detokenize_tokens,
        max_connections_per_ip=0,
    )


DETOKENIZE_COMMA_SLACK = 16
"""Commas a ``/detokenize`` body may hold beyond its ids' (between its
other fields) before :func:`tokenize_body_refusal` counts them as ids."""


def detokenize_refusal(limits: HttpLimits, ids: int) -> str | None:
    """The 413 message for a ``/detokenize`` of ``ids`` token ids over
    ``limits.max_detokenize_tokens`` (None when it fits)."""
    if ids <= limits.max_detokenize_tokens:
        return None
    return (f"more than {limits.max_detokenize_tokens} token ids in one /detokenize "
            "(--max-detokenize-tokens)")


def tokenize_body_refusal(limits: HttpLimits, body: bytes, detokenize: bool) -> str | None:
    """The 413 message for a token route's request ``body`` (None when it
    fits): over ``limits.max_tokenize_bytes``, or for ``/detokenize``
    (``detokenize``) with more commas than ``max_detokenize_tokens`` and
    :data:`DETOKENIZE_COMMA_SLACK` (a list of n ids holds n - 1: a bound on
    the ids found without parsing; the instance counts them exactly once
    parsed). The proxy and the instance check it before the body is parsed
    (issue 31, item 1)."""
    if len(body) > limits.max_tokenize_bytes:
        return (f"request body of {len(body)} bytes is over the {limits.max_tokenize_bytes} "
                "bytes this route takes (--max-tokenize-bytes)")
    if detokenize:
        return detokenize_refusal(limits, body.count(b",") + 1 - DETOKENIZE_COMMA_SLACK)
    return None


def fit_fd_limit(limits: HttpLimits, per_connection: int = 2, reserve: int = 256) -> HttpLimits:
    """Make ``max_connections`` fit this process's open-file limit.

    Each client connection of a proxy holds ``per_connection`` descriptors
    (the client's and its replica's); ``reserve`` more are kept for
    everything else. The soft ``RLIMIT_NOFILE`` is raised as far as the hard
    limit allows; where that is still too low, ``max_connections`` is
    lowered (with a warning) so that the 503 answer, not a failing
    ``accept()``, is what clients over the limit see. Returns ``limits``,
    changed in place."""
    need = limits.max_connections * per_connection + reserve
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        want = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit to %d: %s", want, e)
    if soft != resource.RLIM_INFINITY and soft < need:
        fit = max(1, (soft - reserve) // per_connection)
        log.warning(
            "open-file limit %d allows %d connections, not --max-connections %d",
            soft,
            fit,
            limits.max_connections,
        )
        limits.max_connections = fit
    return limits
