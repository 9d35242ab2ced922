"""The pure scheduler's decisions under contention (issue 34): a snapshot
in, actions out; no processes."""

from __future__ import annotations

from ggmux.shm.layout import WaitReason
from ggmux.supervisor.scheduler import (
    Drain,
    MemoryView,
    ModelView,
    ReplicaView,
    Scheduler,
    Spawn,
    Stop,
    Undrain,
)

S = 1_000_000_000
GiB = 1 << 30
NOW = 1000 * S


def rep(slot, model, in_flight=0, used=0, ready=0, **kw) -> ReplicaView:
    return ReplicaView(slot, model, kw.pop("state", "ready"), in_flight, used or ready,
                       ready_ns=ready, **kw)


def want(index, waited_s, bound_s=10.0, waiters=1) -> ModelView:
    return ModelView(index, waiters, NOW - int(waited_s * S), max_wait_ns=int(bound_s * S))


def kinds(actions) -> list[tuple]:
    out = []
    for a in actions:
        if isinstance(a, Spawn):
            out.append(("spawn", a.model))
        elif isinstance(a, Stop):
            out.append(("stop", a.slot))
        elif isinstance(a, Drain):
            out.append(("drain", a.slot, a.for_model))
        elif isinstance(a, Undrain):
            out.append(("undrain", a.slot))
    return out


def test_a_busy_holder_keeps_its_capacity_until_the_bound_and_the_wait_says_why():
    s = Scheduler(1)
    acts = s.plan([want(1, 3.0)], [rep(0, 0, in_flight=3, ready=NOW - 50 * S)], NOW)
    assert acts == []
    w = s.waits[1]
    assert (w.reason, w.holder, w.eta_ns) == (WaitReason.SLICE, 0, NOW + 7 * S)


def test_past_its_bound_the_head_drains_the_busy_holder_instead_of_waiting_forever():
    s = Scheduler(1)
    acts = s.plan([want(1, 11.0)], [rep(0, 0, in_flight=3, ready=NOW - 50 * S)], NOW)
    assert kinds(acts) == [("drain", 0, 1)]
    assert s.waits[1].reason == WaitReason.DRAINING and s.waits[1].holder == 0


def test_a_drained_replica_stops_once_idle_and_the_head_loads_in_the_same_tick():
    s = Scheduler(1)
    r = rep(0, 0, in_flight=0, ready=NOW - 50 * S, draining=True, drain_for=1)
    acts = s.plan([want(1, 12.0), want(0, 1.0)], [r], NOW)
    assert kinds(acts) == [("stop", 0), ("spawn", 1)]
    assert acts[0].drained
    # the drained model's own waiters queue behind, and say so
    assert s.waits[0].reason == WaitReason.QUEUED


def test_a_draining_replica_with_requests_in_flight_is_left_to_finish():
    s = Scheduler(1)
    r = rep(0, 0, in_flight=2, ready=NOW - 50 * S, draining=True, drain_for=1)
    assert s.plan([want(1, 12.0)], [r], NOW) == []
    assert s.waits[1].reason == WaitReason.DRAINING


def test_a_drain_whose_model_stopped_waiting_is_undone():
    s = Scheduler(1)
    r = rep(0, 0, in_flight=2, ready=NOW - 50 * S, draining=True, drain_for=1)
    assert kinds(s.plan([], [r], NOW)) == [("undrain", 0)]


def test_the_drained_models_own_waiters_do_not_count_its_draining_replica_as_serving():
    s = Scheduler(2)
    r = rep(0, 0, in_flight=2, ready=NOW - 50 * S, draining=True, drain_for=1)
    q = s.queue([want(0, 1.0), want(1, 12.0)], [r], NOW)
    assert [m.index for m in q] == [1, 0]


def test_minimum_residency_protects_a_model_just_swapped_in():
    s = Scheduler(1)
    fresh = rep(0, 0, in_flight=1, ready=NOW - 2 * S, min_residency_ns=5 * S)
    assert s.plan([want(1, 30.0)], [fresh], NOW) == []
    assert s.waits[1].reason == WaitReason.SLICE and s.waits[1].eta_ns == NOW + 3 * S
    old = rep(0, 0, in_flight=1, ready=NOW - 6 * S, min_residency_ns=5 * S)
    assert kinds(s.plan([want(1, 30.0)], [old], NOW)) == [("drain", 0, 1)]


def test_an_idle_replica_is_evicted_even_inside_its_residency():
    s = Scheduler(1)
    fresh = rep(0, 0, ready=NOW - 1 * S, min_residency_ns=5 * S)
    assert kinds(s.plan([want(1, 0.1)], [fresh], NOW)) == [("stop", 0), ("spawn", 1)]


def test_the_longest_waiting_model_loads_first():
    s = Scheduler(1)
    acts = s.plan([want(1, 2.0), want(2, 5.0), want(3, 1.0)], [], NOW)
    assert kinds(acts) == [("spawn", 2)]
    assert s.waits[1].reason == WaitReason.QUEUED and s.waits[1].holder == 2


def test_a_pinned_model_is_never_a_victim_idle_or_busy():
    s = Scheduler(2)
    reps = [rep(0, 0, ready=NOW - 100 * S, pinned=True), rep(1, 1, ready=NOW - 10 * S)]
    assert kinds(s.plan([want(2, 0.1)], reps, NOW)) == [("stop", 1), ("spawn", 2)]
    busy = [rep(0, 0, in_flight=1, ready=NOW - 100 * S, pinned=True),
            rep(1, 1, in_flight=1, ready=NOW - 10 * S)]
    assert kinds(s.plan([want(2, 60.0)], busy, NOW)) == [("drain", 1, 2)]


def test_when_only_pinned_models_hold_the_capacity_the_wait_says_so():
    s = Scheduler(1)
    assert s.plan([want(1, 60.0)], [rep(0, 0, ready=NOW - S, pinned=True)], NOW) == []
    assert s.waits[1].reason == WaitReason.PINNED and s.waits[1].holder == 0


def test_eviction_priority_orders_idle_victims_before_recency():
    s = Scheduler(2)
    reps = [rep(0, 0, used=NOW - 100 * S, eviction_priority=5),
            rep(1, 1, used=NOW - 1 * S)]
    assert kinds(s.plan([want(2, 0.1)], reps, NOW)) == [("stop", 1), ("spawn", 2)]


def test_eviction_priority_then_least_recently_started_orders_drains():
    s = Scheduler(2)
    reps = [rep(0, 0, in_flight=1, ready=NOW - 100 * S, eviction_priority=1),
            rep(1, 1, in_flight=1, ready=NOW - 20 * S),
            rep(2, 3, in_flight=1, ready=NOW - 50 * S, state="ready")]
    s.models_max = 3
    assert kinds(s.plan([want(2, 60.0)], reps, NOW)) == [("drain", 2, 2)]


def test_a_model_with_no_bound_never_drains():
    s = Scheduler(1)
    m = ModelView(1, 1, NOW - 1000 * S, max_wait_ns=0)
    assert s.plan([m], [rep(0, 0, in_flight=1, ready=NOW - 1000 * S)], NOW) == []
    assert s.waits[1].reason == WaitReason.SLICE


def test_only_one_drain_at_a_time_for_the_slot_count():
    s = Scheduler(2)
    reps = [rep(0, 0, in_flight=1, ready=NOW - 100 * S, draining=True, drain_for=2),
            rep(1, 1, in_flight=1, ready=NOW - 100 * S)]
    assert s.plan([want(2, 60.0), want(3, 59.0)], reps, NOW) == []
    assert s.waits[2].reason == WaitReason.DRAINING and s.waits[3].reason == WaitReason.QUEUED


def test_memory_victim_set_frees_enough_with_the_fewest_victims():
    # 1 GiB free of need 3 GiB: the one 2 GiB model suffices, not two 1 GiB ones
    s = Scheduler(8)
    reps = [rep(0, 0, used=NOW - 300 * S, held={"host": 1 * GiB}),
            rep(1, 1, used=NOW - 200 * S, held={"host": 1 * GiB}),
            rep(2, 2, used=NOW - 100 * S, held={"host": 2 * GiB})]
    mem = MemoryView(headroom={"host": 1 * GiB}, need={5: {"host": 3 * GiB}})
    acts = s.plan([want(5, 0.1)], reps, NOW, mem)
    assert kinds(acts) == [("stop", 2)]  # then waits for its memory to be released
    assert s.waits[5].reason == WaitReason.STOPPING


def test_memory_victim_set_of_two_busy_models_is_drained_together_past_the_bound():
    s = Scheduler(2)
    reps = [rep(0, 0, in_flight=1, ready=NOW - 300 * S, held={"host": 1 * GiB}),
            rep(1, 1, in_flight=1, ready=NOW - 200 * S, held={"host": 1 * GiB})]
    mem = MemoryView(headroom={"host": 0}, need={5: {"host": 2 * GiB}})
    acts = s.plan([want(5, 30.0)], reps, NOW, mem)
    assert sorted(kinds(acts)) == [("drain", 0, 5), ("drain", 1, 5)]
    # before the bound: nothing, and nothing idle is evicted in vain
    assert s.plan([want(5, 1.0)], reps, NOW, mem) == []


def test_a_busy_model_with_waiters_for_its_own_replica_is_still_drainable():
    s = Scheduler(1)
    acts = s.plan([want(0, 20.0), want(1, 30.0)], [rep(0, 0, in_flight=4, ready=NOW - 99 * S)],
                  NOW)
    assert kinds(acts) == [("drain", 0, 1)]


def test_a_loading_replica_is_neither_evicted_nor_drained():
    s = Scheduler(1)
    assert s.plan([want(1, 60.0)], [rep(0, 0, state="loading")], NOW) == []
    assert s.waits[1].reason == WaitReason.QUEUED


def test_a_replica_just_ready_for_its_own_waiters_is_not_drained_before_it_serves_them():
    s = Scheduler(1)
    fresh = rep(0, 0, in_flight=0, ready=NOW - 1, min_residency_ns=0)
    assert s.plan([want(0, 2.0), want(1, 30.0)], [fresh], NOW) == []
    assert s.waits[1].reason == WaitReason.SLICE and s.waits[1].holder == 0


def test_a_model_too_big_for_everything_evicts_every_idle_one_first():
    s = Scheduler(4)
    reps = [rep(0, 0, used=NOW - 9 * S, held={"host": GiB}),
            rep(1, 1, used=NOW - 5 * S, held={"host": GiB})]
    mem = MemoryView(headroom={"host": 4 * GiB}, need={5: {"host": 8 * GiB}})
    acts = s.plan([want(5, 0.1)], reps, NOW, mem)
    assert sorted(kinds(acts)) == [("stop", 0), ("stop", 1)]
    assert s.waits[5].reason == WaitReason.STOPPING  # loads once they are gone


def test_nothing_loaded_and_short_of_memory_loads_anyway():
    s = Scheduler(4)
    mem = MemoryView(headroom={"host": GiB}, need={5: {"host": 2 * GiB}})
    acts = s.plan([want(5, 0.1)], [], NOW, mem)
    assert kinds(acts) == [("spawn", 5)] and acts[0].warning


def test_a_model_that_fits_only_after_a_stopping_replica_exits_waits_for_the_exit():
    """An evicted replica saving its KV tiers holds its memory until it
    exits: with a free slot and no victim needed, the load still waits."""
    s = Scheduler(2)
    stopping = rep(0, 0, state="stopping", held={"host": 600 << 20})
    mem = MemoryView(headroom={"host": 424 << 20}, need={1: {"host": 600 << 20}})
    assert s.plan([want(1, 0.1)], [stopping], NOW, mem) == []
    assert s.waits[1].reason == WaitReason.STOPPING
    mem = MemoryView(headroom={"host": 1024 << 20}, need={1: {"host": 600 << 20}})
    assert kinds(s.plan([want(1, 0.2)], [], NOW, mem)) == [("spawn", 1)]


def test_an_idle_model_whose_clients_come_back_keeps_its_capacity_through_its_grace():
    """Between two requests of a closed-loop client its model is idle; in
    its grace it counts as busy (a waiting model waits, told when it
    frees), and once the grace is over it is an idle victim again."""
    s = Scheduler(1)
    held = rep(0, 0, used=NOW - 1 * S, ready=NOW - 50 * S, grace_until_ns=NOW + 1 * S)
    assert s.plan([want(1, 0.5)], [held], NOW) == []
    w = s.waits[1]
    assert (w.reason, w.holder, w.eta_ns) == (WaitReason.SLICE, 0, NOW + 1 * S)
    over = rep(0, 0, used=NOW - 3 * S, ready=NOW - 50 * S)
    assert kinds(s.plan([want(1, 0.5)], [over], NOW)) == [("stop", 0), ("spawn", 1)]
    # past the waiting model's bound, a replica in its grace drains like a busy one
    assert kinds(s.plan([want(1, 11.0)], [held], NOW)) == [("drain", 0, 1)]


def test_a_model_holds_through_its_grace_only_while_its_clients_come_back_within_it():
    """Returns: a model whose idle spells end with a request within the
    grace (a chat's next turn) holds; one whose clients moved on to
    another model (round robin) stops holding after a spell or two, and
    holds again once they return."""
    from ggmux.supervisor.contention import Returns

    r = Returns(grace_s=2.0)
    t = NOW
    r.step(t, {0: 1}, {0})
    assert not r.holds(0)  # undecided before anything was seen: it has to be earned
    for _ in range(3):  # idle 1 s, then its client's next request
        r.step(t, {}, {0})
        t += 1 * S
        r.step(t, {0: 1}, {0})
        assert r.holds(0)  # from the first return on
    for _ in range(2):  # idle past the grace: nobody came back in time
        r.step(t, {}, {0})
        t += 3 * S
        r.step(t, {}, {0})
        t += 1 * S
        r.step(t, {0: 1}, {0})
    assert not r.holds(0)
    r.step(t, {}, {0})
    t += 10 * S
    for _ in range(8):  # a long idle spell counts once, not once per grace
        r.step(t, {}, {0})
        t += 3 * S
    assert r.share[0] > 0.1
    r.step(t, {0: 1}, {0})
    for _ in range(2):  # quick returns again
        r.step(t, {}, {0})  # idle...
        t += 1 * S
        r.step(t, {}, set())  # ...evicted meanwhile: its client's return still counts
        r.step(t, {0: 1}, set())
    assert r.holds(0)
    assert not Returns(grace_s=0).holds(0)  # --demand-grace 0: off


def test_a_hold_pays_only_where_the_reload_it_saves_outweighs_the_waits_it_costs():
    """A model whose clients come back holds over waiting requests only
    while its reload (load time x how often they come back) is worth the
    think time it makes them wait (its measured return gap each): a
    half-second model does not hold a round robin's waiter through a 1 s
    gap, a burst's 20 ms gaps do pay, a 10-second model holds for a few;
    with nobody waiting a hold costs nothing; a hold lasts three gaps,
    within the grace."""
    from ggmux.supervisor.contention import HOLD_MIN_S, Returns

    r = Returns(grace_s=2.0)
    t = NOW
    r.step(t, {0: 1}, {0})
    for _ in range(4):  # its clients come back after 1 s each time (a round robin)
        r.step(t, {}, {0})
        t += 1 * S
        r.step(t, {0: 1}, {0})
    assert r.holds(0) and abs(r.gap[0] - 1.0) < 0.1
    assert not r.pays(0, 0.5, 1) and r.pays(0, 0.5, 0)
    assert r.pays(0, 10.0, 3) and not r.pays(0, 10.0, 11)
    assert r.hold_s(0) == 2.0  # three gaps, capped at the grace
    for _ in range(6):  # now 20 ms gaps (a burst's clients)
        r.step(t, {}, {0})
        t += S // 50
        r.step(t, {0: 1}, {0})
    assert r.pays(0, 0.5, 4)
    assert r.hold_s(0) == HOLD_MIN_S
    r.share[0] = 0.4  # does not hold at all
    assert not r.pays(0, 100.0, 0)


def test_a_grace_yields_to_eviction_priority():
    """An idle replica the operator ranked above (eviction-priority 5) is
    not evicted instead of one in its grace ranked below."""
    s = Scheduler(2)
    kept = rep(0, 0, used=NOW - 5 * S, ready=NOW - 50 * S, eviction_priority=5)
    graced = rep(1, 1, used=NOW - 1 * S, ready=NOW - 50 * S, grace_until_ns=NOW + 1 * S)
    assert kinds(s.plan([want(2, 0.5)], [kept, graced], NOW)) == [("stop", 1), ("spawn", 2)]
    same = rep(0, 0, used=NOW - 5 * S, ready=NOW - 50 * S)
    assert kinds(s.plan([want(2, 0.5)], [same, graced], NOW)) == [("stop", 0), ("spawn", 2)]
