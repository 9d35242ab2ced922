"""Benchmarks for ggmux: an open-loop load generator and a side-by-side comparison.

* ``bench.serving``: Poisson (or closed-loop) load against any
  OpenAI-compatible server; per-request TTFT, time per output token and
  end-to-end latency; ``run(config) -> results dict``.
* ``bench.compare``: the same workload against several targets (one
  instance, ggmux, nginx, llama.cpp's router) in alternating rounds, with
  ratios relative to the direct instance (its targets
  ``bench.compare_targets``, its tables ``bench.compare_report``).
* ``bench.processes`` and ``bench.targets``: what every side-by-side
  harness stands on (the child processes, stopped however a run ends; the
  servers under test and the HTTP helpers that start and watch them).
* ``bench.fake_openai``: a tiny stdlib OpenAI-compatible streaming server
  for testing the harness without a model.

Run from the repository root: ``python -m bench.serving --help``.
"""
