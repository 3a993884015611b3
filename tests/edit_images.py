"""Condition images for the edit-family tests."""

from __future__ import annotations

import numpy as np
from PIL import Image


def condition_image(seed: int, width: int = 64, height: int = 48) -> Image.Image:
    """A smooth random picture (the VAE sees structure, not only noise)."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, width)[None, :, None] * rng.random(3) + np.linspace(0, 1, height)[:, None, None]
    pixels = (ramp / ramp.max() * 200 + rng.random((height, width, 3)) * 55).astype(np.uint8)
    return Image.fromarray(pixels)
