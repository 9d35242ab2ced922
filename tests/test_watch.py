"""--watch-config's watcher (supervisor/watch.py) on real files."""

from __future__ import annotations

import os

from ggmux.supervisor.watch import ConfigWatch

S = 1_000_000_000


def test_an_edited_preset_file_is_noticed_once(tmp_path):
    p = tmp_path / "presets.ini"
    p.write_text("[a]\nmodel = /x.gguf\n")
    w = ConfigWatch([str(p)], interval=0.5)
    assert w.check(1 * S) is None
    p.write_text("[a]\nmodel = /y.gguf\n")
    os.utime(p, ns=(10**18, 10**18))  # a different mtime even on a coarse clock
    assert w.check(1 * S + S // 10) is None  # not before the interval
    assert w.check(2 * S) == f"{p} changed (--watch-config)"
    assert w.check(3 * S) is None


def test_a_replaced_or_removed_file_is_a_change(tmp_path):
    p = tmp_path / "presets.ini"
    p.write_text("x")
    w = ConfigWatch([str(p)], interval=0)
    tmp = tmp_path / "new.ini"
    tmp.write_text("x")
    os.replace(tmp, p)  # an editor's save: same size, new inode
    assert w.check() is not None
    p.unlink()
    assert w.check() is not None
    assert w.check() is None


def test_models_dir_changes_one_level_down_are_noticed(tmp_path):
    d = tmp_path / "models"
    (d / "sub").mkdir(parents=True)
    (d / "a.gguf").write_bytes(b"GGUF")
    w = ConfigWatch([str(d), str(d)], interval=0)  # the same path twice: watched once
    assert w.paths == [str(d)] and w.check() is None
    (d / "b.gguf").write_bytes(b"GGUF")
    assert w.check() is not None
    (d / "sub" / "part.gguf").write_bytes(b"GGUF")  # a model folder's file
    assert w.check() is not None
    (d / "a.gguf").write_bytes(b"GGUF-longer")
    assert w.check() is not None
    assert w.check() is None


def test_nothing_to_watch_is_never_a_change():
    w = ConfigWatch([], interval=0)
    assert w.check() is None
