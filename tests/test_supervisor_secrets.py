"""No key in the supervisor's own command line or environment (issue 18,
finding 7), whatever way it was given: ``--opt VALUE``, ``--opt=VALUE`` or
the ``GGMUX_*`` variable; the API and admin keys, the cluster token, NATS
passwords and tokens, and a ``GGMUX_CLUSTER`` URL with credentials in it.
The children's side is tested where the keys reach them
(``test_forwarding_faults.py``, ``test_cluster.py``: ``secrets_shown``)."""

from __future__ import annotations

import os
import signal

import pytest
from conftest import (
    alive,
    chat_body,
    children_of,
    descendants,
    secrets_shown,
    unlink_server_objects,
    wait_for,
)
from ggmux.supervisor.cli import build_parser

API, ADMIN = "api-secret-1234", "admin-secret-5678"
TOKEN, PASSWORD, NATS_TOKEN = "cluster-token-2468", "nats-password-1357", "nats-token-9753"
API_H, ADMIN_H = {"Authorization": f"Bearer {API}"}, {"Authorization": f"Bearer {ADMIN}"}
SECRET_NAMES = ("GGMUX_API_KEY", "GGMUX_ADMIN_KEY", "GGMUX_CLUSTER_TOKEN",
                "GGMUX_NATS_PASSWORD", "GGMUX_NATS_TOKEN", "GGMUX_CLUSTER=")


def own_secrets(pid: int, secrets) -> list[tuple[str, str]]:
    """``(cmdline | environ, secret)`` for each of ``secrets`` in process
    ``pid``'s own command line or environment."""
    found = []
    for what in ("cmdline", "environ"):
        with open(f"/proc/{pid}/{what}", "rb") as f:
            data = f.read()
        found += [(what, x) for x in secrets if x.encode() in data]
    return found


def setenv_first(monkeypatch, env: dict[str, str]) -> None:
    """Set ``env`` at the head of the environment the servers inherit: a
    secret variable first is the case where deleting it made setproctitle
    silently do nothing (a shell's ``GGMUX_API_KEY=x ggmux serve``)."""
    rest = {k: v for k, v in os.environ.items() if k not in env}
    for k in rest:
        monkeypatch.delenv(k)
    for k, v in {**env, **rest}.items():
        monkeypatch.setenv(k, v)


def title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode().strip()


def assert_hidden(s, secrets) -> None:
    every = (*secrets, *SECRET_NAMES)
    found = own_secrets(s.proc.pid, every)
    assert found == [], f"{found}\n{s.logs()[-2000:]}"
    assert secrets_shown(s.proc.pid, every) == []
    assert title(s.proc.pid).startswith(f"ggmux: supervisor 127.0.0.1:{s.port}"), found


def keys_in_force(s) -> None:
    """The API key serves, the admin key unloads, nothing else does."""
    assert s.request("POST", "/v1/chat/completions", chat_body("m"))[0] == 401
    assert s.request("POST", "/v1/chat/completions", chat_body("m"), headers=API_H)[0] == 200
    assert s.request("POST", "/models/unload", {"model": "m"}, headers=API_H)[0] == 401
    assert s.request("POST", "/models/unload", {"model": "m"}, headers=ADMIN_H)[0] == 200


def reload_sees(s, fakes, name: str) -> None:
    """A SIGHUP reload rescans the sources with the same options and keys."""
    fakes.add(name, tokens=1)
    os.kill(s.proc.pid, signal.SIGHUP)

    def listed() -> set[str]:
        status, doc = s.json("GET", "/v1/models", headers=API_H)
        assert status == 200, doc
        return {m["id"] for m in doc["data"]}

    wait_for(lambda: name in listed(), 10, what=f"{name} listed after SIGHUP")


@pytest.mark.parametrize(("argv", "env"), [
    (["--admin-key", ADMIN], {"GGMUX_API_KEY": API}),  # the finding's own example
    ([f"--api-key={API}"], {"GGMUX_ADMIN_KEY": ADMIN}),
], ids=["env-api-argv-admin", "equals-api-env-admin"])
def test_the_supervisor_shows_no_key_in_its_command_line_or_environment(
        serve, fakes, monkeypatch, argv, env):
    fakes.add("m", tokens=1)
    setenv_first(monkeypatch, env)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0", *argv)
    keys_in_force(s)
    wait_for(lambda: len(descendants(s.proc.pid)) >= 1, 10, what="the proxy")
    assert_hidden(s, (API, ADMIN))
    assert "started again without its secrets" not in s.logs()  # the title did it
    reload_sees(s, fakes, "late")
    assert_hidden(s, (API, ADMIN))


@pytest.mark.slow
def test_where_the_title_cannot_hide_them_the_supervisor_starts_again_with_its_pid(
        serve, fakes, monkeypatch):
    """``$SPT_NOENV``: setproctitle leaves the environment alone, so the
    supervisor execs itself without the secret variables; the same pid
    takes SIGHUP, and a kill -9 of it still leaves no child."""
    fakes.add("m", tokens=1)
    setenv_first(monkeypatch, {"GGMUX_API_KEY": API, "SPT_NOENV": "1"})
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "1",
              "--admin-key", ADMIN)
    assert "started again without its secrets" in s.logs()
    keys_in_force(s)
    assert_hidden(s, (API, ADMIN))
    reload_sees(s, fakes, "late")
    kids = wait_for(lambda: len(k := children_of(s.proc.pid)) == 3 and k, 10,
                    what="proxy, instance and spare")
    assert_hidden(s, (API, ADMIN))
    s.proc.send_signal(signal.SIGKILL)
    s.proc.wait(10)
    for pid in kids:  # each sees its stdin close
        wait_for(lambda p=pid: not alive(p), 10, what=f"child {pid} gone")
    # what a SIGKILLed supervisor could not remove
    unlink_server_objects(s.port)
    s.log.close()
    s.stop = lambda *a, **k: None


@pytest.mark.slow
def test_cluster_secrets_are_not_in_the_supervisors_command_line_or_environment(
        nats_server, serve, fakes, monkeypatch):
    """Node a: ``--cluster-token=T``, ``--nats-user u --nats-password P``;
    node b: ``$GGMUX_CLUSTER`` with the password in the URL and
    ``$GGMUX_CLUSTER_TOKEN``; node c: ``$GGMUX_NATS_TOKEN`` to a NATS
    server that takes a token."""
    fakes.add("m", tokens=1)
    ns = nats_server(auth=["--user", "u", "--pass", PASSWORD])
    nt = nats_server(auth=["--auth", NATS_TOKEN])
    common = ("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--spares", "0", "--heartbeat", "0.5", "--node-stale", "1.5")
    a = serve(*common, "--node-name", "a", "--cluster", ns.url, f"--cluster-token={TOKEN}",
              "--nats-user", "u", "--nats-password", PASSWORD)
    host = ns.url.removeprefix("nats://")
    setenv_first(monkeypatch, {"GGMUX_CLUSTER": f"nats://u:{PASSWORD}@{host}",
                               "GGMUX_CLUSTER_TOKEN": TOKEN})
    b = serve(*common, "--node-name", "b")
    monkeypatch.delenv("GGMUX_CLUSTER")
    monkeypatch.delenv("GGMUX_CLUSTER_TOKEN")
    setenv_first(monkeypatch, {"GGMUX_NATS_TOKEN": NATS_TOKEN})
    c = serve(*common, "--node-name", "c", "--cluster", nt.url)
    for s in (a, b, c):
        status, doc = s.json("GET", "/cluster")
        assert status == 200 and doc["nodes"], doc  # joined: the credentials were used
        assert_hidden(s, (TOKEN, PASSWORD, NATS_TOKEN))


def test_secret_values_names_every_way_a_secret_is_given():
    """What the supervisor hides: each secret option's value, from the
    command line or its variable, and the credentials of a cluster URL."""
    from ggmux.supervisor.cli import secret_values

    env = {"GGMUX_API_KEY": "a1", "GGMUX_NATS_TOKEN": "t1",
           "GGMUX_CLUSTER": "nats://user:pw1@h:4222"}
    args = build_parser(env).parse_args(["serve", "--admin-key=b1", "--cluster-token", "c1",
                                         "--nats-password", "p1"])
    assert sorted(secret_values(args)) == ["a1", "b1", "c1", "p1", "pw1", "t1"]
    args = build_parser({}).parse_args(["serve", "--cluster", "nats://tok2@h:4222"])
    assert secret_values(args) == ["tok2"]
    assert secret_values(build_parser({}).parse_args(["serve"])) == []
