"""What an optimizer step's backward passes are made of: `GradientTerm`s (`TrainEngine.accumulate`
runs every algorithm's), and the supervised flow-matching micro-batch (`FlowMatchingBatch`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from diffrl.models.base import PromptEmbeds

# Model timesteps are 1000·σ in every flow-matching family diffrl supports (Schedule.timesteps).
NUM_TRAIN_TIMESTEPS = 1000.0


@dataclass
class FlowMatchingBatch:
    """One micro-batch of supervised flow matching: B clean samples with their noise and level.

    latents / noise: fp32 [B, ...] in the adapter's latent layout; sigmas_B: (B,) noise levels in
    (0, 1]; cond: one conditioning row per sample (the empty prompt for dropped-out prompts).
    """

    latents: torch.Tensor
    noise: torch.Tensor
    sigmas_B: torch.Tensor
    cond: PromptEmbeds
    height: int
    width: int
    num_frames: int = 1


@dataclass(frozen=True)
class GradientTerm:
    """One backward pass of an optimizer step (see `TrainEngine.accumulate`).

    forward:       computes (scalar loss, metrics) with grad; called once, in order
    grad_scale:    the term's share of the step's mean loss: the gradient is Σ grad_scale · ∇loss
    metric_weight: the weight of its loss and metrics in the returned ones; None leaves them out
                   (padding that only keeps every worker making the same collective calls)
    """

    forward: Callable[[], tuple[torch.Tensor, dict[str, float]]]
    grad_scale: float
    metric_weight: float | None = 1.0


__all__ = ["NUM_TRAIN_TIMESTEPS", "FlowMatchingBatch", "GradientTerm"]
