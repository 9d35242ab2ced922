"""Parse CPU of one long streamed tool call, per format, before and after
issue 31, item 8 (the stream parser read the whole answer again per token).

For each tool-call format (one chat template per family, tests/templates/)
an answer holding one call whose arguments are about N tokens long (4
characters a token: a file's content in one JSON string, ``--args file``,
or a table of rows, ``--args rows``) is fed to the stream parser 4
characters at a time, then finished; the figure is the CPU time
(``time.process_time``) of all the feeds and the finish. ``before`` is the
stream module of ``--before`` (a commit; default ``ee2ca8c``, the tree
before item 8), loaded from git and run over today's formats (whose parses
are the same: they only add the tail the new stream reads on from);
``after`` today's :class:`~ggmux.instance.tools.stream.ChatStream`. Both
see the same pieces and must send the same deltas (checked). Rounds
alternate before and after.

Usage, from the repository root::

    python -m bench.tool_stream_parse                       # 4k, 16k, 32k tokens
    python -m bench.tool_stream_parse --tokens 4096 16384 --formats hermes-2-pro generic
    python -m bench.tool_stream_parse --args rows --tokens 1024 4096   # the scanner's worst case
    python -m bench.tool_stream_parse --no-before --tokens 4096 32768  # today's only
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

from ggmux.instance.template import JinjaTemplate
from ggmux.instance.tools import format_for
from ggmux.instance.tools.base import ToolRequest
from ggmux.instance.tools.stream import ChatStream

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "templates"
TOOL = {"type": "function", "function": {"name": "write_rows", "description": "Write rows",
                                         "parameters": {"type": "object"}}}
CALLS = "<｜tool▁calls▁begin｜>"
# format -> (template, request fields, the answer with @ARGS@ for the arguments)
FORMATS = {
    "generic": ("HuggingFaceTB-SmolLM2-135M-Instruct.jinja", {},
                '{"tool_calls": [{"name": "write_rows", "arguments": @ARGS@}]}'),
    "hermes-2-pro": ("Qwen-Qwen2.5-7B-Instruct.jinja", {},
                     '<tool_call>\n{"name": "write_rows", "arguments": @ARGS@}\n</tool_call>'),
    "llama-3.x": ("meta-llama-Llama-3.1-8B-Instruct.jinja", {},
                  '{"name": "write_rows", "parameters": @ARGS@}'),
    "mistral-nemo": ("mistralai-Mistral-Nemo-Instruct-2407.jinja", {},
                     '[TOOL_CALLS][{"name": "write_rows", "arguments": @ARGS@, "id": "123456789"}]'),
    "mistral-small": ("Mistral-Small-3.2-24B-Instruct-2506.jinja", {},
                      "[TOOL_CALLS]write_rows[CALL_ID]000000001[ARGS]@ARGS@"),
    "functionary-v3.2": ("meetkai-functionary-medium-v3.2.jinja", {}, "write_rows\n@ARGS@"),
    "command-r7b": ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", {},
                    ('<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "write_rows", '
                    '"parameters": @ARGS@}]<|END_ACTION|>')),
    "deepseek-r1": ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", {"enable_thinking": False},
                    (f"{CALLS}<｜tool▁call▁begin｜>function<｜tool▁sep｜>write_rows\n```json\n"
                    "@ARGS@```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")),
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", {"enable_thinking": False},
                      (f"{CALLS}<｜tool▁call▁begin｜>write_rows<｜tool▁sep｜>@ARGS@<｜tool▁call▁end｜>"
                      "<｜tool▁calls▁end｜>")),
    "gpt-oss": ("openai-gpt-oss-120b.jinja", {},
                ("<|channel|>commentary to=functions.write_rows <|constrain|>json<|message|>"
                "@ARGS@<|call|>")),
    "granite": ("ibm-granite-granite-3.3-2B-Instruct.jinja", {},
                '<|tool_call|>[{"name": "write_rows", "arguments": @ARGS@}]'),
}


def args_of(tokens: int, shape: str = "file") -> str:
    """JSON arguments of about ``tokens`` * 4 characters. ``file``: a
    Write tool's ``{"path", "content"}``, the content a source file (one
    string with escaped quotes and newlines: what coding agents stream);
    ``rows``: a table of rows (objects of strings, numbers and booleans:
    the scanner's worst case)."""
    if shape == "file":
        line = 'def f(x):\n    return "x" * 2  # a line of code\n'
        body = (line * (tokens * 4 // len(json.dumps(line)) + 1))
        return json.dumps({"path": "src/app.py", "content": body})
    rows, size = [], 2
    i = 0
    while size < tokens * 4:
        row = json.dumps({"id": i, "city": f"Oslo \"{i}\"", "temp": -3.5 + i % 7,
                          "sun": i % 2 == 0})
        rows.append(row)
        size += len(row) + 2
        i += 1
    return '{"rows": [' + ", ".join(rows) + "]}"


def load_before(commit: str):
    """The ``ChatStream`` class of ``instance/tools/stream.py`` at ``commit``,
    as a module of today's ``ggmux.instance.tools`` package."""
    src = subprocess.run(["git", "show", f"{commit}:instance/tools/stream.py"], cwd=ROOT,
                         check=True, capture_output=True, text=True).stdout
    name = "ggmux.instance.tools._stream_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "ggmux.instance.tools"
    sys.modules[name] = mod
    exec(compile(src, f"{commit}:instance/tools/stream.py", "exec"), mod.__dict__)  # noqa: S102
    return mod.ChatStream


def run(stream_cls, fmt, plan, text: str) -> tuple[float, list]:
    """CPU seconds to feed ``text`` in 4-character pieces and finish; the deltas."""
    s = stream_cls(fmt, plan)
    out: list = []
    t0 = time.process_time()
    for i in range(0, len(text), 4):
        out += s.feed(text[i:i + 4])
    msg, rest = s.finish()
    cpu = time.process_time() - t0
    return cpu, out + rest + [msg.tool_calls[0].arguments if msg.tool_calls else None]


def same(a: list, b: list) -> bool:
    """The same deltas, call ids aside (each stream makes its own)."""
    def norm(deltas: list) -> str:
        ids: dict = {}
        out = json.loads(json.dumps(deltas))
        for d in out:
            for tc in d.get("tool_calls", []) if isinstance(d, dict) else []:
                if "id" in tc:
                    tc["id"] = ids.setdefault(tc["id"], len(ids))
        return json.dumps(out)

    return norm(a) == norm(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384, 32768])
    ap.add_argument("--formats", nargs="+", default=list(FORMATS))
    ap.add_argument("--args", choices=["file", "rows"], default="file",
                    help="the arguments: a file's content in one string, or rows of a table")
    ap.add_argument("--before", default="ee2ca8c", help="the commit whose stream.py is 'before'")
    ap.add_argument("--no-before", action="store_true",
                    help="only today's stream (the old one takes minutes at 32k tokens)")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here too")
    a = ap.parse_args()
    before = load_before(a.before)
    results = []
    print(f"{'format':18} {'tokens':>6} {'chars':>7} {'before s':>9} {'after s':>8} {'ratio':>7} "
          f"{'after us/token':>14}")
    for name in a.formats:
        template, req, shape = FORMATS[name]
        tmpl = JinjaTemplate((TEMPLATES / template).read_text(), "<s>", "</s>")
        r = ToolRequest(tools=[TOOL], choice="required", **req)
        fmt = format_for(tmpl.source, True)
        assert fmt.name == name, (fmt.name, name)
        plan = fmt.plan(tmpl, [{"role": "user", "content": "rows"}], r)
        for tokens in a.tokens:
            text = shape.replace("@ARGS@", args_of(tokens, a.args))
            cpu_after, out_after = run(ChatStream, fmt, plan, text)
            cpu_before = float("nan")
            if not a.no_before:
                cpu_before, out_before = run(before, fmt, plan, text)
                assert same(out_before, out_after), f"{name}: the deltas differ"
            results.append({"format": name, "args": a.args, "tokens": tokens, "chars": len(text),
                            "before_s": round(cpu_before, 3), "after_s": round(cpu_after, 4)})
            print(f"{name:18} {tokens:>6} {len(text):>7} {cpu_before:>9.2f} {cpu_after:>8.3f} "
                  f"{cpu_before / max(cpu_after, 1e-6):>6.0f}x {cpu_after / tokens * 1e6:>14.1f}",
                  flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
