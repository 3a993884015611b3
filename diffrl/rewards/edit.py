"""`edit_preservation`: how much of the source image an edit kept (image-edit runs).

An edit should change what the instruction asks for and nothing else. Without a mask of the
edited region, the reward compares the whole result with the source, pixel by pixel, with a
per-pixel penalty that saturates:

    ŝ    = the source resized to the result's H × W (bilinear, antialiased; a stretch when the
           aspect ratios differ)
    d_p  = (1/3) Σ_c |r_{c,p} − ŝ_{c,p}|                   per-pixel difference, 0..255
    k_p  = max(0, 1 − d_p / τ)                             how much of pixel p is kept, 0..1
    score = (1 / HW) Σ_p k_p                               ∈ [0, 1]

with τ = `threshold` (32 by default, 1/8 of the range). 1 means every pixel equals the source; 0
means every pixel differs by τ or more. Why this measure:

- saturating (robust): a pixel costs at most 1/HW however much it changed, so a local edit of a
  fraction a of the image costs at most a (the "outside the edit" part is what is measured), and
  a few wild pixels cannot dominate, unlike the plain mean absolute difference, where a strong
  colour change costs several times a subtle one of the same area;
- graded below τ: a pixel that drifted by d < τ (the VAE's reconstruction noise, a slight colour
  shift) loses d/τ of its credit, so RL gets a signal for drift long before a hard "changed or
  not" threshold would flip;
- pixel-based, no model: cheap, deterministic, any resolution; unrelated images score low
  (two independent uniformly random images score about 0.014 at τ = 32).

Extras: `mean_abs_diff` (the mean of d_p / 255, 0..1) and `kept_fraction` (the fraction of pixels
with d_p < τ). Videos: every frame against the source, averaged. The source is the sample's
condition image number `source_index` (rows of Qwen-Image-Edit-Plus carry up to three).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import RewardOutput, check_batch, flatten_frames, mean_over_frames
from diffrl.rewards.registry import register_reward

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def resize_source(source_3HW: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """float32 [3, height, width] in 0..255: `source_3HW` (uint8) resized bilinearly with
    antialiasing (torch's `interpolate`), or just converted when it already has that size."""
    image = source_3HW.to(torch.float32)
    if tuple(image.shape[1:]) == (height, width):
        return image
    resized = torch.nn.functional.interpolate(
        image.unsqueeze(0), size=(height, width), mode="bilinear", align_corners=False, antialias=True
    )
    return resized.squeeze(0)


def preservation(result_N3HW: torch.Tensor, source_3HW: torch.Tensor, threshold: float) -> tuple:
    """(score, mean |d| / 255, fraction of pixels with d < τ), each float32 (N,), of N frames
    against one source image already at their size (float, 0..255); the module docstring's formula."""
    diff_NHW = (result_N3HW.to(torch.float32) - source_3HW).abs().mean(dim=1)
    kept_NHW = (1.0 - diff_NHW / threshold).clamp_(min=0.0)
    return (
        kept_NHW.mean(dim=(1, 2)),
        diff_NHW.mean(dim=(1, 2)) / 255.0,
        (diff_NHW < threshold).to(torch.float32).mean(dim=(1, 2)),
    )


@register_reward("edit_preservation")
class EditPreservation:
    """The share of the source image an edit kept (module docstring); needs `sources`.

    Args:
        threshold: τ, the per-pixel difference (0..255, mean over RGB) at which a pixel counts as
            fully changed; > 0.
        source_index: which of the sample's condition images is the source (0: the first).
    """

    name = "edit_preservation"

    def __init__(self, threshold: float = 32.0, source_index: int = 0) -> None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold <= 255:
            raise ValueError(
                f"edit_preservation: threshold={threshold!r} is invalid: must be a number in (0, 255] "
                "(a per-pixel difference in 0..255 units; 32 by default)"
            )
        if isinstance(source_index, bool) or not isinstance(source_index, int) or source_index < 0:
            raise ValueError(
                f"edit_preservation: source_index={source_index!r} is invalid: must be an integer >= 0 "
                "(which condition image of the row is the source; 0 = the first)"
            )
        self.threshold = float(threshold)
        self.source_index = source_index

    def __call__(
        self,
        pixels: torch.Tensor,
        prompts: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None,
        *,
        sources: Sequence[Sequence[torch.Tensor]] | None,
    ) -> RewardOutput:
        check_batch(pixels, prompts, metadata)
        batch = int(pixels.shape[0])
        if sources is None:
            raise ValueError(
                "edit_preservation compares each result with its source image, and this batch has none: "
                "the run's model takes no condition images. Use it with an image-edit model (FLUX.1 "
                "Kontext, Qwen-Image-Edit) whose prompt rows carry their images (data.image_key), or "
                "remove reward.functions.edit_preservation"
            )
        if len(sources) != batch:
            raise ValueError(f"edit_preservation: {len(sources)} rows of sources for {batch} samples")
        frames_N3HW, frames = flatten_frames(pixels)
        height, width = int(frames_N3HW.shape[-2]), int(frames_N3HW.shape[-1])
        resized: dict[int, torch.Tensor] = {}  # the samples of one prompt share their source tensor
        scores, diffs, kept = [], [], []
        for i, row in enumerate(sources):
            if len(row) <= self.source_index:
                raise ValueError(
                    f"edit_preservation: sample {i} has {len(row)} condition image(s), so there is no "
                    f"source_index={self.source_index}: set reward.functions.edit_preservation.args."
                    f"source_index below {len(row) or 1}"
                )
            source = row[self.source_index]
            if id(source) not in resized:
                resized[id(source)] = resize_source(source, height, width)
            out = preservation(
                frames_N3HW[i * frames : (i + 1) * frames], resized[id(source)], self.threshold
            )
            scores.append(out[0])
            diffs.append(out[1])
            kept.append(out[2])
        return RewardOutput(
            mean_over_frames(torch.cat(scores), frames),
            {
                "mean_abs_diff": mean_over_frames(torch.cat(diffs), frames),
                "kept_fraction": mean_over_frames(torch.cat(kept), frames),
            },
        )
