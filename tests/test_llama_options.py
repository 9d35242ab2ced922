"""Preset options reach llama-cpp-python as Llama() keywords."""

from ggmux.instance.llama import llama_kwargs, model_parts


def test_known_llama_cpp_options_map_to_llama_keywords():
    kw = llama_kwargs(["--batch-size", "256", "-ub", "64", "--no-mmap", "--mlock",
                       "--cache-type-k", "q8_0", "-ctv", "f16", "--flash-attn", "on",
                       "--seed", "-1", "--rope-freq-base", "10000", "-np", "3",
                       "--no-kv-unified"])
    assert kw == {"n_batch": 256, "n_ubatch": 64, "use_mmap": False, "use_mlock": True,
                  "type_k": 8, "type_v": 1, "flash_attn": True, "seed": -1,
                  "rope_freq_base": 10000.0, "parallel": 3, "kv_unified": False}


def test_unknown_options_and_bad_cache_types_are_ignored():
    assert llama_kwargs(["--spec-replace", "a", "b", "--cache-type-k", "q9_9",
                         "--temp", "hot"]) == {}


def test_server_options_of_llama_server_reach_the_backend():
    # issue 23: llama-server's sampling defaults, template options, --verbose
    # and --pooling were dropped with a warning
    kw = llama_kwargs(["--temp", "0", "--top-k", "5", "--jinja", "--chat-template", "llama3",
                       "--chat-template-file", "/t.jinja", "--verbose", "--pooling", "none"])
    assert kw == {"sampling": {"temperature": 0.0, "top_k": 5}, "jinja": True,
                  "chat_format": "llama3", "chat_template_file": "/t.jinja", "verbose": True,
                  "pooling": "none"}
    assert llama_kwargs(["--no-jinja"]) == {"jinja": False}
    assert llama_kwargs(["--dry-multiplier", "0.8", "--dry-penalty-last-n", "-1"]) == {
        "sampling": {"dry_multiplier": 0.8, "dry_penalty_last_n": -1}}
    assert llama_kwargs(["--dry-sequence-breaker", "<|im_end|>", "--dry-sequence-breaker",
                         "\n"]) == {"sampling": {"dry_sequence_breakers": ["<|im_end|>", "\n"]}}
    assert llama_kwargs(["--dry-sequence-breaker", "none"]) == {
        "sampling": {"dry_sequence_breakers": []}}


def test_split_model_lists_its_existing_parts(tmp_path):
    parts = [tmp_path / f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for p in parts:
        p.write_bytes(b"x")
    assert model_parts(str(parts[0])) == [str(p) for p in parts]
    assert model_parts(str(tmp_path / "plain.gguf")) == [str(tmp_path / "plain.gguf")]


def test_openai_content_parts_become_one_string_and_bad_messages_are_400():
    import pytest
    from ggmux.instance.llama import chat_messages, check_sampling
    from ggmux.instance.server import BadRequest

    msgs = chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}])
    assert msgs == [{"role": "user", "content": "ab"}]
    for bad in ([1, 2], [], "hi", [{"role": "user", "content": 5}],
                [{"role": "user", "content": [{"type": "image_url"}]}]):
        with pytest.raises(BadRequest):
            chat_messages(bad)
    check_sampling({"temperature": 0.7, "max_tokens": 8, "seed": -1, "stop": ["x"]})
    for bad in ({"seed": "abc"}, {"max_tokens": "x"}, {"max_tokens": -5},
                {"temperature": "hot"}, {"temperature": 9}, {"n": 2}, {"stop": 3},
                {"top_k": True}):
        with pytest.raises(BadRequest):
            check_sampling(bad)


def test_context_checkpoint_options_reach_the_engine_and_the_tiers():
    # issue 35: llama-server's names and aliases, ggmux's tier keys
    from ggmux.instance.llama import LlamaBackend
    from ggmux.instance.options import parse_args

    args = ["--ctx-checkpoints", "8", "-cms", "256", "--swa-full", "--cache-checkpoints", "2",
            "--cache-checkpoint-max", "64"]
    assert llama_kwargs(args) == {"ctx_checkpoints": 8, "checkpoint_min_step": 256,
                                  "swa_full": True, "cache_checkpoints": 2,
                                  "cache_checkpoint_max": 64}
    assert llama_kwargs(["-ctxcp", "0"]) == llama_kwargs(["--swa-checkpoints", "0"]) == {
        "ctx_checkpoints": 0}
    import json

    cfg = LlamaBackend(parse_args(["--model", "x.gguf", "--llama-args", json.dumps(args)]))._config()
    assert (cfg.ctx_checkpoints, cfg.checkpoint_min_step, cfg.swa_full) == (8, 256, True)
    assert (cfg.cache.checkpoints, cfg.cache.checkpoint_mib) == (2, 64)
    default = LlamaBackend(parse_args(["--model", "x.gguf"]))._config()
    assert (default.ctx_checkpoints, default.checkpoint_min_step, default.swa_full) == (
        32, 8192, False)  # llama-server's defaults
    assert (default.cache.checkpoints, default.cache.checkpoint_mib) == (4, 1024)
