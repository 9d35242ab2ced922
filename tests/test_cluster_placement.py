"""Placement of a cold model in the cluster, on records alone (LocalAI's
SmartRouter order, DESIGN.md "Cluster")."""

from __future__ import annotations

from ggmux.supervisor.cluster.placement import node_view, place

MiB = 1 << 20


def rec(slots=2, free_mib=1000, has=("m",), need_mib=600, models=None, draining=False):
    return {"url": "http://x", "slots_free": slots, "headroom": {"host": free_mib * MiB},
            "has": {h: {"host": need_mib * MiB} for h in has}, "models": models or {},
            "draining": draining}


def idle(mib=500, idle_s=10.0, in_flight=0, state="loaded"):
    return {"state": state, "in_flight": in_flight, "idle_s": idle_s, "held": {"host": mib * MiB}}


def test_a_node_that_holds_or_loads_the_model_wins():
    nodes = [node_view("a", rec()), node_view("b", rec(models={"m": idle(state="loading")}))]
    p = place("m", nodes, "a")
    assert (p.node, p.why) == ("b", "holds it")


def test_nodes_without_the_model_or_room_are_dropped_and_the_asker_preferred():
    nodes = [node_view("a", rec(free_mib=500)), node_view("b", rec(free_mib=700)),
             node_view("c", rec(has=()))]
    assert place("m", nodes, "a").node == "b"  # a cannot fit 600 MiB, c lacks it
    nodes.append(node_view("d", rec(free_mib=5000)))
    assert place("m", nodes, "b").node == "b"  # the asker, since it fits
    assert place("m", nodes, "a").node == "d"  # most free memory
    assert place("m", [node_view("a", rec(slots=0))], "a") is None


def test_ties_go_to_idle_then_least_loaded_nodes():
    busy = {"x": idle(mib=0, in_flight=3)}
    calm = {"x": idle(mib=0, in_flight=1)}
    nodes = [node_view("a", rec(models=busy)), node_view("b", rec(models=calm)),
             node_view("c", rec())]
    assert place("m", nodes, "z").node == "c"
    assert place("m", nodes[:2], "z").node == "b"


def test_when_nothing_fits_the_node_with_the_least_recently_used_idle_model_evicts():
    nodes = [node_view("a", rec(slots=0, free_mib=0, models={"x": idle(700, idle_s=5)})),
             node_view("b", rec(slots=0, free_mib=0, models={"y": idle(700, idle_s=50)}), 1.0),
             node_view("c", rec(slots=0, free_mib=0, models={"z": idle(700, idle_s=20)}))]
    p = place("m", nodes, "a")
    assert (p.node, p.evict) == ("b", True)
    # an eviction that would not free enough memory does not count
    nodes[1] = node_view("b", rec(slots=0, free_mib=0, models={"y": idle(mib=100, idle_s=50)}))
    assert place("m", nodes, "a").node == "c"


def test_with_every_model_busy_or_nodes_draining_it_waits():
    busy = {"x": idle(in_flight=1)}
    nodes = [node_view(n, rec(slots=0, free_mib=0, models=busy)) for n in "abc"]
    assert place("m", nodes, "a") is None
    assert place("m", [node_view("a", rec(draining=True))], "a") is None
    assert place("m", [node_view("a", rec(models={"m": idle()}, draining=True))], "a") is None


def test_unmeasured_models_need_only_a_slot_and_bad_records_read_as_empty():
    r = rec(free_mib=0)
    r["has"] = {"m": None}
    assert place("m", [node_view("a", r)], "a").node == "a"
    assert place("m", [node_view("a", {"models": 3, "has": [], "headroom": "x"})], "a") is None
    assert place("m", [node_view("a", rec())], "a", exclude={"a"}) is None
