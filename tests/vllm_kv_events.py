"""vLLM's own KV event classes, for tests that decode ggmux's events as a
picker does.

``pip install --no-deps vllm`` (``.ci/run`` does) installs
``vllm/distributed/kv_events.py``, but importing it pulls torch and the rest
of vLLM. So this loads that one file's event classes (``EventBatch``,
``KVCacheEvent``, ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``,
``KVEventBatch``) and its ``MEDIUM_*`` constants from the installed source,
unchanged, with ``ExternalBlockHash`` as vLLM defines it (``bytes | int``),
and decodes with msgspec as vLLM's consumers do. :func:`load` returns None
when vLLM is not installed (the tests then skip, unless
``GGMUX_EXPECT_K8S_TOOLS`` is set, as in CI, where that fails).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import types
import typing
from pathlib import Path

CLASSES = ("EventBatch", "KVCacheEvent", "BlockStored", "BlockRemoved", "AllBlocksCleared",
           "KVEventBatch")


def source() -> Path | None:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(spec.submodule_search_locations[0]) / "distributed" / "kv_events.py"
    return p if p.exists() else None


def load() -> types.SimpleNamespace | None:
    """The classes, a ``decoder`` of ``KVEventBatch`` and the file's path."""
    path = source()
    if path is None:
        if os.environ.get("GGMUX_EXPECT_K8S_TOOLS"):
            raise AssertionError("vllm is not installed (.ci/run: pip install --no-deps vllm)")
        return None
    import msgspec

    tree = ast.parse(path.read_text())
    keep = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in CLASSES
            or isinstance(n, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id.startswith("MEDIUM_") for t in n.targets)]
    assert {n.name for n in keep if isinstance(n, ast.ClassDef)} == set(CLASSES), \
        f"{path} no longer defines {CLASSES}"
    code = compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec")
    mod = types.ModuleType("ggmux_tests_vllm_kv_events")  # msgspec resolves names in it
    mod.__dict__.update(msgspec=msgspec, Any=typing.Any, ExternalBlockHash=bytes | int)
    sys.modules[mod.__name__] = mod
    exec(code, mod.__dict__)  # noqa: S102 - vLLM's own source, installed
    ns = mod.__dict__
    out = types.SimpleNamespace(**{k: ns[k] for k in CLASSES}, path=path,
                                **{k: v for k, v in ns.items() if k.startswith("MEDIUM_")})
    out.decoder = msgspec.msgpack.Decoder(type=ns["KVEventBatch"])
    return out


def prefix_index():
    """A precise-prefix index as llm-d's kv-cache indexer keeps one, fed by
    decoded events: (lora_name, block token ids chain) -> media. It keys
    blocks by their tokens and extra keys (never the publisher's hashes,
    which it maps), and answers how many leading tokens of a prompt a pod
    holds, in whole blocks."""
    return PrefixIndex()


def freeze(v):
    """Decoded arrays (lists) as tuples, all the way down, to key a dict."""
    return tuple(freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


class PrefixIndex:
    def __init__(self) -> None:
        self.by_engine: dict[int, tuple] = {}  # publisher's hash -> our key
        self.blocks: dict[tuple, set[str]] = {}  # our key -> media holding it
        self.block_size = 0

    def apply(self, ev) -> None:
        name = type(ev).__name__
        if name == "BlockStored":
            self.block_size = ev.block_size
            parent = self.by_engine.get(ev.parent_block_hash) if ev.parent_block_hash else None
            for i, h in enumerate(ev.block_hashes):
                toks = tuple(ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                extra = (freeze(ev.extra_keys[i]),) if ev.extra_keys else ()
                key = (parent, ev.lora_name, toks, extra)
                self.by_engine[h] = key
                self.blocks.setdefault(key, set()).add(ev.medium)
                parent = key
        elif name == "BlockRemoved":
            for h in ev.block_hashes:
                key = self.by_engine.get(h)
                if key is not None:
                    self.blocks.get(key, set()).discard(ev.medium)
                    if not self.blocks.get(key):
                        self.blocks.pop(key, None)
                        self.by_engine.pop(h, None)
        elif name == "AllBlocksCleared":
            self.by_engine.clear()
            self.blocks.clear()

    def match(self, model: str, tokens: list[int], extra_tail: tuple = (),
              media: str | None = None) -> int:
        """Leading tokens of ``tokens`` held (in any medium, or ``media``),
        block by block: each block's extra keys are ``(model, *extra_tail)``."""
        bs = self.block_size
        if not bs:
            return 0
        parent = None
        n = 0
        for i in range(len(tokens) // bs):
            key = (parent, model, tuple(tokens[i * bs:(i + 1) * bs]),
                   ((model, *extra_tail),))
            held = self.blocks.get(key)
            if not held or (media is not None and media not in held):
                break
            parent = key
            n += bs
        return n
