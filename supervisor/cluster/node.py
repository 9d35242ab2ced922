"""This node's part in the cluster, inside the supervisor's loop (DESIGN.md
"Cluster"). :class:`ClusterNode` runs the cluster agent child (the one that
speaks NATS, :mod:`.agent`), reads its state lines and turns the cluster's
view into this machine's decisions; the supervisor stays the only writer of
shared memory and the only decision maker for its machine.

Each loop turn (:meth:`ClusterNode.step`):

* **publish**: this node's record to the agent every half beat, at once when
  a model's state or the draining flag changes;
* **remote replicas**: one per model another live node holds (loaded or
  asleep), like an ``upstream`` replica at a lower priority tier, health
  probed by :mod:`..remotes`; dropped when that node goes, drains or lets
  the model go; kept while NATS is unreachable (their probes judge them);
* **registry**: a model only other nodes have is registered here as kind
  ``cluster`` (nothing to load locally), so a request for it is accepted;
* **placement** (:mod:`.placement`): a model with waiters here and no
  replica anywhere gets a target node and a cluster-wide load key
  (``claim``); only then may it load, here (the reconciler's gate,
  :meth:`ClusterNode.allows`) or on the target (a ``load`` command). The
  holder renews the key while loading and releases it when ready or failed;
* **drain**: no new placements or loads here, the draining flag published;
  once a beat has gone out and nothing is in flight or waiting (or after
  ``--node-drain-timeout``), leave the cluster and stop (exit code 0).

While NATS is unreachable a node loads its own models on local demand (one
load per model cluster-wide cannot be promised then; it is logged).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import orjson

from ...shm import layout as L
from ..children import Child, ChildSet, state_line
from ..registry import ModelEntry
from ..state import NS, Remote, State
from .options import ClusterOptions
from ..contention import max_wait_s
from .placement import Placement, node_view, place
from .records import LOCAL_KINDS, own_record, proxy_doc, remote_wanted

log = logging.getLogger(__name__)

AGENT_RESTART_S = 1.0  # a crashed agent is started again after this long


class ClusterNode:
    """See the module docstring.

    ``load(m, why)`` / ``unload(m, why)`` queue a local load or stop a
    model (the supervisor's own); ``apply_entries(entries, why)`` makes the
    ``cluster``-kind entries of the registry exactly ``entries``;
    ``drain_timeout`` bounds a drain (seconds).
    """

    def __init__(self, opts: ClusterOptions, state: State, children: ChildSet, *,
                 load: Callable[[int, str], None], unload: Callable[[int, str], None],
                 apply_entries: Callable[[list[ModelEntry], str], None],
                 drain_timeout: float = 120.0, log_level: str = "INFO") -> None:
        self.o = opts
        self.state = state
        self.children = children
        self.load = load
        self.unload = unload
        self.apply_entries = apply_entries
        self.drain_timeout = drain_timeout
        self.log_level = log_level
        self.child: Child | None = None
        self.verdict: str | None = None  # joined | unreachable | refused
        self.refusal = ""
        self.connected = False
        self.closing = False
        self.off = False  # the agent refused while serving: cluster mode is off
        self.fatal = False  # refused before ever joining: the node stops (exit code 1)
        self.joined_once = False
        self.restart_at_ns = 0
        self.nodes: dict[str, tuple[dict, int]] = {}  # name -> (record, arrived_ns)
        self.loads: dict[str, dict] = {}  # model name -> its load key's value
        self.claims: dict[str, tuple[int, str]] = {}  # model -> (ref, target) awaiting claimed
        self.requests: dict[int, tuple[str, str]] = {}  # ref -> (model, node) awaiting reply
        self.placed: dict[str, str] = {}  # model -> node asked to load it for us
        self.refused: dict[tuple[str, str], int] = {}  # (model, node) -> excluded until ns
        self.allowed: set[int] = set()  # models placed here: the reconciler may load them
        self.holding: dict[str, float] = {}  # model -> progress last sent with hold
        self.told_wait: set[str] = set()  # models whose "no room anywhere" was logged
        self.told_alias: set[str] = set()  # names held back as a removed model's alias
        self.registry_tried: tuple = ()  # (wanted, had) of the last refused registry change
        self.ref = 0
        self.draining = False
        self.drain_since_ns = 0
        self.left_ns = 0
        self.next_publish_ns = 0
        self.shape: tuple = ()
        self.doc_bytes = b""

    # ---- the agent child -------------------------------------------------------
    def start(self) -> None:
        """Start the agent and hand it its configuration on stdin."""
        argv = [self.state.python, "-m", "ggmux.supervisor.cluster.agent"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GGMUX_")}
        env["GGMUX_LOG_LEVEL"] = self.log_level
        self.child = self.children.start(argv, "cluster", on_line=self.on_line, env=env)
        self._send("config", **self.o.agent_config())
        for model, progress in self.holding.items():  # a restarted agent renews them too
            self._send("hold", model=model, progress=progress)
        now = time.monotonic_ns()
        record = own_record(self.state, self.o.advertise, self.draining, now)
        self._publish(record, now)
        self._proxy_view(record)
        log.info("cluster: node %s joining through %s", self.o.node, _redact(self.o.url))

    def _send(self, cmd: str, **fields) -> None:
        if self.child is not None:
            self.child.send(orjson.dumps({"cmd": cmd, **fields}) + b"\n")

    def wait_verdict(self, poll_once: Callable[[int], None], timeout_s: float) -> bool:
        """Block (polling) until the agent joined, found NATS unreachable
        (the node starts alone and keeps retrying) or refused (False: the
        node must not start, :attr:`refusal` says why)."""
        deadline = time.monotonic() + timeout_s
        while self.verdict is None and time.monotonic() < deadline:
            poll_once(50)
            self.reap()
        return self.verdict != "refused"

    def reap(self) -> None:
        """Notice an agent that exited: a refusal turns cluster mode off,
        anything else starts it again after :data:`AGENT_RESTART_S`."""
        if self.child is None:
            return
        code = self.children.reap(self.child)
        if code is None:
            return
        self.child = None
        self.connected = False
        if self.closing:
            return
        if code == 2 or self.verdict == "refused":
            self.verdict = "refused"
            self.refusal = self.refusal or "the cluster agent refused to start"
            self.off = True
            if not self.joined_once:
                # never joined: a configuration error (credentials, name), even
                # when the first try only timed out and the node started alone
                log.error("cluster: %s; stopping", self.refusal)
                self.fatal = True
                self.state.stopping_all = True
                return
            log.error("cluster: %s; serving this node's models alone", self.refusal)
            return
        log.error("cluster: agent exited with code %s; restarting it", code)
        self.restart_at_ns = time.monotonic_ns() + int(AGENT_RESTART_S * NS)
        # what only the dead agent knew: a new one reports the cluster afresh
        self.nodes.clear()
        self.loads.clear()
        self.claims.clear()
        self.requests.clear()

    def alive(self) -> bool:
        return self.child is not None

    def close(self) -> None:
        """Leave the cluster: ``exit`` to the agent (it deletes this node's
        key and the load keys it holds, then exits)."""
        self.closing = True
        if self.child is not None and not self.child.send(b"exit\n"):
            self.child.close_stdin()

    # ---- the agent's lines -------------------------------------------------------
    def on_line(self, child: Child, line: bytes) -> None:
        msg = state_line(child, line)
        if msg is None:
            return
        handler = getattr(self, f"_on_{msg.pop('state', '')}", None)
        if handler is None:
            log.debug("cluster: unknown agent line %r", line[:200])
            return
        try:
            handler(**msg)
        except (TypeError, ValueError, KeyError) as e:
            log.warning("cluster: bad agent line %r: %s", line[:200], e)

    def _on_joined(self, node: str = "", reconnect: bool = False, **_) -> None:
        self.verdict = self.verdict or "joined"
        self.connected = True
        self.joined_once = True
        self.next_publish_ns = 0  # republish at once
        self.shape = ()

    def _on_unreachable(self, error: str = "", **_) -> None:
        self.verdict = self.verdict or "unreachable"
        self.connected = False
        # claims and commands in flight were answered "unreachable" or are lost
        self.claims.clear()
        self.requests.clear()

    def _on_refused(self, error: str = "", **_) -> None:
        self.verdict = "refused"
        self.refusal = error

    def _on_node(self, name: str, record: dict, arrived_ns: int, **_) -> None:
        if isinstance(record, dict):
            self.nodes[name] = (record, int(arrived_ns))
            failed = record.get("failed") or {}
            for model, target in list(self.placed.items()):
                if target == name and model in failed:
                    f = failed[model] if isinstance(failed[model], dict) else {}
                    self._remote_failed(model, name, str(f.get("error", "")),
                                        float(f.get("retry_in_s") or 0.0))

    def _on_gone(self, name: str, why: str = "", **_) -> None:
        if self.nodes.pop(name, None) is not None:
            log.warning("cluster: node %s is gone (%s)", name, why)
        for model, target in list(self.placed.items()):
            if target == name:
                del self.placed[model]

    def _on_load(self, model: str, entry: dict | None = None, **_) -> None:
        if entry:
            self.loads[model] = entry
        else:
            self.loads.pop(model, None)
            self.placed.pop(model, None)  # that load is over, whatever came of it

    def _on_claimed(self, ref: int, model: str, ok: bool, holder: str | None = None,
                    error: str = "", **_) -> None:
        pending = self.claims.get(model)
        if pending is None or pending[0] != ref:
            return
        del self.claims[model]
        target = pending[1]
        if not ok:
            if error:
                log.warning("cluster: cannot claim the load of %s: %s", model, error)
            return  # another node holds it: its key arrives as a load line
        if target == self.o.node:
            self._accept_load(model, "placed here")
            return
        self.ref += 1
        self.requests[self.ref] = (model, target)
        self.placed[model] = target
        self._send("request", ref=self.ref, node=target, op="load", model=model)

    def _on_reply(self, ref: int, ok: bool = False, error: str = "", node: str = "", **_) -> None:
        pending = self.requests.pop(ref, None)
        if pending is None or ok:
            return
        model, target = pending
        self._remote_failed(model, target, error)

    def _on_lost(self, model: str, holder: str | None = None, **_) -> None:
        log.warning("cluster: node %s took over the load key of %s", holder, model)
        self.holding.pop(model, None)

    def _on_order(self, id: int, op: str, model: str = "", **kw) -> None:
        sender = kw.get("from", "?")
        if op == "drain":
            self.drain(f"asked by node {sender}")
            self._send("ack", id=id, ok=True)
            return
        i = self._row(model, LOCAL_KINDS)
        if i is None:
            self._send("ack", id=id, ok=False, error=f"node {self.o.node} has no model {model!r}")
            return
        if op == "load":
            if self.draining:
                self._send("ack", id=id, ok=False, error=f"node {self.o.node} is draining")
                return
            self._accept_load(model, f"placed here by node {sender}")
            self._send("ack", id=id, ok=True)
        elif op == "unload":
            self.unload(i, f"asked by node {sender}")
            self._send("ack", id=id, ok=True)
        else:
            self._send("ack", id=id, ok=False, error=f"unknown command {op!r}")

    def _accept_load(self, model: str, why: str) -> None:
        """This node loads ``model`` for the cluster: hold its key, queue it
        (a model this node no longer has: free the key instead)."""
        i = self._row(model, LOCAL_KINDS)
        if i is None:
            self._send("release", model=model)
            return
        self.allowed.add(i)
        self.holding[model] = 0.0
        self._send("hold", model=model, progress=0.0)
        self.load(i, why)

    def _remote_failed(self, model: str, node: str, error: str, retry_in_s: float = 0.0) -> None:
        """The node asked to load ``model`` refused (``retry_in_s`` 0) or
        failed to load it: leave that node out of the next placements for one
        ``--node-stale``, free the key; a failed load also puts the model in
        backoff here for as long as there, so this node's waiters get the
        503 with the cause and Retry-After, as for a local failure."""
        log.warning("cluster: node %s did not load %s: %s", node, model, error or "refused")
        self.placed.pop(model, None)
        now = time.monotonic_ns()
        self.refused[(model, node)] = now + int(max(self.o.node_stale, retry_in_s) * NS)
        self._send("release", model=model)
        i = self._row(model)
        if retry_in_s > 0 and i is not None:
            m = self.state.models[i]
            m.failed = True
            m.error = f"failed to load on node {node}: {error}"
            m.retry_at_ns = now + int(retry_in_s * NS)
            self.state.errors_dirty = True

    def _row(self, name: str, kinds: tuple[str, ...] = ()) -> int | None:
        """The registry row that ``name`` (a name or alias) stands for now:
        ``None`` for a removed row (rows are kept, and still resolve) or,
        with ``kinds``, for an entry of another kind."""
        st = self.state
        i = st.registry.resolve(name) if name else None
        if i is None or i in st.removed or kinds and st.registry.entries[i].kind not in kinds:
            return None
        return i

    # ---- decisions ----------------------------------------------------------------
    def allows(self, model: int) -> bool:
        """The reconciler's gate: may ``model`` load on this machine now?
        Yes when a replica of it runs here already (more replicas, a wake),
        when the cluster placed it here (before a drain, too: that load was
        promised), or, unless draining, when NATS is out of reach (this node
        then serves its own models alone)."""
        if model in self.allowed:
            return True
        if any(r.model == model and r.stop_stage == 0 for r in self.state.replicas.values()):
            return True
        return (not self.connected or self.off) and not self.draining

    def drain(self, why: str) -> None:
        """Start draining (see the module docstring); a second call is a no-op."""
        if self.draining:
            return
        log.info("cluster: draining node %s (%s)", self.o.node, why)
        self.draining = True
        self.drain_since_ns = time.monotonic_ns()
        self.next_publish_ns = 0

    def step(self, now: int) -> None:
        """One loop turn: agent upkeep, publish, remote replicas, registry,
        holds, placement, the proxies' view, drain (``now``: monotonic ns)."""
        self.reap()
        if self.child is None and not self.closing and not self.off and self.restart_at_ns \
                and now >= self.restart_at_ns:
            self.restart_at_ns = 0
            self.start()
        st = self.state
        record = own_record(st, self.o.advertise, self.draining, now)
        self._publish(record, now)
        self._sync_remotes()
        self._sync_registry()
        self._holds(record)
        self._place(record, now)  # a draining node's own record keeps it out
        self._proxy_view(record)
        if self.draining:
            self._drain_step(now)

    def _publish(self, record: dict, now: int) -> None:
        shape = (record["draining"], record["slots_free"],
                 tuple(sorted((k, v["state"]) for k, v in record["models"].items())),
                 tuple(sorted(record["failed"])))
        if shape != self.shape or now >= self.next_publish_ns:
            self._send("publish", record=record, now=shape != self.shape)
            self.shape = shape
            self.next_publish_ns = now + int(self.o.heartbeat * NS / 2)

    def _others(self) -> dict[str, dict]:
        return {n: rec for n, (rec, _) in self.nodes.items()}

    def _sync_remotes(self) -> None:
        """One remote replica per (node, model) of :func:`remote_wanted`, at
        the address that node advertises now: a node that came back on
        another address (a restart while this node's view was frozen, or
        faster than ``--node-stale``) gets a new replica there, never keeps
        the dead address's."""
        st = self.state
        want = {key: _address(url) for key, url in remote_wanted(st, self._others()).items()}
        have = {}
        changed = False
        for slot, rm in list(st.remotes.items()):
            if not rm.node:
                continue
            key = (rm.node, rm.model)
            if want.get(key) == (rm.host, rm.port) and key not in have:
                have[key] = slot
            else:
                del st.remotes[slot]
                changed = True
        for (node, i), (host, port) in want.items():
            if (node, i) in have:
                continue
            slot = st.free_slot()
            if slot is None:
                log.warning("cluster: no replica slot for %s on node %s", st.name(i), node)
                continue
            st.remotes[slot] = Remote(slot, i, host, port, "/health", st.next_incarnation(),
                                      node=node)
            changed = True
            m = st.models[i]
            if m.failed and m.error.startswith("failed to load on node"):
                m.failed, m.error, m.retry_at_ns = False, "", 0  # it loaded there after all
        if changed:
            st.dirty = True
            st.errors_dirty = True  # the remotes' addresses live in the registry blob

    def _sync_registry(self) -> None:
        """Make the ``cluster`` entries exactly the models other live nodes
        have that no live local entry names (by name or alias). A removed
        row (its node went, its source dropped it) names nothing: it stays
        in the registry (rows are kept), and a name that still resolved to
        it would never come back when its node does (issue 18, finding 4)."""
        if not self.connected:
            return  # a frozen view adds nothing and removes nothing
        st = self.state
        names: dict[str, str] = {}
        for node, rec in sorted(self._others().items()):
            for name in [*(rec.get("has") or {}), *(rec.get("models") or {})]:
                names.setdefault(str(name), node)
        reg = st.registry
        local = {n for n, i in reg.names.items()
                 if i not in st.removed and reg.entries[i].kind != "cluster"}
        # a removed row keeps its aliases in the reload bookkeeping, which
        # refuses a model of the same name: such a name waits for a restart
        kept = {n: reg.entries[i].name for n, i in reg.names.items()
                if i in st.removed and n != reg.entries[i].name}
        wanted = {}
        for n, node in names.items():
            if n in local:
                continue
            if n in kept:
                if n not in self.told_alias:
                    self.told_alias.add(n)
                    log.warning("cluster: %s (on node %s) stays unserved here: it is an alias "
                                "of the removed model %s until this node restarts", n, node,
                                kept[n])
                continue
            wanted[n] = node
        have = self._cluster_names()
        attempt = (frozenset(wanted), frozenset(have))
        if set(wanted) == have or attempt == self.registry_tried:
            return  # in line, or asked already and refused (logged): not every turn
        self.apply_entries([ModelEntry(name=n, path="", kind="cluster", source=f"cluster:{node}")
                            for n, node in sorted(wanted.items())], "cluster")
        self.registry_tried = () if self._cluster_names() == set(wanted) else attempt

    def _cluster_names(self) -> set[str]:
        return {self.state.registry.entries[i].name for i in self._cluster_rows()}

    def _cluster_rows(self) -> list[int]:
        st = self.state
        return [i for i, e in enumerate(st.registry.entries)
                if e.kind == "cluster" and i not in st.removed]

    def _holds(self, record: dict) -> None:
        """Renew the load keys of models loading here; release them once
        the model is ready or its load failed."""
        st = self.state
        for model in list(self.holding):
            i = self._row(model)
            d = record["models"].get(model)
            if i is None:  # removed from its sources meanwhile
                self.holding.pop(model)
                self._send("release", model=model)
                continue
            loading = [r for r in st.replicas.values()
                       if r.model == i and r.status == L.ReplicaStatus.LOADING]
            pending = st.models[i].requested_ns or loading
            if d is not None and d["state"] in ("loaded", "sleeping") or not pending:
                self.holding.pop(model)
                self.allowed.discard(i)
                self._send("release", model=model)
                self.next_publish_ns = 0
                continue
            progress = round(max((r.progress for r in loading), default=0.0), 2)
            if progress != self.holding[model]:
                self.holding[model] = progress
                self._send("hold", model=model, progress=progress)

    def _place(self, record: dict, now: int) -> None:
        st = self.state
        counts, _ = st.demand()
        nodes = None
        for i, e in enumerate(st.registry.entries):
            m = st.models[i]
            if i in st.removed or e.kind == "upstream" or not (counts[i] > 0 or m.requested_ns):
                continue
            name = e.name
            if any(r.model == i and r.stop_stage == 0 for r in st.replicas.values()):
                continue
            if any(rm.model == i for rm in st.remotes.values()):
                continue  # served elsewhere (or its probe is on the way)
            if name in self.claims or name in self.placed or m.retry_at_ns > now:
                continue
            load = self.loads.get(name)
            if load is not None:
                if load.get("node") == self.o.node and e.kind in LOCAL_KINDS \
                        and name not in self.holding:
                    self._accept_load(name, f"placed here by node {load.get('by')}")
                continue
            if not self.connected or self.off:
                if e.kind in LOCAL_KINDS and not self.draining:
                    if i not in self.allowed:
                        log.warning("cluster: no NATS: loading %s here without a cluster-wide "
                                    "claim", name)
                    self.allowed.add(i)
                continue
            if nodes is None:
                nodes = [node_view(self.o.node, record)]
                nodes += [node_view(n, rec, (now - t) / NS) for n, (rec, t) in self.nodes.items()]
                self.refused = {k: t for k, t in self.refused.items() if t > now}
            exclude = {n for (mm, n) in self.refused if mm == name}
            p = place(name, nodes, self.o.node, exclude)
            if p is None and self._past_bound(i, now) and e.kind in LOCAL_KINDS \
                    and not self.draining and self.o.node not in exclude:
                # every node is busy and its requests here waited past their bound
                # (issue 34): it loads here, where the scheduler drains a busy model
                p = Placement(self.o.node, "past its bound (max-wait): drains a busy "
                                           "model here")
            if p is None or p.why == "holds it":
                if p is None and name not in self.told_wait:
                    self.told_wait.add(name)
                    log.info("cluster: %s waits: no node has room for it now", name)
                continue
            self.told_wait.discard(name)
            self.ref += 1
            self.claims[name] = (self.ref, p.node)
            log.info("cluster: placing %s on node %s (%s)", name, p.node, p.why)
            self._send("claim", model=name, node=p.node, ref=self.ref)

    def _past_bound(self, i: int, now: int) -> bool:
        """Whether model ``i``'s oldest waiter on this node waited past its
        bound (:func:`~..contention.max_wait_s`; a bound of 0: never)."""
        st = self.state
        w = st.seg.waiters[:, i]
        firsts = w[w[:, L.W_COUNT] > 0, L.W_FIRST_NS]
        if not len(firsts):
            return False
        e, m = st.registry.entries[i], st.models[i]
        bound = max_wait_s(e.max_wait, st.cfg.max_wait, m.loads, m.load_ns_total)
        return bound > 0 and now - int(firsts.min()) >= bound * NS

    def _proxy_view(self, record: dict) -> None:
        doc = proxy_doc(self.o.node, self.o.cluster_token, self.o.advertise,
                        self.connected and not self.off, self.draining, record, self.nodes,
                        self.loads)
        raw = orjson.dumps(doc, option=orjson.OPT_SORT_KEYS)
        if raw != self.doc_bytes:
            self.doc_bytes = raw
            self.state.cluster_doc = doc
            self.state.errors_dirty = True

    def _drain_step(self, now: int) -> None:
        st = self.state
        c = st.seg.counters
        local = [r.slot for r in st.replicas.values()]
        busy = int(c[:, local, L.C_IN_FLIGHT].sum()) if local else 0
        waiting = st.any_waiters()
        announced = now - self.drain_since_ns >= int(self.o.heartbeat * NS)
        late = now - self.drain_since_ns > int(self.drain_timeout * NS)
        if not self.left_ns:
            if announced and (not busy and not waiting or late):
                if late:
                    log.warning("cluster: drain timed out after %g s with %d in flight, "
                                "%s waiting", self.drain_timeout, busy, "some" if waiting else "none")
                log.info("cluster: node %s drained; leaving", self.o.node)
                self.left_ns = now
                self.close()
        elif self.child is None or now - self.left_ns > 2 * NS:
            st.stopping_all = True


def _address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a node's advertised ``http://`` URL (port 80 if none)."""
    u = urlsplit(url)
    return u.hostname or "127.0.0.1", u.port or 80


def _redact(url: str) -> str:
    from .options import redact

    return redact(url)
