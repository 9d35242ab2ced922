"""An instance's ``GET /metrics``: Prometheus text in llama-server's
``llamacpp:`` names (``tools/server/server-task.cpp``, ``to_metrics``) plus
ggmux's own families."""

from __future__ import annotations

from .backend import Backend
from .cache.report import cache_metrics

CHECKPOINT_FAMILIES = (  # context checkpoints (issue 35): (name, kind, metrics key, help)
    ("checkpoints_made_total", "counter", "checkpoints_made_total",
     "Context checkpoints made (sliding-window and recurrent models)"),
    ("checkpoint_made_bytes_total", "counter", "checkpoint_bytes_made_total",
     "Bytes of the context checkpoints made"),
    ("checkpoints_restored_total", "counter", "checkpoints_restored_total",
     "Context checkpoints restored into a slot"),
    ("checkpoint_restored_tokens_total", "counter", "checkpoint_tokens_total",
     "Prompt tokens a restored context checkpoint served"),
    ("checkpoint_bytes", "gauge", "checkpoint_bytes",
     "Bytes the slots' context checkpoints hold now"),
    # media (a model with a multimodal projector): its encoder and what was read
    ("media_encoded_total", "counter", "media_encoded_total",
     "Images and audio clips the projector encoded"),
    ("media_encode_seconds_total", "counter", "media_encode_seconds_total",
     "Seconds the projector spent encoding (on its own thread)"),
    ("media_decode_seconds_total", "counter", "media_decode_seconds_total",
     "Seconds the decode thread spent reading media embeddings into slots"),
    ("media_tokens_total", "counter", "media_tokens_total",
     "Media embeddings read into slots (tokens)"),
    ("media_hold_seconds_total", "counter", "media_hold_seconds_total",
     "Seconds ready media waited for other slots' encodes (a burst starts together)"),
)


def metrics_text(backend: Backend, requests: int, in_flight: int) -> str:
    """Prometheus text of an instance: its ``requests`` so far and
    ``in_flight`` now, and the backend's figures (llama-server's ``llamacpp:``
    families: tokens and seconds, busy slots, deferred requests, KV cache
    use, speculative decoding's drafts), its KV tiers' (``ggmux_kv_cache_``)
    its context checkpoints' (``ggmux_checkpoint*``) and its media's
    (``ggmux_media_*``)."""
    m = backend.metrics()
    lines = ["# TYPE ggmux_instance_requests_total counter",
             f"ggmux_instance_requests_total {requests}",
             "# TYPE ggmux_instance_in_flight gauge",
             f"ggmux_instance_in_flight {in_flight}"]
    decodes = m.get("decode_calls_total")

    def spec(key: str):  # speculative decoding (issue 30): zeros when it is off
        return None if decodes is None else m.get(key, 0)

    families = (  # llama-server's names and help (server-task.cpp, to_metrics)
        ("prompt_tokens_total", "counter", m.get("prompt_tokens_total"),
         "Number of prompt tokens processed, excluding cached tokens"),
        ("prompt_tokens_cached_total", "counter", m.get("cached_tokens_total"),
         "Number of prompt tokens reused from the cache"),
        ("prompt_seconds_total", "counter", m.get("prompt_seconds_total"),
         "Total time spent processing prompts"),
        ("tokens_predicted_total", "counter", m.get("predicted_tokens_total"),
         "Number of generation tokens processed"),
        ("tokens_predicted_seconds_total", "counter", m.get("predicted_seconds_total"),
         "Total time spent generating tokens"),
        ("n_decode_total", "counter", decodes, "Total number of llama_decode() calls"),
        ("n_tokens_max", "counter", m.get("tokens_max"),
         "Largest observed sequence length (prompt + generation)"),
        ("spec_decode_num_draft_tokens_total", "counter", spec("draft_tokens_total"),
         "Speculative: Total draft tokens generated"),
        ("spec_decode_num_accepted_tokens_total", "counter", spec("draft_accepted_total"),
         "Speculative: Total draft tokens accepted by the target model"),
        ("spec_decode_num_drafts_total", "counter", spec("draft_verifications_total"),
         "Speculative: Total speculative decoding verification steps"),
        ("decode_seconds_total", "counter", m.get("decode_seconds_total"),
         "Total time spent in llama_decode()"),
        ("requests_processing", "gauge", m.get("slots_busy"), "Number of requests processing"),
        ("requests_deferred", "gauge", m.get("queue_depth"), "Number of requests deferred"),
        ("n_busy_slots_per_decode", "gauge",
         None if decodes is None else m.get("busy_slots_total", 0) / max(decodes, 1),
         "Average number of busy slots per llama_decode() call"),
        ("slots", "gauge", m.get("slots_total", backend.slots), "Number of slots"),
        ("kv_cache_tokens", "gauge", m.get("kv_used"),
         "KV cache cells reserved or holding a slot's cache"),
        ("kv_cache_size", "gauge", m.get("kv_size"), "KV cache cells"),
    )
    if m.get("kv_busy") is not None:  # ggmux's: what the router's vllm:kv_cache_usage_perc counts
        lines += ["# HELP ggmux_kv_cache_busy_tokens KV cache cells reserved by running requests",
                  "# TYPE ggmux_kv_cache_busy_tokens gauge",
                  f"ggmux_kv_cache_busy_tokens {m['kv_busy']:g}"]
    for name, kind, v, what in families:
        if v is not None:
            lines += [f"# HELP llamacpp:{name} {what}", f"# TYPE llamacpp:{name} {kind}",
                      f"llamacpp:{name} {v:g}"]
    for name, tokens, seconds, what in (
            ("prompt_tokens_seconds", "prompt_tokens_total", "prompt_seconds_total",
             "Average prompt throughput in tokens/s"),
            ("predicted_tokens_seconds", "predicted_tokens_total",
             "predicted_seconds_total", "Average generation throughput in tokens/s")):
        if tokens in m:  # llama-server's averages: tokens per second of a request
            rate = m[tokens] / m[seconds] if m.get(seconds) else 0.0
            lines += [f"# HELP llamacpp:{name} {what}", f"# TYPE llamacpp:{name} gauge",
                      f"llamacpp:{name} {rate:.3f}"]
    lines += cache_metrics(backend.cache_report())
    for name, kind, key, what in CHECKPOINT_FAMILIES:
        if key in m:
            lines += [f"# HELP ggmux_{name} {what}", f"# TYPE ggmux_{name} {kind}",
                      f"ggmux_{name} {m[key]:g}"]
    if m.get("kv_size"):
        lines += ["# HELP llamacpp:kv_cache_usage_ratio KV cache cells in use, of all",
                  "# TYPE llamacpp:kv_cache_usage_ratio gauge",
                  f"llamacpp:kv_cache_usage_ratio {m['kv_used'] / m['kv_size']:.6f}"]
    return "\n".join(lines) + "\n"
