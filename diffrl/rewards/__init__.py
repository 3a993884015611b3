"""Reward functions: one contract, a registry, multi-reward, async workers, an HTTP client and server.

Importing this package registers every built-in reward:
`jpeg_compressibility`, `jpeg_incompressibility`, `ocr`, `shapes`, `clip_score`, `pickscore`, `aesthetic`,
`edit_preservation` (image-edit runs), `http`, and `python` (a user's `module:function`). Model libraries (transformers, pytesseract)
are imported only when a reward that needs them is built. See docs/rewards.md.
"""

from typing import Any

from diffrl.config.registries import register_reward_check
from diffrl.rewards import clip, edit, jpeg, ocr, remote, shapes, shapes_edit, user  # noqa: F401  (registration on import)
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

# The workers import torch and the trainer's worker group (Ray), which only a run needs; the
# package itself is imported by config validation (`diffrl config`), so they load on first use.
_FROM_WORKERS = frozenset(
    {
        "InProcessRewardWorkers",
        "RayRewardWorkers",
        "RewardHandle",
        "RewardWorkers",
        "create_reward_workers",
        "gather",
    }
)


def __getattr__(name: str) -> Any:
    if name in _FROM_WORKERS:
        from diffrl.rewards import workers

        return getattr(workers, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
