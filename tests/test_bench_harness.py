"""The benchmark harness (bench/) measures a fake OpenAI-compatible server.

No timing thresholds: only counts, statuses and the order of the recorded
times (0 < TTFT < end-to-end) are checked.
"""

from __future__ import annotations

import json
import math
import socket
import sys
from dataclasses import replace
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


def test_itl_and_tpot_come_from_the_content_event_times():
    from bench.stats import inter_token_gaps, tpot

    # content events at 0.5 s (the first token), then 20, 30 and 100 ms apart
    arrivals = [0.5, 0.52, 0.55, 0.65]

    gaps = inter_token_gaps(arrivals)

    assert gaps == pytest.approx([0.02, 0.03, 0.10])
    assert inter_token_gaps([0.5]) == [] and inter_token_gaps([]) == []
    # (end - first token) over the tokens after the first
    assert tpot(0.5, 0.66, 4) == pytest.approx(0.16 / 3)
    assert tpot(0.5, 0.66, 1) is None and tpot(None, 0.66, 4) is None


def _record(index, *, ok=True, ttft=0.1, itl=(), e2e=None, tokens=None):
    from bench.serving import RequestResult
    from bench.stats import tpot

    itl = list(itl)
    tokens = len(itl) + 1 if tokens is None else tokens
    e2e = ttft + sum(itl) if e2e is None else e2e
    return RequestResult(
        index, "m", 0.0, status=200 if ok else 500, ok=ok, ttft=ttft, e2e=e2e,
        tpot=tpot(ttft, e2e, tokens), output_tokens=tokens, itl=itl,
    )


def test_itl_percentiles_pool_the_gaps_of_every_successful_stream():
    from bench.stats import summarize

    records = [
        _record(0, itl=[0.01, 0.02, 0.03]),
        _record(1, itl=[0.04, 0.50]),  # one stall of 500 ms
        _record(2, ok=False, itl=[9.0, 9.0]),  # failed: its gaps are not counted
    ]

    itl = summarize(records, elapsed=2.0)["metrics"]["itl"]

    # numpy's linear interpolation over [0.01, 0.02, 0.03, 0.04, 0.50]
    assert itl["count"] == 5
    assert itl["p50"] == pytest.approx(0.03)
    assert itl["p99"] == pytest.approx(0.04 + 0.96 * 0.46)
    assert itl["max"] == pytest.approx(0.50)


def test_goodput_counts_only_requests_that_met_every_slo():
    from bench.stats import meets_slo, summarize

    slo = {"ttft": 1.0, "tpot": 0.05, "itl": 0.2}
    fine = _record(0, ttft=0.5, itl=[0.04, 0.04, 0.04])
    late = _record(1, ttft=1.5, itl=[0.04])  # TTFT over 1 s
    slow = _record(2, ttft=0.5, itl=[0.06, 0.06])  # TPOT 60 ms
    stall = _record(3, ttft=0.5, itl=[0.01, 0.01, 0.01, 0.01, 0.01, 0.3])  # one gap of 300 ms
    one_token = _record(4, ttft=0.5, tokens=1)  # no TPOT: not held against it
    failed = _record(5, ok=False, ttft=0.1, itl=[0.01])

    assert [meets_slo(r, slo) for r in (fine, late, slow, stall, one_token, failed)] == [
        True, False, False, False, True, False,
    ]
    summary = summarize([fine, late, slow, stall, one_token, failed], elapsed=4.0, slo=slo)
    assert summary["goodput"] == pytest.approx(2 / 4.0)  # requests/s that met every bound
    assert summary["slo_attained"] == pytest.approx(2 / 6)  # share of all requests
    assert summary["request_throughput"] == pytest.approx(5 / 4.0)


def test_slo_bounds_parse_with_units_and_need_what_they_bound():
    from bench.stats import parse_slo

    assert parse_slo("ttft=1s,tpot=50ms") == {"ttft": 1.0, "tpot": 0.05}
    assert parse_slo("e2e=2.5") == {"e2e": 2.5}
    for bad in ("latency=1s", "ttft=fast", "ttft"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    with pytest.raises(ValueError, match="streaming"):
        BenchConfig(stream=False, slo={"ttft": 1.0}, requests=1).validate()
    with pytest.raises(ValueError, match="finite plan"):
        BenchConfig(rate=math.inf, duration=1.0, max_concurrency=2, prompt_tokens=10).validate()


def test_sized_prompts_hold_the_chosen_token_count_whatever_the_tokenizer():
    import random

    from bench.prompts import sized_prompt

    def per_word(_model, text):  # one token per word
        return len(text.split())

    def long_words_two(_model, text):  # words over 6 letters are 2 tokens
        return sum(1 + (len(w) > 6) for w in text.split())

    def all_two(_model, text):  # every word 2 tokens: an odd gap cannot be filled
        return 2 * len(text.split())

    for counter in (per_word, long_words_two):
        for seed in range(20):
            text, n = sized_prompt(random.Random(seed), 40, "m", counter)
            assert n == counter("m", text) == 40
    # the same seed, the same prompt
    assert sized_prompt(random.Random(3), 40, "m", long_words_two) == sized_prompt(
        random.Random(3), 40, "m", long_words_two
    )
    # when it cannot be met, the count returned is the prompt's own
    text, n = sized_prompt(random.Random(0), 41, "m", all_two)
    assert n == all_two("m", text) == 40
    text, n = sized_prompt(random.Random(0), 2, "m", per_word)  # the instruction is longer
    assert n == per_word("m", text) > 2


def test_sizing_prompts_keeps_the_plans_arrivals_and_models():
    config = BenchConfig(models=[("a", 1.0), ("b", 2.0)], rate=5.0, requests=30, seed=4)

    plain = list(plan(config))
    sized = list(plan(replace(config, prompt_tokens=25), lambda _m, t: len(t.split())))

    assert [(s.at, s.model, s.max_tokens) for s in sized] == [
        (s.at, s.model, s.max_tokens) for s in plain
    ]
    assert all(s.prompt_text_tokens == 25 == len(s.prompt.split()) for s in sized)
    with pytest.raises(ValueError):
        list(plan(replace(config, prompt_tokens=25)))  # no counter


def test_a_sweep_sends_every_level_the_same_sized_prompts(fake_server):
    from bench.serving import sweep

    config = BenchConfig(
        base_url=fake_server.base_url, models=[("small", 1.0)], requests=4, max_tokens=(3, 3),
        prompt_tokens=20, timeout=10.0, progress=False,
    )

    swept = sweep(config, [1, 2])

    prompts = fake_server.server.prompts
    assert len(prompts) == 8
    # the same four prompts at each level, each 20 tokens by the server's /tokenize
    assert sorted(prompts[:4]) == sorted(prompts[4:]) and len(set(prompts)) == 4
    assert all(len(p.split()) == 20 for p in prompts)
    for lv in swept["levels"]:
        assert [r["prompt_text_tokens"] for r in lv["requests"]] == [20] * 4
        assert lv["summary"]["prompt_tokens"]["prompt_text_tokens"]["mean"] == 20
    fresh = sweep(config, [1, 2], fresh_prompts=True)
    assert all(lv["summary"]["failed"] == 0 for lv in fresh["levels"])
    assert len(set(prompts[8:])) == 8  # a new set for each level


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
    from bench.compare import Settings, measure_hot
    from bench.compare_report import figures, format_report
    from bench.processes import ProcessSet
    from bench.targets import Context, Target

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


def test_slots_runs_every_level_on_every_target_in_turn_and_reports_ratios(tmp_path, monkeypatch):
    import bench.slots
    from bench.processes import ProcessSet
    from bench.slots import Settings, figures, format_report, level_config, measure
    from bench.targets import Context, Target

    settings = Settings(rounds=2, levels=(1, 3), per_stream=2, min_requests=2, max_tokens=4,
                        prompt_tokens=12)
    with (
        FakeServerThread(ttft=0.005, token_delay=0.001) as a,
        FakeServerThread(ttft=0.005, token_delay=0.001) as b,
    ):
        targets = [Target("llama-server", a.base_url), Target("ggmux", b.base_url)]
        ctx = Context(args=None, procs=ProcessSet(tmp_path), model_paths={}, env={})
        base = BenchConfig(models=[("m", 1.0)], rate=math.inf, max_tokens=(4, 4),
                           prompt_tokens=12, timeout=10.0, progress=False)
        calls: list[tuple[str, int, int]] = []

        def recording_run(config):
            calls.append((config.base_url, config.max_concurrency, config.seed))
            return run(config)

        monkeypatch.setattr(bench.slots, "run", recording_run)

        runs = measure(ctx, targets, settings, base)

        # the same prompts for both targets within a round and level, new ones otherwise
        assert a.server.prompts == b.server.prompts
        assert len(set(a.server.prompts)) == len(a.server.prompts) == 2 * (2 + 6)
    # for every round, for every level: each target in turn
    assert [(url, c) for url, c, _ in calls] == [
        (url, c) for _ in range(2) for c in (1, 3) for url in (a.base_url, b.base_url)
    ]
    assert len({seed for _, _, seed in calls}) == 4
    assert level_config(base, settings, targets[0], 3, 0).requests == 6
    figs = figures(runs)
    assert set(figs) == {"1", "3"}
    for by_target in figs.values():
        for fig in by_target.values():
            assert fig["failed"] == 0 and fig["output_tokens"] == 4
            assert fig["tok_s"] > 0 and 0 < fig["itl_p50"] <= fig["itl_p99"]
    report = {
        "targets": [{"name": t.name} for t in targets],
        "figures": figs,
        "commands": {t.name: ["serve"] for t in targets},
        "skipped": {"llama-router": "not built"},
    }
    table = format_report(report)
    assert "x)" in table and "ITL p99" in table and "skipped llama-router" in table
