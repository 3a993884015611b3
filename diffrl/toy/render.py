"""Drawing shapes-world scenes: correct images for supervised pretraining, wrong scenes for negatives.

`render(scene, size, generator)` draws every object of the scene in a flat palette colour on a
white background (an object without a colour gets a random palette colour, each object its own).
Shapes are axis-aligned in a square box: a circle, a square, a triangle pointing up (apex at the
top centre of its box, base along its bottom). Layout, by rejection sampling from `generator`:

- box side uniform in `SIZE_RANGE` (18-30%) of the image side, but at least `MIN_SIDE_PX` pixels:
  at 32x32 a circle smaller than that is hard to tell from a square with clipped corners, for the
  verifier and for a model alike;
- no two boxes closer than `GAP` (6%) of the side, at least 2 pixels, so objects never merge even
  after a slight blur; crowded scenes that fail to place shrink their objects a little and retry;
- a relation holds with a clear margin: `relation_holds` with `RENDER_MIN_COS` (0.8) instead of the
  verifier's 0.5, i.e. the second object lies within about 37° of the relation's axis.

Images are drawn `SUPERSAMPLE` (4) times larger and box-filtered down, so edges are anti-aliased
like a real image's, not hard pixel steps (the verifier must cope with soft edges anyway).

`render_batch(scenes, size, seed)` renders a batch, image i from its own generator (seed, i).
`corrupt(scene, generator)` returns a scene that the same prompt forbids (a wrong count, colour or
shape, a missing or extra object, the opposite relation, swapped colours); rendering it gives a
negative example, which the verifier must reject.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np
from PIL import Image, ImageDraw

from diffrl.lazy import lazy_import
from diffrl.seeding import derive_seed
from diffrl.toy.grammar import (
    BACKGROUND,
    MAX_COUNT,
    MIRROR,
    PALETTE,
    SHAPES,
    Box,
    ObjectSpec,
    Scene,
    relation_holds,
)

torch = lazy_import("torch")  # deferred: see diffrl.lazy

SIZE_RANGE = (0.18, 0.30)  # object box side, fraction of the image side
MIN_SIDE_PX = 8.0  # ... but never below this many pixels
GAP = 0.06  # least free space between two boxes (and at least 2 px), fraction of the side
RENDER_MIN_COS = 0.8  # relations drawn with this margin (the verifier accepts > 0.5)
SUPERSAMPLE = 4  # drawn this many times larger, then box-filtered down (anti-aliasing)
MIN_SIZE = 24  # smallest image side the layout rules fit in
_TRIES_PER_SCALE = 200
_SHRINK = 0.9  # object sizes shrink by this after every _TRIES_PER_SCALE failed layouts
_COLORS = list(PALETTE.values())


def layout(scene: Scene, size: int, rng: np.random.Generator) -> list[tuple[str, tuple[int, ...], Box]]:
    """(shape, rgb, box in pixels) of every object of `scene`, objects of objects[0] first: the layout
    `render` draws (the same draws from `rng`)."""
    items: list[tuple[str, tuple[int, ...]]] = []
    for spec in scene.objects:
        for _ in range(spec.count):
            rgb = PALETTE[spec.color] if spec.color else _COLORS[int(rng.integers(len(_COLORS)))]
            items.append((spec.shape, rgb))
    gap = max(2.0, GAP * size)
    lo, hi = side_range(size)
    scale = 1.0
    for attempt in range(20 * _TRIES_PER_SCALE):
        if attempt and attempt % _TRIES_PER_SCALE == 0:
            scale *= _SHRINK
        boxes: list[Box] = []
        for _ in items:
            box = _uniform_box(float(rng.uniform(lo, hi)) * scale, size, rng)
            if _too_close(box, boxes, gap):
                break
            boxes.append(box)
        else:
            if scene.relation is None or relation_holds(scene.relation, boxes[0], boxes[1], RENDER_MIN_COS):
                return [(shape, rgb, box) for (shape, rgb), box in zip(items, boxes, strict=True)]
    raise AssertionError(f"no layout found for {scene} at size {size}")  # the rules always fit at >= MIN_SIZE


def side_range(size: int) -> tuple[float, float]:
    """(smallest, largest) object box side in pixels at image side `size` (`SIZE_RANGE`, at least
    `MIN_SIDE_PX`), as `layout` draws them."""
    lo = max(SIZE_RANGE[0] * size, MIN_SIDE_PX)
    return lo, max(SIZE_RANGE[1] * size, lo)


def free_box(
    side: float,
    taken: Sequence[Box],
    size: int,
    rng: np.random.Generator,
    accept: Callable[[Box], bool] | None = None,
    tries: int = _TRIES_PER_SCALE,
) -> Box | None:
    """A box of `side` pixels at a uniform position, at least the layout's gap (`GAP`, 2 px) from
    every box of `taken`, for which `accept` (when given) holds; None after `tries` failed draws."""
    gap = max(2.0, GAP * size)
    for _ in range(tries):
        box = _uniform_box(side, size, rng)
        if not _too_close(box, taken, gap) and (accept is None or accept(box)):
            return box
    return None


def _uniform_box(side: float, size: int, rng: np.random.Generator) -> Box:
    """A square box of `side` pixels at a uniform position at least 1 px inside the image."""
    x0, y0 = rng.uniform(1.0, size - 1.0 - side, size=2)
    return (float(x0), float(y0), float(x0) + side, float(y0) + side)


def _too_close(box: Box, others: Sequence[Box], gap: float) -> bool:
    """Whether `box` comes within `gap` pixels of one of `others` (on both axes at once)."""
    return any(
        box[0] < b[2] + gap and b[0] < box[2] + gap and box[1] < b[3] + gap and b[1] < box[3] + gap
        for b in others
    )


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: Box, rgb: tuple[int, ...], scale: int) -> None:
    """One shape in `box` (pixel units of the final image) on a canvas `scale` times larger."""
    x0, y0, x1, y1 = (round(v * scale) for v in box)
    # Pillow's boxes include their last pixel: [x0, x1 - 1] covers exactly x1 - x0 pixels.
    if shape == "circle":
        draw.ellipse((x0, y0, x1 - 1, y1 - 1), fill=rgb)
    elif shape == "square":
        draw.rectangle((x0, y0, x1 - 1, y1 - 1), fill=rgb)
    else:
        draw.polygon([((x0 + x1 - 1) / 2, y0), (x1 - 1, y1 - 1), (x0, y1 - 1)], fill=rgb)


def render(scene: Scene, size: int = 64, generator: np.random.Generator | None = None) -> np.ndarray:
    """uint8 [size, size, 3]: a correct image of `scene`, its random layout and free colours drawn
    from `generator` (required: every random draw in diffrl is seeded, see diffrl.seeding)."""
    if not isinstance(scene, Scene):
        raise ValueError(f"render needs a Scene (parse_prompt(text) or Scene.from_dict(row)), got {scene!r}")
    if not isinstance(generator, np.random.Generator):
        raise ValueError(
            "render needs generator=numpy.random.Generator, e.g. diffrl.seeding.numpy_rng(seed, index); "
            f"got {generator!r}"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        raise ValueError(f"size={size!r} is invalid: use an integer >= {MIN_SIZE} (the toy model uses 32)")
    return draw_objects(layout(scene, size, generator), size)


def draw_objects(objects: Sequence[tuple[str, tuple[int, ...], Box]], size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the (shape, rgb, box in pixels) `objects` on the white background,
    drawn `SUPERSAMPLE` times larger and box-filtered down (what `render` draws for a layout)."""
    big = size * SUPERSAMPLE
    image = Image.new("RGB", (big, big), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for shape, rgb, box in objects:
        _draw(draw, shape, box, rgb, SUPERSAMPLE)
    return np.array(image.reduce(SUPERSAMPLE))


def render_batch(scenes: Sequence[Scene], size: int, seed: int) -> torch.Tensor:
    """uint8 [B, 3, size, size]; image i from its own generator `derive_seed(seed, i)`, so it does
    not depend on the batch it is in. Pass a seed derived for the purpose (e.g.
    `derive_seed(SFT_STREAM, seed, step)`) to keep streams apart."""
    if len(scenes) == 0:
        raise ValueError("render_batch needs at least one scene")
    images_BHW3 = np.stack(
        [render(s, size, np.random.default_rng(derive_seed(seed, i))) for i, s in enumerate(scenes)]
    )
    return torch.from_numpy(images_BHW3).permute(0, 3, 1, 2).contiguous()


# ------------------------------------------------------------------------------------ negatives
def corrupt(scene: Scene, generator: np.random.Generator) -> Scene:
    """A scene that violates `scene`'s prompt in one way: a kind of mistake drawn uniformly from those
    that apply to the category, then one instance of it.

    Every corruption is visible to a checker of the original prompt, whatever colours and layout the
    renderer draws: a different shape, count or colour, a missing or an extra object, the opposite
    relation (or the two objects swapped), or, for color_attr, the two colours swapped between the
    shapes (the classic attribute-binding error). The result is a valid scene of the grammar (possibly
    of another category), so it has a prompt too.
    """
    objs = scene.objects
    first = objs[0]

    def others(*used: str) -> list[str]:
        return [s for s in SHAPES if s not in used]

    kinds: dict[str, list[Scene]] = {}
    if scene.category == "single_object":
        kinds["shape"] = [Scene("single_object", (ObjectSpec(s),)) for s in others(first.shape)]
        kinds["extra"] = [Scene("counting", (ObjectSpec(first.shape, None, 2),))]
        kinds["extra"] += [Scene("two_objects", (first, ObjectSpec(s))) for s in others(first.shape)]
    elif scene.category == "two_objects":
        a, b = objs
        third = others(a.shape, b.shape)[0]
        kinds["missing"] = [Scene("single_object", (o,)) for o in objs]
        kinds["shape"] = [
            Scene("two_objects", (a, ObjectSpec(third))),
            Scene("two_objects", (ObjectSpec(third), b)),
            Scene("counting", (ObjectSpec(a.shape, None, 2),)),
            Scene("counting", (ObjectSpec(b.shape, None, 2),)),
        ]
    elif scene.category == "counting":
        n = first.count
        kinds["count"] = [
            Scene("counting", (replace(first, count=m),)) for m in (n - 1, n + 1) if 2 <= m <= MAX_COUNT
        ]
        if n == 2:
            kinds["count"].append(Scene("single_object", (ObjectSpec(first.shape),)))
        kinds["shape"] = [Scene("counting", (replace(first, shape=s),)) for s in others(first.shape)]
    elif scene.category == "colors":
        kinds["color"] = [Scene("colors", (replace(first, color=c),)) for c in PALETTE if c != first.color]
        kinds["shape"] = [Scene("colors", (replace(first, shape=s),)) for s in others(first.shape)]
        kinds["extra"] = [
            Scene("color_attr", (first, ObjectSpec(s, c)))
            for s in others(first.shape)
            for c in PALETTE
            if c != first.color
        ]
    elif scene.category == "position":
        a, b = objs
        assert scene.relation is not None
        third = others(a.shape, b.shape)[0]
        kinds["relation"] = [
            replace(scene, relation=MIRROR[scene.relation]),  # the opposite side
            Scene("position", (b, a), scene.relation),  # the two objects swapped
        ]
        kinds["shape"] = [
            Scene("position", (ObjectSpec(third), b), scene.relation),
            Scene("position", (a, ObjectSpec(third)), scene.relation),
        ]
        kinds["missing"] = [Scene("single_object", (o,)) for o in objs]
    else:  # color_attr
        a, b = objs
        assert a.color is not None and b.color is not None
        spare = [c for c in PALETTE if c not in (a.color, b.color)]
        third = others(a.shape, b.shape)[0]
        kinds["binding"] = [Scene("color_attr", (replace(a, color=b.color), replace(b, color=a.color)))]
        kinds["color"] = [Scene("color_attr", (replace(a, color=c), b)) for c in spare]
        kinds["color"] += [Scene("color_attr", (a, replace(b, color=c))) for c in spare]
        kinds["shape"] = [
            Scene("color_attr", (replace(a, shape=third), b)),
            Scene("color_attr", (a, replace(b, shape=third))),
        ]
        kinds["missing"] = [Scene("colors", (o,)) for o in objs]
    names = sorted(kinds)
    options = kinds[names[int(generator.integers(len(names)))]]
    return options[int(generator.integers(len(options)))]
