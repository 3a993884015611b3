"""The shapes world's verifier: does an image show what its prompt asks for?

It reads pixels only, never the renderer's layout, so it scores a generated image the same way as a
rendered one. Four steps, batched in torch:

1. Pixel colours. A flat object of palette colour c, anti-aliased or blurred into the white
   background, has pixels on the RGB segment white -> c. Each pixel is projected onto the segment
   of every palette colour: alpha (0 at white, 1 at c) and the residual (its RGB distance from the
   segment). The pixel takes the colour with the smallest residual when that residual is at most
   `COLOR_TOLERANCE` and alpha >= `MIN_COVERAGE` (more colour than white: the object's pixel
   coverage thresholded at one half, whatever the blur). Pale pixels (alpha below it) and pixels
   near white are background. Anything else far from white (grey, black, a colour off the palette)
   is "other" ink: it makes objects too, which then count as extra objects.
   Projecting on segments instead of taking the nearest colour matters: half-blue-half-white is
   nearer to purple than to blue or white, so nearest-colour labelling would ring every blue object
   with purple.
2. Connected components (8-neighbourhood) of each colour, by min-label propagation with pointer
   jumping. Components smaller than `MIN_AREA` of the image are speckle and ignored.
3. The shape of each object, from two moments of its soft coverage (the alpha of step 1 over its
   pixels and its pale fringe), which unlike a thresholded mask barely change with blur, noise or
   size (an 8-pixel circle thresholded is nearly a square with clipped corners):
   - skewness of the coverage along y (and x): 0 for a circle or a square, -2√2/5 ≈ -0.57 for a
     triangle pointing up (its mass sits low); beyond `TRIANGLE_SKEW` in either axis: a triangle;
   - diagonal ratio (E[u⁴] + E[v⁴]) / (E[x⁴] + E[y⁴]) with u, v the diagonal axes: 1 for a disk
     (isotropic), 4/3 for an axis-aligned square (its corners lie on the diagonals), 3/4 for one
     turned 45°; further than `SQUARE_DIAG` from 1 (either way): a square, else a circle.
4. The scene's constraints, each true or false:
   - `count:<shape>` for each object spec: exactly `count` objects of that shape;
   - `color:<color> <shape>` for each coloured spec: exactly `count` of them have that colour;
   - `no_extra`: the image holds exactly the prompt's number of objects, "other" ink included;
   - `relation` (position): both objects found once, and `grammar.relation_holds` (GenEval's rule)
     holds for their bounding boxes.

`Verdict.score` is the fraction of constraints that hold (partial credit, a dense RL signal),
`Verdict.correct` whether all do (GenEval-style accuracy). tests/toy checks the verifier against the
renderer at 32x32 and 64x64 (≥ 99% of correct renderings accepted, ≥ 99% of `corrupt`ed ones
rejected, ≥ 95% accepted under slight blur and noise).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from diffrl.lazy import lazy_import
from diffrl.toy.grammar import BACKGROUND, PALETTE, Scene, relation_holds

# The shapes reward imports the verifier, and `diffrl config` imports the rewards to check names
# and args: deferring torch keeps that check free of it.
torch = lazy_import("torch")  # deferred: see diffrl.lazy

COLOR_TOLERANCE = 65.0  # max RGB distance of a pixel from a colour's white->colour segment
MIN_COVERAGE = 0.5  # least fraction of colour (vs white) for a pixel to belong to an object
OTHER_INK = 120.0  # RGB distance from white beyond which an unexplained pixel is "other" ink
MIN_AREA = 0.005  # components below this fraction of the image are speckle (20 px at 64x64)
MIN_AREA_PX = 4
TRIANGLE_SKEW = 0.25  # |skewness| above this: triangle (0.57; circles and squares 0)
SQUARE_DIAG = 1.17  # diagonal ratio above this or below its inverse: square (4/3; a circle 1)
_FRINGE = 2  # pixels around an object's box whose pale coverage counts towards its moments

COLOR_NAMES: tuple[str, ...] = tuple(PALETTE)
OTHER = "other"  # colour name of ink that is no palette colour
_BACKGROUND_LABEL = -1
_OTHER_LABEL = len(COLOR_NAMES)


@functools.cache
def _palette_segments() -> tuple[torch.Tensor, torch.Tensor]:
    """(white [3], white - colour [K, 3]) in float32: the segments of step 1, built on first use
    (tensors at module level would load torch on import)."""
    white = torch.tensor(BACKGROUND, dtype=torch.float32)
    return white, white - torch.tensor(list(PALETTE.values()), dtype=torch.float32)


@dataclass(frozen=True)
class DetectedObject:
    """One object found in an image. `box` is (x0, y0, x1, y1) in pixels, x1 and y1 exclusive."""

    shape: str
    color: str  # a palette colour name, or "other"
    box: tuple[int, int, int, int]
    area: int
    fill: float  # area / box area (square 1, circle 0.785, triangle 0.5), for diagnostics
    skew: float  # the larger |skewness| of the soft coverage along x or y
    diag: float  # diagonal 4th-moment ratio of the soft coverage
    center_xy: tuple[float, float]


@dataclass(frozen=True)
class Verdict:
    """`correct`: every constraint holds; `score`: the fraction that hold; `detail`: {"checks":
    constraint name -> bool, "objects": the detected objects}."""

    correct: bool
    score: float
    detail: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ pixels
def classify_pixels(images_BHW3: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1 of the module docstring, for uint8 images [B, H, W, 3].

    Returns int64 `labels_BHW` (-1 background, i the i-th palette colour, len(PALETTE) other ink),
    int64 `color_BHW` (the palette colour whose segment is nearest, -1 where none is within the
    tolerance) and float32 `coverage_BHW` (alpha along that colour's segment clamped to [0, 1], the
    pixel's estimated coverage by an object of that colour; 0 where no colour explains the pixel).
    """
    white, to_white_K3 = _palette_segments()
    to_white = white - images_BHW3.to(torch.float32)  # [B, H, W, 3]
    sq_len_K = (to_white_K3**2).sum(dim=1)
    alpha_BHWK = (to_white @ to_white_K3.T) / sq_len_K
    dist2_BHW = (to_white**2).sum(dim=-1)
    residual_BHWK = (dist2_BHW.unsqueeze(-1) - alpha_BHWK**2 * sq_len_K).clamp_min(0).sqrt()
    best_res_BHW, best_BHW = residual_BHWK.min(dim=-1)
    alpha_BHW = alpha_BHWK.gather(-1, best_BHW.unsqueeze(-1)).squeeze(-1)
    explained = (best_res_BHW <= COLOR_TOLERANCE) & (alpha_BHW > 0)
    color_BHW = torch.where(explained, best_BHW, torch.tensor(-1))
    coverage_BHW = torch.where(explained, alpha_BHW.clamp(0, 1), torch.tensor(0.0))
    labels_BHW = torch.where(
        explained & (alpha_BHW >= MIN_COVERAGE), best_BHW, torch.tensor(_BACKGROUND_LABEL)
    )
    labels_BHW[~explained & (dist2_BHW > OTHER_INK**2)] = _OTHER_LABEL
    return labels_BHW, color_BHW, coverage_BHW


def label_components(labels_BHW: torch.Tensor) -> torch.Tensor:
    """int64 [B, H, W]: for each non-background pixel, the smallest flat index (y * W + x) of its
    8-connected component of equal label; -1 on background.

    Min-label propagation: every pixel repeatedly takes the smallest label among its same-label
    neighbours, and pointer jumping (a pixel takes the label of the pixel its label names) makes
    labels travel far in one round; it stops when nothing changes.
    """
    batch, height, width = labels_BHW.shape
    big = height * width
    index_HW = torch.arange(height * width, dtype=torch.int32).reshape(height, width)
    inside = labels_BHW >= 0
    comp_BHW = torch.where(inside, index_HW, big).to(torch.int32)
    padded_labels = torch.nn.functional.pad(labels_BHW, (1, 1, 1, 1), value=-1)
    offsets = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1) if dy or dx]
    # same[i]: the pixel's neighbour at offsets[i] is in the image and has the same (non-background) label
    same = [
        inside & (padded_labels[:, 1 + dy : 1 + dy + height, 1 + dx : 1 + dx + width] == labels_BHW)
        for dy, dx in offsets
    ]
    while True:
        padded = torch.nn.functional.pad(comp_BHW, (1, 1, 1, 1), value=big)
        new_BHW = comp_BHW
        for (dy, dx), same_BHW in zip(offsets, same, strict=True):
            neighbour = padded[:, 1 + dy : 1 + dy + height, 1 + dx : 1 + dx + width]
            new_BHW = torch.where(same_BHW & (neighbour < new_BHW), neighbour, new_BHW)
        flat = new_BHW.reshape(batch, height * width)
        jumped = flat.gather(1, flat.clamp_max(big - 1).long())
        new_BHW = torch.where(inside, torch.minimum(flat, jumped).reshape(batch, height, width), big)
        if torch.equal(new_BHW, comp_BHW):
            break
        comp_BHW = new_BHW
    return torch.where(inside, comp_BHW.long(), -1)


def detect_batch(images_BHW3: torch.Tensor) -> list[list[DetectedObject]]:
    """The objects in each image (uint8 [B, H, W, 3]), sorted by position (top to bottom, left to right)."""
    batch, height, width, _ = images_BHW3.shape
    labels_BHW, color_BHW, coverage_BHW = classify_pixels(images_BHW3)
    comp_BHW = label_components(labels_BHW)
    mask = comp_BHW >= 0
    b_N, y_N, x_N = mask.nonzero(as_tuple=True)
    if b_N.numel() == 0:
        return [[] for _ in range(batch)]
    key_N = (b_N * (_OTHER_LABEL + 1) + labels_BHW[mask]) * (height * width) + comp_BHW[mask]
    keys_M, inverse_N, area_M = torch.unique(key_N, return_inverse=True, return_counts=True)
    m = keys_M.numel()

    def reduce(values_N: torch.Tensor, how: str) -> torch.Tensor:
        init = torch.zeros(m, dtype=values_N.dtype)
        return init.scatter_reduce(0, inverse_N, values_N, reduce=how, include_self=False)

    x0_M, x1_M = reduce(x_N, "amin"), reduce(x_N, "amax") + 1
    y0_M, y1_M = reduce(y_N, "amin"), reduce(y_N, "amax") + 1
    cx_M = reduce(x_N.double(), "sum") / area_M + 0.5
    cy_M = reduce(y_N.double(), "sum") / area_M + 0.5
    fill_M = area_M / ((x1_M - x0_M) * (y1_M - y0_M)).double()
    min_area = max(MIN_AREA_PX, MIN_AREA * height * width)
    color_np, coverage_np, comp_np = color_BHW.numpy(), coverage_BHW.numpy(), comp_BHW.numpy()
    found: list[list[DetectedObject]] = [[] for _ in range(batch)]
    for j in (area_M >= min_area).nonzero().flatten().tolist():
        rest, comp_id = divmod(int(keys_M[j]), height * width)
        image, label = divmod(rest, _OTHER_LABEL + 1)
        box = (int(x0_M[j]), int(y0_M[j]), int(x1_M[j]), int(y1_M[j]))
        weights_hw = _object_weights(color_np[image], coverage_np[image], comp_np[image], label, comp_id, box)
        skew, diag = _shape_moments(weights_hw)
        if skew > TRIANGLE_SKEW:
            shape = "triangle"
        elif diag > SQUARE_DIAG or diag < 1 / SQUARE_DIAG:
            shape = "square"
        else:
            shape = "circle"
        found[image].append(
            DetectedObject(
                shape=shape,
                color=COLOR_NAMES[label] if label < len(COLOR_NAMES) else OTHER,
                box=box,
                area=int(area_M[j]),
                center_xy=(round(float(cx_M[j]), 2), round(float(cy_M[j]), 2)),
                fill=round(float(fill_M[j]), 4),
                skew=round(skew, 4),
                diag=round(diag, 4),
            )
        )
    return [sorted(objs, key=lambda o: (o.box[1], o.box[0])) for objs in found]


def _object_weights(
    color_HW: np.ndarray,
    coverage_HW: np.ndarray,
    comp_HW: np.ndarray,
    label: int,
    comp_id: int,
    box: tuple[int, int, int, int],
) -> np.ndarray:
    """One object's soft coverage in its box grown by `_FRINGE` pixels.

    The coverage by the object's colour, on its own pixels and on background pixels (its pale
    anti-aliased fringe), never on another object's pixels. "Other" ink has no coverage: its
    thresholded mask is used.
    """
    height, width = color_HW.shape
    x0, y0 = max(box[0] - _FRINGE, 0), max(box[1] - _FRINGE, 0)
    x1, y1 = min(box[2] + _FRINGE, width), min(box[3] + _FRINGE, height)
    comp = comp_HW[y0:y1, x0:x1]
    if label == _OTHER_LABEL:
        return (comp == comp_id).astype(np.float64)
    own = (color_HW[y0:y1, x0:x1] == label) & ((comp == comp_id) | (comp < 0))
    return np.where(own, coverage_HW[y0:y1, x0:x1], 0.0).astype(np.float64)


def _shape_moments(weights_hw: np.ndarray) -> tuple[float, float]:
    """(larger |skewness| along x or y, diagonal 4th-moment ratio) of a weighted pixel patch."""
    h, w = weights_hw.shape
    total = weights_hw.sum()
    dy = np.arange(h, dtype=np.float64)[:, None]
    dx = np.arange(w, dtype=np.float64)[None, :]
    dy = dy - (weights_hw * dy).sum() / total
    dx = dx - (weights_hw * dx).sum() / total
    skews = []
    for d in (dx, dy):
        var = (weights_hw * d**2).sum() / total
        skews.append(abs((weights_hw * d**3).sum() / total) / max(var, 1e-9) ** 1.5)
    axis4 = (weights_hw * (dx**4 + dy**4)).sum()
    diag4 = (weights_hw * ((dx + dy) ** 4 + (dx - dy) ** 4)).sum() / 4
    return float(max(skews)), float(diag4 / max(axis4, 1e-9))


# ------------------------------------------------------------------------------------ checks
def check_scene(objects: Sequence[DetectedObject], scene: Scene) -> Verdict:
    """The verdict on detected `objects` for `scene` (step 4 of the module docstring)."""
    checks: dict[str, bool] = {}
    for spec in scene.objects:
        same_shape = [o for o in objects if o.shape == spec.shape]
        checks[f"count:{spec.shape}"] = len(same_shape) == spec.count
        if spec.color is not None:
            checks[f"color:{spec.color} {spec.shape}"] = (
                sum(o.color == spec.color for o in same_shape) == spec.count
            )
    checks["no_extra"] = len(objects) == scene.n_objects
    if scene.relation is not None:
        a = [o for o in objects if o.shape == scene.objects[0].shape]
        b = [o for o in objects if o.shape == scene.objects[1].shape]
        checks["relation"] = (
            len(a) == 1 and len(b) == 1 and relation_holds(scene.relation, a[0].box, b[0].box)
        )
    score = sum(checks.values()) / len(checks)
    return Verdict(all(checks.values()), score, {"checks": checks, "objects": list(objects)})


def as_hw3(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """One image as a uint8 tensor [H, W, 3] (what `detect_batch` takes), from a numpy array
    [H, W, 3] or a tensor [3, H, W]; a ValueError naming the layout otherwise."""
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or image.shape[0] != 3:
            raise ValueError(
                f"a tensor image must be uint8 [3, H, W] (numpy arrays are [H, W, 3]); got {tuple(image.shape)}"
            )
        tensor = image.detach().cpu().permute(1, 2, 0)
    elif isinstance(image, np.ndarray):
        if image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(
                f"a numpy image must be uint8 [H, W, 3] (tensors are [3, H, W]); got shape {image.shape}"
            )
        tensor = torch.from_numpy(np.array(image))  # a copy: arrays from Pillow are read-only
    else:
        raise ValueError(
            f"image must be a numpy array [H, W, 3] or a tensor [3, H, W], got {type(image).__name__}"
        )
    if tensor.dtype != torch.uint8:
        raise ValueError(f"image must be uint8 (0..255), got {tensor.dtype}")
    return tensor


def _check_scene_arg(scene: Any) -> Scene:
    if not isinstance(scene, Scene):
        raise ValueError(f"verify needs a Scene (parse_prompt(text) or Scene.from_dict(row)), got {scene!r}")
    return scene


def verify(image: np.ndarray | torch.Tensor, scene: Scene) -> Verdict:
    """Check one image (uint8 numpy [H, W, 3] or tensor [3, H, W]) against `scene`."""
    objects = detect_batch(as_hw3(image).unsqueeze(0))[0]
    return check_scene(objects, _check_scene_arg(scene))


def detect_pixels(pixels: torch.Tensor, count: int, what: str) -> list[list[DetectedObject]]:
    """`detect_batch` of uint8 images [B, 3, H, W], checked to be that and B = `count` (the number
    of `what` they are judged against)."""
    if not isinstance(pixels, torch.Tensor) or pixels.dtype != torch.uint8 or pixels.ndim != 4:
        raise ValueError(
            f"pixels must be a uint8 tensor [B, 3, H, W], got {getattr(pixels, 'shape', pixels)!r}"
        )
    if pixels.shape[1] != 3 or pixels.shape[0] != count:
        raise ValueError(
            f"pixels must be [B, 3, H, W] with B = len({what}) = {count}; got {tuple(pixels.shape)}"
        )
    return detect_batch(pixels.detach().cpu().permute(0, 2, 3, 1))


def verify_batch(pixels: torch.Tensor, scenes: Sequence[Scene]) -> tuple[torch.Tensor, torch.Tensor]:
    """(correct_B bool, score_B float32) for uint8 images [B, 3, H, W] and their B scenes."""
    scenes = [_check_scene_arg(s) for s in scenes]
    detected = detect_pixels(pixels, len(scenes), "scenes")
    verdicts = [check_scene(objs, scene) for objs, scene in zip(detected, scenes, strict=True)]
    return (
        torch.tensor([v.correct for v in verdicts], dtype=torch.bool),
        torch.tensor([v.score for v in verdicts], dtype=torch.float32),
    )
