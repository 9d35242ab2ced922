"""The web page at ``/`` in a real browser (issue 15): headless Chromium
(Debian's ``chromium``, which .ci/run installs) driven by Playwright with
that executable (never ``playwright install``). Waits are Playwright's own
deadlines on conditions in the page; screenshots go to the test's temp dir
(``GGMUX_README_SCREENSHOT=1`` also copies the first one to
``docs/page.png`` for the README).

Pages of other origins cannot drive a ggmux that has no key (issue 18,
finding 5): a page served from another port of 127.0.0.1 by a plain
``http.server`` (another origin, as a site on the internet is to a browser
that also reaches localhost) tries every way to unload a model and read
the logs, and the operator's page on ggmux's own origin still works."""

from __future__ import annotations

import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from conftest import CHROMIUM, open_stream, wait_for

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason="Debian's chromium is not installed (.ci/run installs it)")
pytestmark = [pytestmark, pytest.mark.slow]  # a browser
ROOT = Path(__file__).resolve().parent.parent
LOAD_S = 90_000  # ms: a demo model's load on a busy 2-core machine


def row(page, model: str):
    return page.locator(f'tr[data-model="{model}"]')


def test_the_page_shows_the_demo_models_loads_one_and_streams_a_chat(serve, browser_page,
                                                                     tmp_path):
    from playwright.sync_api import expect

    s = serve("--proxies", "1", "--models-max", "2")  # no source: the demo models
    page = browser_page
    page.goto(s.base + "/")
    expect(row(page, "smollm2-135m")).to_be_visible()
    expect(row(page, "gemma3-270m")).to_be_visible()
    expect(page.locator("#model-count")).to_have_text("0 loaded of 2")
    expect(row(page, "gemma3-270m").locator(".state")).to_have_text("unloaded")
    expect(page.locator("#live")).to_have_text("live")

    row(page, "gemma3-270m").locator("button.load").click()
    # the state turns to loaded from /models/sse, with no reload of the page
    expect(row(page, "gemma3-270m").locator(".state")).to_have_text("loaded", timeout=LOAD_S)
    expect(row(page, "gemma3-270m").locator("td.col-replicas")).to_have_text("ready")
    assert s.models()["gemma3-270m"]["status"]["value"] == "loaded"

    page.select_option("#pg-model", "smollm2-135m")
    page.fill("#pg-temp", "0")
    page.fill("#pg-max", "24")
    page.fill("#pg-input", "Say hi")
    page.click("#pg-send")
    answer = page.locator("#pg-transcript .msg.assistant .text").last
    expect(answer).not_to_be_empty(timeout=LOAD_S)
    expect(page.locator("#pg-stats")).to_contain_text("tokens/s", timeout=LOAD_S)
    expect(page.locator("#pg-send")).to_be_enabled(timeout=LOAD_S)  # the stream ended
    stats = page.locator("#pg-stats").inner_text()
    assert int(stats.split()[0]) > 1, stats  # counted from the stream's chunks
    assert answer.inner_text().strip()
    expect(row(page, "smollm2-135m").locator(".state")).to_have_text("loaded")
    # the counters follow /ps: the request ended, its TTFT is counted
    expect(row(page, "smollm2-135m").locator("td.col-inflight")).to_have_text("0")
    # ms below 10 s, else seconds (a loaded machine's first answer may take longer)
    expect(row(page, "smollm2-135m").locator("td.col-ttft")).to_have_text(
        re.compile(r"^\d+ ms$|^\d+\.\d s$"))
    expect(row(page, "smollm2-135m").locator("td.col-memory")).to_contain_text("MiB")

    # the log tail shows the supervisor's lines, live
    expect(page.locator("#log")).to_contain_text("loading gemma3-270m in slot", timeout=10_000)
    expect(page.locator("#devices .device")).to_have_count(1)  # the host, on this machine

    shot = tmp_path / "page.png"
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("GGMUX_README_SCREENSHOT") == "1":
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copy(shot, ROOT / "docs" / "page.png")

    page.fill("#filter", "gemma")
    expect(row(page, "smollm2-135m")).to_be_hidden()
    expect(row(page, "gemma3-270m")).to_be_visible()
    expect(page.locator("#model-count")).to_have_text("1 shown · 2 loaded of 2")
    assert page.errors == []


def test_with_an_api_key_the_page_asks_for_it_and_then_works(serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=6, token_s=0.02)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--api-key", "sk-page")
    page = browser_page
    page.goto(s.base + "/")  # the page itself needs no key
    dialog = page.locator("#key-dialog")
    expect(dialog).to_be_visible()
    expect(page.locator("#key-label")).to_have_text("key")
    # the server's own 401 names the keys it takes
    expect(page.locator("#key-message")).to_contain_text("this server takes an --api-key key")
    expect(row(page, "alpha")).to_have_count(0)  # nothing shown without the key
    page.fill("#key-input", "sk-page")
    page.click("#key-ok")
    expect(dialog).to_be_hidden()
    expect(row(page, "alpha")).to_be_visible()
    row(page, "alpha").locator("button.load").click()  # no admin key: the API key loads
    expect(row(page, "alpha").locator(".state")).to_have_text("loaded", timeout=30_000)
    page.fill("#pg-input", "hello")
    page.click("#pg-send")
    expect(page.locator("#pg-transcript .msg.assistant .text").last).to_contain_text(
        "[alpha:", timeout=30_000)
    assert page.errors == []


def test_the_filter_keeps_the_page_usable_with_200_models(serve, fakes, browser_page):
    from playwright.sync_api import expect

    for i in range(200):
        fakes.add(f"m-{i:03d}")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    page = browser_page
    page.goto(s.base + "/")
    expect(page.locator("#model-count")).to_have_text("0 loaded of 200")
    page.fill("#filter", "m-123")
    expect(page.locator("#model-count")).to_have_text("1 shown · 0 loaded of 200")
    expect(row(page, "m-123")).to_be_visible()
    expect(row(page, "m-124")).to_be_hidden()
    row(page, "m-123").locator("button.load").click()
    expect(row(page, "m-123").locator(".state")).to_have_text("loaded", timeout=30_000)
    page.fill("#filter", "loaded")  # the state is searchable too
    expect(page.locator("#model-count")).to_have_text("1 shown · 1 loaded of 200")
    page.fill("#filter", "")
    expect(page.locator("#models tbody tr:visible")).to_have_count(200)
    assert page.errors == []


# what a hostile page tries: every way a page can POST without a preflight,
# the same with a preflight, reading the logs, Ollama's unload idiom, and a
# reload through an <img>; it reports what it could see
ATTACK = """<!doctype html><html><body><iframe name="sink"></iframe><script>
const G = "%(ggmux)s", out = {};
const unload = JSON.stringify({model: "alpha"});
async function attempt(name, f) {
  try { out[name] = await f(); } catch (e) { out[name] = "blocked"; }
}
(async () => {
  await attempt("plain", async () => (await fetch(G + "/models/unload",
      {method: "POST", mode: "no-cors", body: unload})).type);
  await attempt("blob", async () => (await fetch(G + "/models/unload",
      {method: "POST", mode: "no-cors", body: new Blob([unload])})).type);
  await attempt("json", async () => (await fetch(G + "/models/unload",
      {method: "POST", headers: {"content-type": "application/json"}, body: unload})).status);
  await attempt("logs", async () => await (await fetch(G + "/logs")).text());
  await attempt("ollama", async () => {
    const r = await fetch(G + "/api/generate", {method: "POST",
        headers: {"content-type": "application/json"},
        body: JSON.stringify({model: "alpha", keep_alive: 0, stream: false})});
    return r.status + " " + await r.text();
  });
  const form = document.createElement("form");
  form.action = G + "/models/unload"; form.method = "post"; form.enctype = "text/plain";
  form.target = "sink";
  const input = document.createElement("input");
  input.name = '{"model": "alpha", "x": "'; input.value = '"}';
  form.appendChild(input); document.body.appendChild(form);
  const posted = new Promise(r => document.querySelector("iframe").onload = r);
  form.submit();
  await posted;
  out.form = "posted";
  const img = new Image();
  await new Promise(r => { img.onload = img.onerror = r; img.src = G + "/v1/models?reload=1"; });
  out.img = "loaded";
  document.title = "done";
  window.results = out;
})();
</script></body></html>"""


@pytest.fixture
def other_origin():
    """``(base URL, set_page(html))``: a server on another port of 127.0.0.1."""
    page = {"html": b""}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(page["html"])))
            self.end_headers()
            self.wfile.write(page["html"])

        def log_message(self, *args):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}", lambda html: page.update(
        html=html.encode())
    srv.shutdown()
    srv.server_close()


def test_a_page_of_another_origin_cannot_unload_nor_read_the_logs(serve, fakes, browser_page,
                                                                  other_origin):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=6, token_s=0.02)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")  # no key
    assert s.request("POST", "/models/load", {"model": "alpha"})[0] == 200
    wait_for(lambda: s.models()["alpha"]["status"]["value"] == "loaded", 30, what="loaded")
    base, set_page = other_origin
    set_page(ATTACK % {"ggmux": s.base})
    page = browser_page
    page.goto(base + "/attack.html")
    expect(page).to_have_title("done", timeout=30_000)
    out = page.evaluate("window.results")
    assert out["plain"] == "opaque" and out["blob"] == "opaque", out  # sent, and refused
    assert out["json"] == "blocked", out  # its preflight got no allow header
    assert out["logs"] == "blocked", out
    assert out["ollama"].startswith("403 "), out  # an API route: readable, and refused
    assert out["form"] == "posted" and out["img"] == "loaded", out
    # the queue keeps order: an order sent now is read after anything those sent
    assert s.request("POST", "/api/generate", {"model": "alpha", "prompt": "x",
                                               "keep_alive": "1h", "stream": False})[0] == 200
    wait_for(lambda: "keep_alive 3600 s" in s.logs(), 10, what="the marker order")
    assert s.models()["alpha"]["status"]["value"] == "loaded"
    log = s.logs()
    assert "requested by POST /models/unload" not in log, log[-2000:]
    assert "requested by POST /api/generate" not in log and "reloaded models" not in log

    # the operator's page, on ggmux's own origin, still does all of it
    page.goto(s.base + "/")
    expect(row(page, "alpha").locator(".state")).to_have_text("loaded", timeout=30_000)
    page.select_option("#pg-model", "alpha")
    page.fill("#pg-input", "hello")
    page.click("#pg-send")
    expect(page.locator("#pg-transcript .msg.assistant .text").last).to_contain_text(
        "[alpha:", timeout=30_000)
    expect(page.locator("#log")).to_contain_text("ready on port", timeout=10_000)
    row(page, "alpha").locator("button.unload").click()
    expect(row(page, "alpha").locator(".state")).to_have_text("unloaded", timeout=30_000)
    row(page, "alpha").locator("button.load").click()
    expect(row(page, "alpha").locator(".state")).to_have_text("loaded", timeout=30_000)
    assert page.errors == []


def test_the_usage_view_charts_each_key_and_model_with_their_totals(
        serve, fakes, browser_page, tmp_path):
    """The usage view (issue 36): a row per key and model with its chart and
    totals from ``GET /usage``, after the admin key; the store it reads."""
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=3)
    fakes.add("beta", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--admin-key", "adm",
              "--state-dir", str(tmp_path / "st"))
    for model in ("alpha", "alpha", "beta"):
        assert s.request("POST", "/v1/chat/completions", {
            "model": model, "messages": [{"role": "user", "content": "hi"}]},
            headers={"authorization": "Bearer adm"})[0] == 200
    wait_for(lambda: sum(r["requests"] for r in s.json(
        "GET", "/usage", headers={"authorization": "Bearer adm"})[1]["data"]) == 3,
        20, 0.1, "3 rows")
    page = browser_page
    page.goto(s.base + "/")
    expect(page.locator("#usage-admin")).to_be_visible(timeout=10_000)
    page.click("#usage-admin")
    page.fill("#key-input", "adm")
    page.click("#key-ok")
    alpha = page.locator('#usage tr[data-usage-model="alpha"]')
    expect(alpha).to_be_visible(timeout=15_000)
    expect(alpha.locator(".col-requests")).to_have_text("2")
    expect(alpha.locator(".col-completion_tokens")).to_have_text("6")
    expect(alpha.locator("svg.usage-chart rect.bar-completion")).to_have_count(1)
    expect(page.locator('#usage tr[data-usage-model="beta"] .col-requests')).to_have_text("1")
    expect(page.locator("#usage-state")).to_contain_text("sqlite")
    page.select_option("#usage-range", "7d")
    expect(alpha.locator(".col-requests")).to_have_text("2")


def test_the_page_fits_420_px_and_uses_the_full_width_at_1280(serve, fakes, browser_page,
                                                              tmp_path):
    """Issue 37, the first hour: at 420 px no empty progress bar under a
    loaded model (a CSS rule overrode ``hidden``) and the requests table not
    cut at the right edge; at 1280 px the logs beside the playground (they
    left the right 40% empty); one duration format (``87038 ms`` stood
    beside ``17.6 s``)."""
    from playwright.sync_api import expect

    fakes.add("alpha-model-with-a-long-name", tokens=6, token_s=0.01)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1")
    for _ in range(3):
        assert s.request("POST", "/v1/chat/completions",
                         {"model": "alpha-model-with-a-long-name", "stream": True,
                          "messages": [{"role": "user", "content": "hi"}]})[0] == 200
    page = browser_page
    page.set_viewport_size({"width": 420, "height": 900})
    page.goto(s.base + "/")
    model = row(page, "alpha-model-with-a-long-name")
    expect(model.locator(".state")).to_have_text("loaded")
    expect(page.locator("#requests tbody tr")).to_have_count(3)
    assert page.locator("progress.load-progress:visible").count() == 0
    wrap = page.locator("#requests-section .table-wrap")
    assert wrap.evaluate("e => e.scrollWidth <= e.clientWidth"), "the requests table is cut"
    page.screenshot(path=str(tmp_path / "page-420.png"), full_page=True)
    page.set_viewport_size({"width": 1280, "height": 900})
    pg = page.locator("#playground").bounding_box()
    logs = page.locator("#logs-section").bounding_box()
    assert logs["x"] > pg["x"] + pg["width"] - 1 and abs(logs["y"] - pg["y"]) < 2, (pg, logs)
    assert page.evaluate("fmtMs(87038)") == "87.0 s" and page.evaluate("fmtMs(950)") == "950 ms"
    page.screenshot(path=str(tmp_path / "page-1280.png"), full_page=True)
    assert page.errors == []


def _within(page, locator, width: int) -> bool:
    """Every cell of ``locator`` (a row) is drawn inside ``0 .. width`` px."""
    return page.evaluate("""([row, w]) => [...row.children].filter((c) => c.offsetParent)
        .every((c) => { const b = c.getBoundingClientRect(); return b.left >= 0 && b.right <= w; })""",
        [locator.element_handle(), width])


def test_the_page_under_contention_and_with_a_team_at_420_and_1280_px(
        serve, fakes, browser_page, tmp_path, private_files):
    """A waiting model is "waiting", its reason a line under its row (the
    table's headers stay in view at 1280 px) and the figure /ps gives; the
    usage charts share one scale with an axis, and every figure of the usage
    and requests tables is in sight at 420 px; a 499 is explained; a
    key-file key sees its own limits; the playground's toolbar is one line
    and its empty transcript says what to do. Writes docs/page.png (the
    picture README shows) from this page at 1280 px."""
    from playwright.sync_api import expect

    fakes.add("a", tokens=4000, token_s=0.02, parallel=4, min_bytes=300 << 20)
    fakes.add("b", tokens=4, min_bytes=120 << 20)
    keys = tmp_path / "keys.ini"
    keys.write_text("[alice]\nkey = sk-alice\nrpm = 60\ntokens-per-day = 200000\n"
                    "[bob]\nkey = sk-bob\n")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--models-max", "1",
              "--max-wait", "600", "--keys", str(keys), "--admin-key", "adm",
              "--state-dir", str(tmp_path / "st"))
    alice, bob = ({"authorization": f"Bearer {k}"} for k in ("sk-alice", "sk-bob"))
    small = {"model": "a", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    assert s.request("POST", "/v1/chat/completions", small, headers=alice)[0] == 200
    for _ in range(3):
        assert s.request("POST", "/v1/chat/completions", {**small, "max_tokens": 40},
                         headers=bob)[0] == 200
    # a client that leaves mid-answer: 499
    gone = open_stream(s.port, {**small, "max_tokens": 50, "stream": True}, headers=alice)
    gone.recv(1)
    gone.close()
    # a keeps busy (a long stream), so b's request waits for its capacity
    busy = open_stream(s.port, {**small, "max_tokens": 4000, "stream": True}, headers=bob)
    busy.recv(1)
    waiter = threading.Thread(target=s.request, args=("POST", "/v1/chat/completions",
                                                      {**small, "model": "b"}),
                              kwargs={"headers": alice, "timeout": 300}, daemon=True)
    waiter.start()
    admin = {"authorization": "Bearer adm"}
    wait_for(lambda: any(m["id"] == "b" and m.get("waiting")
                         for m in s.json("GET", "/ps", headers=admin)[1]["models"]),
             30, 0.1, "b waiting")
    page = browser_page
    page.add_init_script("sessionStorage.setItem('ggmux.adminKey', 'adm');"
                         "sessionStorage.setItem('ggmux.apiKey', 'sk-alice');")
    try:
        page.goto(s.base + "/")
        b = row(page, "b")
        expect(b.locator(".state")).to_have_text("waiting", timeout=15_000)
        why = page.locator('tr.why-row[data-why-of="b"]')
        expect(why).to_contain_text("waiting for capacity held by a", timeout=10_000)
        ps_why = next(m for m in s.json("GET", "/ps", headers=admin)[1]["models"]
                      if m["id"] == "b")["queue"]["why"]
        assert ps_why.startswith("waiting for capacity held by a"), ps_why
        expect(b.locator("td.col-waiting")).to_have_text("1")
        expect(b.locator("td.col-memory")).to_have_text("~120 MiB est.")
        # every header in view: the reason no longer widens a column
        wrap = page.locator("#models-section .table-wrap")
        assert wrap.evaluate("e => e.scrollWidth <= e.clientWidth"), "the models table scrolls"
        for th in ("th.col-cache", "th.col-idle"):
            box = page.locator(f"#models {th}").bounding_box()
            assert box["x"] + box["width"] <= 1280, (th, box)
        # usage: one scale for every row, and its axis
        bob_row = page.locator('#usage tr[data-usage-key="bob"]')
        alice_row = page.locator('#usage tr[data-usage-key="alice"][data-usage-model="a"]')
        expect(bob_row).to_be_visible(timeout=20_000)
        expect(alice_row).to_be_visible()
        heights = [r.locator("rect.bar-completion").evaluate("e => e.getBBox().height")
                   for r in (alice_row, bob_row)]
        assert 0 < heights[0] < heights[1], heights  # 3 tokens against 120: not both full
        expect(bob_row.locator("text.axis-label")).to_have_count(4)
        # the 499 is explained where it shows
        status = page.locator("#requests td.col-status", has_text="499").first
        expect(status).to_be_visible(timeout=10_000)
        assert "client closed the connection" in status.get_attribute("title")
        expect(page.locator("#requests-note")).to_be_visible()
        # the playground: one toolbar line, a hint in the empty transcript
        one_line = page.evaluate("""() => { const boxes = [...document.querySelectorAll(
            '#playground .toolbar > *')].map((e) => e.getBoundingClientRect())
            .filter((b) => b.height > 0);  // (the spacer holds nothing)
            return Math.max(...boxes.map((b) => b.top)) < Math.min(...boxes.map((b) => b.bottom));
            }""")  # (a wrapped item starts below the others' bottom)
        assert one_line, "the playground's toolbar wraps"
        expect(page.locator("#pg-transcript .pg-hint")).to_be_visible()
        page.screenshot(path=str(ROOT / "docs" / "page.png"))  # README's picture, current
        page.screenshot(path=str(tmp_path / "contention-1280.png"), full_page=True)
        # 420 px: every figure of a usage row and a request row in sight
        page.set_viewport_size({"width": 420, "height": 900})
        for r in (bob_row, page.locator("#requests tbody tr").first):
            r.scroll_into_view_if_needed()
            assert _within(page, r, 420), r
        expect(bob_row.locator(".col-requests")).to_have_text("3")
        assert page.evaluate("document.documentElement.scrollWidth") <= 420
        expect(page.locator('tr.why-row[data-why-of="b"]')).to_be_visible()
        page.screenshot(path=str(tmp_path / "contention-420.png"), full_page=True)
        # a team member's page: her own key's limits, not everyone's usage
        page.evaluate("keys.admin = ''; refreshUsage()")  # (the tab forgets the admin key)
        mine = page.locator("#usage-mine")
        expect(mine).to_be_visible(timeout=15_000)
        expect(page.locator("#usage-mine-head")).to_contain_text("your key alice")
        expect(page.locator('#usage-mine-limits tr[data-limit="rpm"]')).to_be_visible()
        assert page.errors == []
    finally:
        busy.close()
        waiter.join(120)


def test_the_playground_sends_an_image_to_a_model_that_reads_images(serve, browser_page,
                                                                    tmp_path):
    """A model whose projector reads images gets an image button in the
    playground (chat mode, though its GGUF has no template: the default
    ChatML places the image); the attached file goes as an image_url part."""
    from playwright.sync_api import expect

    from bench import vision_parity as vp
    from bench.vision_model import NAME, write_folder

    write_folder(tmp_path / "models", audio=False)
    s = serve("--models-dir", str(tmp_path / "models"), "--no-hf-cache", "--proxies", "1")
    wait_for(lambda: "modalities" in s.models()[NAME], 60, what="the model measured")
    png = tmp_path / "stripes.png"
    png.write_bytes(vp.stripes_png())
    page = browser_page
    page.goto(s.base + "/")
    page.select_option("#pg-model", NAME)
    expect(page.locator("#pg-attach")).to_be_visible()
    expect(page.locator("#pg-mode")).to_have_value("chat")
    page.set_input_files("#pg-image", str(png))
    expect(page.locator("#pg-attached")).to_have_text("image: stripes.png")
    page.fill("#pg-temp", "0")
    page.fill("#pg-max", "4")
    page.fill("#pg-input", "What is in this picture?")
    page.click("#pg-send")
    expect(page.locator("#pg-send")).to_be_enabled(timeout=LOAD_S)  # the stream ended
    expect(page.locator("#pg-stats")).to_contain_text("tokens", timeout=LOAD_S)
    expect(page.locator("#pg-attached")).to_have_text("")  # sent with that message only
    st, _, metrics = s.request("GET", f"/metrics?model={NAME}")
    assert st == 200
    tokens = re.search(rb"^ggmux_media_tokens_total (\S+)$", metrics, re.MULTILINE)
    assert tokens and float(tokens.group(1)) > 0, metrics[-2000:]
    assert page.errors == []
