"""What the controller adds to a rollout before a policy-gradient update: the training targets.

The sampler's `Rollout` is never modified: the controller builds `TrainingTargets` (advantages,
and the recomputed old log-probs / means, reference means, correction weights and step mask when
the configuration asks for them) and pairs them row for row with the rollout in a
`PolicyGradientBatch`, which the scheduler slices into micro-batches and the engine trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tensordict import tensorclass

from diffrl.transition import Rollout


@tensorclass
class TrainingTargets:
    """Per-sample training inputs, row for row with a rollout's samples (B, W as in `Trajectories`)."""

    advantages_B: torch.Tensor  # fp32 [B]
    old_log_probs_BW: torch.Tensor | None = None  # fp32 [B, W]; None = the rollout's own log_probs_BW
    old_means: torch.Tensor | None = None  # fp32 [B, W, ...]: recomputed old SDE means; None = `means`
    ref_means: torch.Tensor | None = None  # fp32 [B, W, ...]: the reference policy's SDE means (KL)
    weights_BW: torch.Tensor | None = None  # fp32 [B, W]: rollout-correction loss weights; None = 1
    train_mask_BW: torch.Tensor | None = None  # bool [B, W]: the steps each sample trains; None = all


@dataclass
class PolicyGradientBatch:
    """A rollout (or a slice of one) with its training targets."""

    rollout: Rollout
    targets: TrainingTargets

    def __post_init__(self) -> None:
        if len(self.targets) != len(self.rollout):
            raise ValueError(
                f"{len(self.targets)} training targets for {len(self.rollout)} rollout samples: "
                "build the targets from the same rollout"
            )

    def __len__(self) -> int:
        return len(self.rollout)

    @property
    def window_size(self) -> int:
        return self.rollout.window_size

    def select(self, index: torch.Tensor | slice | list[int]) -> PolicyGradientBatch:
        """Some samples of the batch (a micro-batch), sharing the rollout's prompt table."""
        if isinstance(index, list):
            index = torch.tensor(index, dtype=torch.long)
        return PolicyGradientBatch(self.rollout.select(index), self.targets[index])

    def compact(self) -> PolicyGradientBatch:
        """A copy owning exactly its rows (see `Rollout.compact`): what is sent to a worker."""
        return PolicyGradientBatch(self.rollout.compact(), self.targets.clone())

    def to(self, device: torch.device | str) -> PolicyGradientBatch:
        return PolicyGradientBatch(self.rollout.to(device), self.targets.to(device))
