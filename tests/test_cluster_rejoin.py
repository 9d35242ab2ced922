"""A node, or a model, that leaves the cluster and comes back is routed to
again (issue 18, finding 4): a node killed and restarted under its name, a
node frozen (SIGSTOP) past ``--node-stale`` and resumed, a drained node
that rejoins, one that comes back across a NATS restart. Real
``ggmux serve --cluster`` processes, fake models, a real nats-server."""

from __future__ import annotations

import os
import signal
import time

import pytest
from conftest import (
    Server,
    alive,
    descendants,
    free_port,
    unlink_server_objects,
    wait_for,
    write_fake,
)
from test_cluster import ask, converge, sees, served_on, view

pytestmark = pytest.mark.slow  # nodes that leave and come back

HB, STALE = 0.5, 1.5  # --heartbeat, --node-stale
TOKEN = "cluster-secret"


class Nodes:
    """Nodes of one cluster, each one name bound to one port and one models
    folder for the test's whole life, so a node can be killed and started
    again as the same node. Every process is stopped at the end; a killed
    node's processes are waited for before its next start."""

    def __init__(self, nats, tmp_path) -> None:
        self.nats = nats
        self.url = nats.url
        self.tmp = tmp_path
        self.ports: dict[str, int] = {}
        self.live: dict[str, Server] = {}
        self.killed: set[int] = set()  # ports of SIGKILLed supervisors
        self.starts = 0

    def start(self, name: str, *args: str, models: dict | None = None,
              new_port: bool = False) -> Server:
        """Start node ``name`` (again), on its port unless ``new_port``."""
        d = self.tmp / f"models-{name}"
        d.mkdir(exist_ok=True)
        for m, behaviour in (models or {}).items():
            write_fake(d, m, **behaviour)
        if new_port:
            self.ports.pop(name, None)
        port = self.ports.setdefault(name, free_port())
        self.starts += 1
        s = Server(["--fake-models-dir", str(d), "--no-hf-cache", "--proxies", "1",
                    "--spares", "0", "--cluster", self.url, "--node-name", name,
                    "--heartbeat", str(HB), "--node-stale", str(STALE),
                    "--cluster-token", TOKEN, *args],
                   port, self.tmp / f"{name}-{self.starts}.log")
        s.name = name
        self.live[name] = s
        return s.wait_ready()

    def kill(self, name: str) -> None:
        """SIGKILL the node's supervisor; its children die with it
        (PR_SET_PDEATHSIG), so its agent cannot leave: its key expires."""
        s = self.live.pop(name)
        kids = descendants(s.proc.pid)
        os.kill(s.proc.pid, signal.SIGKILL)
        s.proc.wait(10)
        for pid in kids:
            wait_for(lambda p=pid: not alive(p), 10, 0.02, f"{name}'s child {pid} to exit")
        s.log.close()
        self.killed.add(s.port)

    def close(self) -> None:
        """Stop the live nodes; remove what a SIGKILLed supervisor left on a
        port no node took again (its segment, log ring and command queue)."""
        for s in self.live.values():
            s.stop()
        for port in self.killed - {s.port for s in self.live.values()}:
            unlink_server_objects(port)


@pytest.fixture
def nodes(nats_server, tmp_path):
    n = Nodes(nats_server(), tmp_path)
    yield n
    n.close()


def routed(s, model: str, node: str, *servers) -> bool:
    """A request through ``s`` for ``model`` is served on ``node``."""
    status, body = ask(s, model)
    return status == 200 and served_on(body, *servers) == node


def holds(s, node: str, model: str) -> bool:
    """``s``'s ``/cluster`` shows ``node`` with ``model`` loaded."""
    try:
        doc = view(s)
    except OSError:
        return False
    return any(n["name"] == node and (n.get("models") or {}).get(model, {}).get("state")
               == "loaded" for n in doc["nodes"])


def listed(s, model: str) -> bool:
    try:
        return model in s.models()
    except OSError:
        return False


def agent_of(s) -> int | None:
    """Pid of node ``s``'s cluster agent."""
    for pid in descendants(s.proc.pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"ggmux.supervisor.cluster.agent" in f.read():
                    return pid
        except OSError:
            continue
    return None


def test_a_node_killed_and_restarted_three_times_is_routed_to_again_each_time(nodes):
    only1 = {"only1": {}}
    n1 = nodes.start("n1", models=only1)
    n2 = nodes.start("n2", models={"l2": {}})
    converge(n1, n2)
    wait_for(lambda: listed(n2, "only1"), 10, 0.05, "only1 listed on n2")
    assert routed(n2, "only1", "n1", n1, n2)
    for round_ in range(3):
        nodes.kill("n1")
        wait_for(lambda: not listed(n2, "only1") and not sees(n2, {"n1", "n2"}),
                 STALE + 4 * HB, 0.02, f"round {round_}: n2 drops n1 and only1")
        assert "1 removed ['only1']" in n2.logs()
        # the second time on another port: n2 must forward to the new address
        n1 = nodes.start("n1", models=only1, new_port=round_ == 1)
        assert routed(n1, "only1", "n1", n1, n2)  # loaded there, as in the report
        wait_for(lambda: holds(n2, "n1", "only1"), 10, 0.02,
                 f"round {round_}: n2's /cluster shows n1 holding only1")
        wait_for(lambda: listed(n2, "only1"), 2 * HB, 0.02,
                 f"round {round_}: only1 listed on n2 again within two beats")
        wait_for(lambda n1=n1: routed(n2, "only1", "n1", n1, n2), 2 * HB, 0.02,
                 f"round {round_}: a request through n2 served on n1 within two beats")


def test_a_frozen_node_is_dropped_and_both_sides_route_again_when_it_resumes_or_its_agent_restarts(
        nodes):
    """n1 (every process of it) SIGSTOPped for twice ``--node-stale``: n2
    drops it and its model, and once it resumes, n2 routes to it and it to
    n2 again. Then n1's cluster agent is SIGKILLed: the new one reports the
    cluster afresh, so n2's model leaves n1's registry and must come back."""
    n1 = nodes.start("n1", models={"only1": {}})
    n2 = nodes.start("n2", models={"only2": {}})
    converge(n1, n2)
    for s, model in ((n2, "only1"), (n1, "only2")):
        wait_for(lambda s=s, m=model: listed(s, m), 10, 0.05, f"{model} listed on {s.name}")
    assert routed(n2, "only1", "n1", n1, n2)
    assert routed(n1, "only2", "n2", n1, n2)
    frozen = [n1.proc.pid, *descendants(n1.proc.pid)]  # the whole node, as a paused VM
    frozen_at = time.monotonic()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(lambda: not listed(n2, "only1") and not sees(n2, {"n1", "n2"}),
                 STALE + 4 * HB, 0.02, "n2 drops the frozen n1")
        assert ask(n2, "only1")[0] == 404
        wait_for(lambda: "last beat" in n2.logs() and "removed ['only1']" in n2.logs(), 5, 0.05,
                 "n2 logs n1 stale")
    except BaseException:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        raise
    time.sleep(max(0.0, frozen_at + 2 * STALE - time.monotonic()))  # the scenario's freeze
    for pid in frozen:
        os.kill(pid, signal.SIGCONT)
    wait_for(lambda: sees(n2, {"n1", "n2"}), 4 * HB, 0.02, "n2 sees n1 again")
    wait_for(lambda: listed(n2, "only1"), 2 * HB, 0.02, "only1 listed on n2 within two beats")
    wait_for(lambda: routed(n2, "only1", "n1", n1, n2), 2 * HB, 0.02,
             "a request through n2 served on n1 within two beats")
    # on waking n1 may judge n2 stale before its backlog of n2's beats is read
    wait_for(lambda: sees(n1, {"n1", "n2"}) and listed(n1, "only2"), 4 * HB, 0.02,
             "n1 sees n2 and only2 again")
    wait_for(lambda: routed(n1, "only2", "n2", n1, n2), 2 * HB, 0.02,
             "a request through n1 served on n2")
    agent = agent_of(n1)
    os.kill(agent, signal.SIGKILL)
    wait_for(lambda: "agent exited with code" in n1.logs(), 10, 0.02, "n1 notices")
    wait_for(lambda: agent_of(n1) not in (None, agent) and view(n1)["connected"], 10, 0.02,
             "n1's new agent joins")
    wait_for(lambda: listed(n1, "only2"), 4 * HB, 0.02, "only2 listed on n1 again")
    assert routed(n1, "only2", "n2", n1, n2)


def test_a_drained_node_that_rejoins_then_one_back_on_a_new_port_across_a_nats_restart(nodes):
    """n1 drains and exits, then rejoins: n2 routes to it again. Then n1
    dies and comes back on another port while NATS is down, with its model
    loaded: once NATS is back n2 forwards to n1's new address."""
    n1 = nodes.start("n1", models={"only1": {}})
    n2 = nodes.start("n2", models={"l2": {}})
    converge(n1, n2)
    wait_for(lambda: listed(n2, "only1"), 10, 0.05, "only1 listed on n2")
    assert routed(n2, "only1", "n1", n1, n2)
    status, doc = n1.json("POST", "/cluster/drain")
    assert status == 202, doc
    assert n1.proc.wait(30) == 0
    nodes.live.pop("n1").stop()
    wait_for(lambda: not listed(n2, "only1") and not sees(n2, {"n1", "n2"}), 10, 0.02,
             "n2 drops the drained n1 and only1")
    n1 = nodes.start("n1", models={"only1": {}})
    wait_for(lambda: sees(n2, {"n1", "n2"}), 10, 0.02, "n2 sees n1 rejoin")
    wait_for(lambda: listed(n2, "only1"), 2 * HB, 0.02, "only1 listed on n2 within two beats")
    assert routed(n2, "only1", "n1", n1, n2)
    # NATS down; n1 dies and comes back on another port, serving alone meanwhile
    nodes.nats.stop(kill=True)
    wait_for(lambda: not view(n2)["connected"], 10, 0.05, "n2 notices NATS is gone")
    nodes.kill("n1")
    n1 = nodes.start("n1", models={"only1": {}}, new_port=True)
    assert not view(n1)["connected"]
    assert routed(n1, "only1", "n1", n1, n2)
    nodes.nats.start()
    wait_for(lambda: view(n1)["connected"] and view(n2)["connected"], 10, 0.02,
             "both reconnect")
    wait_for(lambda: holds(n2, "n1", "only1"), 10, 0.02, "n2 sees n1 holding only1")
    wait_for(lambda: routed(n2, "only1", "n1", n1, n2), 2 * HB, 0.02,
             "a request through n2 served on n1 at its new port within two beats")


def test_models_a_reload_drops_are_served_by_the_node_that_has_them_and_no_alias_breaks_it(
        nodes, fakes):
    """n2's reload drops its own ``shared`` (n1 has one too) and its ``a``,
    whose alias ``x`` is n1's model: both are forwarded to n1 from then on
    (a reload is planned whole and a removed model frees its name and its
    aliases; before, the bookkeeping kept them, left the registry half
    changed, and the supervisor crashed); n2 stays up."""
    n1 = nodes.start("n1", models={"shared": {}, "x": {}})
    preset = nodes.tmp / "n2.ini"
    l2 = f"[l2]\nmodel = {fakes.add('l2')}\n"
    preset.write_text(f"[shared]\nmodel = {fakes.add('shared')}\n"
                      f"[a]\nmodel = {fakes.add('a')}\nalias = x\n{l2}")
    n2 = nodes.start("n2", "--models-preset", str(preset))
    converge(n1, n2)
    assert routed(n2, "shared", "n2", n1, n2)  # n2's own names win
    assert routed(n2, "x", "n2", n1, n2)
    preset.write_text(l2)
    status, doc = n2.json("GET", "/models?reload=1")
    assert status == 200, doc
    wait_for(lambda: listed(n2, "shared"), 2 * HB, 0.02, "shared listed on n2 from n1")
    wait_for(lambda: routed(n2, "shared", "n1", n1, n2), 2 * HB, 0.02,
             "a request for shared through n2 served on n1")
    wait_for(lambda: routed(n2, "x", "n1", n1, n2), 2 * HB, 0.02,
             "a request for x (the removed a's alias) through n2 served on n1")
    assert n2.proc.poll() is None
    assert "cannot register" not in n2.logs() and "reload failed" not in n2.logs()
