"""The shapes edit task's verifier: does a result image show the edited scene, and nothing else changed?

It reads the result's pixels with the shapes verifier's detectors (`diffrl.toy.verify.detect_batch`:
palette colours, connected objects, shapes from moments) and checks them against the example's
target objects (`diffrl.toy.edit.EditExample`), with the source layout as the reference for where
things must stay. The checks, each true or false (the keys of `detail["checks"]`):

| check | holds when |
|---|---|
| `count:<shape>` | exactly one object of each target shape |
| `color:<colour> <shape>` | ... and it has the target colour |
| `place:<shape>` | ... and it is where the target has it: box centre within `PLACE_TOLERANCE` of the image side of the target box's centre, box side within a factor `SIDE_RATIO` (every target object but an added or a moved one) |
| `relation` | `move` only: one object of each shape, and the moved one is RELATION the other (`relation_holds`, GenEval's rule) |
| `no_extra` | the image holds exactly as many objects as the target |

The checks split in two groups. The **edit** checks are those the unedited source fails (the source
layout, read as perfect detections, judged by the same checks): the change the instruction asks for,
e.g. `color:red circle` for "make the circle red", `count`/`color` of the new object and `no_extra`
for "add", `no_extra` for "remove", `relation` for "move". The **keep** checks are the others:
every object that should not change is still there, unchanged and in place, and nothing was added.
`score = (fraction of edit checks that hold) × (fraction of keep checks that hold)`: the rendered
target scores 1 and a copy of the source 0. A wrong edit scores what it got right of the change
times what it kept: recolouring to another colour, removing the other object or moving the object
anywhere the relation does not hold score 0; adding the right shape in the wrong colour 2/3 (its
count and `no_extra` hold). A right edit that disturbs the rest scores in proportion to what it
kept. `correct` is all checks holding (tests/toy/test_edit_verify.py checks each of these).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from diffrl.lazy import lazy_import
from diffrl.toy.edit import EditExample
from diffrl.toy.grammar import Box, relation_holds
from diffrl.toy.verify import Verdict, as_hw3, detect_batch, detect_pixels

torch = lazy_import("torch")  # deferred: see diffrl.lazy

#: A kept object's box centre may move by this fraction of the image side (3.2 px at 32²).
PLACE_TOLERANCE = 0.1
#: ... and its box side may shrink or grow by this factor.
SIDE_RATIO = 1.5

#: (shape, colour, box in pixels): a detected object, or a layout object read as one.
Seen = tuple[str, str, Box]


def _centre(box: Box) -> tuple[float, float]:
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def _in_place(seen: Box, want: Box, size: int) -> bool:
    (sx, sy), (wx, wy) = _centre(seen), _centre(want)
    if ((sx - wx) ** 2 + (sy - wy) ** 2) ** 0.5 > PLACE_TOLERANCE * size:
        return False
    side = max(seen[2] - seen[0], seen[3] - seen[1])
    wanted = max(want[2] - want[0], want[3] - want[1])
    return 1 / SIDE_RATIO <= side / wanted <= SIDE_RATIO


def edit_checks(objects: Sequence[Seen], example: EditExample, size: int) -> dict[str, bool]:
    """The checks of the module docstring for `objects` in an image of side `size`."""
    edit = example.edit
    checks: dict[str, bool] = {}
    for want in example.target:
        same = [o for o in objects if o[0] == want.shape]
        checks[f"count:{want.shape}"] = len(same) == 1
        checks[f"color:{want.color} {want.shape}"] = len(same) == 1 and same[0][1] == want.color
        if edit.kind == "move" and want.shape == edit.shape:
            anchor = [o for o in objects if o[0] == edit.anchor]
            checks["relation"] = (
                len(same) == 1 and len(anchor) == 1 and relation_holds(edit.value, same[0][2], anchor[0][2])
            )
        elif not (edit.kind == "add" and want.shape == edit.shape):
            checks[f"place:{want.shape}"] = len(same) == 1 and _in_place(same[0][2], want.box_px(size), size)
    checks["no_extra"] = len(objects) == len(example.target)
    return checks


def edit_check_names(example: EditExample, size: int) -> list[str]:
    """The edit group: the checks the unedited source fails (module docstring)."""
    source = [(p.shape, p.color, p.box_px(size)) for p in example.source]
    return [name for name, ok in edit_checks(source, example, size).items() if not ok]


def judge(objects: Sequence[Any], example: EditExample, size: int) -> Verdict:
    """The verdict on detected objects (`DetectedObject`s) of a result image of side `size`."""
    seen = [(o.shape, o.color, o.box) for o in objects]
    checks = edit_checks(seen, example, size)
    edit_names = edit_check_names(example, size)
    keep_names = [name for name in checks if name not in edit_names]
    edit_frac = sum(checks[n] for n in edit_names) / len(edit_names) if edit_names else 1.0
    keep_frac = sum(checks[n] for n in keep_names) / len(keep_names) if keep_names else 1.0
    detail = {
        "checks": checks,
        "edit_checks": edit_names,
        "edit": edit_frac,
        "keep": keep_frac,
        "objects": list(objects),
    }
    return Verdict(all(checks.values()), edit_frac * keep_frac, detail)


def _check_example(example: Any) -> EditExample:
    if not isinstance(example, EditExample):
        raise ValueError(
            f"the edit verifier needs an EditExample (EditExample.from_dict(row['edit'])), got {example!r:.200}"
        )
    return example


def verify_edit(image: np.ndarray | torch.Tensor, example: EditExample) -> Verdict:
    """Check one result image (uint8 numpy [H, W, 3] or tensor [3, H, W], square) against `example`."""
    hw3 = as_hw3(image)
    _check_square(hw3.shape[0], hw3.shape[1])
    return judge(detect_batch(hw3.unsqueeze(0))[0], _check_example(example), hw3.shape[0])


def verify_edit_batch(pixels: torch.Tensor, examples: Sequence[EditExample]) -> list[Verdict]:
    """The verdicts on uint8 result images [B, 3, H, W] (square) for their B examples."""
    examples = [_check_example(e) for e in examples]
    detected = detect_pixels(pixels, len(examples), "examples")
    _check_square(pixels.shape[2], pixels.shape[3])
    size = int(pixels.shape[2])
    return [judge(objs, example, size) for objs, example in zip(detected, examples, strict=True)]


def _check_square(height: int, width: int) -> None:
    if height != width:
        raise ValueError(
            f"the shapes edit verifier reads square images (layouts are fractions of one side); got "
            f"{width}x{height}: sample at rollout.pipeline.height = width"
        )


__all__ = [
    "PLACE_TOLERANCE",
    "SIDE_RATIO",
    "edit_check_names",
    "edit_checks",
    "judge",
    "verify_edit",
    "verify_edit_batch",
]
