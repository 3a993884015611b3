"""The shapes world's edit task: a source scene, an instruction that changes one thing, the target.

An `Edit` is abstract, like a grammar `Scene`: a source scene (a `colors` or `color_attr` scene of
`diffrl.toy.grammar`, so every object has a shape and a colour, and the shapes differ) and one
change. Five kinds:

| kind      | instruction                        | source objects | target                                       |
|-----------|------------------------------------|----------------|----------------------------------------------|
| `recolor` | make the SHAPE COLOUR              | 1 or 2         | the object in place, in the new colour        |
| `reshape` | turn the SHAPE into a SHAPE        | 1 or 2         | the new shape in the old one's box and colour |
| `add`     | add a COLOUR SHAPE                 | 1              | the source plus the new object, anywhere free |
| `remove`  | remove the SHAPE                   | 2              | the other object alone, in place              |
| `move`    | move the SHAPE RELATION the SHAPE  | 2              | the named object moved so the relation holds; the other in place |

Every target is a grammar scene too (`Edit.target_scene`): recolour and add keep the two colours
different, reshape and add the two shapes. The instruction names objects by shape alone, which the
distinct shapes make unambiguous.

An `EditExample` is an edit with a concrete layout: the source and target objects (`Placed`: shape,
colour, box as fractions of the image side), drawn by `draw_example(edit, size, rng)` with the
renderer's layout rules (`diffrl.toy.render.layout` for the source, `free_box` for a new or moved
object), so `render_placed` draws both images. Objects that the edit does not touch keep their
boxes exactly. A `move` source is drawn so that the relation clearly does not hold before the edit
(`SOURCE_MAX_COS`), and the moved object keeps its size.

Train / held-out split (`split_of_edit`): held-out instructions are compositions of an edit kind
with an argument that training shows with the other kinds or other objects, reusing the
text-to-image world's held-out sets, so an edit model's held-out accuracy measures compositional
generalisation:

- `recolor` and `add`: the colour-shape bindings `HELDOUT_BINDINGS` ("make the circle green",
  "add a purple triangle"); each colour and each shape is trained with the others in both kinds.
- `reshape`: the (from, to) pairs `HELDOUT_RESHAPES` (circle -> triangle, square -> circle); every
  shape is trained as a source and as a result.
- `remove`: the shape `HELDOUT_SINGLE` ("remove the square"); squares are trained in every other kind.
- `move`: the arrangements `HELDOUT_LAYOUTS` in either phrasing ("move the circle left of the square",
  "move the square right of the circle"); every relation and every pair of shapes is trained.

15 of the 63 instructions are held out. The source scenes of both splits are drawn from all of
the grammar's coloured scenes: the split is over instructions, not images.

Prompt files (`edit_rows`, `write_edit_file`): `builtin:shapes_edit_train.jsonl` and
`builtin:shapes_edit_heldout.jsonl` hold rows {"prompt": instruction, "image": the source PNG,
"data_source": kind, "source_prompt", "edit": `EditExample.to_dict()`}, a fixed number per kind;
regenerate them with `python -m diffrl.toy.edit`.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from diffrl.seeding import EDIT_STREAM, numpy_rng
from diffrl.toy.grammar import (
    HELDOUT_BINDINGS,
    HELDOUT_LAYOUTS,
    HELDOUT_SINGLE,
    MIRROR,
    PALETTE,
    RELATIONS,
    SHAPES,
    SPLITS,
    Box,
    ObjectSpec,
    Scene,
    relation_holds,
)
from diffrl.toy.render import MIN_SIZE, RENDER_MIN_COS, draw_objects, free_box, layout, side_range

EDIT_KINDS: tuple[str, ...] = ("recolor", "reshape", "add", "remove", "move")
#: (from shape, to shape) reshapes held out.
HELDOUT_RESHAPES: frozenset[tuple[str, str]] = frozenset({("circle", "triangle"), ("square", "circle")})
#: A `move` source is redrawn while the relation holds at this cosine (the verifier's is 0.5), so the
#: unedited source fails the relation with a margin.
SOURCE_MAX_COS = 0.0
#: Image side the built-in files' source images have (the toy model's resolution).
EDIT_IMAGE_SIZE = 32
#: Rows per edit kind of the built-in files.
TRAIN_ROWS_PER_KIND = 48
HELDOUT_ROWS_PER_KIND = 32
# Source layouts drawn before an edit gives up. A move fails on up to 92% of random two-object
# sources at 32² (the relation already holds, or no free place satisfies it), so 100 tries left 1
# in ~20,000 examples without a layout, which a GPU pretraining of 512 rows a step reaches in its
# first minute; 1000 tries leave ~1e-36. Examples found within 100 tries are unchanged.
_EXAMPLE_TRIES = 1000
_COLOR_OF_RGB = {rgb: name for name, rgb in PALETTE.items()}


def _canonical(specs: Sequence[ObjectSpec]) -> tuple[ObjectSpec, ...]:
    return tuple(sorted(specs, key=lambda o: SHAPES.index(o.shape)))


def _scene_of(specs: Sequence[ObjectSpec]) -> Scene:
    """The coloured grammar scene of one or two distinct coloured objects, in `SHAPES` order."""
    specs = _canonical(specs)
    return Scene("colors" if len(specs) == 1 else "color_attr", specs)


@dataclass(frozen=True)
class Edit:
    """One change to a source scene (module docstring). `shape` is the object the instruction names
    (for `add`, the new object's shape); `value` the kind's argument: the new colour (`recolor`, and
    `add`'s new object), the new shape (`reshape`), the relation (`move`), None (`remove`)."""

    kind: str
    source: Scene
    shape: str
    value: str | None = None

    def __post_init__(self) -> None:
        problem = _edit_problem(self)
        if problem:
            raise ValueError(f"not a valid shapes edit ({problem}): {self!r}")

    def _object(self) -> ObjectSpec:
        return next(o for o in self.source.objects if o.shape == self.shape)

    @property
    def anchor(self) -> str | None:
        """`move`: the shape of the object that stays (the relation's second object)."""
        if self.kind != "move":
            return None
        return next(o.shape for o in self.source.objects if o.shape != self.shape)

    def instruction(self) -> str:
        if self.kind == "recolor":
            return f"make the {self.shape} {self.value}"
        if self.kind == "reshape":
            return f"turn the {self.shape} into a {self.value}"
        if self.kind == "add":
            return f"add a {self.value} {self.shape}"
        if self.kind == "remove":
            return f"remove the {self.shape}"
        return f"move the {self.shape} {self.value} the {self.anchor}"

    def target_scene(self) -> Scene:
        """The scene after the edit (positions aside: `move` keeps the source scene)."""
        objs = self.source.objects
        if self.kind == "recolor":
            return _scene_of([ObjectSpec(o.shape, self.value) if o.shape == self.shape else o for o in objs])
        if self.kind == "reshape":
            return _scene_of([ObjectSpec(self.value, o.color) if o.shape == self.shape else o for o in objs])
        if self.kind == "add":
            return _scene_of([*objs, ObjectSpec(self.shape, self.value)])
        if self.kind == "remove":
            return _scene_of([o for o in objs if o.shape != self.shape])
        return self.source

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "shape": self.shape, "value": self.value, "source": self.source.to_dict()}


def _edit_problem(edit: Edit) -> str | None:
    """Why `edit` is not a valid edit (the module docstring's table), or None."""
    if edit.kind not in EDIT_KINDS:
        return f"kind {edit.kind!r} is unknown: use one of {', '.join(EDIT_KINDS)}"
    source = edit.source
    if not isinstance(source, Scene) or source.category not in ("colors", "color_attr"):
        return "the source must be a colors or color_attr Scene (every object coloured)"
    if source.objects != _canonical(source.objects):
        return f"the source's objects must be in shape order {SHAPES}"
    shapes = [o.shape for o in source.objects]
    colors = [o.color for o in source.objects]
    if edit.shape not in SHAPES:
        return f"shape {edit.shape!r} is not one of {', '.join(SHAPES)}"
    if edit.kind == "add":
        if len(shapes) != 1 or edit.shape in shapes or edit.value not in PALETTE or edit.value in colors:
            return "add takes a one-object source and a new shape in a colour the source does not have"
        return None
    if edit.shape not in shapes:
        return f"the source has no {edit.shape}"
    if edit.kind == "recolor":
        if edit.value not in PALETTE or edit.value in colors:
            return "recolor needs a palette colour that no source object has"
    elif edit.kind == "reshape":
        if edit.value not in SHAPES or edit.value in shapes:
            return "reshape needs a shape that no source object has"
    elif edit.kind == "remove":
        if len(shapes) != 2 or edit.value is not None:
            return "remove takes a two-object source and no value"
    elif len(shapes) != 2 or edit.value not in RELATIONS:
        return f"move takes a two-object source and a relation ({', '.join(RELATIONS)})"
    return None


# ------------------------------------------------------------------------------------ the split
def split_of_edit(edit: Edit) -> str:
    """ "train" or "heldout": the rule in the module docstring."""
    if edit.kind in ("recolor", "add"):
        held = (edit.value, edit.shape) in HELDOUT_BINDINGS
    elif edit.kind == "reshape":
        held = (edit.shape, edit.value) in HELDOUT_RESHAPES
    elif edit.kind == "remove":
        held = edit.shape in HELDOUT_SINGLE
    else:
        a, rel, b = edit.shape, edit.value, edit.anchor
        held = (a, rel, b) in HELDOUT_LAYOUTS or (b, MIRROR[rel], a) in HELDOUT_LAYOUTS
    return "heldout" if held else "train"


@cache
def _all_edits() -> tuple[Edit, ...]:
    singles = [_scene_of([ObjectSpec(s, c)]) for s in SHAPES for c in PALETTE]
    pairs = [
        _scene_of([ObjectSpec(a, ca), ObjectSpec(b, cb)])
        for a, b in itertools.combinations(SHAPES, 2)
        for ca, cb in itertools.permutations(PALETTE, 2)
    ]
    candidates: list[tuple[str, Scene, str, str | None]] = []
    for source in singles + pairs:
        for obj in source.objects:
            candidates += [("recolor", source, obj.shape, c) for c in PALETTE]
            candidates += [("reshape", source, obj.shape, s) for s in SHAPES]
            candidates += [("remove", source, obj.shape, None)]
            candidates += [("move", source, obj.shape, r) for r in RELATIONS]
        candidates += [("add", source, s, c) for s in SHAPES for c in PALETTE]
    out = []
    for kind, source, shape, value in candidates:
        try:
            out.append(Edit(kind, source, shape, value))
        except ValueError:  # e.g. recolouring to the colour it has: not an edit
            continue
    return tuple(out)


def all_edits() -> list[Edit]:
    """Every edit of every coloured source scene, in a fixed order (grouped by source scene)."""
    return list(_all_edits())


def edits(split: str, kind: str | None = None) -> list[Edit]:
    """The edits of one split (and one kind), in `all_edits` order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: use one of {', '.join(SPLITS)}")
    if kind is not None and kind not in EDIT_KINDS:
        raise ValueError(f"edit kind {kind!r} is unknown: use one of {', '.join(EDIT_KINDS)}")
    return [e for e in _all_edits() if split_of_edit(e) == split and kind in (None, e.kind)]


def instructions(split: str) -> list[str]:
    """The distinct instructions of a split, in `all_edits` order of first appearance."""
    return list(dict.fromkeys(e.instruction() for e in edits(split)))


# ------------------------------------------------------------------------------------ layouts
@dataclass(frozen=True)
class Placed:
    """One drawn object: shape, palette colour name, box (x0, y0, x1, y1) in fractions of the image
    side, so a layout draws at any size."""

    shape: str
    color: str
    box: Box

    def box_px(self, size: int) -> Box:
        return (self.box[0] * size, self.box[1] * size, self.box[2] * size, self.box[3] * size)

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "color": self.color, "box": list(self.box)}


def _placed(shape: str, color: str, box_px: Box, size: int) -> Placed:
    return Placed(shape, color, tuple(round(v / size, 4) for v in box_px))  # type: ignore[arg-type]


@dataclass(frozen=True)
class EditExample:
    """An edit with a concrete layout: the source's and the target's objects (module docstring)."""

    edit: Edit
    source: tuple[Placed, ...]
    target: tuple[Placed, ...]

    def instruction(self) -> str:
        return self.edit.instruction()

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: {"kind", "shape", "value", "source": [Placed], "target": [Placed]} (the source
        scene is the source objects' shapes and colours)."""
        return {
            "kind": self.edit.kind,
            "shape": self.edit.shape,
            "value": self.edit.value,
            "source": [p.to_dict() for p in self.source],
            "target": [p.to_dict() for p in self.target],
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> EditExample:
        """The inverse of `to_dict`; a ValueError naming the data and the layout otherwise."""
        layout_text = (
            '{"kind": "recolor", "shape": "circle", "value": "red", "source": [{"shape": "circle", '
            '"color": "blue", "box": [0.1, 0.1, 0.4, 0.4]}], "target": [...]}'
        )
        if not isinstance(data, Mapping) or set(data) != {"kind", "shape", "value", "source", "target"}:
            raise ValueError(f"not a shapes edit: {data!r:.300}; expected a dict like {layout_text}")
        lists = []
        for key in ("source", "target"):
            objects = data[key]
            if not isinstance(objects, list) or (not objects and key == "source"):
                raise ValueError(f"shapes edit {key!r} must be a non-empty list of objects: {data!r:.300}")
            placed = []
            for obj in objects:
                box = obj.get("box") if isinstance(obj, Mapping) else None
                if (
                    set(obj or {}) != {"shape", "color", "box"}
                    or not isinstance(box, list | tuple)
                    or len(box) != 4
                    or not all(isinstance(v, int | float) and 0.0 <= v <= 1.0 for v in box)
                    or not (box[0] < box[2] and box[1] < box[3])
                ):
                    raise ValueError(
                        f"not a shapes edit object: {obj!r} (in {key!r} of {data!r:.200}); expected "
                        '{"shape": "circle", "color": "blue", "box": [x0, y0, x1, y1]} with 0 <= x0 < x1 <= 1'
                    )
                ObjectSpec(obj["shape"], obj["color"])  # checks the names
                placed.append(Placed(obj["shape"], obj["color"], tuple(float(v) for v in box)))
            lists.append(tuple(placed))
        source = _scene_of([ObjectSpec(p.shape, p.color) for p in lists[0]])
        return EditExample(Edit(data["kind"], source, data["shape"], data["value"]), *lists)


def draw_example(edit: Edit, size: int, rng: np.random.Generator) -> EditExample:
    """A concrete layout of `edit` at image side `size`: the source by the renderer's layout rules,
    the target from it (module docstring); every random choice from `rng`."""
    if not isinstance(edit, Edit):
        raise ValueError(f"draw_example needs an Edit, got {edit!r}")
    if isinstance(size, bool) or not isinstance(size, int) or size < MIN_SIZE:
        raise ValueError(f"size={size!r} is invalid: use an integer >= {MIN_SIZE} (the toy model uses 32)")
    for _ in range(_EXAMPLE_TRIES):
        source = [(shape, _COLOR_OF_RGB[rgb], box) for shape, rgb, box in layout(edit.source, size, rng)]
        target = _apply(edit, source, size, rng)
        if target is not None:
            order = lambda o: SHAPES.index(o[0])  # noqa: E731
            return EditExample(
                edit,
                tuple(_placed(*o, size) for o in sorted(source, key=order)),
                tuple(_placed(*o, size) for o in sorted(target, key=order)),
            )
    raise AssertionError(f"no layout found for {edit} at size {size} in {_EXAMPLE_TRIES} tries")


def _apply(
    edit: Edit, source: list[tuple[str, str, Box]], size: int, rng: np.random.Generator
) -> list[tuple[str, str, Box]] | None:
    """The target objects of `edit` on the source objects (pixels), or None when this source layout
    does not suit it (a move whose relation already holds, or no free place)."""
    named = next((o for o in source if o[0] == edit.shape), None)
    others = [o for o in source if o is not named]
    if edit.kind == "recolor":
        return [*others, (edit.shape, edit.value, named[2])]
    if edit.kind == "reshape":
        return [*others, (edit.value, named[1], named[2])]
    if edit.kind == "remove":
        return others
    if edit.kind == "add":
        box = free_box(float(rng.uniform(*side_range(size))), [o[2] for o in source], size, rng)
        return None if box is None else [*source, (edit.shape, edit.value, box)]
    (anchor,) = others
    if relation_holds(edit.value, named[2], anchor[2], SOURCE_MAX_COS):
        return None
    side = named[2][2] - named[2][0]
    box = free_box(
        side, [anchor[2]], size, rng, lambda b: relation_holds(edit.value, b, anchor[2], RENDER_MIN_COS)
    )
    return None if box is None else [anchor, (edit.shape, named[1], box)]


def render_placed(objects: Sequence[Placed], size: int) -> np.ndarray:
    """uint8 [size, size, 3]: the objects drawn as the renderer draws (`draw_objects`)."""
    return draw_objects([(o.shape, PALETTE[o.color], o.box_px(size)) for o in objects], size)


def render_example(example: EditExample, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, target) images, uint8 [size, size, 3] each."""
    return render_placed(example.source, size), render_placed(example.target, size)


# ------------------------------------------------------------------------------------ prompt files
def _picked(split: str, per_kind: int, seed: int) -> list[Edit]:
    """`per_kind` edits of every kind of the split: a seeded permutation of the kind's edits, from
    its start (repeated when the kind has fewer)."""
    picked = []
    for k, kind in enumerate(EDIT_KINDS):
        pool = edits(split, kind)
        order = numpy_rng(EDIT_STREAM, seed, 0, k).permutation(len(pool))
        picked += [pool[int(order[j % len(pool)])] for j in range(per_kind)]
    return picked


def edit_examples(split: str, per_kind: int, seed: int = 0, size: int = EDIT_IMAGE_SIZE) -> list[EditExample]:
    """The examples of a split's prompt file: `per_kind` per kind (`EDIT_KINDS` order), row i's
    layout drawn from `numpy_rng(EDIT_STREAM, seed, 1, i)`."""
    if per_kind < 1:
        raise ValueError(f"per_kind={per_kind}: an edit prompt file needs at least 1 row per kind")
    return [
        draw_example(edit, size, numpy_rng(EDIT_STREAM, seed, 1, i))
        for i, edit in enumerate(_picked(split, per_kind, seed))
    ]


def edit_row(example: EditExample, image: str) -> dict[str, Any]:
    """A prompt-file row: the instruction, the source image's path, the kind (`data_source`, so
    validation reports each kind), the source scene's prompt and the example."""
    return {
        "prompt": example.instruction(),
        "image": image,
        "data_source": example.edit.kind,
        "source_prompt": example.edit.source.to_prompt(),
        "edit": example.to_dict(),
    }


def write_edit_file(
    path: str | Path, split: str, per_kind: int, seed: int = 0, size: int = EDIT_IMAGE_SIZE
) -> Path:
    """Write the split's prompt file at `path` (.jsonl) and its source images as PNGs in the folder
    `<stem>/` beside it (rows name them relative to the file, as `data.image_key` expects)."""
    from PIL import Image

    path = Path(path)
    folder = path.parent / path.stem
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.png"):
        old.unlink()
    rows = []
    for i, example in enumerate(edit_examples(split, per_kind, seed, size)):
        name = f"{path.stem}/{i:03d}.png"
        Image.fromarray(render_placed(example.source, size)).save(path.parent / name, optimize=True)
        rows.append(edit_row(example, name))
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def builtin_edit_path(split: str) -> Path:
    """Where the built-in edit prompt file of `split` lives (its images in the folder of its stem)."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: use one of {', '.join(SPLITS)}")
    return (
        Path(__file__).resolve().parent.parent / "config" / "presets" / "data" / f"shapes_edit_{split}.jsonl"
    )


BUILTIN_ROWS_PER_KIND = {"train": TRAIN_ROWS_PER_KIND, "heldout": HELDOUT_ROWS_PER_KIND}

if __name__ == "__main__":  # regenerate the built-in edit prompt files
    for _split in SPLITS:
        print(write_edit_file(builtin_edit_path(_split), _split, BUILTIN_ROWS_PER_KIND[_split]))
