"""``ggmux`` command line: ``ggmux serve [options]``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..shm.segment import queue_name, segment_name
from .main import Config, Supervisor
from .registry import ModelEntry, Registry, demo_models, scan_models_dir

log = logging.getLogger("ggmux")

MiB = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ggmux", description="Many local GGUF models behind one "
                                 "OpenAI-compatible port.")
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the server",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    s.add_argument("--host", default="127.0.0.1", help="address the proxies listen on")
    s.add_argument("--port", type=int, default=8080, help="public port")
    s.add_argument("--proxies", type=int, default=os.cpu_count() or 1,
                   help="proxy processes sharing the port (SO_REUSEPORT)")
    s.add_argument("--models-dir", action="append", default=[],
                   help="folder whose *.gguf files are models named after their files "
                        "(repeatable)")
    s.add_argument("--fake-models-dir", default=None,
                   help="folder whose *.json files are fake models (tests; see "
                        "ggmux.instance.fake)")
    s.add_argument("--models-max", type=int, default=4,
                   help="most model replicas running at once (llama.cpp --models-max)")
    s.add_argument("--ctx-size", "-c", type=int, default=2048, help="context size, tokens")
    s.add_argument("--threads", "-t", type=int, default=None,
                   help="generation threads per instance (default: llama.cpp's)")
    s.add_argument("--n-gpu-layers", "-ngl", type=int, default=0, help="layers offloaded to GPU")
    s.add_argument("--stop-timeout", type=float, default=10.0,
                   help="seconds between 'exit' and SIGTERM when stopping an instance")
    s.add_argument("--load-timeout", type=float, default=None,
                   help="load deadline, seconds (default: 300 + 20 per GiB, at most 6 h)")
    s.add_argument("--load-wait", type=float, default=300.0,
                   help="seconds a request waits for its model to load before a 503")
    s.add_argument("--models-memory-margin", type=float, default=0.0, metavar="MiB",
                   help="memory (MiB) that must stay free on every device after a load, "
                        "judged against the model's measured minimum")
    s.add_argument("--host-memory", type=float, default=None, metavar="MiB",
                   help="treat the host as having this much memory and no other users "
                        "(containers whose limit /proc/meminfo does not show; tests)")
    s.add_argument("--ttl", type=float, default=None,
                   help="unload a model idle this many seconds after its last request ended "
                        "(a preset's ttl wins)")
    s.add_argument("--sleep-idle-seconds", type=float, default=None,
                   help="free an idle model's weights after this many seconds, keeping its "
                        "process; the next request wakes it")
    s.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return ap


def build_registry(args: argparse.Namespace) -> Registry:
    """Registry from the sources on the command line; the demo models when
    none is given. Command-line model options override every source."""
    entries: list[ModelEntry] = []
    for d in args.models_dir:
        entries += scan_models_dir(d)
    if args.fake_models_dir:
        entries += scan_models_dir(args.fake_models_dir, "*.json", kind="fake")
    if not args.models_dir and not args.fake_models_dir:
        entries = demo_models()
    for e in entries:
        e.ctx_size = args.ctx_size
        if args.threads:
            e.threads = args.threads
        e.n_gpu_layers = args.n_gpu_layers
        e.stop_timeout = args.stop_timeout
    return Registry(entries)


def serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        registry = build_registry(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"ggmux: {e}", file=sys.stderr)
        return 2
    if not len(registry):
        print("ggmux: no models found (give --models-dir, or pip install 'ggmux[demo]')",
              file=sys.stderr)
        return 2
    if args.proxies < 1 or args.models_max < 1:
        print("ggmux: --proxies and --models-max must be at least 1", file=sys.stderr)
        return 2
    cfg = Config(
        host=args.host, port=args.port, proxies=args.proxies, models_max=args.models_max,
        stop_timeout=args.stop_timeout, load_timeout=args.load_timeout,
        load_wait=args.load_wait, shm_name=segment_name(args.port),
        mq_name=queue_name(args.port), proxy_args=["--log-level", args.log_level],
        memory_margin=int(args.models_memory_margin * MiB),
        host_memory=int(args.host_memory * MiB) if args.host_memory else None,
        ttl=args.ttl, sleep_idle=args.sleep_idle_seconds,
    )
    for e in registry.entries:
        log.info("model %s: %s", e.name, e.path)
    return Supervisor(cfg, registry).run()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
