"""The pod's KV events publisher: a child of the supervisor (``--kv-events``).

Every instance pushes its cache's events (:mod:`ggmux.instance.kv_events`)
to this process's collector (a ZMQ PULL socket on a private ``ipc://``
path). It merges them into the pod's view and publishes them as vLLM's
``ZmqEventPublisher`` does (``vllm/distributed/kv_events.py``), so an
endpoint picker subscribes to a ggmux pod as to a vLLM one:

* a PUB socket on ``--endpoint`` (bound when it holds ``*`` or ``::`` or is
  ``ipc://``, else connected: a picker that binds its SUB socket, as
  llm-d's does, is connected to), its high-water mark ``--hwm``;
* multipart messages ``(topic, seq, payload)``: ``seq`` an 8-byte big-endian
  counter of this process, ``payload`` msgpack of vLLM's ``EventBatch``
  (an array ``[ts, events]``; ``data_parallel_rank`` left out: one publisher
  per pod), the events tagged maps (see :mod:`ggmux.instance.kv_events`);
* an optional ROUTER replay socket on ``--replay``: a request holding a
  start ``seq`` (8 bytes, big-endian) is answered with every buffered
  message from it on (the last ``--buffer-steps``), then ``(b"", -1, b"")``.

The merge: a block two replicas of one model hold (or one instance in two
tiers of the same medium) is stored once and removed when its last holder
drops it, counted per (medium, hash) over the pod. An instance's
``AllBlocksCleared`` (its model's cache cleared) becomes ``BlockRemoved``
of what only it held, or ``AllBlocksCleared`` when the pod then holds
nothing. An instance that exits (or dies) without saying so is found within
:data:`PID_CHECK_S` and its blocks are removed the same way. The first
message after a start is ``AllBlocksCleared``: a picker that indexed this
pod's previous incarnation forgets it.

``--topic`` may hold ``{model}``: then each model's events go under their
own topic (llm-d's ``kv@<pod>@<model>``); ``seq`` stays one counter for the
pod, as one vLLM publisher's.

Run as ``python -m ggmux.supervisor.kv_publisher --collect ADDR --endpoint
ADDR ...``; it exits on ``exit`` or EOF on stdin (so a dead supervisor never
leaves it behind).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import deque

import msgpack
import zmq

from ..instance.kv_events import ALL_CLEARED, BlockCounts, block_removed, stored_runs

log = logging.getLogger("ggmux.kv_publisher")

PID_CHECK_S = 1.0
"""Seconds between two looks at whether each instance that sent events still runs."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class PodBlocks:
    """The pod's blocks merged over its instances: :meth:`apply` takes one
    instance's events and returns the pod's (``[(model, events)]``)."""

    def __init__(self) -> None:
        self.counts = BlockCounts()
        self.held: dict[bytes, set[tuple[str, int]]] = {}  # instance -> (medium, hash)
        self.model: dict[bytes, str] = {}

    def apply(self, who: bytes, model: str, events: list[dict]) -> list[dict]:
        """The pod's events for instance ``who``'s ``events``."""
        self.model[who] = model
        held = self.held.setdefault(who, set())
        out: list[dict] = []
        for ev in events:
            kind = ev.get("type")
            if kind == "BlockStored":
                medium, hashes = ev.get("medium"), list(ev.get("block_hashes") or ())
                fresh = [h for h in hashes if (medium, h) not in held]
                held.update((medium, h) for h in fresh)
                new = self.counts.add(medium, fresh)
                if new:
                    extra = ev.get("extra_keys") or [()] * len(hashes)
                    out.extend(stored_runs(medium, hashes, ev.get("parent_block_hash"), new,
                                           list(ev.get("token_ids") or ()), extra,
                                           int(ev.get("block_size") or 1),
                                           ev.get("lora_name") or model))
            elif kind == "BlockRemoved":
                medium = ev.get("medium")
                mine = [h for h in ev.get("block_hashes") or () if (medium, h) in held]
                held.difference_update((medium, h) for h in mine)
                gone = self.counts.drop(medium, mine)
                if gone:
                    out.append(block_removed(medium, gone))
            elif kind == "AllBlocksCleared":
                out.extend(self.forget(who))
        return out

    def forget(self, who: bytes) -> list[dict]:
        """Instance ``who`` holds nothing any more (cleared, or gone)."""
        held = self.held.pop(who, set())
        by_medium: dict[str, list[int]] = {}
        for medium, h in held:
            by_medium.setdefault(medium, []).append(h)
        out = []
        for medium, hashes in by_medium.items():
            gone = self.counts.drop(medium, hashes)
            if gone:
                out.append(block_removed(medium, gone))
        if held and not len(self.counts):
            return [dict(ALL_CLEARED)]
        return out


class ZmqPublisher:
    """The PUB and replay sockets, the sequence counter and the replay buffer."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None, topic: str,
                 buffer_steps: int, hwm: int) -> None:
        self.pub = ctx.socket(zmq.PUB)
        self.pub.set_hwm(hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self.pub.bind(endpoint)
        else:
            self.pub.connect(endpoint)
        self.replay = None
        if replay:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay)
        self.topic = topic
        self.seq = 0
        self.buffer: deque[tuple[bytes, int, bytes]] = deque(maxlen=max(1, buffer_steps))

    def publish(self, model: str, ts: float, events: list[dict]) -> None:
        if not events:
            return
        topic = self.topic.replace("{model}", model).encode()
        payload = msgpack.packb([ts, events])
        seq, self.seq = self.seq, self.seq + 1
        self.pub.send_multipart((topic, seq.to_bytes(8, "big"), payload))
        self.buffer.append((topic, seq, payload))

    def serve_replay(self) -> None:
        """Answer one replay request (vLLM's ``_service_replay``)."""
        frame = self.replay.recv_multipart()
        if len(frame) != 3:
            log.warning("a replay request of %d frames, not 3: ignored", len(frame))
            return
        client, _, start = frame
        first = int.from_bytes(start, "big")
        for topic, seq, payload in self.buffer:
            if seq >= first:
                self.replay.send_multipart((client, b"", topic, seq.to_bytes(8, "big"),
                                            payload))
        self.replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run(args: argparse.Namespace) -> int:
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.LINGER, 0)
    pull.bind(args.collect)
    try:
        out = ZmqPublisher(ctx, args.endpoint, args.replay, args.topic, args.buffer_steps,
                           args.hwm)
    except zmq.ZMQError as e:
        log.error("cannot open %s: %s", args.endpoint, e)
        pull.close(0)
        return 2
    pod = PodBlocks()
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    if out.replay is not None:
        poller.register(out.replay, zmq.POLLIN)
    stdin = sys.stdin.fileno()
    poller.register(stdin, zmq.POLLIN)
    out.publish("", time.time(), [dict(ALL_CLEARED)])
    log.info("publishing KV events on %s%s", args.endpoint,
             f" (replay on {args.replay})" if args.replay else "")
    next_check = time.monotonic() + PID_CHECK_S
    try:
        while True:
            ready = dict(poller.poll(PID_CHECK_S * 1000))
            if ready.get(stdin):
                line = os.read(stdin, 4096)
                if not line or b"exit" in line:
                    return 0
            if out.replay is not None and ready.get(out.replay):
                out.serve_replay()
            while ready.get(pull):
                try:
                    who, model, payload = pull.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except ValueError:
                    continue
                try:
                    ts, events = msgpack.unpackb(payload)
                except (ValueError, TypeError, msgpack.UnpackException):
                    log.warning("an instance sent a batch that does not decode: dropped")
                    continue
                name = model.decode("utf-8", "replace")
                out.publish(name, ts, pod.apply(who, name, events))
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + PID_CHECK_S
                for who in [w for w in pod.held if w.isdigit() and not _alive(int(w))]:
                    out.publish(pod.model.pop(who, ""), time.time(), pod.forget(who))
    finally:
        out.close()
        pull.close(0)


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m ggmux.supervisor.kv_publisher")
    ap.add_argument("--collect", required=True, help="the instances' PUSH address (bound)")
    ap.add_argument("--endpoint", required=True, help="the PUB address (vLLM's endpoint)")
    ap.add_argument("--replay", default=None, help="the ROUTER replay address (bound)")
    ap.add_argument("--topic", default="", help="topic; {model} is the model's name")
    ap.add_argument("--buffer-steps", type=int, default=10_000)
    ap.add_argument("--hwm", type=int, default=100_000)
    ap.add_argument("--log-level", default="INFO")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
