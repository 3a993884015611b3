"""Drawing shapes-world scenes with Pillow: correct images for pretraining, wrong ones for tests.

`render(scene, size, generator)` draws every object of the scene on a white background: flat
palette colours (an object without a colour gets a random palette colour), sizes 25–34% of the
image side (smaller in scenes of four or more objects), positions drawn at random until no two objects come closer than a gap of 6% of the
side, and a relation holds with a margin of at least 30% of the side along its axis. Shapes are
axis-aligned: a circle, a square, and a triangle pointing up (apex at the top centre of its box).

`corrupt(scene, generator)` returns a scene that breaks the original prompt in one way (a wrong
count, colour or shape, an extra or missing object, the opposite relation); the verifier must
reject its renderings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import torch
from PIL import Image, ImageDraw

from diffrl.toy.grammar import BACKGROUND, PALETTE, RELATIONS, SHAPES, ObjectSpec, Scene

SIZE_RANGE = (0.25, 0.34)  # object box side, as a fraction of the image side
GAP = 0.06  # minimum free space between two objects' boxes, fraction of the side
RELATION_MARGIN = 0.30  # minimum centre offset along a relation's axis, fraction of the side
_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
_MAX_TRIES = 2000


def relation_holds(
    relation: str, a_xy: tuple[float, float], b_xy: tuple[float, float], margin: float
) -> bool:
    """Whether centre `a_xy` is `relation` centre `b_xy` by more than `margin` pixels (y grows down)."""
    dx, dy = b_xy[0] - a_xy[0], b_xy[1] - a_xy[1]
    return {"left of": dx, "right of": -dx, "above": dy, "below": -dy}[relation] > margin


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], color) -> None:
    x0, y0, x1, y1 = box
    if shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=color)
    elif shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=color)
    else:
        draw.polygon([((x0 + x1 - 1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=color)


def _layout(
    scene: Scene, size: int, rng: np.random.Generator
) -> list[tuple[str, tuple[int, ...], tuple[int, int, int, int]]]:
    """(shape, rgb, box) of every object, placed by rejection sampling."""
    items = []
    for group, spec in enumerate(scene.objects):
        for _ in range(spec.count):
            color = PALETTE[spec.color] if spec.color else PALETTE[rng.choice(list(PALETTE))]
            items.append((group, spec.shape, color))
    gap = max(1, round(GAP * size))
    # Crowded scenes draw smaller objects, and every failed batch of tries shrinks them a little more.
    scale = 0.8 if len(items) >= 4 else 1.0
    for attempt in range(_MAX_TRIES):
        if attempt and attempt % 250 == 0:
            scale *= 0.9
        boxes = []
        for _group, _shape, _color in items:
            side = round(float(rng.uniform(*SIZE_RANGE)) * scale * size)
            x0, y0 = (int(v) for v in rng.integers(0, size - side + 1, size=2))
            box = (x0, y0, x0 + side, y0 + side)
            if any(
                box[0] < b[2] + gap and b[0] < box[2] + gap and box[1] < b[3] + gap and b[1] < box[3] + gap
                for b in boxes
            ):
                break
            boxes.append(box)
        else:
            if scene.relation is not None:
                centre = [((b[0] + b[2]) / 2, (b[1] + b[3]) / 2) for b in boxes]
                if not relation_holds(scene.relation, centre[0], centre[1], RELATION_MARGIN * size):
                    continue
            return [(shape, color, box) for (_g, shape, color), box in zip(items, boxes, strict=True)]
    raise ValueError(f"could not place {len(items)} objects without overlap in a {size}x{size} image")


def render(scene: Scene, size: int = 64, generator: np.random.Generator | None = None) -> np.ndarray:
    """uint8 [size, size, 3]: a correct image of `scene` (random layout and free colours)."""
    if size < 24:
        raise ValueError(f"size={size} is too small to draw shapes reliably: use 32 or 64")
    rng = generator if generator is not None else np.random.default_rng()
    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape, color, box in _layout(scene, size, rng):
        draw_shape(draw, shape, box, color)
    return np.asarray(image).copy()


def render_batch(scenes: Sequence[Scene], size: int, seed: int) -> torch.Tensor:
    """uint8 [B, 3, size, size]; image i from its own generator (seed, i), independent of the batch."""
    from diffrl.seeding import numpy_rng

    images = [render(s, size, numpy_rng(seed, i)) for i, s in enumerate(scenes)]
    return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).contiguous()


def corrupt(scene: Scene, generator: np.random.Generator) -> Scene:
    """A scene that violates `scene`'s prompt in one randomly chosen way."""
    rng = generator
    objects = list(scene.objects)
    choices = ["extra", "shape"]
    if sum(o.count for o in objects) > 1:
        choices.append("missing")
    if any(o.color for o in objects):
        choices.append("color")
    if scene.category == "counting":
        choices.append("count")
    if scene.relation is not None:
        choices += ["relation", "relation"]
    kind = choices[rng.integers(len(choices))]
    i = int(rng.integers(len(objects)))
    if kind == "extra":
        objects.append(ObjectSpec(str(rng.choice(SHAPES))))
        return Scene(scene.category, tuple(objects))  # an extra object; the relation no longer matters
    if kind == "missing":
        if objects[i].count > 1:
            objects[i] = replace(objects[i], count=objects[i].count - 1)
        else:
            del objects[i]
        return Scene(scene.category, tuple(objects))
    if kind == "shape":
        others = [s for s in SHAPES if s != objects[i].shape]
        objects[i] = replace(objects[i], shape=str(rng.choice(others)))
        return replace(scene, objects=tuple(objects))
    if kind == "color":
        i = next(j for j, o in enumerate(objects) if o.color)
        others = [c for c in PALETTE if c != objects[i].color]
        objects[i] = replace(objects[i], color=str(rng.choice(others)))
        return replace(scene, objects=tuple(objects))
    if kind == "count":
        n = objects[0].count
        options = [c for c in (n - 1, n + 1) if 1 <= c <= 5]
        objects[0] = replace(objects[0], count=int(rng.choice(options)))
        return replace(scene, objects=tuple(objects))
    return replace(scene, relation=_OPPOSITE[scene.relation])


assert set(_OPPOSITE) == set(RELATIONS)

__all__ = ["corrupt", "draw_shape", "relation_holds", "render", "render_batch"]
