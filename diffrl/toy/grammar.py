"""The shapes world's prompt grammar: scenes, prompts, categories and the train / held-out split.

A miniature GenEval that needs no downloads. A `Scene` is what a prompt asks for: one or two kinds
of object (a shape, optionally a colour, a count) and optionally a spatial relation between them.
Six categories, as in GenEval:

| category       | example                            | scenes |
|----------------|------------------------------------|--------|
| single_object  | "a triangle"                       | 3      |
| colors         | "a blue square"                    | 15     |
| counting       | "three circles"                    | 9      |
| two_objects    | "a circle and a square"            | 6      |
| position       | "a circle left of a square"        | 24     |
| color_attr     | "a red circle and a blue square"   | 120    |

Shapes are circle, square, triangle; colours the five of `PALETTE`; counts one to four (counting
uses two to four); relations left of, right of, above, below (of the first object's centre
relative to the second's). Objects without a colour may have any palette colour; an image is
correct when it holds exactly the objects the prompt names and nothing else.

The held-out split is a set of novel *compositions* of attributes the train split shows
separately (`split_of`):

- colors and color_attr: the colour-shape pairs `HELD_OUT_PAIRS` (e.g. a red triangle); colors
  holds out those scenes, color_attr the scenes whose *first* object is such a pair, so the
  binding never appears first in a training prompt;
- counting: the (shape, count) pairs `HELD_OUT_COUNTS` (e.g. three circles);
- position: for the i-th ordered shape pair, relation i mod 4 (e.g. a square left of a circle);
- two_objects: the orders `HELD_OUT_PAIR_ORDERS` (e.g. "a square and a circle");
- single_object: "a triangle".

That is 57 of 177 scenes (32%); every category is in both splits, and the splits are disjoint.
The built-in prompt files `builtin:shapes_train.jsonl` / `builtin:shapes_heldout.jsonl` are
`write_prompt_file(path, split)`: one row per scene with its `data_source` (the category, so
validation reports accuracy per category) and the scene itself (`scene`, for the verifier).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (235, 200, 30),
    "purple": (150, 60, 190),
}
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
CATEGORIES = ("single_object", "colors", "counting", "two_objects", "position", "color_attr")
SPLITS = ("train", "heldout")

HELD_OUT_PAIRS = {
    ("red", "triangle"),
    ("green", "circle"),
    ("blue", "square"),
    ("yellow", "triangle"),
    ("purple", "circle"),
}
HELD_OUT_COUNTS = {("circle", 3), ("square", 4), ("triangle", 2)}
HELD_OUT_PAIR_ORDERS = {("square", "circle"), ("triangle", "square")}
HELD_OUT_SINGLE = {"triangle"}


@dataclass(frozen=True)
class ObjectSpec:
    """`count` objects of `shape`, all of `color` (None: any palette colour)."""

    shape: str
    color: str | None = None
    count: int = 1

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape {self.shape!r} is not one of {SHAPES}")
        if self.color is not None and self.color not in PALETTE:
            raise ValueError(f"colour {self.color!r} is not one of {tuple(PALETTE)}")
        if not 1 <= self.count <= 5:
            raise ValueError(f"count {self.count} must be in 1..5")

    def phrase(self) -> str:
        color = f"{self.color} " if self.color else ""
        if self.count == 1:
            return f"a {color}{self.shape}"
        return f"{NUMBER_WORDS[self.count]} {color}{self.shape}s"


@dataclass(frozen=True)
class Scene:
    """What a prompt asks for: objects and, for `position`, `relation` of objects[0] to objects[1]."""

    category: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category {self.category!r} is not one of {CATEGORIES}")
        if self.relation is not None and (self.relation not in RELATIONS or len(self.objects) != 2):
            raise ValueError(f"relation {self.relation!r} needs two objects and one of {RELATIONS}")

    def to_prompt(self) -> str:
        first = self.objects[0].phrase()
        if self.relation is not None:
            return f"{first} {self.relation} {self.objects[1].phrase()}"
        if len(self.objects) == 2:
            return f"{first} and {self.objects[1].phrase()}"
        return first

    def to_dict(self) -> dict[str, Any]:
        return {
            "category": self.category,
            "objects": [{"shape": o.shape, "color": o.color, "count": o.count} for o in self.objects],
            "relation": self.relation,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Scene:
        try:
            return Scene(
                category=data["category"],
                objects=tuple(
                    ObjectSpec(o["shape"], o.get("color"), int(o.get("count", 1))) for o in data["objects"]
                ),
                relation=data.get("relation"),
            )
        except (KeyError, TypeError) as err:
            raise ValueError(
                f"not a shapes scene: {data!r} ({err}); expected "
                '{"category": ..., "objects": [{"shape": ..., "color": ..., "count": ...}], "relation": ...}'
            ) from err


# ------------------------------------------------------------------------------------ parsing
_COLOR = "|".join(PALETTE)
_SHAPE = "|".join(SHAPES)
_NUMBER = "|".join(NUMBER_WORDS.values())
_RELATION = "|".join(RELATIONS)
_ONE = rf"an? (?:(?P<{{p}}c>{_COLOR}) )?(?P<{{p}}s>{_SHAPE})"
_PATTERNS = {
    "relation": re.compile(rf"^{_ONE.format(p='a')} (?P<rel>{_RELATION}) {_ONE.format(p='b')}$"),
    "pair": re.compile(rf"^{_ONE.format(p='a')} and {_ONE.format(p='b')}$"),
    "count": re.compile(rf"^(?P<n>{_NUMBER}) (?P<s>{_SHAPE})s$"),
    "single": re.compile(rf"^{_ONE.format(p='a')}$"),
}
_WORD_NUMBERS = {w: n for n, w in NUMBER_WORDS.items()}


def parse_prompt(text: str) -> Scene:
    """The scene a shapes prompt asks for; the inverse of `Scene.to_prompt`.

    Case, repeated spaces, a trailing full stop and a leading "a photo of" are ignored.
    """
    norm = " ".join(str(text).lower().replace(".", " ").split())
    norm = re.sub(r"^(an? )?(photo|picture|image) of ", "", norm)
    if m := _PATTERNS["count"].match(norm):
        return Scene("counting", (ObjectSpec(m["s"], None, _WORD_NUMBERS[m["n"]]),))
    for kind in ("relation", "pair", "single"):
        if m := _PATTERNS[kind].match(norm):
            a = ObjectSpec(m["as"], m["ac"])
            if kind == "single":
                return Scene("colors" if a.color else "single_object", (a,))
            b = ObjectSpec(m["bs"], m["bc"])
            if kind == "relation":
                return Scene("position", (a, b), m["rel"])
            return Scene("color_attr" if a.color or b.color else "two_objects", (a, b))
    raise ValueError(
        f"{text!r} is not a shapes-world prompt; examples: 'a blue square', 'three circles', "
        "'a circle left of a square', 'a red circle and a blue square' (shapes: "
        f"{', '.join(SHAPES)}; colours: {', '.join(PALETTE)})"
    )


# ------------------------------------------------------------------------------------ scenes
def all_scenes() -> list[Scene]:
    """Every scene of the grammar, in a fixed order (categories as in `CATEGORIES`)."""
    scenes = [Scene("single_object", (ObjectSpec(s),)) for s in SHAPES]
    scenes += [Scene("colors", (ObjectSpec(s, c),)) for c in PALETTE for s in SHAPES]
    scenes += [Scene("counting", (ObjectSpec(s, None, n),)) for s in SHAPES for n in (2, 3, 4)]
    pairs = list(itertools.permutations(SHAPES, 2))
    scenes += [Scene("two_objects", (ObjectSpec(a), ObjectSpec(b))) for a, b in pairs]
    scenes += [Scene("position", (ObjectSpec(a), ObjectSpec(b)), r) for a, b in pairs for r in RELATIONS]
    scenes += [
        Scene("color_attr", (ObjectSpec(a, ca), ObjectSpec(b, cb)))
        for a, b in pairs
        for ca, cb in itertools.permutations(PALETTE, 2)
    ]
    return scenes


def split_of(scene: Scene) -> str:
    """ "train" or "heldout" (the rule is in the module docstring)."""
    first = scene.objects[0]
    if scene.category == "single_object":
        held = first.shape in HELD_OUT_SINGLE
    elif scene.category in ("colors", "color_attr"):
        held = (first.color, first.shape) in HELD_OUT_PAIRS
    elif scene.category == "counting":
        held = (first.shape, first.count) in HELD_OUT_COUNTS
    elif scene.category == "two_objects":
        held = (first.shape, scene.objects[1].shape) in HELD_OUT_PAIR_ORDERS
    else:  # position
        pairs = list(itertools.permutations(SHAPES, 2))
        index = pairs.index((first.shape, scene.objects[1].shape))
        held = scene.relation == RELATIONS[index % len(RELATIONS)]
    return "heldout" if held else "train"


def scenes(split: str) -> list[Scene]:
    """The scenes of one split, in `all_scenes` order."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    return [s for s in all_scenes() if split_of(s) == split]


def prompt_rows(split: str) -> list[dict[str, Any]]:
    return [{"prompt": s.to_prompt(), "data_source": s.category, "scene": s.to_dict()} for s in scenes(split)]


def write_prompt_file(path: str | Path, split: str) -> Path:
    """A .jsonl prompt file of the split (what diffrl ships as builtin:shapes_<split>.jsonl)."""
    path = Path(path)
    path.write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(split)))
    return path


__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "PALETTE",
    "RELATIONS",
    "SHAPES",
    "ObjectSpec",
    "Scene",
    "all_scenes",
    "parse_prompt",
    "prompt_rows",
    "scenes",
    "split_of",
    "write_prompt_file",
]
