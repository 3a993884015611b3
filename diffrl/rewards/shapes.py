"""`shapes`: the shapes world's verifier as a reward (see docs/shapes.md and `diffrl.toy.verify`).

Each sample's scene is its metadata's `scene` (the built-in prompt files carry it) or, without
one, the parse of its prompt ("a red circle left of a blue square"); a prompt outside the grammar
is a ValueError naming it.

- `score: partial` (default): the fraction of the scene's constraints the image satisfies (object
  counts, colours, no extra objects, the relation) — a dense signal for RL;
- `score: binary`: 1 when all hold, else 0 (GenEval-style accuracy).

Extras: `accuracy` (1/0, all constraints hold) and `partial` (the fraction), whatever `score` is,
so validation reports the held-out accuracy per category either way.
"""

from __future__ import annotations

from typing import Any

import torch

from diffrl.rewards.base import ImageReward, RewardOutput
from diffrl.rewards.registry import register_reward

SCORES = ("partial", "binary")


@register_reward("shapes")
class ShapesReward(ImageReward):
    """The verifier's verdict on each image for its scene (module docstring)."""

    name = "shapes"

    def __init__(self, score: str = "partial") -> None:
        if score not in SCORES:
            raise ValueError(f"shapes: score={score!r} is invalid: choose one of {', '.join(SCORES)}")
        self.score = score

    def score_images(
        self, frames_N3HW: torch.Tensor, prompts_N: list[str], metadata_N: list[dict[str, Any]]
    ) -> RewardOutput:
        from diffrl.toy.grammar import Scene, parse_prompt
        from diffrl.toy.verify import verify_batch

        scenes = [
            Scene.from_dict(meta["scene"]) if isinstance(meta.get("scene"), dict) else parse_prompt(prompt)
            for prompt, meta in zip(prompts_N, metadata_N, strict=True)
        ]
        correct_N, partial_N = verify_batch(frames_N3HW, scenes)
        accuracy_N = correct_N.float()
        scores_N = partial_N if self.score == "partial" else accuracy_N
        return RewardOutput(scores_N.clone(), {"accuracy": accuracy_N, "partial": partial_N})


__all__ = ["ShapesReward"]
