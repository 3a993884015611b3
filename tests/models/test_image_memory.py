"""`diffrl.models.memory.latent_elements` reads one sample's latent size off the VAE config without
loading anything: it must equal the shape the loaded model's adapter samples (`latent_shape`), for
each VAE kind (AutoencoderKL of SD3 and FLUX.1, the Qwen-Image VAE, Wan's video VAE with its
temporal packing) and pixel space. The train-side step estimate used a fallback of 3 channels at
full resolution for the Qwen-Image and Wan VAEs, 12x their latents: no lower bound."""

from __future__ import annotations

import json
import math

import pytest

from diffrl.config.loader import load_config
from diffrl.controller.sizes import estimate_image_bytes
from diffrl.models import load_model
from diffrl.models.memory import latent_elements


@pytest.mark.parametrize(
    ("family", "height", "width", "frames"),
    [
        ("sd3", 64, 48, 1),
        ("flux", 64, 96, 1),
        ("qwen_image", 64, 32, 1),
        ("wan", 32, 48, 9),
        ("wan", 32, 32, 1),
    ],
)
def test_latent_elements_match_the_adapters_latent_shape(tiny_model, family, height, width, frames):
    root = tiny_model(family)
    vae = json.loads((root / "vae" / "config.json").read_text())
    adapter = load_model(root, dtype="float32", device="cpu")
    expected = math.prod(adapter.latent_shape(height, width, frames))
    assert latent_elements(vae, height, width, frames) == expected


def test_pixel_space_latents_are_the_pixels():
    """toy:shapes (no VAE): its latents are the image, 3 channels at full resolution."""
    adapter = load_model("toy:shapes", dtype="float32", device="cpu")
    assert latent_elements(None, 32, 32) == math.prod(adapter.latent_shape(32, 32)) == 3 * 32 * 32


def test_an_unknown_vae_config_gives_no_bound_rather_than_a_wrong_one():
    assert latent_elements({"_class_name": "SomeFutureVAE"}, 1024, 1024) == 0


def test_the_step_estimate_of_a_qwen_image_run_counts_its_latents_not_pixel_sized_ones(tiny_model):
    """qwen_image at 64x64, window 2: 3*64*64 pixel bytes + 4 bytes x 16 x 8 x 8 latents x (2*2 + 1)."""
    cfg = load_config(
        "default",
        ["rollout.pipeline.height=64", "rollout.pipeline.width=64", "rollout.sde.window_size=2"],
    )
    vae = json.loads((tiny_model("qwen_image") / "vae" / "config.json").read_text())
    assert estimate_image_bytes(cfg, vae) == 3 * 64 * 64 + 4 * 16 * 8 * 8 * 5
