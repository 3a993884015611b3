"""The shapes world's verifier: does an image show what its prompt asks for?

It reads pixels only (never the renderer's layout), so it scores generated images the same way as
rendered ones:

1. colour segmentation: each pixel takes the nearest of the palette colours and white, and
   counts as background when that is white or when no palette colour is within `COLOR_TOLERANCE`
   (RGB distance) — so anti-aliased or washed-out edges and speckle fall away;
2. connected components (8-neighbourhood) of each palette colour, by min-label propagation in
   numpy; components under `MIN_AREA` of the image are noise and ignored;
3. shape of each object, from its fill of its bounding box and its vertical balance: a triangle
   fills about half of its box and has most of its mass in the lower half; a square fills all of
   it; a circle π/4;
4. the scene's constraints, each true or false:
   - for every object spec: exactly `count` objects of its shape (of its colour, when it has one);
   - no other objects: the image holds exactly as many objects as the prompt names;
   - the relation (position): first object's centre vs the second's along the relation's axis,
     by more than `RELATION_MARGIN` of the image side.

`score` is the fraction of constraints that hold (partial credit for RL), `correct` whether all
do (the GenEval-style accuracy). The verifier is checked in tests/toy against the renderer: at
32² and 64² it accepts ≥ 99% of correct renderings and rejects ≥ 99% of corrupted ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from diffrl.toy.grammar import BACKGROUND, PALETTE, Scene
from diffrl.toy.render import relation_holds

COLOR_TOLERANCE = 110.0  # max RGB distance from a palette colour for a pixel to count as that colour
MIN_AREA = 0.01  # components smaller than this fraction of the image are noise
RELATION_MARGIN = 0.05  # a relation needs its centre offset > this fraction of the side
TRIANGLE_FILL = 0.66  # box fill below this: a triangle (≈ 0.5); above: circle (≈ 0.785) or square
SQUARE_FILL = 0.9  # box fill above this: a square (≈ 1.0)
TRIANGLE_BALANCE = 0.65  # upper-half mass / lower-half mass below this: a triangle (≈ 1/3)

_COLORS = np.array([BACKGROUND, *PALETTE.values()], dtype=np.float32)  # index 0 = background
_COLOR_NAMES = ["background", *PALETTE]


@dataclass(frozen=True)
class DetectedObject:
    shape: str
    color: str
    center_xy: tuple[float, float]
    area: int


@dataclass(frozen=True)
class Verdict:
    correct: bool
    score: float
    detail: dict[str, Any] = field(default_factory=dict)


def segment(image_HW3: np.ndarray) -> np.ndarray:
    """Per-pixel colour index: 0 background, i ≥ 1 the i-th palette colour."""
    pixels = image_HW3.astype(np.float32)
    dist = np.linalg.norm(pixels[:, :, None, :] - _COLORS[None, None], axis=-1)
    nearest = dist.argmin(axis=-1)
    nearest[dist.min(axis=-1) > COLOR_TOLERANCE] = 0
    return nearest


def components(mask_HW: np.ndarray) -> list[np.ndarray]:
    """Boolean masks of the 8-connected components of `mask_HW`."""
    if not mask_HW.any():
        return []
    h, w = mask_HW.shape
    big = h * w + 1
    labels = np.where(mask_HW, np.arange(h * w).reshape(h, w), big)
    while True:
        padded = np.pad(labels, 1, constant_values=big)
        neighbours = [
            padded[1 + dy : 1 + dy + h, 1 + dx : 1 + dx + w] for dy in (-1, 0, 1) for dx in (-1, 0, 1)
        ]
        new = np.where(mask_HW, np.minimum.reduce(neighbours), big)
        if np.array_equal(new, labels):
            break
        labels = new
    return [labels == value for value in np.unique(labels[mask_HW])]


def classify_shape(mask_HW: np.ndarray) -> str:
    ys, xs = np.nonzero(mask_HW)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    fill = len(ys) / float((y1 - y0) * (x1 - x0))
    middle = (y0 + y1) / 2.0
    upper, lower = np.sum(ys + 0.5 < middle), np.sum(ys + 0.5 > middle)
    balance = upper / max(lower, 1)
    if fill < TRIANGLE_FILL or balance < TRIANGLE_BALANCE:
        return "triangle"
    return "square" if fill > SQUARE_FILL else "circle"


def detect(image_HW3: np.ndarray) -> list[DetectedObject]:
    """The objects in an image (uint8 [H, W, 3])."""
    h, w, _ = image_HW3.shape
    labels = segment(image_HW3)
    found = []
    for index in range(1, len(_COLORS)):
        for mask in components(labels == index):
            area = int(mask.sum())
            if area < MIN_AREA * h * w:
                continue
            ys, xs = np.nonzero(mask)
            found.append(
                DetectedObject(
                    classify_shape(mask), _COLOR_NAMES[index], (float(xs.mean()), float(ys.mean())), area
                )
            )
    return found


def verify(image, scene: Scene) -> Verdict:
    """Check `image` (uint8 [H, W, 3] numpy, or [3, H, W] tensor) against `scene`."""
    array = _as_hw3(image)
    objects = detect(array)
    checks: dict[str, bool] = {}
    for i, spec in enumerate(scene.objects):
        same_shape = [o for o in objects if o.shape == spec.shape]
        checks[f"count_{i}_{spec.shape}"] = len(same_shape) == spec.count
        if spec.color is not None:
            checks[f"color_{i}_{spec.color}"] = sum(o.color == spec.color for o in same_shape) == spec.count
    checks["no_extra_objects"] = len(objects) == sum(s.count for s in scene.objects)
    if scene.relation is not None:
        a = [o for o in objects if o.shape == scene.objects[0].shape]
        b = [o for o in objects if o.shape == scene.objects[1].shape]
        margin = RELATION_MARGIN * array.shape[1]
        checks["relation"] = (
            len(a) == 1
            and len(b) == 1
            and relation_holds(scene.relation, a[0].center_xy, b[0].center_xy, margin)
        )
    score = sum(checks.values()) / len(checks)
    return Verdict(all(checks.values()), score, {"checks": checks, "objects": objects})


def verify_batch(pixels: torch.Tensor, scenes: Sequence[Scene]) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct_B bool, score_B float32) for uint8 images [B, 3, H, W]."""
    if pixels.ndim != 4 or pixels.shape[1] != 3 or len(pixels) != len(scenes):
        raise ValueError(
            f"need uint8 [B, 3, H, W] images and B scenes; got {tuple(pixels.shape)} and {len(scenes)}"
        )
    verdicts = [verify(image, scene) for image, scene in zip(pixels, scenes, strict=True)]
    return (
        torch.tensor([v.correct for v in verdicts]),
        torch.tensor([v.score for v in verdicts], dtype=torch.float32),
    )


def _as_hw3(image) -> np.ndarray:
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(f"a tensor image must be [3, H, W]; got {tuple(image.shape)}")
        image = image.permute(1, 2, 0).cpu().numpy()
    array = np.asarray(image)
    if array.dtype != np.uint8 or array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"image must be uint8 [H, W, 3]; got {array.dtype} {array.shape}")
    return array


__all__ = ["DetectedObject", "Verdict", "detect", "verify", "verify_batch"]
