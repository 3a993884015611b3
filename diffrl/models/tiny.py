"""Tiny random models of every family, saved as complete diffusers directories, offline.

Tests and CPU demos load them through the same `from_pretrained` path as real checkpoints, so
the real loading code runs. Each family module (or its `_tiny` companion, where the builder is
large: `qwen_image_tiny`, `qwen_image21_tiny`, `hunyuan_video15_tiny`) defines `build_tiny(path, seed=0) -> Path`, which writes a deterministic
(from `seed`) pipeline directory: a few-layer transformer, a tiny VAE, tiny text encoders and
tokenizers built locally. `model.path=tiny:<name>` builds one into the cache
(`diffrl.models.resolve_model_path`): the families below register here, a task's own tiny models
(the shapes world's) register the same way (`diffrl.config.registries.register_tiny_model`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from diffrl.config.registries import TINY_MODELS, register_tiny_model

# name -> "module" (its `build_tiny`) or "module:function" where a module builds several families.
FAMILY_BUILDERS: dict[str, str] = {
    "sd3": "diffrl.models.sd3",
    "flux": "diffrl.models.flux",
    "qwen_image": "diffrl.models.qwen_image_tiny",
    "qwen_image_edit": "diffrl.models.qwen_image_edit",
    "qwen_image_edit_plus": "diffrl.models.qwen_image_edit:build_tiny_plus",
    "flux_kontext": "diffrl.models.flux_kontext",
    "wan": "diffrl.models.wan",
    "wan22_a14b": "diffrl.models.wan:build_tiny_a14b",
    "zimage": "diffrl.models.zimage",
    "flux2_klein": "diffrl.models.flux2",
    "flux2_klein_base": "diffrl.models.flux2:build_tiny_base",
    "flux2_dev": "diffrl.models.flux2_dev",
    "qwen_image21": "diffrl.models.qwen_image21_tiny",
    "hunyuan_video15": "diffrl.models.hunyuan_video15_tiny",
}
for _name, _builder in FAMILY_BUILDERS.items():
    register_tiny_model(_name, _builder)


def tiny_model_names() -> list[str]:
    """What `tiny:<name>` may name: the model families, then the tasks' own tiny models."""
    return [*FAMILY_BUILDERS, *(name for name in TINY_MODELS if name not in FAMILY_BUILDERS)]


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
    if family not in TINY_MODELS:
        raise ValueError(
            f"unknown family {family!r}; tiny builders exist for {', '.join(tiny_model_names())}"
        )
    module, _, function = TINY_MODELS[family].partition(":")
    return getattr(importlib.import_module(module), function or "build_tiny")(Path(path), seed=seed)
