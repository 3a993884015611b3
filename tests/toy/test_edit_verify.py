"""The shapes edit verifier against rendered ground truth: targets pass, sources and wrong edits fail."""

from collections import defaultdict
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffrl.toy.edit import EDIT_KINDS, EditExample, Placed, edit_examples, render_placed
from diffrl.toy.edit_verify import edit_check_names, verify_edit, verify_edit_batch
from diffrl.toy.grammar import PALETTE, SHAPES, relation_holds
from diffrl.toy.render import free_box

EXAMPLES = edit_examples("train", 24) + edit_examples("heldout", 16)


def _pixels(object_lists, size: int) -> torch.Tensor:
    return torch.stack([torch.from_numpy(render_placed(o, size)).permute(2, 0, 1) for o in object_lists])


def _wrong_target(example: EditExample, rng: np.random.Generator) -> tuple[Placed, ...] | None:
    """A plausible wrong result: the wrong colour, the wrong object, a move elsewhere."""
    edit, source, target = example.edit, list(example.source), list(example.target)
    named = next((p for p in source if p.shape == edit.shape), None)
    if edit.kind in ("recolor", "add"):
        used = {edit.value, *(p.color for p in source)}
        colour = next(c for c in PALETTE if c not in used)
        return tuple(replace(p, color=colour) if p.shape == edit.shape else p for p in target)
    if edit.kind == "reshape":
        if len(source) == 1:
            other = next(s for s in SHAPES if s not in (named.shape, edit.value))
            return (replace(named, shape=other),)
        return tuple(replace(p, shape=edit.value) if p is not named else p for p in source)  # the other one
    if edit.kind == "remove":
        return (named,)  # removes the other object
    anchor = next(p for p in source if p is not named)
    side = named.box_px(32)[2] - named.box_px(32)[0]
    wrong_place = lambda b: not relation_holds(edit.value, b, anchor.box_px(32), 0.0)  # noqa: E731
    box = free_box(side, [anchor.box_px(32)], 32, rng, wrong_place)
    if box is None:
        return None
    return (anchor, Placed(named.shape, named.color, tuple(v / 32 for v in box)))  # moved, not as asked


@pytest.mark.parametrize("size", [32, 64])
def test_rendered_target_scores_one_and_the_unedited_source_zero(size):
    targets = verify_edit_batch(_pixels([e.target for e in EXAMPLES], size), EXAMPLES)
    sources = verify_edit_batch(_pixels([e.source for e in EXAMPLES], size), EXAMPLES)
    for example, good, copy in zip(EXAMPLES, targets, sources, strict=True):
        assert good.correct and good.score == 1.0, (example.instruction(), good.detail["checks"])
        assert not copy.correct and copy.score == 0.0, (example.instruction(), copy.detail["checks"])
        assert copy.detail["keep"] == 1.0 and copy.detail["edit"] == 0.0  # nothing done, nothing broken


def test_wrong_edits_score_low():
    rng = np.random.default_rng(0)
    pairs = [(e, w) for e in EXAMPLES if (w := _wrong_target(e, rng)) is not None]
    assert len(pairs) > 0.9 * len(EXAMPLES) and {e.edit.kind for e, _ in pairs} == set(EDIT_KINDS)
    verdicts = verify_edit_batch(_pixels([w for _, w in pairs], 32), [e for e, _ in pairs])
    scores = defaultdict(list)
    for (example, _), verdict in zip(pairs, verdicts, strict=True):
        assert not verdict.correct, (example.instruction(), verdict.detail["checks"])
        scores[example.edit.kind].append(verdict.score)
    # the wrong colour, the wrong object removed, a move that misses the relation: nothing of the
    # change is right, so 0 whatever was kept
    for kind in ("recolor", "remove", "move"):
        assert scores[kind] == [0.0] * len(scores[kind]), kind
    # a reshape of the wrong object: only the new shape's count holds of the change (1/3), and the
    # object that should have stayed is gone: at most 1/3 x 1/4
    assert max(scores["reshape"]) <= 1 / 12 + 1e-6
    # an added object of the right shape in the wrong colour: 2 of the 3 edit checks
    assert scores["add"] == pytest.approx([2 / 3] * len(scores["add"]))


def test_a_right_edit_that_moves_another_object_loses_the_keep_share():
    example = next(e for e in EXAMPLES if e.edit.kind == "recolor" and len(e.source) == 2)
    other = next(p for p in example.target if p.shape != example.edit.shape)
    named = next(p for p in example.target if p.shape == example.edit.shape)
    # move the untouched object to the far side of the image, away from the edited one
    width = other.box[2] - other.box[0]
    x0 = 0.02 if named.box[0] > 0.5 else 0.97 - width
    y0 = 0.02 if named.box[1] > 0.5 else 0.97 - width
    moved = replace(other, box=(x0, y0, x0 + width, y0 + width))
    verdict = verify_edit(render_placed((named, moved), 32), example)
    assert verdict.detail["checks"][f"place:{other.shape}"] is False
    assert verdict.detail["edit"] == 1.0 and 0.5 < verdict.score < 1.0
    assert not verdict.correct


def test_edit_checks_per_kind():
    by_kind = {e.edit.kind: e for e in EXAMPLES if len(e.source) == 2 or e.edit.kind == "add"}
    names = {kind: edit_check_names(example, 32) for kind, example in by_kind.items()}
    recolor = by_kind["recolor"].edit
    assert names["recolor"] == [f"color:{recolor.value} {recolor.shape}"]
    reshape = by_kind["reshape"].edit
    assert set(names["reshape"]) == {
        f"count:{reshape.value}",
        f"color:{_colour(by_kind['reshape'])} {reshape.value}",
        f"place:{reshape.value}",
    }
    add = by_kind["add"].edit
    assert set(names["add"]) == {f"count:{add.shape}", f"color:{add.value} {add.shape}", "no_extra"}
    assert names["remove"] == ["no_extra"]
    assert names["move"] == ["relation"]


def _colour(example: EditExample) -> str:
    return next(p.color for p in example.source if p.shape == example.edit.shape)


def test_blur_and_noise_keep_the_verdicts():
    rng = np.random.default_rng(1)

    def degrade(image: np.ndarray) -> np.ndarray:
        blurred = np.asarray(Image.fromarray(image).filter(ImageFilter.GaussianBlur(0.7)), dtype=np.float64)
        return np.clip(np.round(blurred + rng.normal(0, 8, image.shape)), 0, 255).astype(np.uint8)

    targets = torch.stack(
        [torch.from_numpy(degrade(render_placed(e.target, 32))).permute(2, 0, 1) for e in EXAMPLES]
    )
    sources = torch.stack(
        [torch.from_numpy(degrade(render_placed(e.source, 32))).permute(2, 0, 1) for e in EXAMPLES]
    )
    accepted = np.mean([v.correct for v in verify_edit_batch(targets, EXAMPLES)])
    rejected = np.mean([v.score == 0 for v in verify_edit_batch(sources, EXAMPLES)])
    assert accepted >= 0.95 and rejected >= 0.95


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="square images"):
        verify_edit(np.full((32, 48, 3), 255, np.uint8), EXAMPLES[0])
    with pytest.raises(ValueError, match=r"EditExample\.from_dict"):
        verify_edit(np.full((32, 32, 3), 255, np.uint8), EXAMPLES[0].to_dict())
    with pytest.raises(ValueError, match="B = len\\(examples\\) = 2"):
        verify_edit_batch(torch.zeros(1, 3, 32, 32, dtype=torch.uint8), EXAMPLES[:2])
