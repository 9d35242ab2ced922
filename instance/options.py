"""The instance process's command line (``python -m ggmux.instance``):
its options, the title ``ps`` shows, and the backend they choose."""

from __future__ import annotations

import argparse
import json
import os

from ..http1.limits import add_http_limit_options, instance_limits
from .backend import Backend
from .cache.options import add_cache_options
from .kv_events import add_kv_events_options
from .reasoning import add_reasoning_option
from .validate import CACHE_SCOPES, add_request_limit_options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ggmux.instance")
    ap.add_argument("--model", default=None, help="GGUF file (or fake behaviour file)")
    ap.add_argument("--spare", action="store_true",
                    help="start, import everything, then wait for a 'load {json}' command")
    ap.add_argument("--name", default=None, help="model name reported in responses")
    ap.add_argument("--fd", type=int, default=None, help="listening socket from the supervisor")
    ap.add_argument("--keys-fd", type=int, default=None,
                    help='inherited pipe holding {"secret": HEX} as JSON (from the supervisor)')
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--ctx-size", type=int, default=2048,
                    help="tokens one request may use, prompt and answer")
    ap.add_argument("--kv-size", type=int, default=0,
                    help="KV cache tokens for all slots together (0: ctx-size x --parallel, "
                         "which comes in --llama-args)")
    ap.add_argument("--stop-timeout", type=float, default=10.0,
                    help="seconds the supervisor waits after 'exit' before SIGTERM; running "
                         "requests get that less one second to finish")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-gpu-layers", type=int, default=0)
    ap.add_argument("--fake", action="store_true", help="use the fake backend (tests)")
    ap.add_argument("--mmproj", default=None,
                    help="multimodal projector GGUF (llama.cpp's mmproj): images and audio")
    ap.add_argument("--media-fetch", action="store_true",
                    help="fetch media given as http(s) URLs (off: data: URLs and base64 only)")
    ap.add_argument("--llama-args", type=json.loads, default=[],
                    help="other llama.cpp options as a JSON list, e.g. "
                         '\'["--batch-size", "256", "--flash-attn", "on"]\'')
    ap.add_argument("--measure", action="store_true", help="report memory needs and exit")
    add_request_limit_options(ap)
    add_reasoning_option(ap)
    ap.add_argument("--cache-scope", choices=CACHE_SCOPES, default="global",
                    help="whose prompt cache a request may reuse: key (its own tenant's, "
                         "from the proxy's x-ggmux-tenant), global (any), none")
    ap.add_argument("--slot", type=int, default=None,
                    help="the supervisor's replica slot, for the process title")
    add_cache_options(ap)
    add_kv_events_options(ap)
    # the supervisor passes the header and body limits that fit its proxies'
    add_http_limit_options(ap, instance_limits())
    return ap.parse_args(argv)


def process_title(args: argparse.Namespace) -> str:
    """What ``ps`` shows for this process: ``ggmux: instance NAME #SLOT``,
    ``ggmux: measure NAME`` or ``ggmux: spare`` (issue 15: a spare that took
    a model must not look like one)."""
    if args.spare and not args.model:
        return "ggmux: spare"
    name = args.name or os.path.basename(args.model or "?")
    if args.measure:
        return f"ggmux: measure {name}"
    return f"ggmux: instance {name}" + (f" #{args.slot}" if args.slot is not None else "")


def make_backend(args: argparse.Namespace) -> Backend:
    if args.fake:
        from .fake import FakeBackend

        return FakeBackend(args)
    from .llama import LlamaBackend

    return LlamaBackend(args)
