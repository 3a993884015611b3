"""Tiny random models of every family, saved as complete diffusers directories, offline.

Tests and CPU demos load them through the same `from_pretrained` path as real checkpoints, so
the real loading code runs. Each family module defines `build_tiny(path, seed=0) -> Path`, which
writes a deterministic (from `seed`) pipeline directory: a few-layer transformer, a tiny VAE, tiny
text encoders and tokenizers built locally (`TINY_BUILDERS` names "module" for its `build_tiny`, or
"module:function" where a module builds several families).
"""

from __future__ import annotations

import importlib
from pathlib import Path

TINY_BUILDERS: dict[str, str] = {
    "sd3": "diffrl.models.sd3",
    "flux": "diffrl.models.flux",
    "qwen_image": "diffrl.models.qwen_image",
    "qwen_image_edit": "diffrl.models.qwen_image_edit",
    "qwen_image_edit_plus": "diffrl.models.qwen_image_edit:build_tiny_plus",
    "flux_kontext": "diffrl.models.flux_kontext",
    "wan": "diffrl.models.wan",
    "toy": "diffrl.toy.model",  # the shapes world's model, untrained (`diffrl sft` trains it)
    "toy_edit": "diffrl.toy.edit_model:build_toy_edit",  # the shapes edit task's model, untrained
}


def tiny_kl_vae(scaling_factor: float, shift_factor: float):
    """A 4-level `AutoencoderKL` with 16 latent channels and 8x downsampling, like the SD3 and FLUX
    VAEs, at a few thousand parameters; the families differ only in their latent scale and shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=16,
        norm_num_groups=4,
        sample_size=64,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def build_tiny(family: str, path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random `family` pipeline to `path` and return it."""
    if family not in TINY_BUILDERS:
        raise ValueError(f"unknown family {family!r}; tiny builders exist for {', '.join(TINY_BUILDERS)}")
    module, _, function = TINY_BUILDERS[family].partition(":")
    return getattr(importlib.import_module(module), function or "build_tiny")(Path(path), seed=seed)
