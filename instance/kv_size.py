"""Bytes of a llama.cpp KV cache before it is allocated, from GGUF
metadata: what :meth:`~ggmux.instance.llama.LlamaBackend.measure` reports
to the supervisor's memory ledger.

A sliding-window layer (Gemma 2 and 3, gpt-oss, Cohere 2, Llama 4's
chunked attention) keeps only the window and a micro-batch of cells a
sequence (llama.cpp's ``llama_kv_cache_iswa``: ``n_swa + n_ubatch``,
never more than the full cache), unless ``--swa-full``; counting it at
the full context over-states Gemma 3 27B's cache about 5x at 128k tokens
(52 of its 62 layers slide over 1,024 tokens), which would keep it from
loading where it fits. Which layers slide is llama.cpp's per architecture
(``hparams.set_swa_pattern(n)`` in each loader: layer ``il`` slides when
``il % n < n - 1``); the GGUF key ``<arch>.attention.sliding_window_pattern``
overrides the period where a converter wrote it. An architecture not in
:data:`SWA_PERIOD` without that key is counted at the full context (safe:
more than it needs).
"""

from __future__ import annotations

SWA_PERIOD = {"gemma2": 2, "gemma3": 6, "gemma-embedding": 6, "gpt-oss": 2, "cohere2": 4,
              "llama4": 4}
"""``general.architecture`` -> llama.cpp's ``set_swa_pattern`` period."""

SWA_PAD = 256
"""llama.cpp pads a sliding-window cache to 256 cells (llama.cpp #17037)."""


def sliding_layers(arch: str, n_layer: int, n_swa: int, period: int | None = None) -> int:
    """How many of ``n_layer`` layers slide over a window of ``n_swa`` tokens
    (0 without a window); ``period``: the GGUF's pattern key, else
    :data:`SWA_PERIOD`'s; none known: 0 (every layer counted whole)."""
    if n_swa <= 0:
        return 0
    period = period if period is not None and period > 0 else SWA_PERIOD.get(arch)
    if not period or period <= 1:
        return 0
    return sum(1 for il in range(n_layer) if il % period < period - 1)


def pad(cells: int, to: int = SWA_PAD) -> int:
    """``cells`` rounded up to a multiple of ``to``."""
    return -(-cells // to) * to


def kv_cache_bytes(n_layer: int, per_token: int, cells: int, *, swa_layers: int = 0,
                   n_swa: int = 0, sequences: int = 1, unified: bool = True,
                   n_ubatch: int = 512) -> int:
    """K and V bytes of a cache of ``cells`` cells shared by ``sequences``
    (a unified cache) or split evenly among them. ``per_token``: bytes of one
    layer's K or V for one token (KV heads x head size x the type's bytes).
    ``swa_layers`` of the ``n_layer`` keep ``n_swa + n_ubatch`` cells a
    sequence (``n_swa x sequences + n_ubatch`` in a unified cache), at most
    ``cells``, padded to :data:`SWA_PAD`."""
    if swa_layers and n_swa > 0:
        if unified:
            swa_cells = min(cells, pad(n_swa * sequences + n_ubatch))
        else:
            per = cells // max(1, sequences)
            swa_cells = sequences * min(per, pad(n_swa + n_ubatch))
    else:
        swa_layers, swa_cells = 0, 0
    return 2 * per_token * ((n_layer - swa_layers) * cells + swa_layers * swa_cells)


def checkpoint_bytes(swa_layers: int, n_swa: int, per_token: int) -> int:
    """Bytes of one context checkpoint of a sliding-window model: K and V of
    the window's cells in every sliding layer (gemma3-270m: 15 x 512 cells
    x 512 bytes x 2 = 7,864,320; measured 7,870,848 with the state's
    headers). 0 for a model without sliding layers."""
    return 2 * swa_layers * n_swa * per_token if swa_layers and n_swa > 0 else 0


__all__ = ["SWA_PAD", "SWA_PERIOD", "checkpoint_bytes", "kv_cache_bytes", "pad", "sliding_layers"]
