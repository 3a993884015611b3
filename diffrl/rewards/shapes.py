"""`shapes`: the shapes world's verifier as a reward (a miniature GenEval; see docs/shapes.md).

Each image is checked against its scene by `diffrl.toy.verify`: the objects it shows (colour,
shape, count, position), read from the pixels alone, against every constraint of the prompt.

- `score: partial` (default): the fraction of the scene's constraints that hold (each object's
  count, each colour, no extra objects, the relation), a dense signal for RL;
- `score: binary`: 1 when all hold, else 0 (GenEval-style accuracy).

The scene of each sample is its metadata's `scene` (a `Scene.to_dict()`, as in the built-in
prompt files `builtin:shapes_train.jsonl` / `builtin:shapes_heldout.jsonl`), or, when the row has
none, the parse of its prompt (`diffrl.toy.grammar.parse_prompt`: "a red circle and a blue
square", "three triangles", ...). A prompt outside the grammar is a ValueError naming it.

Extras: `accuracy` (1/0, all constraints hold) and `partial` (the fraction), whichever `score`
is, so validation logs both (per category through the rows' `data_source`).
"""

from __future__ import annotations

from typing import Any

from diffrl.lazy import lazy_import
from diffrl.rewards.base import ImageReward, RewardOutput
from diffrl.rewards.registry import register_reward
from diffrl.toy.grammar import Scene, parse_prompt
from diffrl.toy.verify import verify_batch

torch = lazy_import("torch")  # deferred: see diffrl.lazy

SCORES = ("partial", "binary")


def scene_of(prompt: str, metadata: dict[str, Any]) -> Scene:
    """The sample's scene: `metadata["scene"]` when present, else `parse_prompt(prompt)`."""
    scene = metadata.get("scene")
    if scene is None:
        return parse_prompt(prompt)
    if not isinstance(scene, dict):
        raise ValueError(
            f"shapes reward: metadata 'scene' of prompt {prompt!r} must be a dict (Scene.to_dict()), got "
            f"{type(scene).__name__}: {scene!r:.200}; drop the column to parse the prompt instead"
        )
    return Scene.from_dict(scene)


@register_reward("shapes")
class ShapesReward(ImageReward):
    """The shapes-world verifier's verdict on each image for its scene (module docstring).

    Args:
        score: "partial" (fraction of constraints that hold) or "binary" (1 when all hold).
    """

    name = "shapes"

    def __init__(self, score: str = "partial") -> None:
        if score not in SCORES:
            raise ValueError(f"shapes: score={score!r} is invalid: use one of {', '.join(SCORES)}")
        self.score = score

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        scenes = [scene_of(prompt, meta) for prompt, meta in zip(prompts_N, metadata_N, strict=True)]
        correct_N, partial_N = verify_batch(frames_N3HW, scenes)
        accuracy_N = correct_N.to(torch.float32)
        scores_N = partial_N if self.score == "partial" else accuracy_N
        return RewardOutput(scores_N.clone(), {"accuracy": accuracy_N, "partial": partial_N})
