"""The keys file, the key table's windows and its row lock (issue 36),
without a server."""

from __future__ import annotations

import hashlib
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from ggmux.proxy.admission import KeyAdmission, Refusal
from ggmux.shm.keytable import KeyTable, TableShape, period_end, periods
from ggmux.supervisor.keys import KeyRegistry
from ggmux.supervisor.keys_file import builtin_hashes, hash_secret, read_keys_file
from ggmux.supervisor.presets import PresetError
from manual import fenced

# keys files hold secrets: private, as ggmux requires (keys_file.check_file_mode)
pytestmark = pytest.mark.usefixtures("private_files")


def test_the_manuals_keys_example_reads(tmp_path, monkeypatch):
    block = next(b for _, b in fenced("ini") if "[alice]" in b)
    monkeypatch.setenv("CI_KEY", "sk-ci")
    f = tmp_path / "keys.ini"
    f.write_text(block)
    alice, ci = read_keys_file(str(f))
    assert (alice.name, alice.rpm, alice.tpm, alice.max_parallel) == ("alice", 100, 20000, 4)
    assert alice.models == ("smollm2-135m", "gemma3-*") and alice.cached_weight == 0.1
    assert alice.expires == datetime(2027, 1, 1, tzinfo=UTC).timestamp()
    assert ci.sha256 == hash_secret("sk-ci") and ci.rpm == 60  # [*]'s default


@pytest.mark.parametrize("text, why", [
    ("[a]\nrpm = 1\n", "has no key"),
    ("[a]\nkey = x\nrpm = -1\n", "rpm: must be 0"),
    ("[a]\nkey = x\nbogus = 1\n", "unknown key 'bogus'"),
    ("[a]\nkey = x\n[b]\nkey = x\n", "same secret"),
    ("[a b]\nkey = x\n", "bad key name"),
    ("[a]\nkey-sha256 = abc\n", "64 hex digits"),
    ("[*]\nkey = x\n", "defaults, not a secret"),
    # a limit past int64 once crashed the supervisor as it published the table
    ("[a]\nkey = x\nrpm = 99999999999999999999999999\n", "rpm: must be 0 (no limit) to"),
    ("[a]\nkey = x\ntpm = 1e23\n", "tpm: expected a whole number"),
    ("[a]\nkey = x\nspend-per-month = 1e30\n", "spend-per-month: must be a number from 0"),
    ("[a]\nkey = x\noutput-weight = inf\n", "output-weight: must be a number"),
    ("[a]\nkey = x\nexpires = -5\n", "expires: must be a date"),
    ("[a]\nkey = x\nmodels =\n", "models: empty"),
    ("[a]\nkey = x\nrpm = 1\nrpm = 2\n", "'rpm' given twice"),
    ("[a]\nkey = x\nkey-sha256 = " + "0" * 64 + "\n", "both key and key-sha256"),
    ("[a]\nsk-secret-x\n", "expected 'key = value'"),
    ("[sk-secret-x\n", "bad section header"),
])
def test_bad_keys_files_name_the_line_and_never_the_secret(tmp_path, text, why):
    f = tmp_path / "k.ini"
    f.write_text(text.replace("key = x", "key = sk-secret-x"))
    with pytest.raises(PresetError) as e:
        read_keys_file(str(f))
    assert why in str(e.value) and "sk-secret-x" not in str(e.value)


def test_a_keys_file_that_is_not_utf8_names_its_file_and_line(tmp_path):
    f = tmp_path / "k.ini"
    f.write_bytes(b"[a]\nkey = x\nmodels = caf\xe9\n")
    with pytest.raises(PresetError) as e:
        read_keys_file(str(f))
    assert str(e.value).startswith(f"{f}:3:") and "not UTF-8" in str(e.value)


def test_a_quoted_key_is_the_secret_inside_the_quotes(tmp_path):
    f = tmp_path / "k.ini"
    f.write_text('[a]\nkey = "sk-quoted"\n[b]\nkey = \'sk-single\'\n')
    a, b = read_keys_file(str(f))
    assert a.sha256 == hash_secret("sk-quoted") and b.sha256 == hash_secret("sk-single")


def test_a_key_with_the_secret_of_a_built_in_key_is_refused(tmp_path):
    # the built-in key wins the lookup: the file's limits would never apply
    f = tmp_path / "k.ini"
    f.write_text("[a]\nkey = sk-plain\n")
    for keys, opt in (({"api_key": "other, sk-plain"}, "--api-key"),
                      ({"admin_key": "sk-plain"}, "--admin-key")):
        with pytest.raises(PresetError) as e:
            read_keys_file(str(f), builtin_hashes(keys))
        assert f"[a] has the secret of {opt}" in str(e.value)
        assert "sk-plain" not in str(e.value)
    assert read_keys_file(str(f), builtin_hashes({"api_key": "sk-other"}))[0].name == "a"


def test_periods_and_their_ends_are_calendar_windows_utc():
    t = datetime(2026, 12, 31, 23, 59, 30, tzinfo=UTC).timestamp()
    minute, day, week, month = periods(t)
    assert period_end("minute", minute) == t + 30
    assert period_end("day", day) == t + 30
    assert period_end("month", month) == t + 30  # January 2027 begins
    assert datetime.fromtimestamp(period_end("week", week), UTC).weekday() == 0
    assert periods(t + 31)[3] == month + 1
    feb = datetime(2028, 2, 10, tzinfo=UTC).timestamp()
    assert period_end("month", periods(feb)[3]) == datetime(
        2028, 3, 1, tzinfo=UTC).timestamp()


@pytest.fixture
def table(tmp_path):
    t = KeyTable.create(f"/ggmux-test-keys-{os.getpid()}", TableShape(8, 2, 4))
    yield t
    t.close()


def test_registry_keeps_rows_and_admission_counts_exactly(table, tmp_path):
    f = tmp_path / "k.ini"
    f.write_text("[a]\nkey = sk-a\nrpm = 2\n[b]\nkey = sk-b\n")
    reg = KeyRegistry(str(f), table)
    assert reg.load() is None
    ka = KeyAdmission(table.name, 0)
    row = ka.row_of(b"sk-a")
    assert row == 0 and ka.row_of(b"sk-b") == 1 and ka.row_of(b"nope") == -1
    holds = [ka.admit(row, {"max_tokens": 4}, 40) for _ in range(3)]
    assert [isinstance(h, Refusal) for h in holds] == [False, False, True]
    assert holds[2].code == "rate_limit_exceeded" and holds[2].retry_after >= 1
    for h in holds[:2]:
        ka.settle(h, 10, 0, 4, 0)
    u = ka.usage(row)
    if u["requests_this_minute"]:  # unless the minute turned meanwhile
        assert u["tokens_this_minute"] == 28 and u["in_flight"] == 0
    # a reload that drops b and adds c keeps a's row; b's row is not reused
    f.write_text("[c]\nkey = sk-c\n[a]\nkey = sk-a\nrpm = 5\n")
    assert reg.load() is None
    assert ka.row_of(b"sk-a") == 0 and ka.row_of(b"sk-c") == 2 and ka.row_of(b"sk-b") == -1
    assert reg.name_of(2) == "c"
    assert hashlib.sha256(b"sk-c").hexdigest() not in str(ka.usage(2))


def test_admin_edits_keep_the_files_comments(table, tmp_path):
    f = tmp_path / "k.ini"
    f.write_text("; team keys\n[a]\nkey = sk-a ; alice\n")
    reg = KeyRegistry(str(f), table)
    assert reg.load() is None
    assert reg.edit("create", "b", hash_secret("sk-b"), {"rpm": "3"}) is None
    assert reg.edit("create", "b", hash_secret("sk-b2")) is not None  # exists
    assert reg.edit("disable", "a") is None
    assert reg.edit("rotate", "a", hash_secret("sk-a2")) is None
    text = f.read_text()
    assert text.startswith("; team keys\n") and "sk-a" not in text.replace("sk-a2", "")
    assert reg.keys["a"].disabled and reg.keys["a"].sha256 == hash_secret("sk-a2")
    assert reg.keys["b"].rpm == 3
    assert reg.edit("delete", "b") is None and "b" not in reg.keys
    assert reg.edit("disable", "zed", None) == f"no key 'zed' in {f.name}"


def test_row_lock_is_released_when_its_holder_dies(table):
    """A proxy killed inside the critical section blocks nobody (the
    kernel drops its fcntl lock), unlike a semaphore held forever."""
    pid = os.fork()
    if pid == 0:  # the child takes row 3's lock and dies holding it
        t = KeyTable.attach(table.name)
        t.lock(3)
        os._exit(0)
    os.waitpid(pid, 0)
    start = time.monotonic()
    with table.locked(3) as row:
        row[0] += 1
    assert time.monotonic() - start < 5


def test_a_dead_proxys_requests_in_flight_are_given_back(table, tmp_path):
    f = tmp_path / "k.ini"
    f.write_text("[a]\nkey = sk-a\nmax-parallel = 2\n")
    assert KeyRegistry(str(f), table).load() is None
    dead, alive = KeyAdmission(table.name, 1), KeyAdmission(table.name, 0)
    held = [dead.admit(0, None, 0), dead.admit(0, None, 0)]
    assert isinstance(alive.admit(0, None, 0), Refusal)  # max-parallel 2 reached
    table.proxy_gone(1)  # the supervisor, before proxy 1's replacement starts
    h = alive.admit(0, None, 0)
    assert not isinstance(h, Refusal) and alive.usage(0)["in_flight"] == 1
    for x in held:  # a late settle of the dead proxy's requests takes nothing back
        dead.settle(x, 1, 0, 1, 0)
    assert alive.usage(0)["in_flight"] == 1


# ---- who may read or steer the keys file ------------------------------------------------

@pytest.mark.parametrize("text, mode, refused", [
    ("[a]\nkey = sk-secret-x\n", 0o644, "line 2"),
    ("[a]\nkey = 'sk-secret-x' ; quoted\n", 0o640, "line 2"),
    ("[a]\nkey = sk-secret-x\n", 0o600, None),
    ("[a]\nkey-sha256 = " + "0" * 64 + "\n", 0o644, None),  # a hash opens nothing
    ("[a]\nkey = ${env.GGMUX_TEST_KEY}\n", 0o644, None),  # the secret is not in the file
    ("[a]\nkey-sha256 = " + "0" * 64 + "\n", 0o664, "written by other users"),
    ("[a]\nkey-sha256 = " + "0" * 64 + "\n", 0o646, "written by other users"),
])
def test_a_keys_file_others_may_read_secrets_from_or_write_is_refused(
        tmp_path, monkeypatch, text, mode, refused):
    monkeypatch.setenv("GGMUX_TEST_KEY", "sk-from-env")
    f = tmp_path / "k.ini"
    f.write_text(text)
    f.chmod(mode)
    if refused is None:
        assert [p.name for p in read_keys_file(str(f))] == ["a"]
        return
    with pytest.raises(PresetError) as e:
        read_keys_file(str(f))
    msg = str(e.value)
    assert str(f) in msg and "sk-secret-x" not in msg and f"{mode:o}" in msg
    assert refused in msg or f"{f}:2:" in msg


def test_an_admin_edit_of_a_linked_keys_file_writes_the_links_target(table, tmp_path):
    real = tmp_path / "config" / "keys.ini"
    real.parent.mkdir()
    real.write_text("[a]\nkey = sk-a\n")
    link = tmp_path / "keys.ini"
    link.symlink_to(real)
    reg = KeyRegistry(str(link), table)
    assert reg.load() is None
    assert reg.edit("create", "b", hash_secret("sk-b"), {"rpm": "3"}) is None
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert "[b]" in real.read_text() and set(reg.keys) == {"a", "b"}
    assert reg.load() is None and set(reg.keys) == {"a", "b"}  # read back through the link
    # a target that cannot be written (a ConfigMap's read-only mount; as root,
    # a file of /proc): refused, naming the link and its target
    real.parent.chmod(0o500)
    target = real
    try:
        if os.access(real.parent, os.W_OK):  # root writes a read-only folder
            target = Path("/proc/version")
            link.unlink()
            link.symlink_to(target)
        err = reg.edit("create", "c", hash_secret("sk-c"))
    finally:
        real.parent.chmod(0o700)
    assert err is not None and str(link) in err and str(target) in err and "link" in err
    assert link.is_symlink() and "[c]" not in target.read_text() and "c" not in reg.keys


def test_the_sqlite_ledger_is_readable_by_its_owner_only(tmp_path):
    from ggmux.ledger.sqlite import SqliteStore

    fresh = tmp_path / "fresh" / "usage.sqlite3"
    old = tmp_path / "old.sqlite3"
    old.touch()
    old.chmod(0o644)  # made by an older ggmux
    for path in (fresh, old):
        store = SqliteStore(str(path))
        store.schema()
        store.close()
        assert path.stat().st_mode & 0o777 == 0o600, path
