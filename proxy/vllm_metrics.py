"""``GET /metrics`` under vLLM's names (``--metrics-compat vllm``): the
signals an endpoint picker scores a model server by.

The Gateway API Inference Extension's endpoint picker (and llm-d, kgateway,
Istio, which use it) scrapes each pod of an ``InferencePool`` for vLLM's
``vllm:num_requests_waiting`` (queue scorer), ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (KV-utilization scorer), ``vllm:lora_requests_info``
(adapter affinity) and ``vllm:cache_config_info`` (the KV block size and
count the precise-prefix scorer sizes its index by). A ggmux pod serves many
models: its loaded models are the "adapters", so the picker sends a request
to a pod that already holds its model instead of making another pod load it.

Each family starts with one series for the whole pod, without a
``model_name`` label, then one per model with ``model_name`` (vLLM's label):
a picker that names no label reads the first series of a family (the
reference picker takes the first of equal timestamps), so it scores the pod;
one that names ``model_name`` scores that model. Sums in PromQL take
``model_name!=""``. Every figure comes from the models passed in, so a
filter on the models a key may see applies here as to ggmux's own series.

Figures (all gauges):

* running: requests in the model's replicas' slots (``llamacpp:requests_processing``
  scraped from them), or the proxies' in-flight count where a replica has no
  such figure (a ``cmd`` or remote replica);
* waiting: requests waiting for the model to load or for capacity (the
  models table's waiters) plus those queued inside replicas for a slot or KV
  room (``llamacpp:requests_deferred``);
* KV usage, 0-1: cells reserved by running requests (prompt plus the most
  they may generate) over the cells of the ready replicas; an idle slot's
  prompt cache is evictable, so, as vLLM's cached free blocks, it counts as
  free;
* ``cache_config_info``: ``block_size`` (the KV events' block, ``--kv-events-block-size``)
  and ``num_gpu_blocks`` (the ready replicas' cells over it);
* ``lora_requests_info``: ``max_lora`` (``--models-max``), ``running_lora_adapters``
  (models with a ready replica), ``waiting_lora_adapters`` (models that load
  or whose requests wait for one), comma-separated; its value is the time of
  the scrape (Unix seconds), the "last update" the picker orders by.
"""

from __future__ import annotations

import time

import numpy as np

from ..shm import layout as L

DEFAULT_BLOCK_SIZE = 16
"""Tokens per KV block when no ``--kv-events-block-size`` is given (vLLM's default)."""


def vllm_text(models: list[tuple[int, str]], names: dict[int, str], rows: np.ndarray,
              in_flight: dict[int, int], replicas: dict[int, dict] | None, *,
              models_max: int, block_size: int = DEFAULT_BLOCK_SIZE,
              now: float | None = None) -> list[str]:
    """The vLLM families' lines (text exposition 0.0.4) for ``models``
    (``(index, label-escaped name)``; ``names``: index -> the plain name for
    the adapters' lists), from the models table's ``rows``, the proxies'
    ``in_flight`` per model and the replicas' scraped figures (as
    :func:`~ggmux.proxy.metrics.scrape_replicas` sums them)."""
    got = replicas or {}
    running: dict[int, float] = {}
    waiting: dict[int, float] = {}
    busy: dict[int, float] = {}
    size: dict[int, float] = {}
    for i, _ in models:
        r = got.get(i, {})
        running[i] = r.get("llamacpp:requests_processing", float(in_flight.get(i, 0)))
        waiting[i] = float(rows[i, L.M_WAITERS]) + r.get("llamacpp:requests_deferred", 0.0)
        busy[i] = r.get("ggmux_kv_cache_busy_tokens", 0.0)
        size[i] = r.get("llamacpp:kv_cache_size", 0.0)
    out: list[str] = []

    def family(name: str, help_: str, pod: float, per: dict[int, float], fmt: str) -> None:
        out.append(f"# HELP {name} {help_}\n# TYPE {name} gauge\n")
        out.append(f"{name} {fmt.format(pod)}\n")
        out.extend(f'{name}{{model_name="{n}"}} {fmt.format(per[i])}\n' for i, n in models)

    family("vllm:num_requests_running", "Requests in model execution batches (ggmux: in "
           "the replicas' slots).", sum(running.values()), running, "{:g}")
    family("vllm:num_requests_waiting", "Requests waiting to be processed (ggmux: for a "
           "model load, capacity, a slot or KV room).", sum(waiting.values()), waiting, "{:g}")
    total = sum(size.values())
    usage = {i: busy[i] / size[i] if size[i] else 0.0 for i, _ in models}
    pod_usage = sum(busy.values()) / total if total else 0.0
    for name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
        # gpu_cache_usage_perc: the name before vLLM 0.10, which older pickers read
        family(name, "KV-cache usage, 1 means 100 percent (ggmux: cells reserved by running "
               "requests over the ready replicas' cells).", pod_usage, usage, "{:.6f}")
    bs = max(1, int(block_size))
    out.append("# HELP vllm:cache_config_info Information of the KV cache (ggmux: the ready "
               "replicas' cells in blocks of the KV events).\n"
               "# TYPE vllm:cache_config_info gauge\n"
               f'vllm:cache_config_info{{block_size="{bs}",enable_prefix_caching="True",'
               f'num_gpu_blocks="{int(total) // bs}"}} 1\n')
    loaded = [i for i, _ in models if rows[i, L.M_STATUS] == L.ModelStatus.LOADED
              or rows[i, L.M_REPLICAS] > 0]
    pending = [i for i, _ in models if i not in loaded and (
        rows[i, L.M_STATUS] == L.ModelStatus.LOADING or rows[i, L.M_WAITERS] > 0)]

    def adapters(idx: list[int]) -> str:
        return ",".join(names[i] for i in idx).replace("\\", "\\\\").replace('"', '\\"').replace(
            "\n", "\\n")

    out.append("# HELP vllm:lora_requests_info Running stats on LoRA requests (ggmux: the "
               "loaded models, and those waiting for a load).\n"
               "# TYPE vllm:lora_requests_info gauge\n"
               f'vllm:lora_requests_info{{max_lora="{int(models_max)}",'
               f'running_lora_adapters="{adapters(loaded)}",'
               f'waiting_lora_adapters="{adapters(pending)}"}} '
               f"{time.time() if now is None else now:.3f}\n")
    return out


__all__ = ["DEFAULT_BLOCK_SIZE", "vllm_text"]
