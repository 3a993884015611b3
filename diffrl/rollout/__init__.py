"""Rollout: the batched trajectory sampler and SDE windows (the `Rollout` batch: diffrl.transition)."""

from diffrl.rollout.sampler import TrajectorySampler
from diffrl.rollout.window import window_start

__all__ = ["TrajectorySampler", "window_start"]
