"""``ggmux run MODEL [PROMPT]``: a streamed chat (or, with
``--completion``, a plain completion) in the terminal: one answer for
PROMPT, else a conversation (interactive, or one turn per piped line)."""

from __future__ import annotations

import argparse
import sys

from .http_client import (
    Client,
    ServerError,
    error_message,
    json_kind,
    parse_json,
)

# `ggmux run --completion` without --max-tokens: a base model (no end of
# turn) would run until the context is full
COMPLETION_MAX_TOKENS = 128
# `ggmux run` without --timeout: its answer's head comes with the first
# token (after the prompt is read and a slot is free), which may take long
# on a CPU; the server's own --first-byte-timeout (600 s) answers 504 by then
RUN_TIMEOUT_S = 600.0


# ---- run ------------------------------------------------------------------------
def _answer(client: Client, args: argparse.Namespace, body: dict, out=None) -> str:
    """Stream one answer to ``out`` (stdout), return its text."""
    out = out or sys.stdout
    path = "/v1/completions" if args.completion else "/v1/chat/completions"
    text = []
    waiting_shown = False
    for event, data in client.events("POST", path, body):
        if event == "comment":
            if data.startswith("waiting for") and sys.stderr.isatty():
                print(f"\r{data}", end="", file=sys.stderr, flush=True)
                waiting_shown = True
            continue
        if data.strip() == "[DONE]":
            break
        for piece in _pieces(client, path, data):
            if waiting_shown:
                print("\r\033[K", end="", file=sys.stderr, flush=True)
                waiting_shown = False
            if piece:
                text.append(piece)
                out.write(piece)
                out.flush()
    out.write("\n")
    out.flush()
    return "".join(text)


def _pieces(client: Client, path: str, data: str) -> list[str]:
    """The text of one streamed chunk (chat ``delta.content`` or completion
    ``text``, one per choice); an error event is a :class:`ServerError`,
    a chunk of another shape :class:`NoAnswer`."""
    try:
        chunk = parse_json(data)
    except ValueError:
        raise client.shape("POST", path, f"an event that is not JSON ({data[:60]!r})") from None
    if not isinstance(chunk, dict):
        raise client.shape("POST", path, f"an event that is a JSON {json_kind(chunk)}")
    if chunk.get("error"):
        raise ServerError(502, error_message(data.encode()))
    choices = chunk.get("choices") or []
    if not isinstance(choices, list) or not all(isinstance(c, dict) for c in choices):
        raise client.shape("POST", path, "an event whose 'choices' are not objects")
    out = []
    for choice in choices:
        delta = choice.get("delta")
        piece = (delta.get("content") if isinstance(delta, dict) else None) \
            if "delta" in choice else choice.get("text")
        out.append(piece if isinstance(piece, str) else "")
    return out or [""]


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    base: dict = {"model": args.name, "stream": True}
    if args.max_tokens is not None:
        base["max_tokens"] = args.max_tokens
    elif args.completion:
        base["max_tokens"] = COMPLETION_MAX_TOKENS
    if args.temperature is not None:
        base["temperature"] = args.temperature
    system = [{"role": "system", "content": args.system}] if args.system else []
    prompt = " ".join(args.prompt)
    piped = not sys.stdin.isatty()
    if prompt:  # one answer; piped input is part of the prompt (as ollama run does)
        if piped:
            extra = sys.stdin.read().strip()
            prompt = f"{prompt}\n\n{extra}" if extra else prompt
        _answer(client, args, _request(args, base, system, [], prompt))
        return 0
    history: list[dict] = []
    while True:  # a conversation: interactive, or one turn per piped line
        try:
            line = input() if piped else input(">>> ")
        except EOFError:
            if not piped:
                print()
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/bye", "/exit", "/quit"):
            return 0
        if line == "/clear":
            history = []
            continue
        answer = _answer(client, args, _request(args, base, system, history, line))
        history += [{"role": "user", "content": line}, {"role": "assistant", "content": answer}]


def _request(args: argparse.Namespace, base: dict, system: list[dict], history: list[dict],
             line: str) -> dict:
    if args.completion:
        prior = "".join(f"{m['content']}\n" for m in history)
        return {**base, "prompt": prior + line}
    return {**base, "messages": [*system, *history, {"role": "user", "content": line}]}
