"""`shapes_edit`: the shapes edit task's verifier as a reward (see docs/shapes.md, "The edit task").

Each result image is checked against its row's edit (`metadata["edit"]`, an
`EditExample.to_dict()`, as in `builtin:shapes_edit_train.jsonl` / `builtin:shapes_edit_heldout.jsonl`):
the objects it shows, read from the pixels by the shapes verifier's detectors, against the edited
scene, and every object the instruction does not touch against where the source had it
(`diffrl.toy.edit_verify`). The instruction itself is not parsed: the row's edit is the truth.

- `score: partial` (default): (fraction of the edit checks that hold) × (fraction of the keep
  checks that hold): 1 for the edited scene, 0 for an unedited copy of the source or a wrong edit;
- `score: binary`: 1 when every check holds, else 0.

Extras, whichever `score` is: `accuracy` (all checks hold), `partial`, `edit` (the fraction of the
edit checks: was the change made) and `keep` (the fraction of the keep checks: did the rest stay).
"""

from __future__ import annotations

from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import ImageReward, RewardOutput
from diffrl.rewards.registry import register_reward
from diffrl.toy.edit import EditExample
from diffrl.toy.edit_verify import verify_edit_batch

torch = lazy_import("torch")  # deferred: see diffrl.lazy

SCORES = ("partial", "binary")


def example_of(prompt: str, metadata: dict[str, Any]) -> EditExample:
    """The sample's edit: `metadata["edit"]`, required."""
    data = metadata.get("edit")
    if data is None:
        raise ValueError(
            f"shapes_edit reward: the row of prompt {prompt!r} has no 'edit' field; it needs the edit "
            "its instruction asks for (EditExample.to_dict()): use builtin:shapes_edit_train.jsonl / "
            "builtin:shapes_edit_heldout.jsonl, or rows written by diffrl.toy.edit.write_edit_file"
        )
    try:
        return EditExample.from_dict(data)
    except ValueError as err:
        raise ValueError(f"shapes_edit reward: the 'edit' of prompt {prompt!r} is invalid: {err}") from None


@register_reward("shapes_edit")
class ShapesEditReward(ImageReward):
    """The shapes edit verifier's verdict on each result image for its row's edit (module docstring).

    Args:
        score: "partial" (edit fraction × keep fraction) or "binary" (1 when every check holds).
    """

    name = "shapes_edit"

    def __init__(self, score: str = "partial") -> None:
        if score not in SCORES:
            raise ValueError(f"shapes_edit: score={score!r} is invalid: use one of {', '.join(SCORES)}")
        self.score = score

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        examples = [example_of(p, m) for p, m in zip(prompts_N, metadata_N, strict=True)]
        verdicts = verify_edit_batch(frames_N3HW, examples)
        accuracy_N = torch.tensor([float(v.correct) for v in verdicts], dtype=torch.float32)
        partial_N = torch.tensor([v.score for v in verdicts], dtype=torch.float32)
        extras = {
            "accuracy": accuracy_N,
            "partial": partial_N,
            "edit": torch.tensor([v.detail["edit"] for v in verdicts], dtype=torch.float32),
            "keep": torch.tensor([v.detail["keep"] for v in verdicts], dtype=torch.float32),
        }
        scores_N = partial_N if self.score == "partial" else accuracy_N
        return RewardOutput(scores_N.clone(), extras)
