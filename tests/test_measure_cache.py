"""Each GGUF is measured once: many preset sections on one file run one
measure child, an option that changes memory or a touched file measures
again, and a reload keeps what was measured (supervisor/measure.py)."""

from __future__ import annotations

import os

from conftest import wait_for

MiB = 1 << 20


def _preset(path, model, names, extra: str = "") -> None:
    path.write_text("".join(f"[{n}]\nmodel = {model}\n" for n in names) + extra)


def _measured(s) -> dict[str, int]:
    st, doc = s.json("GET", "/ps")
    assert st == 200
    return {m["id"]: m["memory"]["min"] for m in doc["models"]}


def _all_measured(s, names) -> bool:
    got = _measured(s)
    return all(got.get(n) == 300 * MiB for n in names)


def _measures(log) -> list[str]:
    """The ``--ctx-size`` of each measure the fake ran (one line each: pid, ctx)."""
    return [ln.split()[1] for ln in log.read_text().splitlines()] if log.exists() else []


def test_many_sections_on_one_file_are_measured_once(serve, fakes, tmp_path):
    log = tmp_path / "measures.log"
    model = fakes.add("shared", min_bytes=300 * MiB, max_bytes=400 * MiB, measure_s=0.2,
                      measure_log=str(log))
    names = [f"m{i:02d}" for i in range(40)]
    preset = tmp_path / "presets.ini"
    # one more section on the file with a context size that changes memory
    _preset(preset, model, names, f"[long]\nmodel = {model}\nctx-size = 4096\n")
    s = serve("--models-preset", str(preset), "--proxies", "1", "--spares", "0")
    wait_for(lambda: _all_measured(s, [*names, "long"]), 30, 0.05, "every section measured")
    # one measure per (file, memory options): 2048 for the 40, 4096 for "long"
    assert sorted(_measures(log)) == ["2048", "4096"], _measures(log)
    assert "(the same files and options as " in s.logs()


def test_a_reload_keeps_the_measures_and_a_touched_file_is_measured_again(serve, fakes,
                                                                            tmp_path):
    log = tmp_path / "measures.log"
    model = fakes.add("shared", min_bytes=300 * MiB, measure_log=str(log))
    preset = tmp_path / "presets.ini"
    _preset(preset, model, ["a", "b"])
    s = serve("--models-preset", str(preset), "--proxies", "1", "--spares", "0")
    wait_for(lambda: _all_measured(s, ["a", "b"]), 20, 0.05, "a and b measured")
    assert len(_measures(log)) == 1
    # a new section on the file, and an edit that does not change memory (ttl)
    _preset(preset, model, ["a", "b", "c"], "")
    preset.write_text(preset.read_text().replace("[b]\n", "[b]\nttl = 60\n"))
    st, doc = s.json("GET", "/models?reload=1")
    assert st == 200 and [m["id"] for m in doc["data"]] == ["a", "b", "c"]
    wait_for(lambda: _all_measured(s, ["a", "b", "c"]), 20, 0.05, "c measured")
    assert len(_measures(log)) == 1, "the reload measured again"
    # the file touched: the next reload measures it again, once for all three
    st_ = os.stat(model)
    os.utime(model, ns=(st_.st_atime_ns, st_.st_mtime_ns + 5_000_000_000))
    assert s.json("GET", "/models?reload=1")[0] == 200
    wait_for(lambda: len(_measures(log)) == 2, 20, 0.05, "a measure of the touched file")
    wait_for(lambda: _all_measured(s, ["a", "b", "c"]), 20, 0.05, "all measured again")
    assert len(_measures(log)) == 2
