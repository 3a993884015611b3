"""`reward.*`: the reward functions (weights, arguments) and the reward workers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diffrl.config.checks import ConfigError, require_at_least, require_positive
from diffrl.config.registries import check_reward_functions


@dataclass
class RewardFnConfig:
    weight: float = 1.0  # the reward's weight in the weighted sum
    required: bool = True  # true: a failure stops the run; false: the batch scores 0, counted
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the reward function
    # videos: score this many evenly spaced frames (first and last among them), averaged; null = all
    video_frames: int | None = None
    # > 0: this reward gets reward workers of its own, each with that many GPUs (a VLM judge on GPUs
    # the policy does not use); 0: the shared reward workers (reward.workers, gpus_per_worker) score it
    gpus: float = 0.0
    workers: int = 1  # this reward's own workers (with gpus > 0)


@dataclass
class RewardConfig:
    functions: dict[str, RewardFnConfig] = field(default_factory=dict)  # name -> weight/args
    workers: int = 1  # reward worker processes (Ray actors)
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0
    overlap: bool = True  # score each decoded micro-batch while the next one samples

    def validate(self, at: str) -> None:
        if self.functions:  # an empty set is the trainer's error: `diffrl config` may show one
            try:
                check_reward_functions(self.functions)  # names, args and weights, loading no model
            except ValueError as err:
                raise ConfigError(str(err)) from None
        require_at_least(f"{at}.workers", self.workers, 1)
        require_positive(f"{at}.cpus_per_worker", self.cpus_per_worker)
        require_at_least(f"{at}.gpus_per_worker", self.gpus_per_worker, 0.0)
