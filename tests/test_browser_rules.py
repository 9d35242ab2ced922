"""What a web page of another origin may ask of a ggmux without a key
(issue 18, finding 5): with the default ``--cors-origins *``, a page on any
origin could ``POST /models/unload`` with a ``text/plain`` body (a
"simple" request: no preflight) and read ``/logs``. Now POST bodies must
be JSON (415), admin routes never answer ``Access-Control-Allow-Origin:
*`` and refuse requests from other origins (403), and a preflight grants
only the headers ggmux reads. The same requests in real Chromium are in
tests/test_page.py; here they go as the browser would send them, on a
fake model.
"""

from __future__ import annotations

import http.client
import json

import pytest
from conftest import chat_body, wait_for

EVIL = "http://evil.example"
UNLOAD = json.dumps({"model": "m"}).encode()


@pytest.fixture(scope="module")
def open_server(tmp_path_factory):
    """No key, the default CORS; fake model ``m`` loaded."""
    from conftest import Server, free_port, write_fake

    d = tmp_path_factory.mktemp("browser")
    write_fake(d / "fakes", "m", tokens=2)
    s = Server(["--fake-models-dir", str(d / "fakes"), "--no-hf-cache", "--proxies", "1",
                "--spares", "0"], free_port(), d / "server.log")
    try:
        s.wait_ready()
        assert s.request("POST", "/models/load", {"model": "m"})[0] == 200
        wait_for(lambda: s.models()["m"]["status"]["value"] == "loaded", 20, what="m loaded")
        yield s
    finally:
        s.stop()


def post(s, path: str, body: bytes, ctype: str | None, headers: dict | None = None):
    """``(status, headers, body)`` of a POST with Content-Type ``ctype``
    (None: no such header at all, as a ``fetch`` with a Blob body sends)."""
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    try:
        conn.request("POST", path, body=body, headers={
            **({"content-type": ctype} if ctype else {}), **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def loaded(s) -> bool:
    return s.models()["m"]["status"]["value"] == "loaded"


@pytest.mark.parametrize("ctype", [None, "text/plain;charset=UTF-8",
                                   "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_simple_cross_origin_post_cannot_unload(open_server, ctype):
    s = open_server
    page = {"origin": EVIL, "sec-fetch-site": "cross-site"}
    status, h, body = post(s, "/models/unload", UNLOAD, ctype, page)
    assert status in (403, 415), (status, body)
    assert "access-control-allow-origin" not in h
    # the same body with no Origin (curl -d, a script) but not JSON: 415, and says what to send
    status, h, body = post(s, "/models/unload", UNLOAD, ctype)
    assert status == 415, (status, body)
    assert "application/json" in json.loads(body)["error"]["message"]
    assert loaded(s)


def test_an_admin_route_refuses_another_origin_even_with_a_json_body(open_server):
    s = open_server
    status, h, body = s.request("POST", "/models/unload", UNLOAD,
                                headers={"origin": EVIL, "content-type": "application/json"})
    assert status == 403 and "another origin" in json.loads(body)["error"]["message"], body
    assert "access-control-allow-origin" not in h
    # a page's <img src=/models?reload=1> sends no Origin, but Sec-Fetch-Site
    assert s.request("GET", "/v1/models?reload=1", headers={"sec-fetch-site": "cross-site"})[0] \
        == 403
    assert loaded(s)


def test_logs_cannot_be_read_from_another_origin_but_from_ggmuxs_own(open_server):
    s = open_server
    for path in ("/logs", "/requests"):  # what others did: the log ring, the request ring
        for headers in ({"origin": EVIL}, {"origin": "null"}, {"sec-fetch-site": "same-site"}):
            status, h, _ = s.request("GET", path, headers=headers)
            assert status == 403 and "access-control-allow-origin" not in h, (path, headers,
                                                                             status, h)
        assert s.request("GET", path)[0] == 200  # curl, the CLI: no Origin at all
    own = {"origin": s.base, "sec-fetch-site": "same-origin"}
    status, h, body = s.request("GET", "/logs", headers=own)
    assert status == 200 and b"ready" in body
    assert s.request("GET", "/requests", headers=own)[0] == 200


def test_preflights_grant_admin_routes_nothing_and_api_routes_only_known_headers(open_server):
    s = open_server
    ask = {"origin": EVIL, "access-control-request-method": "POST",
           "access-control-request-headers": "content-type, x-evil, X-Stainless-Lang, "
                                             "authorization"}
    status, h, _ = s.request("OPTIONS", "/models/unload", headers=ask)
    assert status == 200
    assert "access-control-allow-origin" not in h and "access-control-allow-methods" not in h
    status, h, _ = s.request("OPTIONS", "/v1/chat/completions", headers=ask)
    # llama-server's default: the origin echoed (here without credentials)
    assert status == 200 and h["access-control-allow-origin"] == EVIL
    assert "access-control-allow-credentials" not in h
    assert h["access-control-allow-headers"] == "content-type, x-stainless-lang, authorization"


def test_api_routes_take_json_bodies_only_in_their_own_envelope(open_server):
    s = open_server
    body = json.dumps(chat_body("m")).encode()
    plain = {"content-type": "text/plain"}
    # m is loaded with one replica: the fast path sees this request first
    status, _, out = s.request("POST", "/v1/chat/completions", body, headers=plain)
    assert status == 415 and json.loads(out)["error"]["type"], out
    status, _, out = s.request("POST", "/api/chat", body, headers=plain)
    assert status == 415 and list(json.loads(out)) == ["error"], out
    status, _, out = s.request("POST", "/v1/messages", body, headers=plain)
    assert status == 415 and json.loads(out)["type"] == "error", out
    for ctype in ("application/json", "application/json; charset=utf-8",
                  "Application/JSON", "application/vnd.api+json"):
        assert s.request("POST", "/v1/chat/completions", body,
                         headers={"content-type": ctype})[0] == 200, ctype
    # a pass-through takes any type a page could not send without a preflight
    status, _, out = s.request("POST", "/upstream/m/v1/chat/completions", body, headers=plain)
    assert status == 415, out
    assert s.request("POST", "/upstream/m/v1/chat/completions", body,
                     headers={"content-type": "application/json"})[0] == 200


def test_ollama_unload_from_another_origin_is_refused_without_any_key(open_server):
    s = open_server
    req = {"model": "m", "keep_alive": 0, "stream": False}
    status, _, out = s.request("POST", "/api/generate", req,
                               headers={"origin": EVIL, "content-type": "application/json"})
    assert status == 403 and "another origin" in json.loads(out)["error"], out
    # and keep_alive 0 on a generation from there unloads nothing (read in order: see below)
    assert s.request("POST", "/api/generate", {**req, "prompt": "hi"},
                     headers={"origin": EVIL})[0] == 200
    assert s.request("POST", "/api/generate", {**req, "prompt": "hi", "keep_alive": "1h"},
                     headers={"origin": s.base})[0] == 200
    wait_for(lambda: "m: keep_alive 3600 s from POST /api/generate" in s.logs(), 10,
             what="the own page's keep_alive, queued after the other page's")
    assert loaded(s)


def test_listed_origins_may_do_admin_actions_and_read_the_answer(serve, fakes):
    fakes.add("m", tokens=2)
    ok = "http://ok.example"
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--cors-origins", f"{ok},*")
    status, h, _ = s.request("OPTIONS", "/models/load", headers={
        "origin": ok, "access-control-request-method": "POST",
        "access-control-request-headers": "content-type"})
    assert status == 200 and h["access-control-allow-origin"] == ok
    status, h, _ = s.request("POST", "/models/load", {"model": "m"}, headers={"origin": ok})
    assert status == 200 and h["access-control-allow-origin"] == ok
    status, h, _ = s.request("GET", "/logs", headers={"origin": ok})
    assert status == 200 and h["access-control-allow-credentials"] == "true"
    assert s.request("GET", "/logs", headers={"origin": EVIL})[0] == 403  # "*" is not enough


def test_a_replicas_admin_routes_are_not_reached_through_the_pass_through(open_server):
    """Issue 37, item 3: on a keyless server a page of any origin emptied
    every tenant's KV tiers with a body-less ``POST /upstream/m/cache/clear``
    (no preflight), and anyone read ``GET /upstream/m/cache``."""
    s = open_server
    page = {"origin": EVIL, "sec-fetch-site": "cross-site"}
    for path in ("/upstream/m/cache/clear", "/upstream/m/v1/chat/completions"):
        status, _, body = post(s, path, b"", None, page)  # what a page's fetch() sends
        assert status == 403 and "another origin" in json.loads(body)["error"]["message"], body
    # no admin key set: nobody reaches them, whatever the spelling
    for path in ("/upstream/m/cache/clear", "/upstream/m/cache", "/upstream/m//cache/clear/",
                 "/upstream/m/cach%65/clear", "/upstream/m/x/../cache"):
        status, _, body = s.request("POST" if "clear" in path else "GET", path)
        assert status == 403 and "admin route" in json.loads(body)["error"]["message"], (
            path, body)
    assert s.request("GET", "/upstream/m/v1/models")[0] == 200  # the rest passes as before


def test_only_the_admin_key_reaches_a_replicas_admin_routes(serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--api-key", "k", "--admin-key", "a")
    api, admin = {"authorization": "Bearer k"}, {"authorization": "Bearer a"}
    assert s.request("POST", "/v1/chat/completions", chat_body("m"), headers=api)[0] == 200
    for method, path in (("POST", "/upstream/m/cache/clear"), ("GET", "/upstream/m/cache"),
                         ("POST", "/upstream/m/slots/0?action=erase"),
                         ("POST", "/upstream/m/props")):
        status, _, body = s.request(method, path, b"{}" if method == "POST" else None,
                                    headers=api)
        assert status == 403, (path, status, body)
    status, _, body = s.request("POST", "/upstream/m/cache/clear", b"{}", headers=admin)
    assert status == 200 and "cleared" in json.loads(body), body
    assert s.request("GET", "/upstream/m/props", headers=api)[0] == 200


# ---- DNS rebinding: a page whose name now points at this machine -------------------------

def rebound(s, method: str, path: str, body=None, host: str | None = None):
    """A request as a rebinding page sends it: same-origin, ``Host`` its own name."""
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=30)
    try:
        headers = {"host": host or f"evil.example:{s.port}",
                   "origin": f"http://{host or f'evil.example:{s.port}'}"}
        if body is not None:
            headers["content-type"] = "application/json"
            body = json.dumps(body).encode()
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_a_page_that_rebinds_its_name_to_a_keyless_server_is_refused(open_server):
    s = open_server
    for method, path, body in (
            ("POST", "/models/unload", {"model": "m"}), ("POST", "/cache/clear", {}),
            ("GET", "/logs", None), ("GET", "/usage", None), ("GET", "/requests", None),
            ("POST", "/v1/chat/completions", chat_body("m")),  # the fast path's
            ("POST", "/api/generate", {"model": "m", "prompt": "", "keep_alive": 0}),
            ("GET", "/v1/models", None)):
        st, raw = rebound(s, method, path, body)
        assert st == 403, (path, raw)
        assert b"--allowed-hosts evil.example" in raw and b"DNS rebinding" in raw
    assert loaded(s)
    # this machine's names, addresses and one-label names are served
    for host in (f"localhost:{s.port}", f"127.0.0.1:{s.port}", f"[::1]:{s.port}",
                 "ggmux", "box.local", "app.localhost"):
        assert rebound(s, "GET", "/v1/models", host=host)[0] == 200, host
    # a probe's /health whatever its Host
    assert rebound(s, "GET", "/health")[0] == 200


def test_allowed_hosts_names_the_servers_other_names_and_star_turns_the_check_off(
        serve, fakes):
    fakes.add("m", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
              "--allowed-hosts", "llm.example.com, *.corp.example")
    assert rebound(s, "GET", "/v1/models", host="llm.example.com")[0] == 200
    assert rebound(s, "GET", "/v1/models", host="a.corp.example:8080")[0] == 200
    assert rebound(s, "GET", "/v1/models", host="evil.example")[0] == 403
    off = serve("--fake-models-dir", str(fakes), "--no-hf-cache", "--proxies", "1",
                "--allowed-hosts", "*")
    assert rebound(off, "GET", "/v1/models", host="evil.example")[0] == 200


def test_the_host_check_reads_names_and_applies_on_loopback_by_default():
    from ggmux.proxy.hosts import HostCheck, host_name

    assert host_name(b"[::1]:8080") == "::1" and host_name(b"Evil.Example.:80") == "evil.example"
    local = HostCheck("127.0.0.1")
    assert not local.allows(b"evil.example") and not local.allows(b"localhost.evil.com")
    assert local.allows(None) and local.allows(b"10.1.2.3:8080") and local.allows(b"ggmux")
    assert local.allows(b"svc.ns.svc.cluster.local")
    # listening on a network: the operator's names are many; a key guards it
    assert HostCheck("0.0.0.0").allows(b"evil.example")
    assert not HostCheck("0.0.0.0", "llm.example.com").allows(b"evil.example")
    cluster = HostCheck("127.0.0.1")
    cluster.set_cluster("node-a.example.net")
    assert cluster.allows(b"node-a.example.net:8080")
