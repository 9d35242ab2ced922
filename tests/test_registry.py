"""The model registry: sources (Hugging Face cache, models dirs, presets, the
command line), their precedence, llama.cpp's preset format and its errors,
aliases and path safety. Pure unit tests: tiny fake ``.gguf`` files, no
server started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from ggmux.supervisor import cli as cli_mod
from ggmux.supervisor.cli import build_parser, build_registry
from ggmux.supervisor.presets import PresetError, load_preset, read_ini, resolve
from ggmux.supervisor.registry import (
    ModelEntry,
    Registry,
    demo_models,
    gguf_name,
    hf_cache_dir,
    scan_hf_cache,
    scan_models_dir,
)

ROOT = Path(__file__).resolve().parents[1]
REV = "0123456789abcdef0123456789abcdef01234567"


# ---- helpers -------------------------------------------------------------------------


def touch(path: Path, size: int = 16) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF" + b"\0" * (size - 4))
    return path


def cache_repo(
    cache: Path, repo: str, files: dict[str, int], rev: str = REV, ref: str | None = "main"
) -> Path:
    """A hub-cache repo as huggingface_hub lays it out: blobs, a snapshot of
    symlinks to them, and refs/<ref> holding the revision."""
    d = cache / ("models--" + repo.replace("/", "--"))
    snap = d / "snapshots" / rev
    for i, (name, size) in enumerate(files.items()):
        blob = touch(d / "blobs" / f"{i:064x}", size)
        link = snap / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (d / "refs").mkdir(parents=True, exist_ok=True)
        (d / "refs" / ref).write_text(rev)
    return snap


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """An empty hub cache that HF_HUB_CACHE points at (LLAMA_CACHE unset)."""
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.delenv("LLAMA_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


@pytest.fixture
def no_hub(tmp_path, monkeypatch) -> Path:
    """HF_HUB_CACHE pointing at a folder that does not exist."""
    monkeypatch.delenv("LLAMA_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub"))
    return tmp_path / "no-hub"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def registry(*argv: str) -> Registry:
    return build_registry(build_parser().parse_args(["serve", *argv]))


def by_name(entries) -> dict[str, ModelEntry]:
    return {e.name: e for e in (entries.entries if isinstance(entries, Registry) else entries)}


def expect_error(path: Path, line: int, *words: str):
    """Context manager: a PresetError at ``path:line`` whose text holds ``words``."""

    class Check:
        def __enter__(self):
            self.cm = pytest.raises(PresetError)
            self.info = self.cm.__enter__()
            return self.info

        def __exit__(self, *exc):
            handled = self.cm.__exit__(*exc)
            e = self.info.value
            assert e.file == str(path), str(e)
            assert e.line == line, str(e)
            assert str(e).startswith(f"{path}:{line}: "), str(e)
            for w in words:
                assert w in str(e), str(e)
            return handled

    return Check()


# ---- GGUF names ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, prefix, tag, index, count",
    [
        ("gemma-3-4b-it-Q4_K_M.gguf", "gemma-3-4b-it-Q4_K_M", "Q4_K_M", 1, 1),
        ("tinyllama-1.1b-chat-v1.0.Q8_0.gguf", "tinyllama-1.1b-chat-v1.0.Q8_0", "Q8_0", 1, 1),
        ("Kimi-K2-UD-IQ1_S-00002-of-00006.gguf", "Kimi-K2-UD-IQ1_S", "IQ1_S", 2, 6),
        ("model-f16.gguf", "model-f16", "F16", 1, 1),
        ("model.gguf", "model", "", 1, 1),
    ],
)
def test_gguf_names_split_into_prefix_quant_tag_and_part_as_llama_cpp_does(
    name, prefix, tag, index, count
):
    g = gguf_name(name)
    assert (g.prefix, g.tag, g.index, g.count) == (prefix, tag, index, count)
    assert gguf_name("notes.txt") is None


# ---- Hugging Face cache ---------------------------------------------------------------------


def test_hf_cache_lists_gguf_models_as_org_repo_quant(hub):
    snap = cache_repo(
        hub,
        "ggml-org/gemma-3-4b-it-GGUF",
        {
            "gemma-3-4b-it-Q4_K_M.gguf": 100,
            "gemma-3-4b-it-Q8_0.gguf": 200,
            "mmproj-model-f16.gguf": 30,
            "README.md": 5,
        },
    )
    cache_repo(
        hub,
        "unsloth/Kimi-GGUF",
        {
            "UD-IQ1_S/Kimi-UD-IQ1_S-00001-of-00003.gguf": 10,
            "UD-IQ1_S/Kimi-UD-IQ1_S-00002-of-00003.gguf": 20,
            "UD-IQ1_S/Kimi-UD-IQ1_S-00003-of-00003.gguf": 30,
            "imatrix_unsloth.gguf": 1,
        },
    )
    models = by_name(scan_hf_cache())
    assert sorted(models) == [
        "ggml-org/gemma-3-4b-it-GGUF:Q4_K_M",
        "ggml-org/gemma-3-4b-it-GGUF:Q8_0",
        "unsloth/Kimi-GGUF:IQ1_S",
    ]
    q4 = models["ggml-org/gemma-3-4b-it-GGUF:Q4_K_M"]
    assert q4.path == str(snap / "gemma-3-4b-it-Q4_K_M.gguf")
    assert q4.mmproj == str(snap / "mmproj-model-f16.gguf")  # attached, as llama.cpp's -hf does
    assert q4.size_bytes == 100 and q4.source == "hf-cache" and q4.kind == "llama"
    kimi = models["unsloth/Kimi-GGUF:IQ1_S"]
    assert kimi.path.endswith("UD-IQ1_S/Kimi-UD-IQ1_S-00001-of-00003.gguf")
    assert kimi.size_bytes == 60  # every part
    assert kimi.mmproj is None


def test_hf_cache_uses_the_snapshot_refs_main_names_and_skips_what_llama_cpp_skips(hub):
    old = "f" * 40
    cache_repo(hub, "org/repo", {"old-Q4_0.gguf": 1}, rev=old, ref=None)
    cache_repo(hub, "org/repo", {"new-Q5_K_M.gguf": 1}, rev=REV, ref="main")
    cache_repo(hub, "org/untagged", {"model.gguf": 1})  # no quant tag: not listed
    cache_repo(hub, "bad--name/x", {"m-Q4_0.gguf": 1})  # not a valid repo id
    touch(hub / "models--org--empty" / "blobs" / "x")  # no snapshots
    d = hub / "models--org--broken" / "snapshots" / REV
    d.mkdir(parents=True)
    (d / "m-Q4_0.gguf").symlink_to("../../blobs/missing")  # interrupted download
    assert [e.name for e in scan_hf_cache()] == ["org/repo:Q5_K_M"]


def test_hf_cache_folder_follows_llama_cpp_environment_order(tmp_path, monkeypatch):
    for v in ("LLAMA_CACHE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert hf_cache_dir() == tmp_path / "home" / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hubcache"))
    assert hf_cache_dir() == tmp_path / "hubcache"


def test_hf_cache_is_a_source_only_when_it_exists(no_hub):
    assert scan_hf_cache() == []


# ---- models dir ------------------------------------------------------------------------------


def test_models_dir_reads_files_parts_and_subfolders_like_llama_cpp(tmp_path):
    d = tmp_path / "models"
    touch(d / "llama-3.2-1b-Q4_K_M.gguf", 40)
    touch(d / "big-00001-of-00002.gguf", 10)
    touch(d / "big-00002-of-00002.gguf", 15)
    touch(d / "mmproj-stray.gguf")  # a projector alone is not a model
    touch(d / "notes.txt")
    touch(d / "gemma-3-4b-it-Q8_0" / "gemma-3-4b-it-Q8_0.gguf", 50)
    touch(d / "gemma-3-4b-it-Q8_0" / "mmproj-F16.gguf", 7)
    for i in (1, 2, 3):
        touch(d / "Kimi-IQ1_S" / f"Kimi-IQ1_S-0000{i}-of-00003.gguf", 100)
    (d / "empty").mkdir()
    models = by_name(scan_models_dir(str(d)))
    assert sorted(models) == ["Kimi-IQ1_S", "big", "gemma-3-4b-it-Q8_0", "llama-3.2-1b-Q4_K_M"]
    assert models["big"].path == str(d / "big-00001-of-00002.gguf")
    assert models["big"].size_bytes == 25
    g = models["gemma-3-4b-it-Q8_0"]
    assert g.path == str(d / "gemma-3-4b-it-Q8_0" / "gemma-3-4b-it-Q8_0.gguf")
    assert g.mmproj == str(d / "gemma-3-4b-it-Q8_0" / "mmproj-F16.gguf")
    assert g.size_bytes == 50  # the projector is not part of the checkpoint
    assert models["Kimi-IQ1_S"].path.endswith("Kimi-IQ1_S-00001-of-00003.gguf")
    assert models["Kimi-IQ1_S"].size_bytes == 300
    assert all(e.source == f"dir:{d}" for e in models.values())


def test_missing_models_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        scan_models_dir(str(tmp_path / "nope"))


# ---- the INI reader -------------------------------------------------------------------------


def test_ini_reader_keeps_line_numbers_and_strips_comments(tmp_path):
    p = write(
        tmp_path / "p.ini",
        "\ufeffversion = 1\n; comment\n\n[*]\nc = 8192 ; inline\n"
        "  # indented comment\n[org/repo:Q4_K_M]  ; trailing\n"
        "upstream = http://h:1/#x\nchat-template-kwargs = "
        '{"a": "#b"}\n',
    )
    top, sections = read_ini(str(p))
    assert [(i.key, i.value, i.line) for i in top] == [("version", "1", 1)]
    assert [(s.name, s.line) for s in sections] == [("*", 4), ("org/repo:Q4_K_M", 7)]
    assert [(i.key, i.value, i.line) for i in sections[0].items] == [("c", "8192", 5)]
    assert [(i.key, i.value) for i in sections[1].items] == [
        ("upstream", "http://h:1/#x"),
        ("chat-template-kwargs", '{"a": "#b"}'),
    ]


# ---- presets ---------------------------------------------------------------------------------


def test_preset_keys_are_llama_cpp_long_short_and_env_names(tmp_path, no_hub):
    m = touch(tmp_path / "m.gguf")
    p = write(
        tmp_path / "p.ini",
        f"""
[m]
m = {m}
c = 4096
ngl = all
t = 3
LLAMA_ARG_CACHE_RAM = 0
no-mmap = true
jinja = on
no-context-shift = false
flash-attn = auto
temp = 0.7
alias = one , two,,three
load-on-startup = true
stop-timeout = 5
""",
    )
    e = by_name(resolve([], load_preset(str(p))))["m"]
    assert (e.path, e.ctx_size, e.n_gpu_layers, e.threads) == (str(m), 4096, -1, 3)
    assert e.aliases == ["one", "two", "three"]
    assert e.load_on_startup is True and e.stop_timeout == 5.0
    assert e.extra_args == [
        "--cache-ram",
        "0",
        "--no-mmap",
        "--jinja",
        "--context-shift",
        "--flash-attn",
        "auto",
        "--temperature",
        "0.7",
    ]
    assert e.args()[:8] == [
        "--model",
        str(m),
        "--ctx-size",
        "4096",
        "--threads",
        "3",
        "--n-gpu-layers",
        "-1",
    ]
    assert e.args()[8:] == e.extra_args
    assert e.source == f"preset:{p}:2" and e.kind == "llama"


def test_ggmux_preset_keys_fill_the_model_entry(tmp_path, no_hub, monkeypatch):
    monkeypatch.setenv("TOKEN", "sk-secret")
    p = write(
        tmp_path / "p.ini",
        """
[remote]
upstream = http://user:pw@example.com:8443/, http://10.0.0.2:8080/v1x
api-key = ${env.TOKEN}
priority = 1
weight = 2.5
max-concurrency = 8
replicas = 3
ttl = 0
check-endpoint = none

[server]
cmd = llama-server --port ${PORT} -m /x.gguf
cmd-stop = pkill -f x
env = A=1 "B=two words"
env = C=3,4
ttl = 90
""",
    )
    models = by_name(resolve([], load_preset(str(p))))
    r = models["remote"]
    assert (
        r.kind == "upstream" and r.path == ""
        and r.upstream == ["http://user:pw@example.com:8443", "http://10.0.0.2:8080/v1x"]
    )
    assert (r.api_key, r.priority, r.weight, r.max_concurrency, r.replicas) == (
        "sk-secret",
        1,
        2.5,
        8,
        3,
    )
    assert r.ttl is None and r.check_endpoint == ""  # ttl 0 = never; none = no check
    assert r.args() == []
    pub = r.public()
    assert "api_key" not in pub and "env" not in pub
    assert pub["upstream"] == ["http://example.com:8443", "http://10.0.0.2:8080/v1x"]
    s = models["server"]
    assert s.kind == "cmd" and s.cmd_stop == "pkill -f x" and s.ttl == 90.0
    assert s.env == {"A": "1", "B": "two words", "C": "3,4"}
    assert s.args() == ["llama-server", "--port", "${PORT}", "-m", "/x.gguf"]
    assert s.check_endpoint == "/health"


def test_a_model_path_ending_json_is_a_fake_model(tmp_path, no_hub):
    f = write(tmp_path / "fake.json", "{}")
    p = write(tmp_path / "p.ini", f"[f]\nmodel = {f}\n")
    assert by_name(resolve([], load_preset(str(p))))["f"].kind == "fake"


def test_relative_model_paths_are_relative_to_the_working_directory(tmp_path, no_hub, monkeypatch):
    touch(tmp_path / "work" / "m.gguf")
    p = write(tmp_path / "conf" / "p.ini", "[m]\nmodel = m.gguf\n")
    monkeypatch.chdir(tmp_path / "work")
    assert by_name(resolve([], load_preset(str(p))))["m"].path == str(tmp_path / "work" / "m.gguf")


# ---- bad presets: every error names file, line and reason -------------------------------------


@pytest.mark.parametrize(
    "text, line, words",
    [
        ("[m]\nmodel = {m}\nfrobnicate = 1\n", 3, ["unknown key", "'frobnicate'"]),
        ("[m]\nmodel = {m}\n\n[m]\nc = 1\n", 4, ["duplicate section [m]", "line 1"]),
        ("[*]\n[*]\n", 2, ["duplicate section [*]"]),
        ("[m]\nmodel = {m}\nctx-size = big\n", 3, ["'ctx-size'", "bad number", "'big'"]),
        ("[m]\nmodel = {m}\nc = 1.5\n", 3, ["'c'", "bad number"]),
        ("[m]\nmodel = {m}\nttl = soon\n", 3, ["'ttl'", "bad number"]),
        ("[m]\nmodel = {m}\nstop-timeout = -1\n", 3, ["'stop-timeout'", "at least 0"]),
        ("[m]\nmodel = {m}\nreplicas = 0\n", 3, ["'replicas'", "at least 1"]),
        ("[m]\nmodel = {m}\nweight = 0\n", 3, ["'weight'", "greater than 0"]),
        ("[m]\nmodel = {m}\nmax-concurrency = x\n", 3, ["'max-concurrency'", "bad number"]),
        ("[m]\nmodel = {m}\npriority = high\n", 3, ["'priority'", "bad number"]),
        ("[m]\nmodel = {m}\nngl = most\n", 3, ["'ngl'", "bad number"]),
        ("[m]\nmodel = {m}\njinja = maybe\n", 3, ["'jinja'", "bad boolean"]),
        ("[m]\nmodel = {m}\nload-on-startup = yes\n", 3, ["'load-on-startup'", "bad boolean"]),
        (
            "[*]\nc = 1\n\n[m]\nmodel = {tmp}/missing.gguf\n",
            5,
            ["model file not found", "missing.gguf"],
        ),
        ("[m]\nmodel = {m}\nmmproj = {tmp}/nope.gguf\n", 3, ["projector file not found"]),
        ("[m]\nc = 4096\n", 1, ["[m] names no existing model", "model, hf-repo, cmd, upstream"]),
        ("c = 4096\n[m]\nmodel = {m}\n", 1, ["outside any section", "[*]"]),
        ("[m\nmodel = {m}\n", 1, ["bad section header"]),
        ("[m]\nmodel {m}\n", 2, ["expected 'key = value'"]),
        ("[]\n", 1, ["empty section name"]),
        ("[m]\nmodel = ${{env.GGMUX_TEST_UNSET}}\n", 2, ["GGMUX_TEST_UNSET is not set"]),
        ("[m]\nmodel-url = http://x/m.gguf\n", 2, ["does not download"]),
        ("[m]\nupstream = ftp://x\n", 2, ["'upstream'", "bad upstream"]),
        ("[m]\nmodel = {m}\nenv = 1A=b\n", 3, ["'env'", "NAME=VALUE"]),
        ("[m]\nmodel = {m}\ncheck-endpoint = health\n", 3, ["'check-endpoint'"]),
        ("[m]\nhf-repo = not-a-repo\n", 2, ["'hf-repo'", "ORG/REPO"]),
        ("[m]\nhf-repo = org/absent:Q4_K_M\n", 2, ["not in the Hugging Face cache"]),
        ("[m]\nmodel = {tmp}/big-00001-of-00002.gguf\n", 2, ["part big-00002-of-00002.gguf"]),
    ],
)
def test_bad_preset_errors_name_file_line_and_reason(
    tmp_path, no_hub, monkeypatch, text, line, words
):
    monkeypatch.delenv("GGMUX_TEST_UNSET", raising=False)
    m = touch(tmp_path / "m.gguf")
    touch(tmp_path / "big-00001-of-00002.gguf")
    p = write(tmp_path / "bad.ini", text.format(m=m, tmp=tmp_path))
    with expect_error(p, line, *words):
        resolve([], load_preset(str(p)))


def test_an_unreadable_preset_file_is_an_error_naming_it(tmp_path):
    with pytest.raises(PresetError, match="cannot read preset file") as e:
        load_preset(str(tmp_path / "absent.ini"))
    assert e.value.file == str(tmp_path / "absent.ini")


def test_router_controlled_options_are_ignored_as_llama_cpp_does(tmp_path, no_hub, caplog):
    m = touch(tmp_path / "m.gguf")
    p = write(
        tmp_path / "p.ini", f"[m]\nmodel = {m}\nport = 9999\nhost = 0.0.0.0\nmodels-max = 2\n"
    )
    e = by_name(resolve([], load_preset(str(p))))["m"]
    assert "--port" not in e.args() and "--host" not in e.args()
    assert f"{p}:3: 'port' is controlled by ggmux" in caplog.text


# ---- precedence --------------------------------------------------------------------------------


def test_preset_keys_win_over_the_cache_unset_keys_keep_its_values_and_the_cli_beats_all(
    tmp_path, hub
):
    snap = cache_repo(hub, "org/repo", {"repo-Q4_K_M.gguf": 64, "mmproj-f16.gguf": 8})
    models = tmp_path / "models"
    touch(models / "local.gguf")
    name = "org/repo:Q4_K_M"
    p = write(
        tmp_path / "p.ini",
        f"""
[*]
c = 1000
t = 2
ttl = 60
model = {tmp_path}/ignored-for-existing-models.gguf

[{name}]
c = 4096
alias = repo
temp = 0.5

[local]
ngl = 10
""",
    )
    reg = registry("--models-dir", str(models), "--models-preset", str(p))
    cached, local = reg.get(name), reg.get("local")
    # the section's keys win; unset keys keep the cache's values; [*] fills the rest
    assert cached.ctx_size == 4096 and cached.threads == 2 and cached.ttl == 60
    assert cached.path == str(snap / "repo-Q4_K_M.gguf")
    assert cached.mmproj == str(snap / "mmproj-f16.gguf") and cached.size_bytes == 64
    assert cached.source == f"preset:{p}:8" and cached.extra_args == ["--temperature", "0.5"]
    assert reg.resolve("repo") == reg.resolve(name)
    assert local.path == str(models / "local.gguf")  # [*] model never replaces a source's file
    assert (local.ctx_size, local.threads, local.n_gpu_layers) == (1000, 2, 10)
    # explicit command-line options beat every source and preset
    reg = registry(
        "--models-dir",
        str(models),
        "--models-preset",
        str(p),
        "--ctx-size",
        "512",
        "-t",
        "7",
        "-ngl",
        "0",
        "--stop-timeout",
        "3",
    )
    for e in reg.entries:
        assert (e.ctx_size, e.threads, e.n_gpu_layers, e.stop_timeout) == (512, 7, 0, 3.0)


def test_command_line_options_not_given_are_defaults_under_every_source(tmp_path, no_hub):
    models = tmp_path / "models"
    touch(models / "a.gguf")
    touch(models / "b.gguf")
    p = write(tmp_path / "p.ini", "[a]\nc = 8192\nstop-timeout = 4\n")
    args = build_parser().parse_args(
        ["serve", "--models-dir", str(models), "--models-preset", str(p)]
    )
    assert (args.ctx_size, args.threads, args.n_gpu_layers, args.stop_timeout) == (
        None,
        None,
        None,
        None,
    )
    reg = build_registry(args)
    a, b = reg.get("a"), reg.get("b")
    assert (a.ctx_size, a.stop_timeout) == (8192, 4.0)
    assert (b.ctx_size, b.threads, b.n_gpu_layers, b.stop_timeout) == (2048, None, 0, 10.0)
    assert args.stop_timeout == 10.0  # resolved for the code that reads it afterwards


def test_ttl_on_the_command_line_is_a_default_that_a_preset_overrides(tmp_path, no_hub):
    models = tmp_path / "models"
    touch(models / "a.gguf")
    touch(models / "b.gguf")
    touch(models / "c.gguf")
    p = write(tmp_path / "p.ini", "[a]\nttl = 5\n[b]\nttl = 0\n")
    reg = registry("--models-dir", str(models), "--models-preset", str(p), "--ttl", "30")
    assert [reg.get(n).ttl for n in "abc"] == [5.0, None, 30.0]


def test_a_later_models_dir_replaces_a_model_of_the_same_name(tmp_path, no_hub):
    touch(tmp_path / "d1" / "m.gguf", 10)
    touch(tmp_path / "d2" / "m.gguf", 20)
    touch(tmp_path / "d1" / "other.gguf")
    reg = registry("--models-dir", str(tmp_path / "d1"), "--models-dir", str(tmp_path / "d2"))
    assert [e.name for e in reg.entries] == ["m", "other"]
    assert reg.get("m").path == str(tmp_path / "d2" / "m.gguf")


def test_dedup_cache_models_hides_the_cache_entries_of_a_presets_hf_repo_and_draft(tmp_path, hub):
    """llama.cpp's dedup-cache-models: false by default; true hides (from
    the lists, not from routing) the cache entries that the section's
    hf-repo and spec-draft-hf resolve to; a `model = FILE` section hides
    nothing (llama.cpp looks at hf-repo only)."""
    snap = cache_repo(hub, "org/repo", {"repo-Q4_K_M.gguf": 64, "repo-Q8_0.gguf": 128})
    cache_repo(hub, "org/draft", {"draft-F16.gguf": 8})
    body = f"""
[fast]
model = {snap}/repo-Q4_K_M.gguf
c = 1024

[big]
hf-repo = org/repo:q8_0
spec-draft-hf = org/draft
"""
    p = write(tmp_path / "p.ini", body)
    reg = registry("--models-preset", str(p))
    names = ["big", "fast", "org/draft:F16", "org/repo:Q4_K_M", "org/repo:Q8_0"]
    assert sorted(e.name for e in reg.entries) == names
    assert not any(e.hidden for e in reg.entries)  # llama.cpp's default: nothing hidden
    assert reg.get("big").path == str(snap / "repo-Q8_0.gguf")
    assert reg.get("big").size_bytes == 128
    for where in ("[big]\n", "[*]\ndedup-cache-models = 1\n"):
        text = (body.replace("[big]\n", "[big]\ndedup-cache-models = true\n")
                if where == "[big]\n" else where + body)
        reg = registry("--models-preset", str(write(tmp_path / "p.ini", text)))
        assert sorted(e.name for e in reg.entries) == names  # every one still served
        hidden = {e.name for e in reg.entries if e.hidden}
        assert hidden == {"org/repo:Q8_0", "org/draft:F16"}, where
        assert reg.doc()["models"][reg.resolve("org/repo:Q8_0")]["hidden"] is True


def test_hf_repo_resolves_like_llama_cpp_default_quant_and_file(tmp_path, hub):
    snap = cache_repo(
        hub,
        "org/repo",
        {
            "repo-Q8_0.gguf": 1,
            "repo-Q4_K_M.gguf": 1,
            "sub/repo-IQ2_M.gguf": 1,
            "mmproj-F16.gguf": 1,
        },
    )
    p = write(
        tmp_path / "p.ini",
        """
[default-quant]
hf = org/repo
[by-file]
hf-repo = org/repo
hf-file = sub/repo-IQ2_M.gguf
no-mmproj = true
""",
    )
    models = by_name(resolve([], load_preset(str(p))))
    assert models["default-quant"].path == str(snap / "repo-Q4_K_M.gguf")
    assert models["default-quant"].mmproj == str(snap / "mmproj-F16.gguf")
    assert models["by-file"].path == str(snap / "sub" / "repo-IQ2_M.gguf")
    assert models["by-file"].mmproj is None


# ---- sources when none is given ----------------------------------------------------------------


def fake_demo(tmp_path):
    return [ModelEntry(name="demo-model", path=str(touch(tmp_path / "demo.gguf")), source="demo")]


def test_no_source_and_no_cache_serves_the_demo_models(tmp_path, no_hub, monkeypatch):
    monkeypatch.setattr(cli_mod, "demo_models", lambda: fake_demo(tmp_path))
    assert [e.name for e in registry().entries] == ["demo-model"]


def test_no_source_with_a_cache_serves_the_cache_as_llama_cpp_does(tmp_path, hub, monkeypatch):
    monkeypatch.setattr(cli_mod, "demo_models", lambda: fake_demo(tmp_path))
    cache_repo(hub, "org/repo", {"repo-Q4_K_M.gguf": 1})
    assert [e.name for e in registry().entries] == ["org/repo:Q4_K_M"]
    assert [e.name for e in registry("--no-hf-cache").entries] == ["demo-model"]


def test_the_cache_is_listed_beside_explicit_sources_unless_turned_off(tmp_path, hub):
    cache_repo(hub, "org/repo", {"repo-Q4_K_M.gguf": 1})
    touch(tmp_path / "models" / "m.gguf")
    d = str(tmp_path / "models")
    assert [e.name for e in registry("--models-dir", d).entries] == ["org/repo:Q4_K_M", "m"]
    assert [e.name for e in registry("--models-dir", d, "--no-hf-cache").entries] == ["m"]


def test_fake_models_dir_lists_json_behaviour_files(tmp_path, no_hub):
    write(tmp_path / "fakes" / "a.json", "{}")
    reg = registry("--fake-models-dir", str(tmp_path / "fakes"))
    assert [(e.name, e.kind) for e in reg.entries] == [("a", "fake")]


# ---- aliases and path safety ----------------------------------------------------------------------


def test_aliases_resolve_to_one_canonical_name_everywhere():
    reg = Registry(
        [
            ModelEntry(name="org/repo:Q4_K_M", path="/m", aliases=["gpt-4o", "m"]),
            ModelEntry(name="other", path="/o"),
        ]
    )
    assert reg.resolve("gpt-4o") == reg.resolve("m") == reg.resolve("org/repo:Q4_K_M") == 0
    assert reg.canonical("gpt-4o") == "org/repo:Q4_K_M"
    assert reg.doc()["names"] == {"org/repo:Q4_K_M": 0, "other": 1, "gpt-4o": 0, "m": 0}
    assert reg.doc()["models"][0]["aliases"] == ["gpt-4o", "m"]


def test_an_alias_given_to_two_models_is_an_error(tmp_path, no_hub):
    m = touch(tmp_path / "m.gguf")
    p = write(tmp_path / "p.ini", f"[a]\nmodel = {m}\nalias = x\n[b]\nmodel = {m}\nalias = y, x\n")
    with pytest.raises(ValueError, match="alias 'x' is given to two models: 'a'.*'b'"):
        registry("--models-preset", str(p))
    p = write(tmp_path / "p2.ini", f"[a]\nmodel = {m}\nalias = b\n[b]\nmodel = {m}\n")
    with pytest.raises(ValueError, match="alias 'b' of model 'a'.*name of another model"):
        registry("--models-preset", str(p))


def test_names_that_look_like_paths_are_not_models(tmp_path, no_hub, monkeypatch):
    models = tmp_path / "models"
    touch(models / "x.gguf")
    touch(tmp_path / "x.gguf")  # next to the models dir, not in it
    monkeypatch.chdir(models)
    reg = registry("--models-dir", str(models))
    assert reg.resolve("x") == 0
    for name in (
        "../x",
        "../x.gguf",
        "/etc/passwd",
        "..%2Fx",
        "%2e%2e/x",
        "x.gguf",
        str(models / "x.gguf"),
        "./x",
        "X",
        "x ",
        "",
        "models/x",
    ):
        assert reg.resolve(name) is None, name
        assert reg.get(name) is None and reg.canonical(name) is None
        assert name not in reg.doc()["names"]
    assert all(Path(e.path).parent == models for e in reg.entries)


# ---- the annotated example ---------------------------------------------------------------------


def test_the_example_preset_loads(tmp_path, no_hub, monkeypatch):
    demos = {e.name: e.path for e in demo_models()}
    smol = demos.get("smollm2-135m") or str(touch(tmp_path / "smollm2.gguf"))
    gemma = demos.get("gemma3-270m") or str(touch(tmp_path / "gemma3.gguf"))
    monkeypatch.setenv("GGMUX_DEMO_SMOLLM2", smol)
    monkeypatch.setenv("GGMUX_DEMO_GEMMA3", gemma)
    example = str(ROOT / "presets.example.ini")
    reg = registry("--models-preset", example)
    assert [e.name for e in reg.entries] == [
        "smollm2-135m",
        "gemma3-270m",
        "gemma3-270m-llama-server",
        "remote-gemma3",
    ]
    s = reg.get("smol")
    assert (s.name, s.path, s.ctx_size, s.ttl) == ("smollm2-135m", smol, 4096, 300.0)
    assert s.aliases == ["smol", "tiny"] and s.stop_timeout == 10.0
    assert s.extra_args == ["--temperature", "0.7", "--jinja"]
    g = reg.get("gemma3-270m")
    assert (g.path, g.ctx_size, g.replicas, g.max_concurrency) == (gemma, 2048, 2, 4)
    assert (g.max_tokens_limit, g.cache_scope) == (1024, "key")
    assert (g.eviction_priority, g.max_wait, g.pin, g.min_residency) == (1, 60.0, False, None)
    assert g.extra_args == ["--n-predict", "256"]
    assert g.instance_args[-4:] == ["--cache-scope", "key", "--max-tokens-limit", "1024"]
    c = reg.get("gemma3-270m-llama-server")
    assert c.kind == "cmd" and f"-m {gemma}" in c.cmd and "--port ${PORT}" in c.cmd
    assert c.env == {"LLAMA_ARG_THREADS": "2"} and c.stop_timeout == 5.0
    u = reg.get("remote-gemma3")
    assert (u.kind, u.upstream, u.priority) == ("upstream", ["http://127.0.0.1:9000"], 1)


def test_an_engine_key_goes_to_the_built_in_instance_as_an_option(tmp_path, no_hub):
    model = touch(tmp_path / "m.gguf")
    ini = write(tmp_path / "p.ini", f"[m]\nmodel = {model}\nprefill-wait-ms = 5\n")
    assert registry("--models-preset", str(ini)).get("m").extra_args == [
        "--prefill-wait-ms", "5.0"]
    from ggmux.instance.llama_args import llama_kwargs

    assert llama_kwargs(["--prefill-wait-ms", "5.0"]) == {"prefill_wait_ms": 5.0}
    bad = write(tmp_path / "bad.ini", f"[m]\nmodel = {model}\nprefill-wait-ms = -1\n")
    with expect_error(bad, 3, "prefill-wait-ms", "at least 0"):
        registry("--models-preset", str(bad))


def test_every_key_of_the_example_is_documented_with_its_default():
    text = (ROOT / "presets.example.ini").read_text()
    from ggmux.supervisor.preset_values import FIELDS

    for key in FIELDS:
        assert f"; {key} = " in text, key


def test_the_example_preset_finds_the_demo_models_without_environment_variables(
        tmp_path, no_hub, monkeypatch):
    """presets.example.ini starts as shipped on a fresh machine (issue 15):
    its ${env.GGMUX_DEMO_*} default to the installed demo models."""
    demos = {e.name: e.path for e in demo_models()}
    if len(demos) < 2:
        pytest.skip("the demo models are not installed")
    monkeypatch.delenv("GGMUX_DEMO_SMOLLM2", raising=False)
    monkeypatch.delenv("GGMUX_DEMO_GEMMA3", raising=False)
    reg = registry("--models-preset", str(ROOT / "presets.example.ini"))
    assert reg.get("smollm2-135m").path == demos["smollm2-135m"]
    assert reg.get("gemma3-270m").path == demos["gemma3-270m"]
    assert f"-m {demos['gemma3-270m']}" in reg.get("gemma3-270m-llama-server").cmd
    other = write(tmp_path / "p.ini", "[x]\nmodel = ${env.GGMUX_NOT_A_DEMO}\n")
    with expect_error(other, 2, "GGMUX_NOT_A_DEMO", "not set"):
        registry("--models-preset", str(other))


def test_a_log_line_names_the_cache_that_replaced_the_demo_models(hub, caplog):
    cache_repo(hub, "org/repo-GGUF", {"repo-Q4_K_M.gguf": 64})
    with caplog.at_level("INFO", logger="ggmux"):
        reg = registry()
    assert [e.name for e in reg.entries] == ["org/repo-GGUF:Q4_K_M"]
    line = next(r.getMessage() for r in caplog.records if "Hugging Face cache" in r.getMessage())
    assert f"serving 1 model(s) of the Hugging Face cache {hub}" in line
    assert "demo models" in line and "--no-hf-cache" in line


def test_with_nothing_cached_a_log_line_says_the_demo_models_serve(no_hub, caplog):
    with caplog.at_level("INFO", logger="ggmux"):
        registry()
    assert any("serving the demo models" in r.getMessage() for r in caplog.records)


def test_an_empty_models_dir_is_named_in_the_error(tmp_path, no_hub, capsys):
    empty = tmp_path / "models"
    empty.mkdir()
    assert cli_mod.main(["serve", "--models-dir", str(empty), "--no-hf-cache"]) == 2
    err = capsys.readouterr().err
    assert f"no models found in --models-dir {empty}" in err
    assert "give --models-dir" not in err
