"""Tenants (issue 18, findings 6 and 10): the proxy tells a built-in
instance who asked (``x-ggmux-tenant``, a keyed hash of the caller's API
key), a client cannot choose its own, slots are shared round robin by
tenant, and ``/slots`` shows request ids to the admin key only. Units, then
``ggmux serve`` on fake instances (the fake backend admits by the same
rule as the engine: instance/engine/fairness.py)."""

from __future__ import annotations

import json
import re
import socket
import sys
import threading
from pathlib import Path

from conftest import chat_body, wait_for
from ggmux.http1.auth import tenant
from ggmux.http1.heads import request_head
from ggmux.http1.request import Request
from ggmux.instance.engine.fairness import FairQueue

CHAT = "/v1/chat/completions"
HEX16 = re.compile(r"[0-9a-f]{16}")


def request(*headers: tuple[bytes, bytes]) -> Request:
    r = Request()
    r.method, r.url, r.path, r.request_id = b"POST", b"/v1/chat/completions", b"/v1/chat/completions", b"rid"
    r.headers = list(headers)
    return r


# ---- units -----------------------------------------------------------------------------

def test_a_tenant_is_a_keyed_hash_of_the_presented_key_and_never_the_clients_header():
    secret = b"s" * 16
    a = tenant(request((b"authorization", b"Bearer key-a")), secret)
    assert HEX16.fullmatch(a.decode()) and b"key-a" not in a
    assert tenant(request((b"x-api-key", b"key-a")), secret) == a  # either way of sending it
    assert tenant(request((b"authorization", b"Bearer key-b")), secret) != a
    assert tenant(request((b"authorization", b"Bearer key-a")), b"t" * 16) != a  # per server
    assert tenant(request(), secret) == b""  # no key: no tenant
    forged = request((b"authorization", b"Bearer key-a"), (b"x-ggmux-tenant", b"0" * 16))
    assert tenant(forged, secret) == a
    # another node's, with the cluster token: kept when it is a tenant's shape
    assert tenant(request((b"x-ggmux-tenant", b"0123456789abcdef")), secret, True) == \
        b"0123456789abcdef"
    assert tenant(request((b"x-ggmux-tenant", b"nope")), secret, True) == b""


def test_the_head_to_a_replica_drops_the_clients_tenant_and_carries_ours():
    r = request((b"x-ggmux-tenant", b"0" * 16), (b"authorization", b"Bearer k"))
    head = request_head(r, 5000, 0)
    assert b"x-ggmux-tenant" not in head and b"Bearer k" not in head
    head = request_head(r, 5000, 0, tenant=b"abcdef0123456789")
    assert head.count(b"x-ggmux-tenant") == 1 and b"x-ggmux-tenant: abcdef0123456789\r\n" in head


def test_the_fair_queue_serves_the_tenant_holding_fewest_slots_then_takes_turns():
    q: FairQueue[tuple[str, int]] = FairQueue(lambda item: item[0])
    for item in [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1), ("b", 2)]:
        q.append(item)
    order, held = [], {"a": 0, "b": 0, "c": 0}

    def admit() -> None:
        item = q.next(held)
        q.take(item)
        held[item[0]] += 1
        order.append(item)

    admit()  # one slot: a's first, the oldest
    held["a"] -= 1  # it ends; a has been served, b and c not yet
    admit()
    assert order == [("a", 1), ("b", 1)]
    admit()  # b holds one, a and c none: c never served comes before a
    admit()  # a (none held) before b's second
    assert order[2:] == [("c", 1), ("a", 2)]
    admit()
    admit()
    assert order[4:] == [("b", 2), ("a", 3)] and not q and q.next(held) is None
    # a cancelled request leaves without taking a turn
    q.append(("d", 1))
    q.remove(next(iter(q)))
    assert len(q) == 0 and q.next(held) is None


# ---- end to end, fake instances ----------------------------------------------------------

def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def gauge(s, model: str, name: str) -> int:
    """A gauge of the instance's /metrics (read with the admin key)."""
    status, _, body = s.request("GET", f"/metrics?model={model}", headers=auth("adm"))
    assert status == 200, body
    m = re.search(rb"^llamacpp:%s (\d+)" % name.encode(), body, re.MULTILINE)
    return int(m.group(1)) if m else -1


def open_chat(port: int, body: dict, headers: dict) -> socket.socket:
    """A raw connection that has sent a chat request; closing it cancels it."""
    data = json.dumps(body).encode()
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items()).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                 b"application/json\r\n%scontent-length: %d\r\n\r\n%s" % (head, len(data), data))
    return sock


def test_a_key_with_requests_running_waits_behind_a_key_with_none(serve, fakes):
    """One slot; key A sends three requests, then key B one: B is served
    second, not last (arrival order gave A, A, A, B)."""
    fakes.add("one", parallel=1, tokens=40, token_s=0.05)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--api-key", "key-a,key-b",
              "--admin-key", "adm")
    assert s.request("POST", CHAT, chat_body("one", max_tokens=1),
                     headers=auth("key-a"))[0] == 200
    done: list[str] = []
    lock = threading.Lock()

    def ask(tag: str, key: str, max_tokens: int) -> None:
        status, _, body = s.request("POST", CHAT, chat_body("one", max_tokens=max_tokens),
                                    headers=auth(key))
        assert status == 200, body
        with lock:
            done.append(tag)

    threads = []
    # a1 runs two seconds; the others, a fifth of a second each, queue meanwhile
    for tag, key, max_tokens in [("a1", "key-a", 40), ("a2", "key-a", 4), ("a3", "key-a", 4),
                                 ("b1", "key-b", 4)]:
        t = threading.Thread(target=ask, args=(tag, key, max_tokens))
        t.start()
        threads.append(t)
        if tag == "a1":
            wait_for(lambda: gauge(s, "one", "requests_processing") == 1, 10, 0.005, "a1 runs")
        else:  # each one queued in the instance before the next is sent
            n = len(threads) - 1
            wait_for(lambda n=n: gauge(s, "one", "requests_deferred") == n, 10, 0.005,
                     f"{tag} queued")
    assert gauge(s, "one", "requests_processing") == 1, "a1 ended too soon for this test"
    for t in threads:
        t.join(60)
    assert done == ["a1", "b1", "a2", "a3"]


def test_slots_show_request_ids_and_tenants_only_to_the_admin_key(serve, fakes):
    fakes.add("slow", parallel=2, tokens=200, token_s=0.05)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--api-key", "key-a,key-b",
              "--admin-key", "adm")
    assert s.request("POST", CHAT, chat_body("slow", max_tokens=1),
                     headers=auth("key-a"))[0] == 200

    socks = [open_chat(s.port, chat_body("slow", stream=True),
                       {**auth("key-a"), "x-request-id": "req-of-a",
                        "x-ggmux-tenant": "0123456789abcdef"}),
             open_chat(s.port, chat_body("slow", stream=True),
                       {**auth("key-b"), "x-request-id": "req-of-b"})]

    def slots(key: str) -> list[dict]:
        status, doc = s.json("GET", "/slots?model=slow", headers=auth(key))
        assert status == 200, doc
        return doc

    busy = wait_for(lambda: (d := slots("adm")) and all(x["is_processing"] for x in d) and d,
                    10, 0.02, "both slots busy")
    assert {x["request_id"] for x in busy} == {"req-of-a", "req-of-b"}
    tenants = {x["request_id"]: x["tenant"] for x in busy}
    assert all(HEX16.fullmatch(t) for t in tenants.values()), tenants
    assert tenants["req-of-a"] != tenants["req-of-b"]
    assert tenants["req-of-a"] != "0123456789abcdef"  # the client's own is dropped
    for key in ("key-a", "key-b"):
        seen = slots(key)
        assert len(seen) == 2 and all("request_id" not in x and "tenant" not in x for x in seen)
        assert "req-of" not in json.dumps(seen)
    for sock in socks:  # the requests end with their clients
        sock.close()
    wait_for(lambda: not any(x["is_processing"] for x in slots("adm")), 10, 0.02, "slots free")


def test_cmd_and_upstream_replicas_never_get_a_tenant(serve, tmp_path, recorder):
    up_port, up_requests = recorder
    log = tmp_path / "cmd.jsonl"
    log.touch()
    rec = Path(__file__).with_name("recorder.py")
    ini = tmp_path / "p.ini"
    ini.write_text(f"[c]\ncmd = {sys.executable} {rec} --port ${{PORT}} --log {log}\n"
                   f"[up]\nupstream = http://127.0.0.1:{up_port}\n")
    s = serve("--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", "--spares", "0",
              "--api-key", "key-a")
    headers = {**auth("key-a"), "x-ggmux-tenant": "0123456789abcdef"}
    wait_for(lambda: s.request("GET", "/upstream/up/health", headers=headers)[0] == 200, 20,
             0.1, "the upstream healthy")
    for model in ("c", "up"):
        for _ in range(2):  # the second over a pooled connection (the fast path)
            assert s.request("POST", CHAT, chat_body(model), headers=headers)[0] == 200
    local = [json.loads(line) for line in log.read_text().splitlines()]
    seen = [r for r in local + up_requests() if not r["path"].endswith("/health")]
    assert len(seen) == 4, seen
    assert all("x-ggmux-tenant" not in r["headers"] for r in seen), seen
