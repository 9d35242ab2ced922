"""Preset options reach llama-cpp-python as Llama() keywords."""

from ggmux.instance.llama import llama_kwargs, model_parts


def test_known_llama_cpp_options_map_to_llama_keywords():
    kw = llama_kwargs(["--batch-size", "256", "-ub", "64", "--no-mmap", "--mlock",
                       "--cache-type-k", "q8_0", "-ctv", "f16", "--flash-attn", "on",
                       "--seed", "-1", "--rope-freq-base", "10000"])
    assert kw == {"n_batch": 256, "n_ubatch": 64, "use_mmap": False, "use_mlock": True,
                  "type_k": 8, "type_v": 1, "flash_attn": True, "seed": -1,
                  "rope_freq_base": 10000.0}


def test_unknown_options_and_bad_cache_types_are_ignored():
    assert llama_kwargs(["--spec-replace", "a", "b", "--cache-type-k", "q9_9", "--jinja"]) == {}


def test_split_model_lists_its_existing_parts(tmp_path):
    parts = [tmp_path / f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for p in parts:
        p.write_bytes(b"x")
    assert model_parts(str(parts[0])) == [str(p) for p in parts]
    assert model_parts(str(tmp_path / "plain.gguf")) == [str(tmp_path / "plain.gguf")]
