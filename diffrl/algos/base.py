"""What a loss receives and returns.

The training engine calls a loss once per (micro-batch, window step):

    loss, metrics = loss_fn.compute(batch, policy_out, cfg)

- `batch: LossInputs` holds the per-sample quantities fixed before the update (advantages, the
  old policy's log-probs and, when the loss needs them, the old / reference SDE means). They are
  treated as constants: losses detach them.
- `policy_out: diffrl.sde.StepOut` is the current policy's step recomputed on the stored
  transition x_k -> x_{k+1}; it carries the gradient (through `log_prob_B` and `mean`).
- `cfg: diffrl.config.schema.LossConfig` (`actor.loss`).

It returns a scalar loss with grad, already averaged over the micro-batch, and a dict of plain
floats. Metric names are bare (`ppo_kl`, `clipfrac`, `kl`); the engine averages them over
micro-batches and window steps and logs them under `actor/` (see `diffrl.algos.metrics`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig
    from diffrl.sde import StepOut


@dataclass
class LossInputs:
    """One window step of one micro-batch of B samples.

    advantages_B:    (B,) advantage of each sample (already broadcast to this step), unclipped.
    old_log_prob_B:  (B,) log-prob of the stored transition under the old (sampling) policy,
                     averaged over elements like `StepOut.log_prob_B`.
    old_mean:        (B, ...) old policy's SDE mean for this step (GRPO-Guard, Flow-DPPO); or None.
    ref_mean:        (B, ...) reference policy's SDE mean for this step (KL loss); or None.
    weights_B:       (B,) rollout-correction weights multiplying each sample's loss term
                     (importance weights, 0 for rejected samples); None means all ones.
    """

    advantages_B: torch.Tensor
    old_log_prob_B: torch.Tensor
    old_mean: torch.Tensor | None = None
    ref_mean: torch.Tensor | None = None
    weights_B: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.advantages_B.ndim != 1:
            raise ValueError(f"advantages_B must have shape (B,), got {tuple(self.advantages_B.shape)}")
        batch = self.advantages_B.shape[0]
        for name in ("old_log_prob_B", "weights_B"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (batch,):
                raise ValueError(
                    f"{name} must have shape ({batch},) like advantages_B, got {tuple(value.shape)}"
                )
        for name in ("old_mean", "ref_mean"):
            value = getattr(self, name)
            if value is not None and (value.ndim < 2 or value.shape[0] != batch):
                raise ValueError(f"{name} must have shape ({batch}, ...), got {tuple(value.shape)}")

    @property
    def batch_size(self) -> int:
        return self.advantages_B.shape[0]


class Loss(Protocol):
    """A registered loss (`@register_loss(name)`): stateless, constructed without arguments."""

    def compute(
        self, batch: LossInputs, policy_out: StepOut, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """Scalar loss with grad (mean over the micro-batch) and metrics as plain floats."""
        ...


class AdvantageEstimator(Protocol):
    """A registered advantage estimator (`@register_advantage(name)`)."""

    def __call__(self, rewards_B: torch.Tensor, uids, cfg) -> torch.Tensor:
        """Per-sample rewards (B,) and group ids (B,) -> advantages (B,)."""
        ...
