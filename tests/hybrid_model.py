"""A tiny random-weight hybrid model for the tests (issue 35): LFM2
(llama.cpp's ``LLM_ARCH_LFM2``: short-convolution layers, whose state is
recurrent, between attention layers), written with the ``gguf`` package in
well under a second. No such model is on the package registries. Its
answers mean nothing; what the tests compare is a restored state's greedy
continuation against a cold prefill's, which random weights exercise as
well as trained ones.

The tensors and keys are those llama.cpp's ``llama_model_lfm2`` loads
(src/models/lfm2.cpp): ``token_embd``, ``token_embd_norm`` (its output
norm), per layer ``attn_norm``, ``ffn_norm``, ``ffn_gate/up/down`` and
either ``attn_q/k/v/output`` with ``attn_q_norm``/``attn_k_norm`` or
``shortconv.conv``/``in_proj``/``out_proj``; a layer is recurrent where
``attention.head_count_kv`` says 0. The vocabulary is GPT-2's 256 byte
tokens (:func:`byte_vocab`): a prompt is a token a byte.
"""

from __future__ import annotations

import numpy as np

N_EMBD = 64
N_FF = 128
N_HEAD = 4
N_HEAD_KV = (0, 0, 2, 0)  # layers 0, 1 and 3 short convolutions, layer 2 attention
L_CACHE = 3
CTX = 2048


def byte_vocab() -> tuple[list[str], list[str]]:
    """GPT-2's byte-level tokens (every byte as its printable character,
    ``bytes_to_unicode``) and an end token, with one merge (llama.cpp's BPE
    vocabulary needs the key): a prompt is about a token a byte."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)}
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    tokens = [chars[b] for b in range(256)] + ["Ġt", "<|endoftext|>"]
    return tokens, ["Ġ t"]


def make_lfm2(path: str, seed: int = 0) -> str:
    """Write the model to ``path``; returns ``path``."""
    import gguf

    tokens, merges = byte_vocab()
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(path, "lfm2")
    w.add_context_length(CTX)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(N_FF)
    w.add_block_count(len(N_HEAD_KV))
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(list(N_HEAD_KV))
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_uint32("lfm2.shortconv.l_cache", L_CACHE)
    w.add_vocab_size(n_vocab)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * (n_vocab - 1) + [gguf.TokenType.CONTROL])
    w.add_token_merges(merges)
    w.add_bos_token_id(n_vocab - 1)
    w.add_eos_token_id(n_vocab - 1)
    w.add_add_bos_token(False)
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.08) -> None:  # numpy order: ggml's reversed
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    head = N_EMBD // N_HEAD
    t("token_embd.weight", n_vocab, N_EMBD, scale=1.0)
    ones("token_embd_norm.weight", N_EMBD)
    t("output.weight", n_vocab, N_EMBD, scale=0.3)  # logits of about 2.4 s.d.: varied draws
    for i, kv in enumerate(N_HEAD_KV):
        ones(f"blk.{i}.attn_norm.weight", N_EMBD)
        ones(f"blk.{i}.ffn_norm.weight", N_EMBD)
        t(f"blk.{i}.ffn_gate.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_up.weight", N_FF, N_EMBD)
        t(f"blk.{i}.ffn_down.weight", N_EMBD, N_FF)
        if kv:
            ones(f"blk.{i}.attn_q_norm.weight", head)
            ones(f"blk.{i}.attn_k_norm.weight", head)
            t(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
            t(f"blk.{i}.attn_k.weight", kv * head, N_EMBD)
            t(f"blk.{i}.attn_v.weight", kv * head, N_EMBD)
            t(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
        else:
            t(f"blk.{i}.shortconv.conv.weight", N_EMBD, L_CACHE, scale=0.5)
            t(f"blk.{i}.shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
            t(f"blk.{i}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
