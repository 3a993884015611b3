"""Shapes edit task: edits and instructions by hand, the split rules, layouts, built-in files."""

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from PIL import Image

from diffrl.data import load_prompts
from diffrl.toy.edit import (
    BUILTIN_ROWS_PER_KIND,
    EDIT_KINDS,
    HELDOUT_RESHAPES,
    SOURCE_MAX_COS,
    Edit,
    EditExample,
    all_edits,
    builtin_edit_path,
    draw_example,
    edit_examples,
    edits,
    instructions,
    render_example,
    split_of_edit,
    write_edit_file,
)
from diffrl.toy.grammar import (
    HELDOUT_BINDINGS,
    MIRROR,
    PALETTE,
    RELATIONS,
    SHAPES,
    ObjectSpec,
    Scene,
    relation_holds,
)
from diffrl.toy.render import RENDER_MIN_COS


def _scene(*objects: tuple[str, str]) -> Scene:
    specs = tuple(ObjectSpec(s, c) for s, c in objects)
    return Scene("colors" if len(specs) == 1 else "color_attr", specs)


def test_edit_counts_by_hand():
    shapes, colours = len(SHAPES), len(PALETTE)
    singles, pairs = shapes * colours, 3 * colours * (colours - 1)  # unordered shape pairs
    counts = Counter(e.kind for e in all_edits())
    assert counts == {
        # one object: 4 new colours; two: each object, 3 colours neither has
        "recolor": singles * (colours - 1) + pairs * 2 * (colours - 2),
        # one object: 2 new shapes; two: each object into the one free shape
        "reshape": singles * 2 + pairs * 2,
        "add": singles * 2 * (colours - 1),  # a free shape in a colour the source lacks
        "remove": pairs * 2,
        "move": pairs * 2 * len(RELATIONS),
    }
    assert len(set(all_edits())) == len(all_edits())


def test_instructions_by_hand_and_the_split_rule():
    train, held = set(instructions("train")), set(instructions("heldout"))
    assert not train & held
    assert len(train | held) == 15 + 6 + 15 + 3 + 24
    assert held == {
        "make the circle green",
        "make the square yellow",
        "make the triangle purple",
        "add a green circle",
        "add a yellow square",
        "add a purple triangle",
        "turn the circle into a triangle",
        "turn the square into a circle",
        "remove the square",
        "move the circle left of the square",
        "move the square right of the circle",
        "move the circle above the triangle",
        "move the triangle below the circle",
        "move the triangle left of the square",
        "move the square right of the triangle",
    }
    for edit in all_edits():
        assert edit.instruction() in (held if split_of_edit(edit) == "heldout" else train)


def test_every_heldout_part_is_trained_in_other_compositions():
    train = edits("train")
    for kind in ("recolor", "add"):
        for colour, shape in HELDOUT_BINDINGS:
            assert any(e.kind == kind and e.value == colour for e in train)
            assert any(e.kind == kind and e.shape == shape for e in train)
    for a, b in HELDOUT_RESHAPES:
        assert any(e.kind == "reshape" and e.shape == a for e in train)
        assert any(e.kind == "reshape" and e.value == b for e in train)
    assert any(e.kind == "remove" and e.shape == "square" for e in edits("heldout"))
    assert {e.shape for e in train if e.kind == "remove"} == {"circle", "triangle"}
    assert {e.value for e in train if e.kind == "move"} == set(RELATIONS)
    assert {frozenset((e.shape, e.anchor)) for e in train if e.kind == "move"} == {
        frozenset(p) for p in itertools.combinations(SHAPES, 2)
    }
    # a held-out arrangement is held out in both phrasings
    for e in edits("heldout", "move"):
        mirror = Edit("move", e.source, e.anchor, MIRROR[e.value])
        assert split_of_edit(mirror) == "heldout"
    # every word of a held-out instruction is a word of the training instructions
    words = {w for text in instructions("train") for w in text.split()}
    assert {w for text in instructions("heldout") for w in text.split()} <= words


@pytest.mark.parametrize(
    "kind, source, shape, value, problem",
    [
        ("paint", _scene(("circle", "red")), "circle", "blue", "kind 'paint' is unknown"),
        ("recolor", _scene(("circle", "red")), "circle", "red", "no source object has"),
        ("recolor", _scene(("circle", "red"), ("square", "blue")), "circle", "blue", "no source object has"),
        ("recolor", _scene(("circle", "red")), "square", "blue", "the source has no square"),
        ("reshape", _scene(("circle", "red"), ("square", "blue")), "circle", "square", "no source object"),
        ("add", _scene(("circle", "red"), ("square", "blue")), "triangle", "green", "one-object source"),
        ("remove", _scene(("circle", "red")), "circle", None, "two-object source"),
        ("move", _scene(("circle", "red"), ("square", "blue")), "circle", "near", "a relation"),
        (
            "recolor",
            Scene("single_object", (ObjectSpec("circle"),)),
            "circle",
            "red",
            "every object coloured",
        ),
    ],
)
def test_invalid_edits_name_the_rule(kind, source, shape, value, problem):
    with pytest.raises(ValueError, match=problem):
        Edit(kind, source, shape, value)


def test_unordered_source_is_an_error():
    source = Scene("color_attr", (ObjectSpec("square", "blue"), ObjectSpec("circle", "red")))
    with pytest.raises(ValueError, match="shape order"):
        Edit("recolor", source, "circle", "green")


def test_targets_by_kind():
    two = _scene(("circle", "red"), ("square", "blue"))
    assert (
        Edit("recolor", two, "circle", "green").target_scene().to_prompt()
        == "a green circle and a blue square"
    )
    assert Edit("reshape", two, "square", "triangle").target_scene().to_prompt() == (
        "a red circle and a blue triangle"
    )
    assert Edit("remove", two, "circle").target_scene().to_prompt() == "a blue square"
    assert Edit("move", two, "square", "above").instruction() == "move the square above the circle"
    one = _scene(("square", "blue"))
    assert Edit("add", one, "circle", "red").target_scene() == two


def test_examples_keep_untouched_objects_exactly_and_draw_moves_clearly():
    for i, edit in enumerate(all_edits()[::7]):
        example = draw_example(edit, 32, np.random.default_rng(i))
        assert example == draw_example(edit, 32, np.random.default_rng(i))  # deterministic
        target = {p.shape: p for p in example.target}
        assert [(p.shape, p.color) for p in example.target] == [
            (o.shape, o.color) for o in edit.target_scene().objects
        ]
        for p in example.source:
            if p.shape != edit.shape and p.shape in target:  # untouched: same colour, same box
                assert target[p.shape] == p
        if edit.kind in ("recolor", "reshape"):
            named = next(p for p in example.source if p.shape == edit.shape)
            changed = next(p for p in example.target if p not in example.source)
            assert changed.box == named.box
        if edit.kind == "move":
            moved = {p.shape: p.box_px(32) for p in example.source}
            assert not relation_holds(edit.value, moved[edit.shape], moved[edit.anchor], SOURCE_MAX_COS)
            assert relation_holds(
                edit.value, target[edit.shape].box_px(32), target[edit.anchor].box_px(32), RENDER_MIN_COS
            )
        assert EditExample.from_dict(json.loads(json.dumps(example.to_dict()))) == example


def test_a_move_whose_source_layouts_rarely_suit_it_still_gets_a_layout():
    # "move the triangle above the square": ~91% of random sources of the pair do not suit a move
    # (the relation already holds, or no free place satisfies it); seed 12046 drew 100 unsuitable
    # ones in a row, which ended a GPU pretraining run (diffrl sft shapes_edit_sft) at its step 20.
    edit = Edit("move", _scene(("square", "green"), ("triangle", "purple")), "triangle", "above")
    example = draw_example(edit, 32, np.random.default_rng(12046))
    target = {p.shape: p.box_px(32) for p in example.target}
    assert relation_holds("above", target["triangle"], target["square"], RENDER_MIN_COS)


def test_from_dict_errors_name_the_layout():
    with pytest.raises(ValueError, match="expected a dict like"):
        EditExample.from_dict({"kind": "recolor"})
    good = edit_examples("train", 1)[0].to_dict()
    bad = {**good, "source": [{"shape": "circle", "color": "red", "box": [0.5, 0.5, 0.2, 0.9]}]}
    with pytest.raises(ValueError, match="0 <= x0 < x1 <= 1"):
        EditExample.from_dict(bad)
    with pytest.raises(ValueError, match="not a valid shapes edit"):
        EditExample.from_dict({**good, "kind": "remove", "value": None, "source": good["source"][:1]})


def test_builtin_files_equal_what_the_module_writes(tmp_path):
    for split in ("train", "heldout"):
        builtin = builtin_edit_path(split)
        written = write_edit_file(tmp_path / builtin.name, split, BUILTIN_ROWS_PER_KIND[split])
        assert builtin.read_text(encoding="utf-8") == written.read_text(encoding="utf-8"), (
            f"regenerate {builtin} with `python -m diffrl.toy.edit`"
        )
        rows = [json.loads(line) for line in builtin.read_text(encoding="utf-8").splitlines()]
        assert len(list((builtin.parent / builtin.stem).glob("*.png"))) == len(rows)
        for row in rows[::7]:  # the images: same pixels (PNG bytes may differ across zlib versions)
            ours = np.asarray(Image.open(builtin.parent / row["image"]))
            assert np.array_equal(ours, np.asarray(Image.open(tmp_path / row["image"]))), row["image"]


def test_builtin_rows_by_kind_split_and_source_image():
    for split in ("train", "heldout"):
        path = builtin_edit_path(split)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert Counter(r["data_source"] for r in rows) == {
            k: BUILTIN_ROWS_PER_KIND[split] for k in EDIT_KINDS
        }
        for row in rows:
            example = EditExample.from_dict(row["edit"])
            assert row["prompt"] == example.instruction()
            assert split_of_edit(example.edit) == split
            assert row["source_prompt"] == example.edit.source.to_prompt()
        for row in rows[:: len(rows) // 10]:
            source, _ = render_example(EditExample.from_dict(row["edit"]), 32)
            assert np.array_equal(np.asarray(Image.open(path.parent / row["image"])), source)
        records = load_prompts([str(path)], "prompt", "image")  # the condition images load
        assert len(records) == len(rows) and all(len(r.images) == 1 for r in records)
        assert (records[0].images[0].width, records[0].images[0].height) == (32, 32)
        assert records[0].metadata["edit"] == rows[0]["edit"]
