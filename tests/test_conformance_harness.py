"""The conformance runner's pure parts (bench/conformance.py, issue 23): the
llama-server -> ggmux option mapping of the shim, the fake Hugging Face
cache's layout as ggmux reads it, ``ggmux serve -- LLAMA-OPTIONS``, and the
report's reading of JUnit results. The conformance run itself is not part
of the suite (it runs llama.cpp's tests for an hour)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # bench/ is not part of the installed package
    sys.path.insert(0, str(ROOT))

from ggmux.supervisor.hf_cache import hf_cache_lookup, scan_hf_cache
from ggmux.supervisor.presets import PresetError, llama_args_layer

from bench import fake_hf_cache
from bench.conformance import Outcome, read_junit, regressions, table
from bench.llama_shim import model_name, plan

# what llama.cpp's tests/utils.py gives ServerPreset.tinyllama2() and .router()
TINYLLAMA = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1",
             "--offline", "--hf-repo", "ggml-org/test-model-stories260K", "--batch-size", "32",
             "--no-slots", "--alias", "tinyllama-2", "--ctx-size", "512", "--parallel", "2",
             "--n-predict", "64", "--no-jinja"]
ROUTER = ["--port", "8123", "--temp", "0.8", "--seed", "42", "--host", "127.0.0.1", "--offline",
          "--models-max", "2", "--batch-size", "16", "--no-slots", "--ctx-size", "1024",
          "--parallel", "1", "--n-predict", "16", "--no-models-autoload", "--no-jinja"]


def test_a_single_model_command_line_becomes_a_one_section_preset_loaded_at_start():
    p = plan(TINYLLAMA)
    assert p.preset == ("[tinyllama-2]\nhf-repo = ggml-org/test-model-stories260K\n"
                        "load-on-startup = true\n")
    assert p.argv("/x.ini") == [
        "serve", "--port", "8123", "--host", "127.0.0.1", "--ctx-size", "256",
        "--parallel", "2", "--kv-size", "512", "--no-metrics", "--model-fallback", "tinyllama-2",
        "--models-preset", "/x.ini", "--no-hf-cache", "--",
        "--temp", "0.8", "--seed", "42", "--batch-size", "32", "--no-slots",
        "--n-predict", "64", "--no-jinja"]
    assert p.dropped == []


def test_a_unified_kv_cache_gives_one_request_the_whole_context():
    """llama-server's ``--kv-unified``: any slot may use all of ``--ctx-size``
    (test_completion_unified), so ggmux's per-request context stays whole."""
    p = plan(["--ctx-size", "256", "--parallel", "4", "--kv-unified"])
    assert p.serve == ["--ctx-size", "256", "--parallel", "4", "--kv-size", "256",
                       "--no-metrics"]
    assert p.llama == ["--kv-unified"]
    assert plan(["--ctx-size", "256", "--parallel", "4", "--no-kv-unified"]).serve[1] == "64"


def test_a_router_command_line_keeps_the_cache_and_maps_router_options():
    p = plan(ROUTER)
    assert p.preset is None
    assert p.serve == ["--port", "8123", "--host", "127.0.0.1", "--models-max", "2",
                       "--ctx-size", "1024", "--parallel", "1", "--no-models-autoload",
                       "--no-metrics"]  # a router: no fallback; one slot has all the context
    assert "--no-hf-cache" not in p.argv() and p.argv()[-1] == "--no-jinja"
    assert "--no-metrics" not in plan([*ROUTER, "--metrics"]).serve
    assert "--metrics" in plan([*ROUTER, "--metrics"]).serve


def test_downloads_and_unknown_options_are_dropped_and_said():
    p = plan(["--hf-repo", "a/b", "--hf-file", "x.gguf", "--mmproj-url", "http://h/m.gguf",
              "--grp-attn-n", "2", "--alias", "one,two", "--model-url", "http://h/x"])
    assert p.preset == "[one]\nhf-repo = a/b\nhf-file = x.gguf\nalias = two\nload-on-startup = true\n"
    assert p.dropped == ["--mmproj-url http://h/m.gguf: ggmux never downloads",
                         "--grp-attn-n 2: not a llama-server option ggmux knows",
                         "--model-url http://h/x: ggmux never downloads"]
    router = plan(["--alias", "a"])
    assert router.dropped == ["--alias a: a router takes no model on its command line"]
    with pytest.raises(ValueError, match="--ctx-size needs a value"):
        plan(["--ctx-size"])


def test_the_served_name_is_the_alias_else_the_repo_else_the_file():
    assert model_name({"alias": "x, y", "hf-repo": "a/b"}) == "x"
    assert model_name({"hf-repo": "a/b:Q8_0"}) == "a/b:Q8_0"
    assert model_name({"model": "/m/tiny-q4.gguf"}) == "tiny-q4"


def test_llama_options_after_dashes_are_typed_as_preset_keys():
    layer = llama_args_layer(["--temp", "0.8", "-s", "-1", "--no-mmap", "--n-predict=64",
                              "--embedding"])
    assert {k: o.value for k, o in layer.items()} == {
        "temperature": "0.8", "seed": "-1", "mmap": False, "n-predict": "64",
        "embeddings": True}
    for bad, why in ((["--temp", "hot"], "bad number"), (["--bogus", "1"], "unknown"),
                     (["0.8"], "expected a llama-server option"), (["--temp"], "needs a value")):
        with pytest.raises(PresetError, match=why):
            llama_args_layer(bad)


def test_the_fake_cache_has_the_hub_layout_and_ggmux_reads_its_names(tmp_path):
    f = fake_hf_cache.CachedFile("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf", "x")
    lay = fake_hf_cache.layout(f)
    commit = fake_hf_cache.commit_of("ggml-org/models")
    assert len(commit) == 40 and lay["ref"] == "models--ggml-org--models/refs/main"
    assert lay["snapshot"] == (f"models--ggml-org--models/snapshots/{commit}/"
                               "bert-bge-small/ggml-model-f16.gguf")
    assert lay["target"] == f"../../../blobs/{fake_hf_cache.blob_of(f)}"
    demo = tmp_path / "demo.gguf"
    demo.write_bytes(b"GGUF" + b"\0" * 60)
    files = (fake_hf_cache.CachedFile("org/one", "one-F32.gguf", "x"),
             fake_hf_cache.CachedFile("org/two", "two-Q8_0.gguf", "x"), f,
             fake_hf_cache.CachedFile("org/skipped", "s-F16.gguf", "missing"))
    root = tmp_path / "hub"
    assert len(fake_hf_cache.build(root, {"x": demo}, files)) == 3
    assert len(fake_hf_cache.build(root, {"x": demo}, files)) == 3  # again: kept
    names = {e.name: e.path for e in scan_hf_cache(root)}
    assert set(names) == {"org/one:F32", "org/two:Q8_0", "ggml-org/models:F16"}
    real = {str(Path(p).resolve()) for p in names.values()}
    assert len(real) == 3  # a blob per repo: dedup-cache-models tells them apart
    assert Path(names["org/one:F32"]).read_bytes() == demo.read_bytes()
    found = hf_cache_lookup("ggml-org/models", "bert-bge-small/ggml-model-f16.gguf", root)
    assert found is not None and Path(found[0]).resolve() == Path(
        names["ggml-org/models:F16"]).resolve()


def test_the_report_counts_passes_and_lists_what_only_llama_server_passes(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite><testcase name="a"/>'
        '<testcase name="b"><failure message="assert 404 == 200&#10;more">x</failure></testcase>'
        '<testcase name="c"><skipped message="slow"/></testcase>'
        '<testcase name="d"/><testcase name="d"><error message="teardown"/></testcase>'
        "</testsuite></testsuites>")
    got = read_junit(xml)
    assert got == {"a": Outcome("passed"), "b": Outcome("failed", "assert 404 == 200"),
                   "c": Outcome("skipped", "slow"), "d": Outcome("passed")}
    results = {"test_x": {"llama-server": {"a": Outcome("passed"), "b": Outcome("passed")},
                          "ggmux": got}}
    assert regressions(results) == [("test_x", "b", "[failed] assert 404 == 200")]
    assert table(results).splitlines()[-1] == "| test_x | 4 | 2 | 2 |"
