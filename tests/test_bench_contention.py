"""bench/contention.py's harness (issue 34) on fake models: a tiny round
robin through a real ``ggmux serve`` counts its loads, waits and tokens, and
the report states the issue's targets; the workloads' plans are seeded."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bench.contention import (
    Peer,
    ProcessSet,
    format_report,
    measure,
    resolve,
    summary,
    write_preset,
)
from bench.contention_load import Workload, burst_plan, figures, workloads
from bench.serving import RequestResult

REPO = Path(__file__).resolve().parents[1]


def test_a_tiny_round_robin_through_ggmux_counts_its_swaps_waits_and_tokens(tmp_path):
    # two clients, each cycling over three models that load in 0.05 s, one at a time
    w = Workload("roundrobin", "fake", ["a", "b", "c"], 1, 4,
                 params={"clients": 2, "requests": 3, "think_s": 0.2})
    peer = Peer("new", "ggmux", checkout=REPO)
    procs = ProcessSet(tmp_path)
    try:
        assert resolve(peer, tmp_path).startswith(str(REPO.resolve()))
        preset = write_preset(w, peer, tmp_path, {}, 0.05)
        run = measure(peer, w, procs, preset, seed=0, timeout=60.0)
    finally:
        procs.stop_all()
    assert run["requests"] == 6 and run["failed"] == 0, run["errors"]
    assert set(run["per_model"]) == {"a", "b", "c"}
    # every model was loaded at least once, one at a time: the server's own count
    assert run["swaps"] >= 3 and run["load_s"] > 0
    assert 0 < run["load_share"] < 1
    # the router's own CPU (supervisor and proxy) and the engines' decode pace
    assert run["router_cpu_s"] > 0 and run["tpot"] > 0
    assert all(r["ttft"] > 0 and r["output_tokens"] == 4 for r in run["records"])
    assert run["tok_s"] == pytest.approx(6 * 4 / run["wall_s"], rel=0.02)
    # the report: one table row per peer, the swap target judged against the other peer
    other = {**run, "swaps": 3 * run["swaps"]}
    runs = {"fake": {"roundrobin": {"new": [run], "today": [other]}}}
    s = summary(runs, [peer, Peer("today", "ggmux", checkout=REPO)])
    said = s["fake"]["roundrobin"]["targets"]
    assert any("3.0x fewer than today" in t for t in said), said
    table = format_report({"summary": s})
    assert "| new |" in table and "| today |" in table


def _rec(i: int, model: str, ttft: float | None, ok: bool = True, tokens: int = 10):
    return RequestResult(i, model, 0.0, status=200 if ok else 503, ok=ok, ttft=ttft,
                         e2e=ttft, output_tokens=tokens)


def test_figures_take_waits_per_model_and_goodput_over_the_wall_time():
    records = [_rec(0, "a", 0.5), _rec(1, "a", 1.5), _rec(2, "b", 40.0),
               _rec(3, "b", None, ok=False, tokens=0)]

    f = figures(records, wall_s=60.0, loads=4, load_s=6.0)

    assert f["per_model"]["a"]["max"] == 1.5 and f["per_model"]["b"]["max"] == 40.0
    assert f["per_model"]["b"]["failed"] == 1 and f["failed"] == 1
    assert f["wait_max"] == 40.0
    assert f["req_per_min"] == pytest.approx(3.0) and f["tok_s"] == pytest.approx(0.5)
    assert f["load_share"] == pytest.approx(0.1) and f["swaps"] == 4
    assert figures(records, 60.0, None, None)["load_share"] is None


def test_bursts_are_seeded_interleaved_and_10_to_20_requests_each():
    w = workloads("fake", True, ["a", "b", "c"])["bursts"]

    plan = burst_plan(w, seed=3)

    assert plan == burst_plan(w, seed=3) and plan != burst_plan(w, seed=4)
    assert [t for t, _ in plan] == sorted(t for t, _ in plan)
    n = int(w.params["bursts"])
    assert 10 * n <= len(plan) <= 20 * n
    assert {m for _, m in plan} <= set(w.models)
    # bursts overlap: somewhere a model's request arrives between two of another's
    models = [m for _, m in plan]
    assert any(models[i] != models[i + 1] and models[i] == models[i + 2]
               for i in range(len(models) - 2))
    assert not math.isinf(plan[-1][0])
