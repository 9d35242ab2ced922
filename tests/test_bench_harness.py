"""The benchmark harness (bench/) measures a fake OpenAI-compatible server.

No timing thresholds: only counts, statuses and the order of the recorded
times (0 < TTFT < end-to-end) are checked.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not part of the installed package
    sys.path.insert(0, str(ROOT))

from bench.fake_openai import FakeServerThread
from bench.serving import BenchConfig, format_summary, percentile, plan, run


@pytest.fixture
def fake_server():
    with FakeServerThread(models=["small", "large"], ttft=0.01, token_delay=0.002) as server:
        yield server


def test_streaming_run_records_every_request_with_ttft_before_e2e(fake_server):
    config = BenchConfig(
        base_url=fake_server.base_url,
        models=[("small", 3.0), ("large", 1.0)],
        rate=10.0,
        duration=2.0,
        max_tokens=(4, 8),
        prompt_words=(4, 16),
        warmup=2,
        seed=7,
        timeout=10.0,
        progress=False,
    )
    expected = list(plan(config))

    results = run(config)

    records = results["requests"]
    assert len(records) == len(expected) > 0
    assert [r["model"] for r in records] == [s.model for s in expected]
    assert all(r["status"] == 200 and r["ok"] and r["error"] is None for r in records)
    for r, spec in zip(records, expected, strict=True):
        assert 0 < r["ttfb"] <= r["ttft"] < r["e2e"]
        assert r["output_tokens"] == spec.max_tokens
        assert r["tpot"] > 0
    summary = results["summary"]
    assert summary["requests"] == summary["ok"] == len(records)
    assert summary["status_counts"] == {"200": len(records)}
    assert sum(m["requests"] for m in results["per_model"].values()) == len(records)
    # warm-up requests are served but not recorded
    assert fake_server.server.served == len(records) + 2
    json.dumps(results)  # the results are JSON as they are
    assert "ttft" in format_summary(results)


def test_a_concurrency_sweep_records_inter_token_gaps_and_goodput(fake_server):
    from bench.serving import format_sweep, sweep
    from bench.stats import parse_slo

    assert parse_slo("ttft=1s,tpot=50ms, itl=0.2") == {"ttft": 1.0, "tpot": 0.05, "itl": 0.2}
    with pytest.raises(ValueError):
        parse_slo("latency=1s")
    config = BenchConfig(base_url=fake_server.base_url, models=[("small", 1.0)], requests=6,
                         max_tokens=(5, 5), timeout=10.0, progress=False,
                         slo={"ttft": 60.0, "itl": 60.0})
    swept = sweep(config, [1, 3])
    assert [lv["concurrency"] for lv in swept["levels"]] == [1, 3]
    for lv in swept["levels"]:
        assert lv["config"]["max_concurrency"] == lv["concurrency"]
        assert all(len(r["itl"]) == r["output_tokens"] - 1 == 4 for r in lv["requests"])
        s = lv["summary"]
        assert s["metrics"]["itl"]["count"] == 6 * 4
        assert s["metrics"]["itl"]["p50"] <= s["metrics"]["itl"]["p99"]
        assert s["goodput"] == s["request_throughput"] and s["slo_attained"] == 1.0
    assert "ITL p99" in format_sweep(swept)
    strict = run(BenchConfig(base_url=fake_server.base_url, models=[("small", 1.0)],
                             requests=3, max_tokens=(5, 5), timeout=10.0, progress=False,
                             slo={"ttft": 1e-9}))
    assert strict["summary"]["goodput"] == 0 and strict["summary"]["slo_attained"] == 0
    assert "goodput" in format_summary(strict)


def test_non_streaming_completions_have_no_ttft(fake_server):
    config = BenchConfig(
        base_url=fake_server.base_url + "/v1",
        models=[("large", 1.0)],
        requests=12,
        rate=math.inf,
        max_concurrency=4,
        max_tokens=(3, 3),
        stream=False,
        endpoint="completions",
        timeout=10.0,
        progress=False,
    )

    results = run(config)

    records = results["requests"]
    assert len(records) == 12
    assert all(r["ok"] and r["ttft"] is None and r["output_tokens"] == 3 for r in records)
    assert all(0 < r["ttfb"] <= r["e2e"] for r in records)
    assert results["connections_opened"] <= 4


def test_errors_are_recorded_with_their_status(fake_server):
    config = BenchConfig(
        base_url=fake_server.base_url,
        models=[("missing", 1.0)],
        requests=5,
        rate=50.0,
        timeout=10.0,
        progress=False,
    )

    results = run(config)

    assert results["summary"]["failed"] == 5
    assert results["summary"]["status_counts"] == {"404": 5}
    assert all("model_not_found" in r["error"] for r in results["requests"])


def test_closed_loop_over_a_duration_keeps_connections_bounded(fake_server):
    config = BenchConfig(
        base_url=fake_server.base_url,
        models=[("small", 1.0)],
        rate=math.inf,
        duration=1.0,
        max_concurrency=8,
        endpoint="get",
        timeout=10.0,
        progress=False,
    )

    results = run(config)

    assert results["summary"]["ok"] == len(results["requests"]) > 8
    assert results["connections_opened"] <= 8


def test_closed_loop_without_drain_leaves_out_what_the_window_cut():
    with FakeServerThread(ttft=0.2, token_delay=0.01) as slow:
        config = BenchConfig(
            base_url=slow.base_url,
            models=[("small", 1.0)],
            rate=math.inf,
            duration=0.5,
            max_concurrency=4,
            max_tokens=(2, 2),
            drain=False,
            timeout=10.0,
            progress=False,
        )

        results = run(config)

    assert results["cut_at_window_end"] > 0
    assert all(r["ok"] for r in results["requests"])
    assert results["summary"]["elapsed_s"] == 0.5


def test_unreachable_server_gives_status_zero():
    with socket.socket() as sock:  # a port that was free a moment ago
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = BenchConfig(
        base_url=f"http://127.0.0.1:{port}",
        models=[("small", 1.0)],
        requests=2,
        rate=100.0,
        timeout=10.0,
        progress=False,
    )

    results = run(config)

    assert [r["status"] for r in results["requests"]] == [0, 0]
    assert all(r["error"] for r in results["requests"])


def test_percentile_interpolates_like_numpy():
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def test_compare_alternates_targets_and_reports_ratios_to_direct(tmp_path, monkeypatch):
    import bench.compare
    from bench.compare import (
        Context,
        ProcessSet,
        Settings,
        Target,
        figures,
        format_report,
        measure_hot,
    )

    settings = Settings(
        rounds=2,
        overhead_requests=3,
        cheap_requests=5,
        throughput_seconds=0.3,
        concurrencies=(4,),
        ttft_requests=2,
        ttft_max_tokens=3,
        ttft_prompt_words=4,
        cold_rounds=1,
        warmup=1,
    )
    with (
        FakeServerThread(ttft=0.005, token_delay=0.001) as a,
        FakeServerThread(ttft=0.005, token_delay=0.001) as b,
    ):
        targets = [Target("direct", a.base_url), Target("other", b.base_url)]
        ctx = Context(args=None, procs=ProcessSet(tmp_path), model_paths={}, env={})
        template = BenchConfig(timeout=10.0, progress=False)
        calls: list[str] = []

        def recording_run(config):
            calls.append(config.base_url)
            return run(config)

        monkeypatch.setattr(bench.compare, "run", recording_run)

        hot = measure_hot(ctx, targets, settings, template)

    assert set(hot) == {"tiny_c1", "cheap_c1", "cheap_c4", "tiny_c4", "stream_c1"}
    for by_target in hot.values():
        assert set(by_target) == {"direct", "other"}
        assert all(len(rounds) == 2 for rounds in by_target.values())
        assert all(r["summary"]["failed"] == 0 for rs in by_target.values() for r in rs)
    # every figure runs in alternating rounds: A B A B, never A A B B
    assert calls == [a.base_url, b.base_url] * 2 * len(hot)
    figs = figures(hot)
    assert figs["stream_c1.ttft_p50"]["other"] > 0
    report = {
        "targets": [{"name": t.name, "note": t.note} for t in targets],
        "figures": figs,
        "titles": {},
        "skipped": {},
        "cold": {},
    }
    table = format_report(report)
    assert "x)" in table  # ratios to direct are printed
