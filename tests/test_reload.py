"""Reloads that rename a model with its alias, and reloads that fail (issue
23): a failed reload changes nothing, says so to ``GET /models?reload=1``,
and never ends the server; SIGHUP and ``--watch-config`` take the same path."""

from __future__ import annotations

import os
import signal

from conftest import chat_body, served_by, wait_for
from ggmux.supervisor.registry import ModelEntry, Registry
from ggmux.supervisor.reload import plan_reload

CHAT = "/v1/chat/completions"


def _presets(fakes, tmp_path):
    """A preset of model-a (alias ``shared``) and model-b, and the edit that
    removes model-a and gives its alias to a new model-c (llama.cpp's
    test_router_reload_models, where a cached model's name is that alias)."""
    x, y = fakes.add("x"), fakes.add("y")
    before = f"; a and b\n[model-a]\nmodel = {x}\nalias = shared\n\n[model-b]\nmodel = {y}\n"
    after = f"[model-b]\nmodel = {y}\n\n[model-c]\nmodel = {x}\nalias = shared\n"
    preset = tmp_path / "models.ini"
    preset.write_text(before)
    return preset, after


def _listed(s) -> set[str]:
    return set(s.models())


def _serves_c_through_the_alias(s) -> None:
    st, _, body = s.request("POST", CHAT, chat_body("shared"))
    assert st == 200, body
    assert served_by(body)[0] == "model-c"
    assert s.proc.poll() is None, s.logs()[-2000:]


def test_a_renamed_model_keeps_its_alias_through_reload_and_the_server_lives(
        serve, fakes, tmp_path):
    preset, after = _presets(fakes, tmp_path)
    s = serve("--models-preset", str(preset), "--proxies", "1")
    assert _listed(s) == {"model-a", "model-b"}
    preset.write_text(after)
    st, doc = s.json("GET", "/models?reload=1")
    assert st == 200, doc
    assert {m["id"] for m in doc["data"]} == {"model-b", "model-c"}
    # the supervisor measures model-c's new row and loads it: before issue 23
    # its model table had grown and its registry had not, and it died here
    _serves_c_through_the_alias(s)
    assert s.request("POST", CHAT, chat_body("model-a"))[0] == 404


def test_sighup_and_watch_config_renames_with_the_alias_serve_the_new_model(
        serve, fakes, tmp_path):
    preset, after = _presets(fakes, tmp_path)
    s = serve("--models-preset", str(preset), "--proxies", "1", "--watch-config")
    # an edit the watcher cannot see (same size, inode and mtime): only SIGHUP reloads
    before, stat = preset.read_text(), preset.stat()
    pad = len(before) - len(after) - 1
    assert pad >= 1
    preset.write_text(after + ";" + "-" * (pad - 1) + "\n")
    os.utime(preset, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    s.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: _listed(s) == {"model-b", "model-c"}, 10, what="reload by SIGHUP")
    _serves_c_through_the_alias(s)
    # --watch-config alone: model-c goes, model-e takes the alias
    preset.write_text(after.replace("[model-c]", "[model-e]"))
    os.utime(preset, ns=(10**18, 10**18))  # a new mtime even on a coarse clock
    wait_for(lambda: _listed(s) == {"model-b", "model-e"}, 10, what="reload by --watch-config")
    st, _, body = s.request("POST", CHAT, chat_body("shared"))
    assert st == 200 and served_by(body)[0] == "model-e", body
    assert s.proc.poll() is None


def test_a_failed_reload_answers_500_and_changes_nothing(serve, fakes, tmp_path):
    preset, _ = _presets(fakes, tmp_path)
    s = serve("--models-preset", str(preset), "--proxies", "1")
    good = preset.read_text()
    preset.write_text(good + "bogus-key = 1\n")
    st, doc = s.json("GET", "/models?reload=1")
    assert st == 500, doc  # llama-server's router: the reload's exception, server_error
    assert doc["error"]["type"] == "server_error"
    assert "reload failed" in doc["error"]["message"]
    assert "bogus-key" in doc["error"]["message"]
    assert _listed(s) == {"model-a", "model-b"}
    # SIGHUP with the same file: logged, nothing changes, the server lives
    s.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: s.logs().count("reload failed") >= 2, 10, what="the SIGHUP reload")
    assert _listed(s) == {"model-a", "model-b"}
    st, _, body = s.request("POST", CHAT, chat_body("shared"))
    assert st == 200 and served_by(body)[0] == "model-a"
    # the next good reload answers 200 again, and applies
    preset.write_text(good.replace("[model-b]", "[model-d]"))
    st, doc = s.json("GET", "/models?reload=1")
    assert st == 200 and {m["id"] for m in doc["data"]} == {"model-a", "model-d"}


def test_plan_reload_frees_a_removed_models_alias_and_name_without_touching_its_inputs():
    a = ModelEntry(name="a", path="/a.json", kind="fake", aliases=["shared"])
    b = ModelEntry(name="b", path="/b.json", kind="fake")
    old = Registry([a, b])
    removed: set[int] = set()
    # a goes; c takes a's alias, d takes a's name as its alias
    c = ModelEntry(name="c", path="/a.json", kind="fake", aliases=["shared"])
    d = ModelEntry(name="d", path="/d.json", kind="fake", aliases=["a"])
    plan = plan_reload(old, removed, Registry([b, c, d]), rows=8)
    assert removed == set() and [e.name for e in old.entries] == ["a", "b"]
    assert plan.removed == {0} and plan.gone == {0} and plan.new_rows == 2
    reg = plan.registry
    assert [e.name for e in reg.entries] == ["a", "b", "c", "d"]  # rows never move
    assert reg.resolve("shared") == 2 and reg.resolve("a") == 3
    # a comes back (c and d go): its old row, unchanged, with its alias again
    back = plan_reload(reg, plan.removed, Registry([a, b]), rows=8)
    assert back.removed == {2, 3} and back.new_rows == 0 and not back.changed
    assert back.registry.resolve("a") == 0 and back.registry.resolve("shared") == 0
    assert back.added == ["a"] and back.dropped == ["c", "d"]
    # a model table that is full skips what finds no row, and says so
    full = plan_reload(old, removed, Registry([b, c]), rows=2)
    assert full.skipped == ["c"] and len(full.registry) == 2 and full.removed == {0}
