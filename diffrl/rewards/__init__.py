"""Reward functions: one contract, a registry, multi-reward, an HTTP client and server. The reward
workers that score them in their own processes (Ray actors) are a worker role: diffrl.workers.reward_workers.

Importing this package registers every built-in reward:
`jpeg_compressibility`, `jpeg_incompressibility`, `ocr`, `shapes`, `clip_score`, `pickscore`, `aesthetic`,
`edit_preservation` (image-edit runs), `vlm_judge` (a Qwen-VL yes/no judge), `http`, and `python` (a user's `module:function`). Model libraries (transformers, pytesseract)
are imported only when a reward that needs them is built. See docs/rewards.md.
"""

from diffrl.config.registries import register_reward_check
from diffrl.rewards import (  # noqa: F401  (registration on import)
    clip,
    edit,
    jpeg,
    ocr,
    remote,
    shapes,
    shapes_edit,
    user,
    vlm_judge,
)
from diffrl.rewards.base import ImageReward, Reward, RewardOutput, check_batch
from diffrl.rewards.multi import MultiReward, RewardBatch, RewardError, RewardSpec, reward_specs
from diffrl.rewards.registry import (
    REWARDS,
    build_reward,
    check_reward_spec,
    metric_name,
    register_reward,
    reward_names,
)

# `reward.functions` is checked with the registry filled above (names, args, weights; no model loads).
register_reward_check(reward_specs)

__all__ = [
    "REWARDS",
    "ImageReward",
    "MultiReward",
    "Reward",
    "RewardBatch",
    "RewardError",
    "RewardOutput",
    "RewardSpec",
    "build_reward",
    "check_batch",
    "check_reward_spec",
    "metric_name",
    "register_reward",
    "reward_names",
    "reward_specs",
]
