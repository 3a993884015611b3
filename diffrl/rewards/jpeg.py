"""JPEG (in)compressibility: the file size of each image saved as JPEG at a fixed quality.

The classic sanity-check rewards of DDPO / Flow-GRPO: a model trained on `jpeg_compressibility`
learns flat, low-detail images; on `jpeg_incompressibility`, busy, high-frequency ones. Neither
needs a model or a download, so they also serve as the cheapest end-to-end test of a training loop.

Units: kilobytes, 1 kB = 1000 bytes, of Pillow's baseline JPEG encoder at `quality` (default 95,
as in Flow-GRPO), 4:2:0 chroma subsampling (Pillow's default). For a 512x512 RGB image the size
typically spans ~5 kB (flat) to ~200 kB (noise); a 64x64 image, ~1-15 kB.

- `jpeg_incompressibility`: score = +size_kB (bigger files score higher).
- `jpeg_compressibility`:   score = -size_kB (smaller files score higher; the exact negation).

Extras: `jpeg_kb`, the size itself (positive), for both.
"""

from __future__ import annotations

import io
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import ImageReward, RewardOutput, to_pil
from diffrl.rewards.registry import register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def jpeg_size_kb(frames_N3HW: torch.Tensor, quality: int = 95) -> torch.Tensor:
    """(N,) float32 JPEG sizes in kB (1000 bytes) of uint8 RGB frames at the given quality."""
    sizes = []
    for image in to_pil(frames_N3HW):
        buffer = io.BytesIO()
        image.save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000.0)
    return torch.tensor(sizes, dtype=torch.float32)


class _JpegSize(ImageReward):
    sign = 1.0

    def __init__(self, quality: int = 95) -> None:
        if not isinstance(quality, int) or not 1 <= quality <= 95:
            # Pillow documents 1..95; above 95 disables parts of the JPEG compression.
            raise ValueError(f"{self.name}: quality={quality!r} is invalid: must be an integer in 1..95")
        self.quality = quality

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        size_kb_N = jpeg_size_kb(frames_N3HW, self.quality)
        return RewardOutput(self.sign * size_kb_N, {"jpeg_kb": size_kb_N})


@register_reward("jpeg_incompressibility")
class JpegIncompressibility(_JpegSize):
    """score = JPEG size in kB at `quality` (higher = harder to compress)."""

    name = "jpeg_incompressibility"
    sign = 1.0


@register_reward("jpeg_compressibility")
class JpegCompressibility(_JpegSize):
    """score = -(JPEG size in kB) at `quality` (higher = easier to compress)."""

    name = "jpeg_compressibility"
    sign = -1.0
