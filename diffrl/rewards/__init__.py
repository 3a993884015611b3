"""Reward functions: one contract, a registry, multi-reward, async workers, an HTTP client and server.

Importing this package registers every built-in reward:
`jpeg_compressibility`, `jpeg_incompressibility`, `ocr`, `shapes`, `clip_score`, `pickscore`, `aesthetic`,
`http`, and `python` (a user's `module:function`). Model libraries (transformers, pytesseract)
are imported only when a reward that needs them is built. See docs/rewards.md.
"""

from diffrl.rewards import clip, jpeg, ocr, remote, shapes, user  # noqa: F401  (registration on import)
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
from diffrl.rewards.workers import (
    InProcessRewardWorkers,
    RayRewardWorkers,
    RewardHandle,
    RewardWorkers,
    create_reward_workers,
    gather,
)

__all__ = [
    "REWARDS",
    "ImageReward",
    "InProcessRewardWorkers",
    "MultiReward",
    "RayRewardWorkers",
    "Reward",
    "RewardBatch",
    "RewardError",
    "RewardHandle",
    "RewardOutput",
    "RewardSpec",
    "RewardWorkers",
    "build_reward",
    "check_batch",
    "check_reward_spec",
    "create_reward_workers",
    "gather",
    "metric_name",
    "register_reward",
    "reward_names",
    "reward_specs",
]
