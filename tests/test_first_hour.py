"""What a new user meets in the first hour (issue 37, "The first hour" and
item 16): an option typo names the close option, a llama-server option
says it goes after ``--``; the disk tier's limit is logged with its own
digits; speculative decoding says it is on and reports ``draft_n`` 0 when
nothing was drafted; README no longer lists it among what the built-in
instance lacks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ggmux.instance.cache.tiers import size_text
from ggmux.instance.engine.jobs import Generation, Job
from ggmux.instance.engine.sampling import Sampling
from ggmux.instance.engine.spec_options import SpecConfig
from ggmux.instance.engine.speculation import spec_summary
from manual import manual

ROOT = Path(__file__).resolve().parents[1]


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ggmux.supervisor", "serve", *args],
                          check=False, capture_output=True, text=True, timeout=120)


def test_a_serve_option_typo_names_the_close_option():
    p = _serve("--modls-max", "2")
    assert p.returncode == 2
    assert "unrecognized arguments: --modls-max 2" in p.stderr
    assert "--modls-max: did you mean --models-max?" in p.stderr, p.stderr


def test_a_llama_server_option_before_the_double_dash_says_where_it_goes():
    p = _serve("--temp", "0.7")
    assert p.returncode == 2
    assert "--temp is a llama-server option: give it after '--'" in p.stderr, p.stderr
    assert "ggmux serve [options] -- --temp VALUE" in p.stderr


def test_the_disk_tier_limit_is_logged_with_the_digits_it_was_given():
    assert size_text(0.05) == "51.2 MiB"
    assert size_text(10) == "10 GiB" and size_text(1.5) == "1.5 GiB"


def test_speculation_reports_draft_n_0_when_nothing_was_drafted():
    job = Job(Generation([1, 2, 3], Sampling()), None, 1, lambda: None)
    assert "draft_n" not in job.timings(0.0)  # speculation off: as llama-server
    job.drafts = True
    t = job.timings(0.0)
    assert t["draft_n"] == 0 and t["draft_n_accepted"] == 0


def test_the_speculation_log_line_says_what_drafts():
    line = spec_summary(SpecConfig(types=("ngram-simple",)))
    assert line.startswith("on, ngram-simple (n 12, up to 48 tokens)"), line


def test_the_manual_no_longer_lists_speculative_decoding_among_what_the_instance_lacks():
    text = " ".join(manual().split())
    lacks = text[text.index("The built-in instance has no"):][:200]
    assert "speculative" not in lacks, lacks


class _Client:
    write_paused = False

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send_chunk(self, body: bytes) -> None:
        self.sent.append(body)


def test_prompt_progress_chunks_are_neither_the_first_token_nor_tokens():
    """The requests log of a translated stream (the proxy asks the built-in
    instance for return_progress): TTFT is the first token's, and only
    token events are counted (a Codex turn that decoded nothing in 297 s
    showed a TTFT of 30 s and 10 tokens)."""
    from ggmux.http1.exchange import Exchange
    from ggmux.http1.upstream import Upstream

    up = Upstream(None, 0)
    up.client = _Client()
    up.sse = True
    up.ex = Exchange()
    progress = b'data: {"choices":[],"prompt_progress":{"total":9000,"processed":512}}\n\n'
    up.on_body(progress)
    up.on_body(progress + progress)
    assert up.ex.first_byte_ns == 0 and up.ex.events == 0
    up.on_body(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    assert up.ex.first_byte_ns > 0 and up.ex.events == 1
    assert len(up.client.sent) == 3  # every byte still goes to the client
