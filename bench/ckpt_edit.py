"""Context checkpoints measured (issue 35): a conversation whose last user
message is edited or regenerated, the built-in engine against llama-server,
and the steady state with checkpoints on against off; gemma3-270m (a
512-token sliding window), side by side in one run, alternating rounds.

``python -m bench.ckpt_edit [--workloads edit,reasoning,steady] [--conversations 3]
[--threads 2] [--ctx-checkpoints 32] [--checkpoint-min-step 8192]
[--out FILE]``

Workloads:

``edit``
    ``ggmux`` (built-in instance, ``--ctx-checkpoints N
    --checkpoint-min-step M``) against ``llama-server`` (the binary
    :func:`bench.llama_server.find` finds, the same two options), both with
    one slot of ``--ctx`` tokens and ``--threads``. ``--conversations``
    conversations, each a system prompt of ``--words`` words of tools text
    (about 1k tokens at 450) and :data:`KINDS` turns: ``new`` (the first,
    cold), ``edit`` (the last user message replaced), ``regen`` (the same
    prompt again: regenerate the answer), ``append`` (a fixed answer of
    :data:`ANSWER_WORDS` words and a new user message after the last
    prompt), so the prompts grow to about 1.3k tokens. Prompts are
    rendered as a plain ``User:`` / ``Assistant:`` transcript and sent to
    ``/v1/completions`` (gemma3-270m's GGUF has no chat template; plain text
    tokenizes the same on both engines), streamed, ``--max-tokens`` tokens,
    temperature 0, end-of-generation tokens suppressed. Each conversation
    runs on both engines in turn (the order alternates), the prompts
    identical. Figures: TTFT p50/p99 of the turns after the first (by kind
    and all), and the prompt tokens evaluated per turn (``timings.prompt_n``
    where the answer has it, else prompt tokens less ``cached_tokens``).
``reasoning``
    A conversation rendered as gpt-oss's chat template renders it (the
    harmony format: ``<|start|>user<|message|>...<|end|>``), whose template
    drops the reasoning of every earlier assistant turn: each turn's answer
    is ``--reasoning-tokens`` generated tokens (the model's reasoning, in the
    slot's cache after the turn) and the next prompt carries only a fixed
    final answer in its place, so it diverges from the cache where the
    reasoning began, further back than the sliding-window cache's slack.
    ``ggmux`` with checkpoints, ``llama-server`` with the same options, and
    ``ggmux`` with ``--ctx-checkpoints 0`` (what ggmux did before), each
    conversation on every server in turn. Figures as ``edit``'s, by turn
    (``new`` the first, ``next`` the others).
``steady``
    ``ggmux`` with checkpoints on (the options above) against off
    (``--ctx-checkpoints 0``), both up at once, one stream at a time,
    requests alternating between them: prompts of about ``--steady-words``
    words (new every request, so nothing is cached and each prefill takes
    its checkpoints), ``--steady-tokens`` tokens generated. Figures: decode
    tokens/s (per request, tokens after the first over the time after the
    first, median) and ITL p50/p99 (all gaps pooled), TTFT p50.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import llama_server
from bench.agentic import WORDS, tools_text
from bench.prefix_routing import end_process
from bench.stats import percentile
from bench.targets import demo_model_paths, free_port

MODEL = "gemma3-270m"
KINDS = ("new", "edit", "regen", "append", "edit", "regen", "append", "edit")
ANSWER_WORDS = 100
QUESTIONS = ["Which tool reads a file?", "Summarise the tools above.", "What is step two?",
             "Name one risk of tool_3.", "Which tool would you call next?", "Say it shorter.",
             "List three tools that write.", "Explain the arguments of tool_1."]


class Server:
    """One server process (ggmux or llama-server) on a free port, its log in ``workdir``."""

    def __init__(self, name: str, cmd: list[str], workdir: Path, port: int) -> None:
        self.name, self.port = name, port
        self.log = open(workdir / f"{name}.log", "ab")  # noqa: SIM115 - the server's life
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.cmd = cmd

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Until ``/health`` answers 200; raises ``RuntimeError`` if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited (see {self.log.name})")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"{self.name} did not answer /health")

    def stop(self) -> None:
        end_process(self.proc, 120.0)
        self.log.close()


def ggmux(name: str, workdir: Path, path: Path, args: argparse.Namespace, ckpts: int) -> Server:
    """``ggmux serve`` over a preset of gemma3-270m alone, one slot."""
    ini = workdir / f"{name}.ini"
    ini.write_text(f"[{MODEL}]\nmodel = {path}\nctx-size = {args.ctx}\nparallel = 1\n"
                   f"threads = {args.threads}\nthreads-batch = {args.threads}\n")
    port = free_port()
    cmd = [sys.executable, "-m", "ggmux.supervisor", "serve", "--port", str(port),
           "--models-preset", str(ini), "--no-hf-cache", "--proxies", "1", "--models-max", "1",
           "--spares", "0", "--ctx-checkpoints", str(ckpts),
           "--checkpoint-min-step", str(args.checkpoint_min_step), *shlex.split(args.ggmux_args)]
    return Server(name, cmd, workdir, port)


def llama(workdir: Path, binary: Path, path: Path, args: argparse.Namespace) -> Server:
    """llama-server on gemma3-270m, one slot, the same checkpoint options."""
    port = free_port()
    cmd = [str(binary), "-m", str(path), "--host", "127.0.0.1", "--port", str(port),
           "--threads", str(args.threads), "--threads-batch", str(args.threads), "-np", "1",
           "-c", str(args.ctx), "--ctx-checkpoints", str(args.ctx_checkpoints),
           "--checkpoint-min-step", str(args.checkpoint_min_step)]
    return Server("llama-server", cmd, workdir, port)


def stream(port: int, prompt: str, max_tokens: int, bias: dict[str, int],
           timeout: float) -> dict:
    """One streamed ``/v1/completions``: TTFT, arrival times of text events (s from the
    request), prompt tokens, tokens evaluated, cached tokens."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "logit_bias": bias,
            "ignore_eos": True}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    t0 = time.perf_counter()
    arrivals: list[float] = []
    usage: dict = {}
    timings: dict = {}
    try:
        conn.request("POST", "/v1/completions", json.dumps(body),
                     {"content-type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:300]!r}")
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            doc = json.loads(line[6:])
            for choice in doc.get("choices") or []:
                if choice.get("text"):
                    arrivals.append(time.perf_counter() - t0)
            usage = doc.get("usage") or usage
            timings = doc.get("timings") or timings
    finally:
        conn.close()
    prompt_tokens = int(usage.get("prompt_tokens") or 0)
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if "prompt_n" in timings:
        evaluated = int(timings["prompt_n"])
        cached = int(timings.get("cache_n", cached))
        prompt_tokens = prompt_tokens or evaluated + cached
    else:
        evaluated = prompt_tokens - cached
    return {"ttft": arrivals[0] if arrivals else None, "arrivals": arrivals,
            "prompt": prompt_tokens, "evaluated": evaluated, "cached": cached,
            "checkpoint": int((usage.get("prompt_tokens_details") or {})
                              .get("checkpoint_tokens") or timings.get("checkpoint_n") or 0)}


def answer(c: int, k: int) -> str:
    """A fixed assistant answer of :data:`ANSWER_WORDS` words (the same on both engines)."""
    return " ".join(WORDS[(c * 31 + k * 17 + j * 7) % len(WORDS)] for j in range(ANSWER_WORDS))


def render(system: str, turns: list[tuple[str, str | None]]) -> str:
    """A plain transcript: the system text, then ``User:`` / ``Assistant:`` lines;
    the last turn's answer is None (the prompt ends in ``Assistant:``)."""
    out = [system, ""]
    for user, said in turns:
        out.append(f"User: {user}")
        out.append(f"Assistant:{'' if said is None else ' ' + said}")
    return "\n".join(out)


def conversation(c: int, words: int, user_words: int = 0) -> list[tuple[str, str]]:
    """(kind, prompt) of each turn of conversation ``c`` (:data:`KINDS`).

    ``user_words``: every user message is its question followed by that
    many words of pasted text, so an edit (of the question) diverges that
    far before the prompt's end: past the sliding-window cache's slack of
    ``n_ubatch`` cells at about 250 words, where only a checkpoint (or a
    full prefill) can serve it."""
    system = tools_text(f"conv{c}", words)
    paste = f"\n{answer(c + 1000, 0)}" * (user_words // ANSWER_WORDS) if user_words else ""

    def ask(q: int) -> str:
        return f"{QUESTIONS[(c + q) % len(QUESTIONS)]} ({c}.{q}){paste}"

    turns: list[tuple[str, str | None]] = []
    out, q = [], 0
    for k, kind in enumerate(KINDS):
        if kind == "new":
            turns = [(ask(q), None)]
        elif kind == "edit":
            q += 1
            turns[-1] = (ask(q), None)
        elif kind == "append":
            q += 1
            turns[-1] = (turns[-1][0], answer(c, k))
            turns.append((ask(q), None))
        out.append((kind, render(system, turns)))
    return out


def run_edit(servers: dict[str, Server], args: argparse.Namespace, bias: dict[str, int]) -> dict:
    """Every conversation on every server in turn, the order alternating."""
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for c in range(args.conversations):
        convo = conversation(c, args.words, args.user_words)
        order = names if c % 2 == 0 else names[::-1]
        for name in order:
            for t, (kind, prompt) in enumerate(convo):
                res = stream(servers[name].port, prompt, args.max_tokens, bias, args.timeout)
                res.pop("arrivals")
                rows[name].append({"conversation": c, "turn": t, "kind": kind, **res})
                print(f"edit {name} c{c} t{t} {kind}: ttft {res['ttft']:.3f} s prompt "
                      f"{res['prompt']} evaluated {res['evaluated']} cached {res['cached']}",
                      flush=True)
    return rows


def harmony(system: str, turns: list[tuple[str, str | None]]) -> str:
    """``turns`` as gpt-oss's template renders them (harmony): earlier
    assistant turns keep their final answer only (their reasoning is
    dropped), the prompt ends where the next assistant message starts."""
    out = [f"<|start|>system<|message|>{system}<|end|>"]
    for user, said in turns:
        out.append(f"<|start|>user<|message|>{user}<|end|>")
        if said is not None:
            out.append(f"<|start|>assistant<|channel|>final<|message|>{said}<|end|>")
    out.append("<|start|>assistant")
    return "".join(out)


def run_reasoning(servers: dict[str, Server], args: argparse.Namespace,
                  bias: dict[str, int]) -> dict:
    """Each conversation on every server in turn (the order rotating):
    ``--reasoning-turns`` turns, each answered with ``--reasoning-tokens``
    generated tokens that the next prompt drops (:func:`harmony`)."""
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for c in range(args.conversations):
        system = tools_text(f"reason{c}", args.words)
        order = names[c % len(names):] + names[:c % len(names)]
        for name in order:
            turns: list[tuple[str, str | None]] = []
            for t in range(args.reasoning_turns):
                if turns:
                    turns[-1] = (turns[-1][0], answer(c, t))
                turns.append((f"{QUESTIONS[(c + t) % len(QUESTIONS)]} ({c}.{t})", None))
                res = stream(servers[name].port, harmony(system, turns), args.reasoning_tokens,
                             bias, args.timeout)
                res.pop("arrivals")
                kind = "new" if t == 0 else "next"
                rows[name].append({"conversation": c, "turn": t, "kind": kind, **res})
                print(f"reasoning {name} c{c} t{t}: ttft {res['ttft']:.3f} s prompt "
                      f"{res['prompt']} evaluated {res['evaluated']} cached {res['cached']} "
                      f"checkpoint {res['checkpoint']}", flush=True)
    return rows


def edit_figures(rows: dict[str, list[dict]],
                 kinds: tuple[str, ...] = ("new", "edit", "regen", "append")) -> dict:
    """Per server: TTFT p50/p99 and evaluated tokens (mean, max) by kind and over all
    turns after the first."""
    out: dict = {}
    for name, rs in rows.items():
        fig: dict = {}
        for kind in (*kinds, "after-first"):
            sel = [r for r in rs if (r["kind"] != "new" if kind == "after-first"
                                     else r["kind"] == kind)]
            ttft = [r["ttft"] for r in sel if r["ttft"] is not None]
            ev = [r["evaluated"] for r in sel]
            fig[kind] = {"n": len(sel), "ttft_p50": percentile(ttft, 50),
                         "ttft_p99": percentile(ttft, 99),
                         "evaluated_mean": statistics.fmean(ev) if ev else None,
                         "evaluated_max": max(ev) if ev else None,
                         "prompt_mean": statistics.fmean([r["prompt"] for r in sel]) if sel
                         else None}
        out[name] = fig
    return out


def steady_prompt(i: int, words: int) -> str:
    """A prompt of about ``words`` words, new for each ``i``."""
    return render(tools_text(f"steady{i}", words), [(f"Describe tool_{i % 5}.", None)])


def run_steady(servers: dict[str, Server], args: argparse.Namespace,
               bias: dict[str, int]) -> dict:
    """``--steady-requests`` rounds; in each, one request to every server, the order
    alternating; each server's prompt of a round is the same, new every round."""
    rows: dict[str, list[dict]] = {name: [] for name in servers}
    names = list(servers)
    for i in range(args.steady_requests):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            # the same text, tagged per server so neither answers it from a cache
            prompt = f"[{name}] " + steady_prompt(i, args.steady_words)
            res = stream(servers[name].port, prompt, args.steady_tokens, bias, args.timeout)
            a = res["arrivals"]
            gaps = [y - x for x, y in itertools.pairwise(a)]
            tps = (len(a) - 1) / (a[-1] - a[0]) if len(a) > 1 and a[-1] > a[0] else None
            rows[name].append({"request": i, "ttft": res["ttft"], "tokens": len(a),
                               "decode_tps": tps, "gaps": gaps, "prompt": res["prompt"],
                               "cached": res["cached"]})
            print(f"steady {name} r{i}: ttft {res['ttft']:.3f} s, {len(a)} events, "
                  f"{tps or 0:.1f} tok/s, prompt {res['prompt']}", flush=True)
    return rows


def steady_figures(rows: dict[str, list[dict]]) -> dict:
    out: dict = {}
    for name, rs in rows.items():
        gaps = [g for r in rs for g in r["gaps"]]
        tps = [r["decode_tps"] for r in rs if r["decode_tps"]]
        out[name] = {"requests": len(rs), "decode_tps_median": statistics.median(tps) if tps
                     else None, "decode_tps_min": min(tps, default=None),
                     "decode_tps_max": max(tps, default=None),
                     "itl_p50": percentile(gaps, 50), "itl_p99": percentile(gaps, 99),
                     "ttft_p50": percentile([r["ttft"] for r in rs if r["ttft"]], 50)}
    return out


def eog_bias(path: Path) -> dict[str, int]:
    """logit_bias -100 on every end-of-generation token (every answer is max_tokens long)."""
    from bench.slots import end_of_generation_tokens

    return {str(i): -100 for i in end_of_generation_tokens(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ckpt_edit",
                                description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="edit,steady")
    p.add_argument("--conversations", type=int, default=3)
    p.add_argument("--words", type=int, default=450, help="system prompt words (edit)")
    p.add_argument("--user-words", type=int, default=0,
                   help="pasted words in every user message, after its question (edit)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per edit turn")
    p.add_argument("--reasoning-turns", type=int, default=4, help="turns a conversation")
    p.add_argument("--reasoning-tokens", type=int, default=700,
                   help="tokens of each turn's answer (the reasoning the next prompt drops)")
    p.add_argument("--steady-requests", type=int, default=6, help="requests per server")
    p.add_argument("--steady-words", type=int, default=300)
    p.add_argument("--steady-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--ctx-checkpoints", type=int, default=32)
    p.add_argument("--checkpoint-min-step", type=int, default=8192)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--llama-server", help="llama-server binary (default: bench.llama_server.find)")
    p.add_argument("--ggmux-args", default="", help="more options of every ggmux serve")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    path = demo_model_paths()[MODEL]
    bias = eog_bias(path)
    work = Path(tempfile.mkdtemp(prefix="ggmux-ckpt-edit-"))
    report: dict = {"command": " ".join(["python -m bench.ckpt_edit", *(argv or sys.argv[1:])]),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                    "loadavg_before": os.getloadavg(), "args": vars(args) | {"out": str(args.out)}}
    t0 = time.perf_counter()
    servers: dict[str, Server] = {}
    try:
        if "edit" in workloads:
            binary = llama_server.find(args.llama_server)
            if binary is None:
                raise SystemExit(f"no llama-server: {llama_server.HOW_TO_GET}")
            report["llama_server_version"] = llama_server.version(binary)
            servers = {"ggmux": ggmux("ggmux", work, path, args, args.ctx_checkpoints),
                       "llama-server": llama(work, binary, path, args)}
            for s in servers.values():
                s.wait_ready()
            report["edit_commands"] = {n: s.cmd for n, s in servers.items()}
            for name, s in servers.items():  # load the model: the first request is not measured
                stream(s.port, f"[{name}] warm", 2, bias, args.timeout)
            rows = run_edit(servers, args, bias)
            report["edit"] = {"rows": rows, "figures": edit_figures(rows)}
            for s in servers.values():
                s.stop()
            servers = {}
        if "reasoning" in workloads:
            binary = llama_server.find(args.llama_server)
            if binary is None:
                raise SystemExit(f"no llama-server: {llama_server.HOW_TO_GET}")
            report["llama_server_version"] = llama_server.version(binary)
            servers = {"ggmux": ggmux("ggmux", work, path, args, args.ctx_checkpoints),
                       "llama-server": llama(work, binary, path, args),
                       "ggmux-no-ckpt": ggmux("ggmux-no-ckpt", work, path, args, 0)}
            for s in servers.values():
                s.wait_ready()
            report["reasoning_commands"] = {n: s.cmd for n, s in servers.items()}
            for name, s in servers.items():  # load the model: the first request is not measured
                stream(s.port, f"[{name}] warm", 2, bias, args.timeout)
            rows = run_reasoning(servers, args, bias)
            report["reasoning"] = {"rows": rows, "figures": edit_figures(rows, ("new", "next"))}
            for s in servers.values():
                s.stop()
            servers = {}
        if "steady" in workloads:
            servers = {"on": ggmux("ckpt-on", work, path, args, args.ctx_checkpoints),
                       "off": ggmux("ckpt-off", work, path, args, 0)}
            for s in servers.values():
                s.wait_ready()
            for name, s in servers.items():  # load the model: the first request is not measured
                stream(s.port, f"[{name}] warm", 2, bias, args.timeout)
            rows = run_steady(servers, args, bias)
            report["steady"] = {"rows": rows, "figures": steady_figures(rows)}
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["loadavg_after"] = os.getloadavg()
    summary = {k: report[k]["figures"] for k in ("edit", "reasoning", "steady") if k in report}
    print(json.dumps(summary, indent=1))
    print(f"load {report['loadavg_before']} -> {report['loadavg_after']}, {report['seconds']} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
