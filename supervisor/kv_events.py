"""``ggmux serve --kv-events ENDPOINT``: the pod publishes its KV cache's
events as vLLM does, for an endpoint picker's precise-prefix scorer.

The options (vLLM's ``--kv-events-config`` fields, with its defaults), the
collector address the instances push to (an ``ipc://`` socket in a private
folder, mode 0700, removed at exit), the arguments each instance gets, and
:class:`KVEventsChild`: the publisher process (:mod:`.kv_publisher`), started
with the server, started again after a crash (backoff, doubling to
:data:`RESTART_MAX_S`), stopped at exit.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

from .children import Child, ChildSet

log = logging.getLogger(__name__)

RESTART_MIN_S = 0.5
RESTART_MAX_S = 30.0
MAX_BLOCK_SIZE = 1024


@dataclass(slots=True)
class KVEventsOptions:
    """``endpoint``: the PUB address (``tcp://*:5557`` binds, ``tcp://host:port``
    connects); ``replay``: the ROUTER replay address or None; ``topic``
    (``{model}``: the model's name); ``block_size``: tokens per block;
    ``buffer_steps``: batches kept for replay; ``hwm``: the PUB socket's
    high-water mark; ``folder``: the private folder of the collector socket."""

    endpoint: str
    replay: str | None = None
    topic: str = ""
    block_size: int = 16
    buffer_steps: int = 10_000
    hwm: int = 100_000
    folder: str = ""

    @property
    def collect(self) -> str:
        return f"ipc://{self.folder}/collect"

    def instance_argv(self) -> list[str]:
        """What each built-in instance is started with."""
        return ["--kv-events", self.collect, "--kv-events-block-size", str(self.block_size)]


def add_kv_events_options(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("KV events (an endpoint picker's precise-prefix scorer)")
    g.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                   help="publish every replica's KV cache changes as vLLM's KV events "
                        "(BlockStored, BlockRemoved, AllBlocksCleared; ZMQ PUB, msgpack) on "
                        "ENDPOINT: tcp://*:5557 binds, tcp://HOST:PORT connects (to a "
                        "picker that binds); default: off")
    g.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                   help="a ROUTER socket where a subscriber asks for the batches it missed "
                        "(vLLM's replay_endpoint), e.g. tcp://*:5558")
    g.add_argument("--kv-events-topic", default="",
                   help="the messages' topic (vLLM's topic); {model} becomes the model's "
                        "name, e.g. kv@$(POD_IP)@{model} for llm-d")
    g.add_argument("--kv-events-block-size", type=int, default=16,
                   help="tokens per KV block in the events and in "
                        "vllm:cache_config_info (the picker's block size must match)")
    g.add_argument("--kv-events-buffer-steps", type=int, default=10_000,
                   help="batches kept for replay (vLLM's buffer_steps)")
    g.add_argument("--kv-events-hwm", type=int, default=100_000,
                   help="messages queued for slow subscribers before new ones drop "
                        "(vLLM's hwm)")


def kv_events_options(args: argparse.Namespace) -> KVEventsOptions | None:
    """The options of ``args``, checked (``ValueError`` naming the option at
    fault), with the collector's private folder made; None when off."""
    endpoint = getattr(args, "kv_events", None)
    if not endpoint:
        return None
    for name, v in (("--kv-events", endpoint),
                    ("--kv-events-replay", getattr(args, "kv_events_replay", None))):
        if v is not None and not v.startswith(("tcp://", "ipc://")):
            raise ValueError(f"{name} must be a ZMQ address (tcp://*:5557, tcp://HOST:PORT "
                             f"or ipc://PATH), not {v!r}")
    bs = args.kv_events_block_size
    if not 1 <= bs <= MAX_BLOCK_SIZE:
        raise ValueError(f"--kv-events-block-size must be 1-{MAX_BLOCK_SIZE}, not {bs}")
    for name in ("buffer_steps", "hwm"):
        if getattr(args, f"kv_events_{name}") < 1:
            raise ValueError(f"--kv-events-{name.replace('_', '-')} must be at least 1")
    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError("--kv-events needs pyzmq and msgpack (ggmux's own dependencies): "
                         "pip install pyzmq msgpack")
    return KVEventsOptions(endpoint, args.kv_events_replay, args.kv_events_topic, bs,
                           args.kv_events_buffer_steps, args.kv_events_hwm,
                           tempfile.mkdtemp(prefix="ggmux-kv-"))


class KVEventsChild:
    """The publisher process; see the module docstring."""

    def __init__(self, opts: KVEventsOptions, children: ChildSet, log_level: str = "INFO"):
        self.opts = opts
        self.children = children
        self.log_level = log_level
        self.child: Child | None = None
        self.restart_at = 0.0
        self.backoff = RESTART_MIN_S
        self.started = 0.0
        self.closing = False

    def start(self) -> None:
        o = self.opts
        argv = [sys.executable, "-m", "ggmux.supervisor.kv_publisher", "--collect", o.collect,
                "--endpoint", o.endpoint, "--topic", o.topic,
                "--buffer-steps", str(o.buffer_steps), "--hwm", str(o.hwm),
                "--log-level", self.log_level]
        if o.replay:
            argv += ["--replay", o.replay]
        self.started = time.monotonic()
        try:
            self.child = self.children.start(argv, "kv-events")
        except OSError as e:
            log.error("KV events: cannot start the publisher: %s", e)
            self.child = None
            self.backoff = min(RESTART_MAX_S, self.backoff * 2)
            self.restart_at = self.started + self.backoff

    def alive(self) -> bool:
        return self.child is not None

    def reap(self) -> None:
        """An exited publisher is started again after a backoff (unless closing)."""
        if self.child is None:
            return
        code = self.children.reap(self.child)
        if code is None:
            return
        self.child = None
        if self.closing:
            return
        ran = time.monotonic() - self.started
        self.backoff = RESTART_MIN_S if ran > RESTART_MAX_S else min(
            RESTART_MAX_S, self.backoff * 2)
        self.restart_at = time.monotonic() + self.backoff
        log.warning("KV events: the publisher exited (code %s); starting it again in %.1f s "
                    "(subscribers see AllBlocksCleared, then the caches as they fill)",
                    code, self.backoff)

    def step(self) -> None:
        if self.child is None and not self.closing and time.monotonic() >= self.restart_at:
            self.start()

    def close(self) -> None:
        """Ask the publisher to exit (stdin EOF)."""
        self.closing = True
        if self.child is not None:
            self.child.close_stdin()

    def kill(self) -> None:
        if self.child is not None:
            self.child.kill(signal.SIGKILL)

    def remove_folder(self) -> None:
        shutil.rmtree(self.opts.folder, ignore_errors=True)
        if os.path.exists(self.opts.folder):
            log.warning("KV events: could not remove %s", self.opts.folder)


__all__ = ["KVEventsChild", "KVEventsOptions", "add_kv_events_options", "kv_events_options"]
