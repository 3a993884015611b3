"""The shapes world's prompt grammar: scenes, prompts, categories and the train / held-out split.

A miniature GenEval that needs no downloads. A `Scene` is what a prompt asks for: one or two kinds
of object (`ObjectSpec`: a shape, optionally a colour, a count) and, for `position`, a spatial
relation between them. Six categories, as in GenEval:

| category        | prompt form                              | example                           | scenes |
|-----------------|------------------------------------------|-----------------------------------|--------|
| `single_object` | a SHAPE                                  | "a triangle"                      | 3      |
| `two_objects`   | a SHAPE and a SHAPE (distinct)           | "a circle and a square"           | 6      |
| `counting`      | NUMBER SHAPEs (two to four)              | "three circles"                   | 9      |
| `colors`        | a COLOR SHAPE                            | "a blue square"                   | 15     |
| `position`      | a SHAPE RELATION a SHAPE (distinct)      | "a circle left of a square"       | 24     |
| `color_attr`    | a COLOR SHAPE and a COLOR SHAPE (both distinct) | "a red circle and a blue square" | 120 |

Shapes: circle, square, triangle. Colours: the five of `PALETTE` (saturated, far apart in RGB and
from the white background). Relations: left of, right of, above, below, of the first object
relative to the second. An object without a colour may have any palette colour. An image is correct
when it holds exactly the objects the prompt names and nothing else (so "three circles" means three
circles and no other object). Every word is one token of the toy model's tokenizer
(`diffrl.models.tiny_text.WORDS`).

Held-out split (`split_of`): novel *compositions* of attributes that the train split shows
separately, so held-out accuracy measures compositional generalisation, not memorisation:

- colour–shape bindings `HELDOUT_BINDINGS` (a green circle, a yellow square, a purple triangle):
  `colors` and `color_attr` scenes containing any of them are held out. The train split never
  shows these bindings in any prompt, though it shows every colour and every shape.
- (shape, count) pairs `HELDOUT_COUNTS` (two triangles, three squares, four circles): each count
  and each shape stays in training with the other shapes / counts.
- layouts `HELDOUT_LAYOUTS` (a circle left of a square, a circle above a triangle, a triangle left of
  a square), each with its mirror phrasing (a square right of a circle, ...), so the held-out
  arrangement is never seen in training under either wording; every relation word and every shape
  pair stays in training.
- the pair {circle, triangle} in `two_objects`, in both orders (the two shapes appear together in
  training only in `position` and `color_attr`).
- `single_object` has nothing to compose, but every category must be in both splits: "a square" is
  held out (squares appear in training in every other category).

That is 57 of the 177 scenes (32%): single_object 1/3, two_objects 2/6, counting 3/9, colors 3/15,
position 6/24, color_attr 42/120. The splits are disjoint and each has every category.

The built-in prompt files `builtin:shapes_train.jsonl` and `builtin:shapes_heldout.jsonl` are
`write_prompt_file(path, split)`, one row per scene: `prompt`, `data_source` (the category, so
validation reports accuracy per category) and `scene` (`Scene.to_dict()`, what the verifier and the
renderer read). Regenerate them with `python -m diffrl.toy.grammar`.
"""

from __future__ import annotations

import difflib
import itertools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

#: Colour name -> RGB. Saturated and far apart (every pair > 130 apart in RGB, every colour > 240
#: from white), so the verifier tells them apart in blurred, noisy generated images.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (240, 200, 20),
    "purple": (160, 40, 200),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
RELATIONS: tuple[str, ...] = ("left of", "right of", "above", "below")
#: The relation that says the same with the two objects swapped ("A left of B" = "B right of A").
MIRROR: dict[str, str] = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}
NUMBER_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_COUNT = 4
CATEGORIES: tuple[str, ...] = ("single_object", "two_objects", "counting", "colors", "position", "color_attr")
SPLITS: tuple[str, ...] = ("train", "heldout")

HELDOUT_BINDINGS: frozenset[tuple[str, str]] = frozenset(
    {("green", "circle"), ("yellow", "square"), ("purple", "triangle")}
)
HELDOUT_COUNTS: frozenset[tuple[str, int]] = frozenset({("triangle", 2), ("square", 3), ("circle", 4)})
#: (first shape, relation, second shape); the mirror phrasing of each is held out too.
HELDOUT_LAYOUTS: frozenset[tuple[str, str, str]] = frozenset(
    {("circle", "left of", "square"), ("circle", "above", "triangle"), ("triangle", "left of", "square")}
)
HELDOUT_TWO_OBJECTS: frozenset[frozenset[str]] = frozenset({frozenset({"circle", "triangle"})})
HELDOUT_SINGLE: frozenset[str] = frozenset({"square"})

_EXAMPLE = "a red circle and a blue square"


@dataclass(frozen=True)
class ObjectSpec:
    """`count` objects of `shape`, all of colour `color` (None: each any palette colour)."""

    shape: str
    color: str | None = None
    count: int = 1

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(
                f"shape {self.shape!r} is not a shapes-world shape: use one of {', '.join(SHAPES)}"
            )
        if self.color is not None and self.color not in PALETTE:
            raise ValueError(
                f"colour {self.color!r} is not in the palette: use one of {', '.join(PALETTE)}, or None"
            )
        if (
            isinstance(self.count, bool)
            or not isinstance(self.count, int)
            or not 1 <= self.count <= MAX_COUNT
        ):
            raise ValueError(f"count {self.count!r} is invalid: use an integer in 1..{MAX_COUNT}")

    def phrase(self) -> str:
        """'a red circle', 'a square', 'three triangles'."""
        color = f"{self.color} " if self.color else ""
        if self.count == 1:
            return f"a {color}{self.shape}"
        return f"{NUMBER_WORDS[self.count]} {color}{self.shape}s"

    def to_dict(self) -> dict[str, Any]:
        return {"shape": self.shape, "color": self.color, "count": self.count}


@dataclass(frozen=True)
class Scene:
    """What a prompt asks for: the objects and, for `position`, `relation` of objects[0] to objects[1].

    Construction checks that the scene has its category's form (the table in the module docstring);
    a malformed scene raises ValueError naming the rule it breaks.
    """

    category: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category {self.category!r} is unknown: use one of {', '.join(CATEGORIES)}")
        if isinstance(self.objects, list):  # accept a list; store a tuple (hashable, immutable)
            object.__setattr__(self, "objects", tuple(self.objects))
        if not isinstance(self.objects, tuple) or not all(isinstance(o, ObjectSpec) for o in self.objects):
            raise ValueError(f"Scene.objects must be a tuple of ObjectSpec, got {self.objects!r}")
        if self.relation is not None and self.relation not in RELATIONS:
            raise ValueError(f"relation {self.relation!r} is unknown: use one of {', '.join(RELATIONS)}")
        problem = _form_problem(self)
        if problem:
            raise ValueError(f"not a valid {self.category} scene ({problem}): {self!r}")

    @property
    def n_objects(self) -> int:
        """How many objects a correct image holds."""
        return sum(o.count for o in self.objects)

    def to_prompt(self) -> str:
        first = self.objects[0].phrase()
        if self.relation is not None:
            return f"{first} {self.relation} {self.objects[1].phrase()}"
        if len(self.objects) == 2:
            return f"{first} and {self.objects[1].phrase()}"
        return first

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe: {"category", "objects": [{"shape", "color", "count"}], "relation"}."""
        return {
            "category": self.category,
            "objects": [o.to_dict() for o in self.objects],
            "relation": self.relation,
        }

    @staticmethod
    def from_dict(data: Mapping[str, Any]) -> Scene:
        """The inverse of `to_dict`; ValueError naming the data and the expected layout otherwise."""
        layout = (
            '{"category": "colors", "objects": [{"shape": "square", "color": "blue", "count": 1}], '
            '"relation": null}'
        )
        if not isinstance(data, Mapping):
            raise ValueError(
                f"a shapes scene must be a dict like {layout}, got {type(data).__name__}: {data!r}"
            )
        unknown = set(data) - {"category", "objects", "relation"}
        objects = data.get("objects")
        if unknown or "category" not in data or not isinstance(objects, list | tuple):
            raise ValueError(f"not a shapes scene: {data!r}; expected a dict like {layout}")
        specs = []
        for obj in objects:
            if not isinstance(obj, Mapping) or "shape" not in obj or set(obj) - {"shape", "color", "count"}:
                raise ValueError(
                    f"not a shapes object: {obj!r} (in scene {data!r}); expected a dict like {layout}"
                )
            specs.append(ObjectSpec(obj["shape"], obj.get("color"), obj.get("count", 1)))
        return Scene(data["category"], tuple(specs), data.get("relation"))


def _form_problem(scene: Scene) -> str | None:
    """Why `scene` does not have its category's form, or None when it does."""
    objs, category = scene.objects, scene.category
    two = category in ("two_objects", "position", "color_attr")
    if len(objs) != (2 if two else 1):
        return f"it needs {2 if two else 1} object spec(s), got {len(objs)}"
    if (scene.relation is not None) != (category == "position"):
        return "only position scenes have a relation, and they need one"
    if category == "counting":
        if not 2 <= objs[0].count <= MAX_COUNT:
            return f"counting needs a count of 2..{MAX_COUNT}"
    elif any(o.count != 1 for o in objs):
        return "every object count must be 1 outside counting"
    coloured = category in ("colors", "color_attr")
    if any((o.color is not None) != coloured for o in objs):
        return "colours are given exactly in colors and color_attr"
    if two and objs[0].shape == objs[1].shape:
        return "the two shapes must differ"
    if category == "color_attr" and objs[0].color == objs[1].color:
        return "the two colours must differ"
    return None


# ---------------------------------------------------------------------------------- relations
#: GenEval's rule: centre offsets shrink by this fraction of the two objects' summed extent first.
RELATION_SHRINK = 0.1
#: A relation holds when the shrunk offset points along its axis within acos(0.5) = 60°.
RELATION_MIN_COS = 0.5
_AXIS_SIGN = {"left of": (0, -1.0), "right of": (0, 1.0), "above": (1, -1.0), "below": (1, 1.0)}

Box = tuple[float, float, float, float]  # x0, y0, x1, y1 in pixels (x1, y1 exclusive); y grows down


def relation_holds(relation: str, box_a: Box, box_b: Box, min_cos: float = RELATION_MIN_COS) -> bool:
    """Whether the object in `box_a` is `relation` the object in `box_b` (GenEval's position rule).

    offset = centre(a) - centre(b), each axis shrunk towards 0 by RELATION_SHRINK x (extent of a +
    extent of b) along it (objects must be apart, not just off-centre); the relation holds when the
    shrunk offset, divided by the length of the raw offset, has a component > `min_cos` along the
    relation's direction. The renderer draws with a stricter `min_cos` so its layouts hold with a
    clear margin.
    """
    if relation not in _AXIS_SIGN:
        raise ValueError(f"relation {relation!r} is unknown: use one of {', '.join(RELATIONS)}")
    offset, shrunk = [], []
    for axis in (0, 1):
        lo, hi = axis, axis + 2
        delta = (box_a[lo] + box_a[hi]) / 2 - (box_b[lo] + box_b[hi]) / 2
        extent = (box_a[hi] - box_a[lo]) + (box_b[hi] - box_b[lo])
        offset.append(delta)
        shrunk.append(max(abs(delta) - RELATION_SHRINK * extent, 0.0) * (1.0 if delta >= 0 else -1.0))
    norm = (offset[0] ** 2 + offset[1] ** 2) ** 0.5
    if norm == 0.0:
        return False
    axis, sign = _AXIS_SIGN[relation]
    return sign * shrunk[axis] / norm > min_cos


# ------------------------------------------------------------------------------------ scenes
@cache
def _all_scenes() -> tuple[Scene, ...]:
    pairs = list(itertools.permutations(SHAPES, 2))
    out = [Scene("single_object", (ObjectSpec(s),)) for s in SHAPES]
    out += [Scene("two_objects", (ObjectSpec(a), ObjectSpec(b))) for a, b in pairs]
    out += [Scene("counting", (ObjectSpec(s, None, n),)) for s in SHAPES for n in range(2, MAX_COUNT + 1)]
    out += [Scene("colors", (ObjectSpec(s, c),)) for c in PALETTE for s in SHAPES]
    out += [Scene("position", (ObjectSpec(a), ObjectSpec(b)), r) for a, b in pairs for r in RELATIONS]
    out += [
        Scene("color_attr", (ObjectSpec(a, ca), ObjectSpec(b, cb)))
        for a, b in pairs
        for ca, cb in itertools.permutations(PALETTE, 2)
    ]
    return tuple(out)


def all_scenes() -> list[Scene]:
    """Every scene of the grammar, in a fixed order: categories as in `CATEGORIES`, then shapes,
    counts, colours and relations in their declared order."""
    return list(_all_scenes())


def split_of(scene: Scene) -> str:
    """ "train" or "heldout" (the rule is in the module docstring)."""
    objs = scene.objects
    if scene.category == "single_object":
        held = objs[0].shape in HELDOUT_SINGLE
    elif scene.category == "two_objects":
        held = frozenset(o.shape for o in objs) in HELDOUT_TWO_OBJECTS
    elif scene.category == "counting":
        held = (objs[0].shape, objs[0].count) in HELDOUT_COUNTS
    elif scene.category == "position":
        a, b, rel = objs[0].shape, objs[1].shape, scene.relation
        assert rel is not None
        held = (a, rel, b) in HELDOUT_LAYOUTS or (b, MIRROR[rel], a) in HELDOUT_LAYOUTS
    else:  # colors, color_attr
        held = any((o.color, o.shape) in HELDOUT_BINDINGS for o in objs)
    return "heldout" if held else "train"


def scenes(split: str) -> list[Scene]:
    """The scenes of one split, in `all_scenes` order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is unknown: use one of {', '.join(SPLITS)}")
    return [s for s in _all_scenes() if split_of(s) == split]


def prompt_rows(split: str) -> list[dict[str, Any]]:
    """The rows of the split's prompt file: {"prompt", "data_source": category, "scene"}."""
    return [{"prompt": s.to_prompt(), "data_source": s.category, "scene": s.to_dict()} for s in scenes(split)]


#: Rows per category of the balanced held-out file (builtin:shapes_heldout_balanced.jsonl).
BALANCED_ROWS = 16
#: Rows per category of the larger balanced held-out file the default job validates on
#: (builtin:shapes_heldout_balanced_384.jsonl): a standard error of ~0.025 on `val/accuracy`.
LARGE_BALANCED_ROWS = 64


def balanced_rows(split: str, per_category: int = BALANCED_ROWS) -> list[dict[str, Any]]:
    """`per_category` rows of every category of the split, for a validation whose mean over
    categories has the same precision in each: with one sample per row, `val/accuracy`'s standard
    error is at most 0.5 / sqrt(per_category × 6). A category with fewer scenes repeats them (each
    row is sampled from its own noise); one with more takes `per_category` spread evenly over its
    scenes in `scenes(split)` order."""
    if per_category < 1:
        raise ValueError(
            f"per_category={per_category}: a balanced prompt file needs at least 1 row per category"
        )
    rows = []
    for category in CATEGORIES:
        members = [row for row in prompt_rows(split) if row["data_source"] == category]
        count = len(members)
        picks = [
            j * count // per_category if per_category <= count else j % count for j in range(per_category)
        ]
        rows.extend(members[i] for i in picks)
    return rows


def write_prompt_file(
    path: str | Path, split: str, *, balanced: bool = False, per_category: int = BALANCED_ROWS
) -> Path:
    """Write the split's .jsonl prompt file (what diffrl ships as builtin:shapes_<split>.jsonl), or
    with `balanced` its `balanced_rows(split, per_category)` (builtin:shapes_<split>_balanced.jsonl,
    or with `LARGE_BALANCED_ROWS` per category builtin:shapes_<split>_balanced_384.jsonl)."""
    path = Path(path)
    rows = balanced_rows(split, per_category) if balanced else prompt_rows(split)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------ parsing
@cache
def _prompt_table() -> dict[str, Scene]:
    return {s.to_prompt(): s for s in _all_scenes()}


_PREFIX = re.compile(r"^(?:an? )?(?:photo|picture|image) of ")


def normalise_prompt(text: str) -> str:
    """Lower case, single spaces, no trailing full stop, no leading 'a photo of'."""
    norm = " ".join(text.lower().split()).rstrip(".").strip()
    return _PREFIX.sub("", norm)


def parse_prompt(text: str) -> Scene:
    """The scene a shapes prompt asks for: the exact inverse of `Scene.to_prompt` over `all_scenes()`.

    Lenient on case, repeated spaces, a trailing full stop and a leading "a photo of" (or "an image
    of", "a picture of"). A prompt outside the grammar raises ValueError naming it, the closest
    valid prompt and an example.
    """
    if not isinstance(text, str):
        raise ValueError(f"a shapes prompt must be a string, got {type(text).__name__}: {text!r}")
    table = _prompt_table()
    scene = table.get(normalise_prompt(text))
    if scene is not None:
        return scene
    close = difflib.get_close_matches(normalise_prompt(text), list(table), n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    raise ValueError(
        f"{text!r} is not a shapes-world prompt.{hint} Valid prompts look like {_EXAMPLE!r}, "
        "'three circles' or 'a circle left of a square' (shapes: "
        f"{', '.join(SHAPES)}; colours: {', '.join(PALETTE)}; docs/shapes.md lists the grammar)"
    )


def builtin_path(split: str, *, balanced: bool = False, per_category: int = BALANCED_ROWS) -> Path:
    """Where the built-in prompt file of `split` (or a balanced version) lives in the package: a
    balanced file other than the `BALANCED_ROWS` one is named by its number of rows."""
    if not balanced:
        name = f"shapes_{split}.jsonl"
    elif per_category == BALANCED_ROWS:
        name = f"shapes_{split}_balanced.jsonl"
    else:
        name = f"shapes_{split}_balanced_{per_category * len(CATEGORIES)}.jsonl"
    return Path(__file__).resolve().parent.parent / "config" / "presets" / "data" / name


if __name__ == "__main__":  # regenerate the built-in prompt files
    for _split in SPLITS:
        print(write_prompt_file(builtin_path(_split), _split))
    for _rows in (BALANCED_ROWS, LARGE_BALANCED_ROWS):
        _path = builtin_path("heldout", balanced=True, per_category=_rows)
        print(write_prompt_file(_path, "heldout", balanced=True, per_category=_rows))
