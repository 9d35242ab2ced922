"""The ``ggmux`` command line's parser (:func:`build_parser`): the ``serve``
command's options with their defaults and help (:class:`HelpFormatter`),
each also read as ``GGMUX_<OPTION>`` from the environment
(:func:`apply_env_defaults`), and the client commands'
(:mod:`ggmux.client.commands`). What the options do is :mod:`.cli`'s.
"""

from __future__ import annotations

import argparse
import os

from .. import __version__
from ..client.commands import add_client_commands, add_client_options
from ..http1.limits import add_http_limit_options
from ..instance.reasoning import add_reasoning_option
from ..instance.validate import CACHE_SCOPES, add_request_limit_options
from ..ledger.options import add_ledger_options
from ..shm.requestring import REQUEST_EXCERPT_BYTES
from .cluster.options import add_cluster_options
from .kv_events import add_kv_events_options
from .registry import ModelEntry
from .routing import add_routing_options

_DEFAULTS = ModelEntry(name="", path="")  # ggmux's per-model defaults


SECRET_OPTIONS = frozenset(("api_key", "admin_key", "cluster_token", "nats_password",
                            "nats_token"))
"""Options whose value is never printed (``--help`` names their variable)."""

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
    s.add_argument("--port", type=int, default=8080,
                   help="public port; one already taken is an error (SO_REUSEPORT would "
                        "otherwise share it silently)")
    s.add_argument("--proxies", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="proxy processes sharing the port (SO_REUSEPORT) (default: the CPU "
                        "count)")
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
                   metavar="N",
                   help="most model replicas running at once, loading, loaded or asleep "
                        "(llama.cpp --models-max)")
    s.add_argument("--models-autoload", action=argparse.BooleanOptionalAction, default=True,
                   help="load a model when a request names it (llama.cpp --[no-]models-autoload); "
                        "--no-models-autoload: only POST /models/load and load-on-startup load "
                        "one, and a request for a model that is not running or loading gets "
                        "400 'model is not loaded' (as "
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
    s.add_argument("--metrics-compat", choices=("vllm", "none"), default="vllm",
                   help="GET /metrics also says the endpoint picker's signals under vLLM's "
                        "names (vllm:num_requests_waiting, vllm:num_requests_running, "
                        "vllm:kv_cache_usage_perc, vllm:cache_config_info, "
                        "vllm:lora_requests_info), for a Gateway API Inference Extension "
                        "InferencePool; none: only ggmux's")
    # Model options: None when not given, so build_registry can tell a default
    # (under every source) from an explicit value (over every source, as
    # llama.cpp's router overlays its own command line on every preset).
    s.add_argument("--ctx-size", "-c", type=int, default=None,
                   help="context size, tokens: the most one request may use (prompt and "
                        "answer), 0 = the model's; not given: "
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
                   metavar="S",
                   help="seconds between 'exit' and SIGTERM when stopping an instance (then "
                        "5 s to SIGKILL); not "
                        f"given: {_DEFAULTS.stop_timeout:g} under every preset, given: over "
                        "every preset")
    s.add_argument("--load-timeout", type=float, default=None, metavar="S",
                   help="load deadline, seconds (default: 300 + 20 per GiB, at most 6 h)")
    s.add_argument("--load-nice", type=int, default=10, choices=range(40), metavar="N",
                   help="raise a loading replica's nice value (and a spare's, from its start) "
                        "by N until it is ready, so loads yield the CPU to serving replicas; "
                        "giving the value back needs root, CAP_SYS_NICE or ulimit -e 20 (a "
                        "systemd unit's LimitNICE=20), without which loads run at the serving "
                        "priority (logged at start); 0: off (default: %(default)s)")
    s.add_argument("--load-wait", type=float, default=300.0, metavar="S",
                   help="seconds a request waits for its model before a 503 (its message and "
                        "loading.why say what it waited for)")
    s.add_argument("--max-wait", type=float, default=None, metavar="S",
                   help="a request waits at most this long for capacity other models hold: "
                        "past it a busy model is drained (no new request, its requests "
                        "finish) and the waiting one loads; 0: no bound (not given: 4 x the "
                        "model's load time, at least 30 s; a preset's max-wait wins)")
    s.add_argument("--drain-penalty", type=float, default=30.0, metavar="S",
                   help="a key of the keys file that caused n drains lately (halving every "
                        "10 min) waits S x (2^n - 1) s longer before its requests may drain "
                        "another busy model (at most an hour); loads into room are not "
                        "delayed; 0: off (default: %(default)s)")
    s.add_argument("--min-residency", type=float, default=None, metavar="S",
                   help="a model swapped in keeps its capacity this long while it has "
                        "demand (not given: 3 x its load time, so loading stays under a "
                        "quarter of the time; an idle one is evicted as before; a preset's "
                        "min-residency wins)")
    s.add_argument("--demand-grace", type=float, default=2.0, metavar="S",
                   help="a model whose clients come back within this many seconds of its "
                        "last request (a chat, an agent: they think between requests) keeps "
                        "its capacity after each request, for three of its clients' measured "
                        "return gaps at most this long, instead of being evicted for another "
                        "the moment it is idle, where its reload is worth the waiting "
                        "requests' wait; 0: off (default: %(default)s)")
    s.add_argument("--models-memory-margin", type=float, default=0.0, metavar="MiB",
                   help="memory (MiB) that must stay free on every device after a load, "
                        "judged against the model's measured minimum")
    s.add_argument("--host-memory", type=float, default=None, metavar="MiB",
                   help="treat the host as having this much memory and no other users "
                        "(containers whose limit /proc/meminfo does not show; tests)")
    s.add_argument("--ttl", type=float, default=None, metavar="S",
                   help="unload a model idle this many seconds after its last request ended "
                        "(not given: never; a preset's ttl wins)")
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
    s.add_argument("--sleep-idle-seconds", type=float, default=None, metavar="S",
                   help="free an idle model's weights after this many seconds, keeping its "
                        "process; the next request wakes it (not given: never)")
    s.add_argument("--spares", type=int, default=1, metavar="N",
                   help="instance processes kept started with llama-cpp-python imported, so "
                        "a cold load costs only the model's own load time")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' (compared in "
                        "constant time) on every route but /health and the web page; several "
                        "keys separated by commas, as "
                        "llama-server takes them, each its own tenant (--cache-scope, slot "
                        "fairness) (default: $GGMUX_API_KEY; none: open). On "
                        "a command line any local user can read it (ps) until the server has "
                        "started, and the shell's history keeps it: prefer $GGMUX_API_KEY")
    s.add_argument("--admin-key", default=None, metavar="KEY",
                   help="the only key that loads and unloads (in every API), reloads, clears "
                        "caches, drains, reads /logs, /requests and /usage, manages /keys, "
                        "and sees model file paths and request ids in /props and /slots; it "
                        "also serves every other route and is never limited (default: "
                        "$GGMUX_ADMIN_KEY; none: the --api-key keys do all of that, a keys "
                        "file's keys none of it)")
    s.add_argument("--cache-scope", choices=CACHE_SCOPES, default=None, metavar="SCOPE",
                   help="whose prompt cache a request may reuse in a built-in instance: key "
                        "(only one made with the same API key), global (anyone's, as "
                        "llama-server), none; default: key when --api-key or --admin-key is "
                        "set, else global (a preset's cache-scope wins)")
    # --- keys with limits (issue 36: supervisor/keys.py) ---
    s.add_argument("--keys", default=None, metavar="FILE",
                   help="keys file (INI, one section per key name: key or key-sha256, models, "
                        "rpm, tpm, max-parallel, tokens-per-day|week|month, spend-per-month, "
                        "expires, disabled; the manual's keys page); read at start and on "
                        "reload; --api-key keys stay keys without limits")
    s.add_argument("--keys-max", type=int, default=256, metavar="N",
                   help="keys the key table holds (a key keeps its row for the server's life)")
    # --- end of keys with limits ---
    add_routing_options(s)
    s.add_argument("--queue-timeout", type=float, default=30.0, metavar="S",
                   help="seconds a request waits for a replica below its max-concurrency "
                        "before a 429")
    s.add_argument("--max-queue", type=int, default=64, metavar="N",
                   help="requests per model and proxy that may wait for a free replica; "
                        "more get 429")
    s.add_argument("--stream-keepalive", type=float, default=5.0, metavar="S",
                   help="a streaming request waiting for its model gets the SSE head and a "
                        "comment every this many seconds; an Anthropic or Responses stream "
                        "without content (a long prefill) gets the API's opening events and "
                        "its keep-alive event (ping, response.in_progress) this often until "
                        "its first token; Ollama's NDJSON has no such event and gets none")
    s.add_argument("--cors-origins", default="*", metavar="LIST",
                   help="origins browsers may call from: '*' (any, without credentials; "
                        "llama-server's default), or a comma-separated list, which also get "
                        "credentials ('localhost': every page of this machine, as "
                        "llama-server's); admin routes take listed origins only, never '*'; "
                        "'' turns CORS off")
    s.add_argument("--allowed-hosts", default="", metavar="NAMES",
                   help="Host names the server answers to besides its own (localhost, IP "
                        "addresses, one-label names, .localhost/.local/.internal, --host, "
                        "the machine's names): a comma-separated list (*.domain globs), which "
                        "also turns the check on when --host is not loopback; '*' turns it "
                        "off. Other names get 403 (a page that rebinds its DNS name to this "
                        "machine, DNS rebinding); by default checked while --host is loopback")
    s.add_argument("--first-byte-timeout", type=float, default=600.0, metavar="S",
                   help="a replica that sends no byte of its answer within this many seconds "
                        "hangs: the request gets 504, the replica a fault (a preset's "
                        "first-byte-timeout wins)")
    s.add_argument("--stream-idle-timeout", type=float, default=300.0, metavar="S",
                   help="a replica that sends nothing for this many seconds once it answered "
                        "hangs: the stream ends with an error event, the replica a fault")
    s.add_argument("--log-level", default="INFO", metavar="LEVEL",
                   help="DEBUG, INFO, WARNING, ERROR; every scheduling decision is logged at "
                        "INFO with its reason")
    s.add_argument("--log-ring-bytes", type=int, default=1 << 20, metavar="N",
                   help="bytes of recent log lines (the supervisor's and every child's) kept "
                        "for GET /logs and ggmux logs")
    s.add_argument("--requests-kept", type=int, default=1000, metavar="N",
                   help="requests each proxy keeps in the request ring (time, model, replica, "
                        "API, status, tokens, TTFT, duration) for GET /requests, the page's "
                        "requests table and ggmux logs --requests), about 160 bytes each; the "
                        "usage ledger reads the ring too, so this bounds the requests per proxy "
                        "between two of its reads")
    s.add_argument("--log-requests-bodies", action="store_true",
                   help="keep, with each request of the request ring, the first "
                        f"{REQUEST_EXCERPT_BYTES} bytes of its prompt's last message and of "
                        "its answer's text (off: no prompt or answer text is kept)")
    s.add_argument("--watch-config", action="store_true",
                   help="reload, as SIGHUP does, within a second of a change to the preset "
                        "file or a models dir")
    add_http_limit_options(s)
    s.add_argument("--media-fetch", action="store_true",
                   help="let a request's images and audio be http(s) URLs that the instance "
                        "fetches (10 MB, 10 s); off: data: URLs and base64 only, so a client "
                        "cannot make this machine open connections (llama-server fetches them)")
    add_request_limit_options(s)
    add_reasoning_option(s)
    add_cluster_options(s)
    # --- usage ledger (issue 36): --ledger, --ledger-buffer, --state-dir ---
    add_ledger_options(s)
    add_kv_events_options(s)
    # --- end usage ledger ---
    s.add_argument("--node-drain-timeout", type=float, default=120.0, metavar="S",
                   help="cluster mode: a drain (SIGTERM, POST /cluster/drain) waits at most "
                        "this many seconds for the requests in flight before the node leaves")
    apply_env_defaults(s, environ)
    add_client_commands(sub)
    return ap
