"""Rollout: the batched trajectory sampler, the `Rollout` batch, SDE windows, step re-evaluation."""

from diffrl.rollout.sampler import TrajectorySampler, evaluate_step, evaluate_window
from diffrl.rollout.types import Rollout, RolloutSettings, Trajectories
from diffrl.rollout.window import window_start

__all__ = [
    "Rollout",
    "RolloutSettings",
    "Trajectories",
    "TrajectorySampler",
    "evaluate_step",
    "evaluate_window",
    "window_start",
]
