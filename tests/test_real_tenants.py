"""The prompt cache is no oracle across API keys (issue 18, finding 6), end
to end: ``ggmux serve --api-key key-a,key-b`` on smollm2. Client A sends a
prompt with a password; client B's guesses read
``usage.prompt_tokens_details.cached_tokens``, which counted the prefix A
left in a slot (correct password 38, wrong 27, unrelated 24). Now B's count
is what B itself cached, and A still reuses its own."""

from __future__ import annotations

import pytest
from conftest import Server, free_port

pytestmark = pytest.mark.slow  # the demo model; tenants on the fake: test_tenants.py

SMOL = "smollm2-135m"
SECRET = "You are a helpful assistant. My password is tulip-4417-zebra. Keep it safe. "


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def cached(s: Server, key: str, text: str) -> int:
    status, doc = s.json("POST", "/v1/chat/completions", {
        "model": SMOL, "max_tokens": 1, "temperature": 0,
        "messages": [{"role": "system", "content": text},
                     {"role": "user", "content": "What is my password?"}]}, headers=auth(key))
    assert status == 200, doc
    return doc["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    d = tmp_path_factory.mktemp("tenants")
    s = Server(["--proxies", "1", "--threads", "1", "--ctx-size", "256", "--parallel", "2",
                "--api-key", "key-a,key-b", "--admin-key", "adm", "--spares", "0"],
               free_port(), d / "server.log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_another_keys_cached_prefix_is_neither_reused_nor_counted(keyed):
    assert cached(keyed, "key-a", SECRET) == 0  # a cold slot
    # B's right guess: A's prefix sits in a slot, but B reads (and reuses) none of it
    assert cached(keyed, "key-b", SECRET) == 0
    assert cached(keyed, "key-a", SECRET) > 20  # A's own prefix is still A's to reuse
    assert cached(keyed, "key-b", SECRET) > 20  # and B's its own
