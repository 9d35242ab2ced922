"""``python -m ggmux.proxy``: one proxy worker process (see
:mod:`ggmux.proxy.server`): its arguments, its keys (read from the pipe the
supervisor passes as ``--keys-fd``, never argv or the environment: issue
11), the uvloop event loop, the listening socket (``SO_REUSEPORT``), and the
supervisor's wake-ups on stdin."""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import signal
import sys
from collections.abc import Callable

from setproctitle import setproctitle

from .. import compiled
from ..http1 import (
    HttpConnection,
    HttpLimits,
    add_http_limit_options,
    fit_fd_limit,
    limits_from_args,
)
from ..http1.auth import read_keys
from ..shm.logring import log_to_stderr
from .balancer import DEFAULT_CONFIG, MODES, BalancerConfig
from .drain_penalty import DEFAULT_PENALTY_S
from .hosts import HostCheck
from .server import Proxy

log = logging.getLogger(__name__)

GC_GEN0_THRESHOLD = 10_000  # allocations between young collections (CPython's default: 700)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The worker's options (the supervisor passes them; see ``supervisor/cli.py``)."""
    ap = argparse.ArgumentParser(prog="python -m ggmux.proxy")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--shm", required=True)
    ap.add_argument("--mq", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--load-wait", type=float, default=300.0)
    ap.add_argument("--queue-timeout", type=float, default=30.0)
    ap.add_argument("--max-queue", type=int, default=64)
    ap.add_argument("--stream-keepalive", type=float, default=5.0)
    ap.add_argument("--first-byte-timeout", type=float, default=600.0)
    ap.add_argument("--stream-idle-timeout", type=float, default=300.0)
    ap.add_argument("--keys-fd", type=int, default=None,
                    help="inherited pipe holding {\"api_key\", \"admin_key\"} as JSON")
    ap.add_argument("--cors-origins", default="*")
    ap.add_argument("--allowed-hosts", default="")
    ap.add_argument("--drain-penalty", type=float, default=DEFAULT_PENALTY_S)
    ap.add_argument("--balance", choices=MODES, default="prefix")
    ap.add_argument("--prefix-weight", type=float, default=DEFAULT_CONFIG.prefix_weight)
    ap.add_argument("--prefix-disk-weight", type=float,
                    default=DEFAULT_CONFIG.prefix_disk_weight)
    ap.add_argument("--prefix-load-threshold", type=float,
                    default=DEFAULT_CONFIG.prefix_load_threshold)
    ap.add_argument("--cache-scope", choices=("key", "global", "none"), default="global")
    ap.add_argument("--key-table", default=None,
                    help="the key table's segment (keys' windows, priced replicas' spend)")
    ap.add_argument("--keyed", action="store_true",
                    help="a keys file is set (ggmux serve --keys): its keys open the routes")
    ap.add_argument("--log-level", default="INFO")
    add_http_limit_options(ap)
    return ap.parse_args(argv)


def _on_sigterm(proxy: Proxy, supervisor_pid: int) -> Callable[[], None]:
    """The SIGTERM handler: while the supervisor lives the proxy leaves its
    stop to it (issue 37, item 9: a group-wide SIGTERM, systemd's
    ``KillMode=control-group``, stopped every proxy's loop at once and cut
    the streams it relayed); the supervisor closes our stdin when its own
    drain starts, and :meth:`Proxy.drain` answers everything accepted. With
    the supervisor gone, SIGTERM starts that drain itself."""
    told: list[bool] = []

    def on_term() -> None:
        if os.getppid() != supervisor_pid and not proxy.stopping:
            proxy.drain()
        elif not told:
            told.append(True)
            log.info("proxy %d: SIGTERM ignored, the supervisor drains the server",
                     proxy.index)

    return on_term


def main(argv: list[str] | None = None) -> int:
    """Run one worker until SIGTERM or the end of its drain; returns 0."""
    args = parse_args(argv)
    setproctitle(f"ggmux: proxy {args.index} :{args.port}")
    # the supervisor reads our stderr: it adds the time and the tag; one
    # line per record, control characters escaped (issue 31, item 3)
    log_to_stderr(args.log_level.upper(), "%(levelname)s %(name)s: %(message)s")
    if args.index == 0:  # one line per server: compiled or pure Python, and why
        compiled.log_status(logging.getLogger(__name__))
    import uvloop

    loop = uvloop.new_event_loop()
    asyncio.set_event_loop(loop)
    # keys come through a pipe, never argv or the environment (issue 11)
    keys = read_keys(args.keys_fd) if args.keys_fd is not None else {}
    proxy = Proxy(
        args.index, args.shm, args.mq, args.load_wait, args.queue_timeout, args.max_queue,
        api_key=keys.get("api_key") or None, admin_key=keys.get("admin_key") or None,
        stream_keepalive=args.stream_keepalive, first_byte_timeout=args.first_byte_timeout,
        stream_idle_timeout=args.stream_idle_timeout, cors_origins=args.cors_origins,
        tenant_secret=keys.get("tenant_secret") or None,
        balancer=BalancerConfig(mode=args.balance, prefix_weight=args.prefix_weight,
                                prefix_disk_weight=args.prefix_disk_weight,
                                prefix_load_threshold=args.prefix_load_threshold),
        cache_scope=args.cache_scope, key_table=args.key_table,
        keyed=args.keyed, hosts=HostCheck(args.host, args.allowed_hosts),
        drain_penalty=args.drain_penalty,
    )
    proxy.usage.spec = keys.get("ledger") or ""  # the usage ledger's store (issue 36)
    del keys
    limits: HttpLimits = fit_fd_limit(limits_from_args(args))
    server = loop.run_until_complete(
        loop.create_server(
            lambda: HttpConnection(proxy.handle, limits, fast=proxy.fast), args.host, args.port,
            reuse_port=True, backlog=2048,
        )
    )
    proxy.server = server
    proxy.connections = limits.connections
    os.set_blocking(0, False)
    loop.add_reader(0, proxy.on_notify)
    loop.add_signal_handler(signal.SIGTERM, _on_sigterm(proxy, os.getppid()))
    # the objects of start-up live as long as the process: out of the
    # collector's sight (gc.freeze), and young collections rarer, since a
    # request's objects die by reference count and few survive to be scanned
    # (4% more forwarded requests/s under wrk)
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    os.write(1, b"ready\n")
    prof = None
    if os.environ.get("GGMUX_PROFILE"):  # developer aid: cProfile stats at exit
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        loop.run_forever()
    finally:
        server.close()
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{os.environ['GGMUX_PROFILE']}.{args.index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
