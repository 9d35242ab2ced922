"""The cluster agent: the supervisor's one child that talks to NATS.

Run as ``python -m ggmux.supervisor.cluster.agent``; it is the only process
that imports ``nats`` (DESIGN.md "Cluster"). It speaks the instance line
protocol (:mod:`ggmux.instance.protocol`): orders from the supervisor on
stdin, one JSON object a line (``{"cmd": ...}``; the first line is
``config``, so secrets never sit on a command line or in the environment),
and ``state:{json}`` lines on stdout with the cluster's view. Logs go to
stderr. stdin EOF (the supervisor died) makes it leave the cluster (delete
its node key and the load keys it holds, at most ``EXIT_DEADLINE_S``) and
exit.

The agent decides nothing for its machine; it is the supervisor's pipe to
the cluster:

* **node registry** (KV ``ggmux-nodes``): it writes the record the
  supervisor last sent (``publish``) under its node name every
  ``--heartbeat`` s, with a per-message TTL of ``--node-stale`` s, and
  watches the other nodes' keys. A node is dead once no beat of it has
  *arrived* for ``--node-stale`` s, judged by this process's monotonic clock
  (never by the timestamp inside, so a node whose clock is off is not judged
  dead while its beats arrive); a deleted key (a node that left) is gone at
  once.
* **loads** (KV ``ggmux-loads``): ``claim`` creates ``load.<model>`` naming
  a target node (the create fails if a load is on already, and the line
  says who holds it); ``hold`` makes this node the holder that renews it
  every beat while the supervisor says the load makes progress; ``release``
  deletes it. Every change of any load key is reported (``load`` lines).
* **commands** (request-reply on ``ggmux.node.<name>.cmd``): ``request``
  sends one to another node and reports the answer (``reply``); a command
  that arrives is handed to the supervisor (``order``), whose ``ack`` is
  the answer.
* **faults**: NATS unreachable at start or later: one ``unreachable`` line
  per outage, reconnect with doubling backoff capped at ``--heartbeat``,
  then republish (own key, held loads) and re-read the buckets (a node not
  seen since is judged from the reconnect). Bad credentials, a TLS failure
  or a node name that a live node holds: one ``refused`` line, exit 2.

State lines (``state`` field): ``joined`` (node, reconnect), ``unreachable``
(error, retry_in), ``refused`` (error), ``node`` (name, record,
arrived_ns: CLOCK_MONOTONIC ns of the beat's arrival), ``gone`` (name, why:
``stale`` or ``left``), ``load`` (model, entry or null), ``claimed`` (ref,
model, ok, holder, entry, error), ``lost`` (model, holder: another node
took a load key this one held), ``order`` (id, op, from, ...), ``reply``
(ref, node, op, ok, error, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass

import orjson

from ...instance import protocol
from ...shm.logring import log_to_stderr
from .load_keys import LoadKeys
from .names import LOADS_BUCKET, NODES_BUCKET, cmd_subject, load_key, model_from_key
from .nats_io import TOMBSTONE_OPS, Taken, connect, fatal_reason, open_bucket, put_if
from .node_commands import NodeCommands
from .options import ClusterOptions, redact

log = logging.getLogger("ggmux.supervisor.cluster.agent")

BACKOFF_MIN_S = 0.1  # first reconnect delay; doubles up to --heartbeat
EXIT_DEADLINE_S = 1.0  # leaving the cluster on stdin EOF takes at most this long


class NameTaken(Exception):
    """Another live node writes this node's key."""


@dataclass(slots=True)
class Seen:
    """Another node's last beat as this agent saw it arrive."""

    record: dict
    arrived_ns: int  # time.monotonic_ns() at arrival (or estimated, for a first read)
    revision: int


class Agent(LoadKeys, NodeCommands):
    """One agent process: see the module docstring for what it does.

    ``opts``: the supervisor's :class:`ClusterOptions` (from the ``config``
    line). Derived timings: connect timeout and backoff cap ``--heartbeat``
    (at least 1 s for the timeout), a command to another node times out
    after 2 beats, the supervisor gets 1 beat to answer an order.
    """

    def __init__(self, opts: ClusterOptions) -> None:
        self.o = opts
        self.incarnation = secrets.token_hex(8)
        self.record: dict = {}
        self.nodes: dict[str, Seen] = {}
        self.loads: dict[str, tuple[int, dict]] = {}  # model -> (revision, value)
        self.holding: dict[str, float] = {}  # model -> progress, for loads this node holds
        self.acks: dict[int, asyncio.Future] = {}
        self.order_id = 0
        self.nc = None
        self.js = None
        self.my_rev = 0
        self.beats = 0
        self.joined_once = False
        self.connected = False
        self.lost = asyncio.Event()
        self.wake = asyncio.Event()
        self.wake_beat = False  # publish(now=True): beat at the next tick
        self.leaving = False  # leave() runs: no more beats or renewals
        self.stale_ns = int(opts.node_stale * 1e9)

    # ---- the process -----------------------------------------------------
    async def run(self, reader: asyncio.StreamReader) -> int:
        """Serve until a refusal (returns 2); ``exit``/EOF end the process
        from :meth:`leave` (exit code 0)."""
        self.stdin_task = asyncio.create_task(self._read_stdin(reader))
        backoff = BACKOFF_MIN_S
        outage_told = False
        while True:
            try:
                nc = await asyncio.wait_for(self._connect(), max(1.0, self.o.heartbeat) * 2)
            except Exception as e:  # noqa: BLE001 - every connect failure is reported
                fatal = fatal_reason(e)
                if fatal:
                    return self._refuse(fatal)
                if not outage_told:
                    log.warning("cluster: NATS at %s unreachable (%s); serving this node's models "
                                "alone, retrying", redact(self.o.url), e or type(e).__name__)
                    protocol.emit("unreachable", error=str(e) or type(e).__name__,
                                  retry_in=backoff)
                    outage_told = True
                await self._pause(backoff)
                backoff = min(backoff * 2, self.o.heartbeat)
                continue
            backoff = BACKOFF_MIN_S
            try:
                await self._session(nc)
            except NameTaken as e:
                return self._refuse(str(e))
            except Exception as e:  # noqa: BLE001 - any session failure: reconnect
                log.warning("cluster: lost NATS at %s (%s); reconnecting",
                            redact(self.o.url), e or type(e).__name__)
                protocol.emit("unreachable", error=str(e) or type(e).__name__, retry_in=backoff)
                outage_told = True
            else:
                outage_told = False
            finally:
                self.connected = False
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(nc.close(), 1.0)

    def _refuse(self, why: str) -> int:
        log.error("cluster: %s", why)
        protocol.emit("refused", error=why)
        return 2

    async def _pause(self, seconds: float) -> None:
        self.wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.wake.wait(), seconds)

    async def _connect(self):
        lost = asyncio.Event()
        self.lost = lost

        async def on_gone() -> None:
            lost.set()
            self.wake.set()

        return await connect(self.o, on_gone)

    async def _read_stdin(self, reader: asyncio.StreamReader) -> None:
        while True:
            line = await reader.readline()
            if not line:
                await self.leave(EXIT_DEADLINE_S)
                return
            line = line.strip()
            if not line:
                continue
            if line == b"exit":
                await self.leave(5 * EXIT_DEADLINE_S)
                return
            try:
                order = orjson.loads(line)
                cmd = order.pop("cmd")
            except (orjson.JSONDecodeError, KeyError, AttributeError, TypeError):
                log.warning("cluster: bad order from the supervisor: %.200r", line)
                continue
            handler = getattr(self, f"cmd_{cmd}", None)
            if handler is None:
                log.warning("cluster: unknown order %r", cmd)
                continue
            try:
                res = handler(**order)
                if asyncio.iscoroutine(res):
                    asyncio.create_task(self._guard(res, cmd))
            except TypeError as e:
                log.warning("cluster: bad order %r: %s", cmd, e)

    async def _guard(self, coro, what: str) -> None:
        try:
            await coro
        except Exception as e:  # noqa: BLE001 - an order fails alone, the agent goes on
            log.warning("cluster: %s failed: %s", what, e or type(e).__name__)

    async def leave(self, deadline: float) -> None:
        """Delete this node's key and the load keys it holds, close, exit.

        The session goes on meanwhile (it stops beating), so nothing
        returns from :meth:`run` before the keys are gone."""
        if self.leaving:
            return
        self.leaving = True
        nc = self.nc
        if nc is not None and self.connected:
            async def bye() -> None:
                kv = await self.js.key_value(NODES_BUCKET)
                await kv.delete(self.o.node)
                lkv = await self.js.key_value(LOADS_BUCKET)
                for model in list(self.holding):
                    await lkv.delete(load_key(model))
                await nc.flush()

            try:
                await asyncio.wait_for(bye(), deadline)
            except Exception as e:  # noqa: BLE001 - leaving is best effort
                log.warning("cluster: could not leave cleanly: %r", e)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), deadline)
        os._exit(0)

    # ---- one connection ----------------------------------------------------
    async def _session(self, nc) -> None:
        self.nc = nc
        self.js = nc.jetstream(timeout=max(1.0, self.o.heartbeat))
        self.nodes_kv = await open_bucket(self.js, NODES_BUCKET, self.o.node_stale)
        self.loads_kv = await open_bucket(self.js, LOADS_BUCKET, self.o.node_stale)
        await self._claim_name()
        self.connected = True
        sub = await nc.subscribe(cmd_subject(self.o.node), cb=self._on_command)
        # the server must know the subscription before anyone hears we joined:
        # nats-py sends SUB from a buffer, and a request that came first would
        # find no responder (a test's order to a just-joined node, 1 in ~20)
        await nc.flush(timeout=max(1.0, self.o.heartbeat))
        reconnected_ns = time.monotonic_ns()
        for seen in self.nodes.values():  # judged from now: their beats could not arrive
            seen.arrived_ns = max(seen.arrived_ns, reconnected_ns)
        watchers = [asyncio.create_task(self._watch_nodes()),
                    asyncio.create_task(self._watch_loads())]
        log.info("cluster: node %s joined through %s", self.o.node, redact(self.o.url))
        protocol.emit("joined", node=self.o.node, reconnect=self.joined_once)
        self.joined_once = True
        for model in list(self.holding):
            await self._renew(model)
        tick = max(0.05, self.o.heartbeat / 4)
        next_beat = time.monotonic() + self.o.heartbeat
        try:
            while not self.lost.is_set():
                self.wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wake.wait(), tick)
                if self.lost.is_set():
                    break
                for w in watchers:
                    if w.done() and w.exception() is not None:
                        raise w.exception()
                self._judge()
                if self.leaving:
                    continue
                if self.wake_beat or time.monotonic() >= next_beat:
                    self.wake_beat = False
                    await self._beat()
                    for model in list(self.holding):
                        await self._renew(model)
                    next_beat = time.monotonic() + self.o.heartbeat
            raise ConnectionError("connection closed")
        finally:
            for w in watchers:
                w.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _put(self, bucket: str, key: str, value: bytes, last: int) -> int:
        return await put_if(self.js, bucket, key, value, last, self.o.node_stale)

    def _value(self) -> bytes:
        self.beats += 1
        return orjson.dumps({**self.record, "node": self.o.node, "incarnation": self.incarnation,
                             "beat": self.beats, "sent": time.time()})

    async def _claim_name(self) -> None:
        """Write this node's key, unless a live node of the same name does:
        a key of another incarnation blocks until it expires (a dead node,
        at most ``--node-stale``) or is rewritten (a live one: refuse)."""
        first_seq = None
        deadline = time.monotonic() + self.o.node_stale + self.o.heartbeat
        while True:
            try:
                self.my_rev = await self._put(NODES_BUCKET, self.o.node, self._value(),
                                              self.my_rev)
                return
            except Taken as t:
                if t.value.get("incarnation") == self.incarnation:
                    self.my_rev = t.seq
                    continue
                if first_seq is None:
                    first_seq = t.seq
                    log.info("cluster: key %s exists; waiting to see whether its node is alive",
                             self.o.node)
                elif t.seq != first_seq or time.monotonic() > deadline:
                    raise NameTaken(
                        f"--node-name {self.o.node} is taken by a live node "
                        f"(advertising {t.value.get('url', '?')}); give this node another "
                        "--node-name") from None
                self.my_rev = 0
                await asyncio.sleep(min(0.25, self.o.heartbeat / 4))

    async def _beat(self) -> None:
        try:
            self.my_rev = await self._put(NODES_BUCKET, self.o.node, self._value(), self.my_rev)
        except Taken as t:
            if t.value.get("incarnation") == self.incarnation:
                self.my_rev = t.seq
                return
            raise NameTaken(f"--node-name {self.o.node} is now written by another node "
                            f"(advertising {t.value.get('url', '?')})") from None

    def _judge(self) -> None:
        now = time.monotonic_ns()
        for name, seen in list(self.nodes.items()):
            if now - seen.arrived_ns > self.stale_ns:
                del self.nodes[name]
                age = (now - seen.arrived_ns) / 1e9
                log.warning("cluster: node %s is stale (last beat %.1f s ago)", name, age)
                protocol.emit("gone", name=name, why="stale", age_s=round(age, 3))

    # ---- watching ---------------------------------------------------------
    async def _watch(self, kv, on_entry, on_snapshot) -> None:
        watcher = await kv.watchall()
        snapshot: list = []
        initial = True
        async for e in watcher:
            if e is None:
                if initial:
                    initial = False
                    on_snapshot(snapshot)
                    snapshot = []
                continue
            if initial:
                snapshot.append(e)
            else:
                on_entry(e, time.monotonic_ns())

    async def _watch_nodes(self) -> None:
        def snapshot(entries) -> None:
            now = time.monotonic_ns()
            stamps = [e.created for e in entries if e.created]
            newest = max(stamps) if stamps else None
            for e in entries:
                behind = 0
                if newest is not None and e.created:
                    behind = int(max(0.0, (newest - e.created).total_seconds()) * 1e9)
                self._node_entry(e, now - behind)

        await self._watch(self.nodes_kv, self._node_entry, snapshot)

    def _node_entry(self, e, arrived_ns: int) -> None:
        name = e.key
        if name == self.o.node:
            return
        if e.operation == "PURGE":
            # the key's TTL ran out on the server: no verdict here, the node
            # is judged by the arrival of its beats (and after a NATS restart
            # every key may have expired while each node is still alive)
            return
        if e.operation == "DEL" or not e.value:
            if self.nodes.pop(name, None) is not None:
                log.info("cluster: node %s left", name)
                protocol.emit("gone", name=name, why="left")
            return
        try:
            record = orjson.loads(e.value)
        except orjson.JSONDecodeError:
            log.warning("cluster: node %s wrote a record that is not JSON", name)
            return
        if not isinstance(record, dict):
            return
        known = self.nodes.get(name)
        if known is None:
            log.info("cluster: node %s at %s", name, record.get("url", "?"))
        else:
            # a node's arrival never moves back: after an outage a known node
            # is judged from the reconnect (set in _session), not from the old
            # key a snapshot still holds (its node may not have rewritten it yet)
            arrived_ns = max(arrived_ns, known.arrived_ns)
        self.nodes[name] = Seen(record, arrived_ns, e.revision)
        protocol.emit("node", name=name, record=record, arrived_ns=arrived_ns)

    async def _watch_loads(self) -> None:
        def snapshot(entries) -> None:
            before = set(self.loads)
            for e in entries:
                self._load_entry(e, 0)
            now = {model_from_key(e.key) for e in entries if e.key.startswith("load.")}
            for model in before - now:
                if self.loads.pop(model, None) is not None:
                    protocol.emit("load", model=model, entry=None)

        await self._watch(self.loads_kv, self._load_entry, snapshot)

    def _load_entry(self, e, _arrived_ns: int) -> None:
        try:
            model = model_from_key(e.key)
        except ValueError:
            return
        if e.operation in TOMBSTONE_OPS or not e.value:
            self.loads.pop(model, None)
            protocol.emit("load", model=model, entry=None)
            return
        try:
            value = orjson.loads(e.value)
        except orjson.JSONDecodeError:
            return
        self.loads[model] = (e.revision, value)
        holder = value.get("node")
        if model in self.holding and holder != self.o.node:
            del self.holding[model]
            protocol.emit("lost", model=model, holder=holder)
        protocol.emit("load", model=model, entry=value)

    # ---- orders from the supervisor ---------------------------------------
    def cmd_publish(self, record: dict, now: bool = False) -> None:
        """Replace this node's record; ``now``: write it at once."""
        self.record = record
        if now:
            self.wake_beat = True
            self.wake.set()


async def _main() -> int:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=64 << 20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    first = await reader.readline()
    try:
        cfg = orjson.loads(first)
        if cfg.pop("cmd") != "config":
            raise ValueError("the first line must be config")
        opts = ClusterOptions(**cfg)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        if not first:
            return 0
        log.error("cluster agent: bad config line: %s", e)
        protocol.emit("refused", error=f"bad agent config: {e}")
        return 2
    agent = Agent(opts)
    loop.add_signal_handler(signal.SIGTERM, lambda: asyncio.ensure_future(agent.leave(1.0)))
    return await agent.run(reader)


def main() -> None:
    """Entry point: ``python -m ggmux.supervisor.cluster.agent``."""
    protocol.claim_stdout()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the supervisor decides when this one ends
    log_to_stderr(os.environ.get("GGMUX_LOG_LEVEL", "INFO").upper(),
                  "%(levelname)s %(name)s: %(message)s")  # one line a record (issue 31)
    code = asyncio.run(_main())
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
