"""The web page with many models and keys (issue 22 items 1, 6, 8, 9) in
headless Chromium, as test_page.py drives it: running models pinned above
the rest with a count, load progress that moves, a refused key said so and
the panes that waited for the admin key starting by themselves, a 420 px
window that keeps the load/unload buttons in sight, TTFT p50 from the
recent requests, completion mode for a model without a chat template, the
in-flight count following a playground stream, and the live requests
table. Real servers on fake models."""

from __future__ import annotations

import math
import re

from conftest import chat_body, wait_for
from test_page import pytestmark, row  # noqa: F401 - its skip mark (no chromium)


def rows_order(page) -> list[str]:
    return page.eval_on_selector_all("#models tbody tr[data-model]", "rs => rs.map(r => r.dataset.model)")


def test_running_models_are_pinned_above_the_rest_with_a_count_and_load_progress_moves(
        serve, fakes, browser_page):
    from playwright.sync_api import expect

    for i in range(30):
        fakes.add(f"m-{i:03d}")
    fakes.add("slow", load_s=8)  # progress lines every 0.2 s
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    page = browser_page
    page.goto(s.base + "/")
    expect(page.locator("#model-count")).to_have_text("0 loaded of 31")
    assert rows_order(page)[:2] == ["m-000", "m-001"]
    for name in ("m-023", "m-017"):
        assert s.request("POST", "/models/load", {"model": name})[0] == 200
    expect(page.locator("#model-count")).to_have_text("2 loaded of 31", timeout=30_000)
    # pinned in the server's order, then every other model in it
    wait_for(lambda: rows_order(page)[:3] == ["m-017", "m-023", "m-000"], 10,
             what="loaded rows on top")
    expect(row(page, "m-023")).to_have_class(re.compile(r"\bpin-last\b"))
    row(page, "slow").locator("button.load").click()
    # loading is pinned too, and its share moves: neither 0% nor done
    expect(page.locator("#model-count")).to_have_text("2 loaded, 1 loading of 31",
                                                      timeout=10_000)
    expect(row(page, "slow").locator(".state")).to_have_text(
        re.compile(r"^loading ([1-9]|[1-9]\d)%$"), timeout=10_000)
    assert rows_order(page)[:3] == ["m-017", "m-023", "slow"]
    share = float(row(page, "slow").locator("progress").get_attribute("value") or 0)
    assert 0 < share < 1 or row(page, "slow").locator(".state").inner_text() == "loaded"
    expect(row(page, "slow").locator(".state")).to_have_text("loaded", timeout=30_000)
    expect(page.locator("#model-count")).to_have_text("3 loaded of 31")
    # unloaded: back among the rest, in its place
    assert s.request("POST", "/models/unload", {"model": "m-017"})[0] == 200
    expect(page.locator("#model-count")).to_have_text("2 loaded of 31", timeout=30_000)
    wait_for(lambda: rows_order(page)[:3] == ["m-023", "slow", "m-000"], 10,
             what="m-017 unpinned")
    assert page.errors == []


def test_load_progress_moves_in_the_models_list_and_its_events(serve, fakes):
    fakes.add("slow", load_s=4)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert s.request("POST", "/models/load", {"model": "slow"})[0] == 200
    seen: set[float] = set()

    def loaded() -> bool:
        st = s.models()["slow"]["status"]
        if st["value"] == "loading":
            seen.add(st["progress"])
        return st["value"] == "loaded"

    wait_for(loaded, 30, 0.05, "slow loaded")
    # several shares between none and all, not 0% until ready
    assert len({p for p in seen if 0 < p < 1}) >= 3, seen


def test_a_refused_key_says_so_and_the_panes_start_once_the_admin_key_is_known(
        serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=3)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0",
              "--api-key", "sk-api", "--admin-key", "sk-admin")
    page = browser_page
    page.goto(s.base + "/")
    dialog, message = page.locator("#key-dialog"), page.locator("#key-message")
    expect(dialog).to_be_visible()
    expect(message).not_to_contain_text("refused")  # nothing was tried yet
    page.fill("#key-input", "sk-wrong")
    page.click("#key-ok")
    expect(message).to_contain_text("key refused")
    page.fill("#key-input", "sk-api")
    page.click("#key-ok")
    expect(dialog).to_be_hidden()
    expect(row(page, "alpha")).to_be_visible()
    # the log tail and the requests need the admin key: they say so and wait
    expect(page.locator("#logs-state")).to_have_text("the log tail needs the admin key")
    expect(page.locator("#req-state")).to_have_text("the requests need the admin key")
    row(page, "alpha").locator("button.load").click()
    expect(page.locator("#key-label")).to_have_text("admin key")
    page.fill("#key-input", "sk-api")  # the API key is no admin key
    page.click("#key-ok")
    expect(message).to_contain_text("key refused")
    page.fill("#key-input", "sk-admin")
    page.click("#key-ok")
    expect(row(page, "alpha").locator(".state")).to_have_text("loaded", timeout=30_000)
    # nobody clicked "enter the admin key": both panes started by themselves
    expect(page.locator("#logs-state")).to_have_text("live")
    expect(page.locator("#log")).to_contain_text("loading alpha in slot", timeout=10_000)
    expect(page.locator("#req-state")).to_have_text("live")
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha"),
                     headers={"authorization": "Bearer sk-api"})[0] == 200
    expect(page.locator("#requests tbody tr")).to_have_count(1, timeout=10_000)
    assert page.errors == []


def test_a_narrow_window_keeps_the_load_and_unload_buttons_in_sight(serve, fakes, browser_page):
    from playwright.sync_api import expect

    name = "org-with-a-long-name/model-with-an-even-longer-name-Q4_K_M"
    fakes.add(name.replace("/", "_"))
    fakes.add("short")
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    page = browser_page
    page.set_viewport_size({"width": 420, "height": 800})
    page.goto(s.base + "/")
    long_row = row(page, name.replace("/", "_"))
    expect(long_row).to_be_visible()

    def in_sight(button) -> bool:
        """Inside the window as laid out, and the element a click there hits
        (nothing scrolled first, as Playwright's own click would)."""
        box = button.bounding_box()
        if box is None or box["x"] < 0 or box["x"] + box["width"] > 420:
            return False
        x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
        return page.evaluate("([x, y, b]) => document.elementFromPoint(x, y) === b",
                             [x, y, button.element_handle()])

    for r in (long_row, row(page, "short")):
        r.scroll_into_view_if_needed()
        assert in_sight(r.locator("button.load")), r
        assert in_sight(r.locator("button.unload"))
    long_row.locator("button.load").click()
    expect(long_row.locator(".state")).to_have_text("loaded", timeout=30_000)
    long_row.scroll_into_view_if_needed()
    assert in_sight(long_row.locator("button.unload"))
    long_row.locator("button.unload").click()
    expect(long_row.locator(".state")).to_have_text("unloaded", timeout=30_000)
    assert page.evaluate("document.documentElement.scrollWidth") <= 420  # no sideways page
    assert page.errors == []


def test_a_narrow_window_shows_the_ttft_digits_beside_the_buttons_not_under_them(
        serve, fakes, browser_page, tmp_path):
    # issue 31, item 14: the sticky button cell covered the TTFT digits
    from playwright.sync_api import expect

    name = "org-with-a-long-name_model-with-an-even-longer-name-Q4_K_M"
    fakes.add(name, tokens=2, ttft_s=1.234)  # four TTFT digits: "1234 ms"
    fakes.add("short", tokens=2, ttft_s=0.5)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    for model in (name, "short"):
        assert s.request("POST", "/v1/chat/completions", chat_body(model))[0] == 200
    page = browser_page
    page.set_viewport_size({"width": 420, "height": 800})
    page.goto(s.base + "/")
    for model in (name, "short"):
        expect(row(page, model).locator("td.col-ttft")).to_contain_text(" ms", timeout=10_000)
    page.screenshot(path=str(tmp_path / "narrow.png"), full_page=True)
    for model in (name, "short"):
        r = row(page, model)
        r.scroll_into_view_if_needed()
        # where the digits are drawn (the text, not its cell's padding) and
        # where the sticky cell of the buttons is drawn: side by side
        text = page.evaluate("""(td) => { const range = document.createRange();
            range.selectNodeContents(td); const b = range.getBoundingClientRect();
            return {left: b.left, right: b.right}; }""", r.locator("td.col-ttft").element_handle())
        buttons = r.locator("td.col-actions").bounding_box()
        assert text["right"] <= buttons["x"] + 0.5, (model, text, buttons)
        assert 0 <= text["left"] and text["right"] <= 420, (model, text)
    assert page.evaluate("document.documentElement.scrollWidth") <= 420  # no sideways page
    assert page.errors == []


def test_ttft_p50_is_the_median_of_the_recent_requests(serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=2, ttft_s=0.03)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    for _ in range(5):
        assert s.request("POST", "/v1/chat/completions", chat_body("alpha", stream=True))[0] \
            == 200
    recs = wait_for(lambda: len(r := s.json("GET", "/requests")[1]["data"]) == 5 and r, 10,
                    what="five records")
    samples = sorted(r["ttft_ms"] for r in recs)
    p50 = s.json("GET", "/ps")[1]["models"][0]["ttft_p50_ms"]
    # the middle sample itself (both in 0.1 ms), not an edge of a histogram bucket
    assert p50 == samples[2], (p50, samples)
    page = browser_page
    page.goto(s.base + "/")
    expect(row(page, "alpha").locator("td.col-ttft")).to_have_text(
        f"{math.floor(p50 + 0.5)} ms")
    assert page.errors == []


def test_the_playground_uses_completion_mode_for_a_model_without_a_chat_template(
        serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("base", tokens=3, chat_template=False)
    fakes.add("chat", tokens=3)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    wait_for(lambda: all("has_chat_template" in s.models()[m] for m in ("base", "chat")), 10,
             what="both measured")
    assert s.models()["base"]["has_chat_template"] is False
    assert s.models()["chat"]["has_chat_template"] is True
    status, shown = s.json("POST", "/api/show", {"model": "base"})
    assert status == 200 and shown["has_chat_template"] is False
    page = browser_page
    page.goto(s.base + "/")
    expect(row(page, "base")).to_be_visible()
    page.select_option("#pg-model", "base")
    expect(page.locator("#pg-mode")).to_have_value("completion")
    expect(page.locator("#pg-note")).to_have_text(
        "base has no chat template: the playground uses completion mode")
    page.fill("#pg-input", "The capital of France is")
    page.click("#pg-send")
    expect(page.locator("#pg-transcript .msg.assistant .text").last).to_contain_text(
        "[base:", timeout=30_000)
    expect(page.locator("#pg-send")).to_be_enabled(timeout=30_000)
    recs = s.json("GET", "/requests")[1]["data"]
    assert [r["path"] for r in recs] == ["/v1/completions"]  # no chat was sent
    page.select_option("#pg-model", "chat")
    expect(page.locator("#pg-mode")).to_have_value("chat")
    expect(page.locator("#pg-note")).to_be_hidden()
    assert page.errors == []


def test_in_flight_follows_a_playground_stream_without_waiting_for_a_poll(
        serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=40, token_s=0.05)  # a stream of about two seconds
    s = serve("--fake-models-dir", str(fakes), "--proxies", "2", "--spares", "0")
    assert s.request("POST", "/models/load", {"model": "alpha"})[0] == 200
    wait_for(lambda: s.models()["alpha"]["status"]["value"] == "loaded", 30, what="loaded")
    page = browser_page
    # the page's timers never fire: its 1 s /ps poll cannot be what updates the count
    page.clock.install()
    page.clock.pause_at(1_900_000_000_000)
    page.goto(s.base + "/")
    cell = row(page, "alpha").locator("td.col-inflight")
    expect(cell).to_have_text("0")
    page.fill("#pg-input", "hello")
    page.click("#pg-send")
    expect(cell).to_have_text("1", timeout=10_000)  # as the answer starts
    expect(page.locator("#pg-send")).to_be_enabled(timeout=30_000)  # the stream ended
    expect(cell).to_have_text("0")  # as it ends
    assert page.errors == []


def test_the_requests_table_is_live_newest_first_and_filtered_by_model(
        serve, fakes, browser_page):
    from playwright.sync_api import expect

    fakes.add("alpha", tokens=4)
    fakes.add("beta", tokens=2)
    s = serve("--fake-models-dir", str(fakes), "--proxies", "1", "--spares", "0")
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha", stream=True))[0] == 200
    page = browser_page
    page.goto(s.base + "/")
    table = page.locator("#requests tbody tr")
    expect(table).to_have_count(1)
    expect(page.locator("#req-state")).to_have_text("live")
    assert s.request("POST", "/v1/completions", {"model": "beta", "prompt": "x"})[0] == 200
    expect(table).to_have_count(2)  # live, newest first
    expect(table.first.locator("td.col-model")).to_have_text("beta")
    first = table.nth(1)
    expect(first.locator("td.col-model")).to_have_text("alpha")
    expect(first.locator("td.col-api")).to_have_text("openai /v1/chat/completions (stream)")
    expect(first.locator("td.col-status")).to_have_text("200")
    expect(first.locator("td.col-prompt")).to_have_text("1")
    expect(first.locator("td.col-generated")).to_have_text("4")
    expect(first.locator("td.col-ttft")).to_contain_text(" ms")
    page.select_option("#req-model", "alpha")
    expect(table).to_have_count(1)
    expect(table.first.locator("td.col-model")).to_have_text("alpha")
    assert s.request("POST", "/v1/completions", {"model": "beta", "prompt": "y"})[0] == 200
    assert s.request("POST", "/v1/chat/completions", chat_body("alpha"))[0] == 200
    expect(table).to_have_count(2)
    assert page.eval_on_selector_all("#requests tbody td.col-model",
                                     "tds => tds.map(t => t.textContent)") == ["alpha", "alpha"]
    assert page.errors == []


def test_the_page_shows_each_models_kv_tier_bytes_ram_and_disk(serve, fakes, tmp_path,
                                                               browser_page):
    """Issue 29: the cache column, RAM / disk, for a running model and for
    one whose disk tier is all it has (tests/test_kv_tiers_router.py sets
    them up and checks the figures in /ps)."""
    from ggmux.shm import layout as L
    from playwright.sync_api import expect
    from test_kv_tiers_router import warm_two_models

    s, *_ = warm_two_models(serve, fakes, tmp_path)
    disk = int(s.seg.models[1, L.M_CACHE_DISK_BYTES])
    page = browser_page
    page.goto(s.base + "/")
    expect(row(page, "m").locator("td.col-cache")).to_have_text("2.00 KiB / 0", timeout=10_000)
    assert 1024 <= disk < 10 * 1024  # one saved prompt: the page shows it as N.NN KiB
    expect(row(page, "n").locator("td.col-cache")).to_have_text(f"0 / {disk / 1024:.2f} KiB",
                                                               timeout=10_000)
    assert "on disk" in row(page, "m").locator("td.col-cache").get_attribute("title")
    assert page.errors == []
