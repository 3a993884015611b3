"""benchmarks/shapes_layouts.py: the prompt groups follow the split's rules, the classifier agrees
with the renderer's ground truth, and the script's main path runs on a tiny CPU sample."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import shapes_layouts as sl

from diffrl.toy.grammar import parse_prompt, split_of
from diffrl.toy.render import render


def test_groups_are_the_heldout_layouts_and_the_trained_arrangements_of_the_same_pairs():
    groups = sl.prompt_groups()
    heldout, trained = groups["heldout"], groups["trained"]
    assert len(heldout) == 6 and all(split_of(s) == "heldout" for s in heldout)
    assert len(trained) == 6 and all(split_of(s) == "train" for s in trained)
    heldout_layouts = {sl.layout(s) for s in heldout}
    # every trained prompt shows the other arrangement of a held-out pair: the held-out layout swapped
    assert {sl.layout(s) for s in trained} == {(axis, b, a) for axis, a, b in heldout_layouts}
    assert sl.layout(parse_prompt("a square right of a circle")) == ("H", "circle", "square")
    assert sl.layout(parse_prompt("a triangle below a circle")) == ("V", "circle", "triangle")


@pytest.mark.parametrize(
    "drawn, expected",
    [
        ("a circle left of a square", "asked"),
        ("a square right of a circle", "asked"),  # the same layout in the mirror phrasing
        ("a square left of a circle", "swapped"),
        ("a circle above a square", "neither"),
        ("a circle and a triangle", "other"),
        ("three circles", "other"),
    ],
)
def test_classify_matches_what_was_drawn(drawn, expected):
    scene = parse_prompt("a circle left of a square")
    for seed in range(5):
        image = render(parse_prompt(drawn), size=32, generator=np.random.default_rng(seed))
        assert sl.classify(image, scene) == expected, f"{drawn!r}, seed {seed}"


def test_main_counts_every_image(tmp_path):
    result = sl.main(["--n", "2", "--steps", "2", "--device", "cpu", "--out", str(tmp_path)])
    for group in ("heldout", "trained"):
        total = result[group]["total"]
        assert total["images"] == 6 * 2
        assert total["asked"] + total["swapped"] + total["neither"] + total["other"] == total["images"]
        assert total["two_shapes"] == total["images"] - total["other"]
    assert len(list(tmp_path.glob("*.png"))) == 24
