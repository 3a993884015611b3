"""Shapes-world grammar: scene counts by hand, prompt round trips, split rules, built-in files."""

import itertools
import json
from collections import Counter

import pytest

from diffrl.config import load_config
from diffrl.models.tiny_text import WORDS
from diffrl.toy import grammar
from diffrl.toy.grammar import (
    CATEGORIES,
    LARGE_BALANCED_ROWS,
    PALETTE,
    ObjectSpec,
    Scene,
    all_scenes,
    builtin_path,
    parse_prompt,
    prompt_rows,
    relation_holds,
    scenes,
    split_of,
    write_prompt_file,
)


def test_scene_counts_per_category_by_hand():
    counts = Counter(s.category for s in all_scenes())
    shapes, colours = 3, len(PALETTE)
    assert len(PALETTE) == 5
    assert counts == {
        "single_object": shapes,
        "two_objects": shapes * (shapes - 1),  # ordered pairs of distinct shapes
        "counting": shapes * 3,  # two, three, four
        "colors": shapes * colours,
        "position": shapes * (shapes - 1) * 4,  # x 4 relations
        "color_attr": shapes * (shapes - 1) * colours * (colours - 1),
    }
    assert len(all_scenes()) == 177
    assert len(set(all_scenes())) == 177  # all distinct
    assert all_scenes() == all_scenes()  # deterministic order


def test_prompts_are_english_and_known_words():
    prompts = {s.to_prompt() for s in all_scenes()}
    assert len(prompts) == 177  # one prompt per scene
    for expected in [
        "a triangle",
        "a circle and a square",
        "three triangles",
        "two circles",
        "four squares",
        "a blue square",
        "a circle left of a square",
        "a triangle below a circle",
        "a red circle and a blue square",
    ]:
        assert expected in prompts
    numbered = [p for p in prompts if p.split()[0] in ("two", "three", "four")]
    assert len(numbered) == 9 and all(p.endswith("s") for p in numbered)  # plural nouns
    vocabulary = set(WORDS)
    assert {w for p in prompts for w in p.split()} <= vocabulary  # one tokenizer token per word
    assert set(PALETTE) <= vocabulary


def test_parse_is_the_inverse_of_to_prompt_and_to_dict_round_trips():
    for scene in all_scenes():
        assert parse_prompt(scene.to_prompt()) == scene
        data = json.loads(json.dumps(scene.to_dict()))  # JSON-safe
        assert Scene.from_dict(data) == scene


@pytest.mark.parametrize(
    "text",
    [
        "A Photo of  a RED circle and a blue square.",
        "  a red   circle and a blue square ",
        "an image of a red circle and a blue square",
    ],
)
def test_parse_is_lenient_on_case_spaces_and_photo_prefix(text):
    assert parse_prompt(text) == Scene(
        "color_attr", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue"))
    )


@pytest.mark.parametrize(
    "text",
    [
        "a red circle left of a blue square",  # position prompts are uncoloured
        "a circle and a circle",  # two_objects needs distinct shapes
        "one circle",  # counting is two to four
        "five circles",
        "a orange circle",
        "three circle",
        "a cat",
    ],
)
def test_parse_rejects_text_outside_the_grammar_naming_it(text):
    with pytest.raises(ValueError, match="is not a shapes-world prompt") as info:
        parse_prompt(text)
    assert repr(text) in str(info.value)
    assert "a red circle and a blue square" in str(info.value)  # an example of a valid prompt


def test_parse_suggests_the_closest_prompt():
    with pytest.raises(ValueError, match="Did you mean 'three circles'"):
        parse_prompt("three circels")


@pytest.mark.parametrize(
    ("category", "objects", "relation", "message"),
    [
        ("counting", (ObjectSpec("circle", None, 1),), None, "count of 2..4"),
        ("single_object", (ObjectSpec("circle", "red"),), None, "colours are given exactly"),
        ("two_objects", (ObjectSpec("circle"), ObjectSpec("circle")), None, "shapes must differ"),
        ("position", (ObjectSpec("circle"), ObjectSpec("square")), None, "need one"),
        ("colors", (ObjectSpec("circle", "red"), ObjectSpec("square", "blue")), None, "1 object spec"),
        (
            "color_attr",
            (ObjectSpec("circle", "red"), ObjectSpec("square", "red")),
            None,
            "colours must differ",
        ),
        ("landscape", (ObjectSpec("circle"),), None, "category 'landscape' is unknown"),
    ],
)
def test_malformed_scenes_raise(category, objects, relation, message):
    with pytest.raises(ValueError, match=message):
        Scene(category, objects, relation)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"shape": "hexagon"}, "shape 'hexagon'"),
        ({"shape": "circle", "color": "orange"}, "colour 'orange'"),
        ({"shape": "circle", "count": 5}, "count 5"),
        ({"shape": "circle", "count": True}, "count True"),
    ],
)
def test_bad_object_specs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ObjectSpec(**kwargs)


def test_scene_objects_may_be_given_as_a_list():
    scene = Scene("colors", [ObjectSpec("circle", "red")])
    assert scene.objects == (ObjectSpec("circle", "red"),) and hash(scene) == hash(
        parse_prompt("a red circle")
    )
    with pytest.raises(ValueError, match="tuple of ObjectSpec"):
        Scene("colors", ({"shape": "circle", "color": "red"},))


def test_from_dict_rejects_malformed_data_with_the_layout():
    with pytest.raises(ValueError, match="expected a dict like"):
        Scene.from_dict({"category": "colors", "shapes": []})
    with pytest.raises(ValueError, match="not a shapes object"):
        Scene.from_dict({"category": "colors", "objects": [{"shape": "circle", "colour": "red"}]})
    with pytest.raises(ValueError, match="must be a dict"):
        Scene.from_dict("a red circle")


def test_split_sizes_disjoint_and_every_category_in_both():
    train, heldout = scenes("train"), scenes("heldout")
    assert not set(train) & set(heldout)
    assert set(train) | set(heldout) == set(all_scenes())
    per = {split: Counter(s.category for s in scenes(split)) for split in ("train", "heldout")}
    for category in CATEGORIES:
        assert per["train"][category] > 0 and per["heldout"][category] > 0
    assert per["heldout"] == {
        "single_object": 1,
        "two_objects": 2,
        "counting": 3,
        "colors": 3,
        "position": 6,
        "color_attr": 42,
    }
    assert 0.2 <= len(heldout) / len(all_scenes()) <= 0.35


def test_heldout_is_novel_compositions_of_seen_attributes():
    train, heldout = scenes("train"), scenes("heldout")

    def bindings(scene_list):
        return {(o.color, o.shape) for s in scene_list for o in s.objects if o.color}

    # No held-out colour-shape binding appears anywhere in training, yet every colour and shape does.
    assert bindings(heldout) - bindings(train) == set(grammar.HELDOUT_BINDINGS)
    assert not bindings(train) & set(grammar.HELDOUT_BINDINGS)
    assert {c for c, _ in bindings(train)} == set(PALETTE)
    assert {s for _, s in bindings(train)} == set(grammar.SHAPES)
    # Counting: every count and every shape is trained, but not the held-out combinations.
    counting_train = {(s.objects[0].shape, s.objects[0].count) for s in train if s.category == "counting"}
    assert {n for _, n in counting_train} == {2, 3, 4}
    assert {sh for sh, _ in counting_train} == set(grammar.SHAPES)
    # Position: a held-out layout is never trained under either phrasing; every relation word is.
    mirror = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}

    def layouts(scene_list):
        out = set()
        for s in scene_list:
            if s.category == "position":
                a, b = s.objects[0].shape, s.objects[1].shape
                out |= {(a, s.relation, b), (b, mirror[s.relation], a)}
        return out

    assert not layouts(train) & layouts(heldout)
    assert {s.relation for s in train if s.category == "position"} == set(grammar.RELATIONS)
    assert {s.relation for s in heldout if s.category == "position"} == set(grammar.RELATIONS)
    # Every held-out scene uses only shapes, colours and counts that training shows.
    assert all(split_of(s) == "heldout" for s in heldout)


def test_builtin_prompt_files_equal_what_the_grammar_writes(tmp_path):
    for split in ("train", "heldout"):
        written = write_prompt_file(tmp_path / f"{split}.jsonl", split)
        assert builtin_path(split).read_text(encoding="utf-8") == written.read_text(encoding="utf-8"), (
            f"regenerate {builtin_path(split)} with `python -m diffrl.toy.grammar`"
        )


def test_prompt_file_rows_load_with_category_as_data_source(tmp_path):
    from diffrl.data.prompts import load_prompts

    records = load_prompts(write_prompt_file(tmp_path / "heldout.jsonl", "heldout"))
    assert len(records) == 57
    for record in records:
        scene = Scene.from_dict(record.metadata["scene"])
        assert record.data_source == scene.category
        assert parse_prompt(record.prompt) == scene
    with pytest.raises(ValueError, match="split 'test' is unknown"):
        scenes("test")


def test_relation_rule_is_genevals():
    box = (0.0, 0.0, 10.0, 10.0)
    right = (20.0, 0.0, 30.0, 10.0)  # 20 px to the right, same row
    assert relation_holds("left of", box, right) and relation_holds("right of", right, box)
    assert not relation_holds("right of", box, right)
    assert not relation_holds("above", box, right) and not relation_holds("below", box, right)
    # At 45° both axes hold (cos 45° > 0.5, as in GenEval); steeply below, only "above" does.
    diagonal = (20.0, 20.0, 30.0, 30.0)
    assert relation_holds("left of", box, diagonal) and relation_holds("above", box, diagonal)
    steep = (8.0, 30.0, 18.0, 40.0)  # offset (-8, -30), shrunk by 2 px per axis: (-6, -28)
    assert relation_holds("above", box, steep) and not relation_holds("left of", box, steep)
    # Barely apart (centres 2 px apart, objects 10 px wide): the shrink says "no relation".
    assert not relation_holds("left of", box, (2.0, 0.0, 12.0, 10.0))
    with pytest.raises(ValueError, match="relation 'near'"):
        relation_holds("near", box, right)


def test_heldout_rules_name_real_scenes():
    # Each rule constant refers to grammar vocabulary (a typo would silently hold out nothing).
    assert all(c in PALETTE and s in grammar.SHAPES for c, s in grammar.HELDOUT_BINDINGS)
    assert all(s in grammar.SHAPES and 2 <= n <= 4 for s, n in grammar.HELDOUT_COUNTS)
    for a, rel, b in grammar.HELDOUT_LAYOUTS:
        Scene("position", (ObjectSpec(a), ObjectSpec(b)), rel)
    assert all(pair <= set(grammar.SHAPES) and len(pair) == 2 for pair in grammar.HELDOUT_TWO_OBJECTS)
    assert len(list(itertools.chain(grammar.HELDOUT_SINGLE))) == 1


def test_balanced_heldout_rows_and_builtin_file(tmp_path):
    from collections import Counter

    from diffrl.toy.grammar import BALANCED_ROWS, balanced_rows, prompt_rows

    rows = balanced_rows("heldout")
    counts = Counter(row["data_source"] for row in rows)
    assert counts == dict.fromkeys(CATEGORIES, BALANCED_ROWS)
    heldout = {row["prompt"] for row in prompt_rows("heldout")}
    assert {row["prompt"] for row in rows} <= heldout  # only held-out scenes
    by_category = {c: [r["prompt"] for r in rows if r["data_source"] == c] for c in CATEGORIES}
    assert set(by_category["single_object"]) == {"a square"}  # 1 scene, repeated 16 times
    assert len(set(by_category["counting"])) == 3  # 3 scenes, each 5 or 6 times
    assert len(set(by_category["color_attr"])) == BALANCED_ROWS  # 42 scenes: 16 distinct, spread
    written = write_prompt_file(tmp_path / "b.jsonl", "heldout", balanced=True)
    assert builtin_path("heldout", balanced=True).read_text(encoding="utf-8") == written.read_text(
        encoding="utf-8"
    )
    with pytest.raises(ValueError, match="per_category=0"):
        balanced_rows("heldout", 0)


def test_the_default_jobs_384_row_file_is_balanced_and_up_to_date(tmp_path):
    path = builtin_path("heldout", balanced=True, per_category=LARGE_BALANCED_ROWS)
    assert path.name == "shapes_heldout_balanced_384.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 384
    assert {c: sum(r["data_source"] == c for r in rows) for c in CATEGORIES} == dict.fromkeys(CATEGORIES, 64)
    assert {r["prompt"] for r in rows} <= {r["prompt"] for r in prompt_rows("heldout")}
    assert len({r["prompt"] for r in rows if r["data_source"] == "color_attr"}) == 42  # every one of them
    written = write_prompt_file(
        tmp_path / "b.jsonl", "heldout", balanced=True, per_category=LARGE_BALANCED_ROWS
    )
    assert path.read_text(encoding="utf-8") == written.read_text(encoding="utf-8"), (
        f"regenerate {path} with `python -m diffrl.toy.grammar`"
    )
    assert "builtin:shapes_heldout_balanced_384.jsonl" in load_config("default").data.val_files
