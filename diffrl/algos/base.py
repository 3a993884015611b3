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

from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig
    from diffrl.sde import StepOut

torch = lazy_import("torch")  # deferred: see diffrl.lazy


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


# ------------------------------------------------------------------------ shared by the PPO-style losses
#: The ratio statistics `clip_ratio_stats` returns, in order.
CLIP_RATIO_METRICS = ("ppo_kl", "clipfrac", "clipfrac_higher", "clipfrac_lower", "ratio_mean", "ratio_std")


def check_step_inputs(
    batch: LossInputs, policy_out: StepOut, loss_name: str, needs_old_mean: bool = False
) -> None:
    """The recomputed step and the batch describe the same samples (and the old means exist when
    the loss needs them); ValueError naming the mismatch otherwise."""
    if policy_out.log_prob_B.shape != batch.old_log_prob_B.shape:
        raise ValueError(
            f"policy_out.log_prob_B has shape {tuple(policy_out.log_prob_B.shape)} but the batch's "
            f"old_log_prob_B has {tuple(batch.old_log_prob_B.shape)}; they must be the same samples"
        )
    if not needs_old_mean:
        return
    if batch.old_mean is None:
        raise ValueError(
            f"{loss_name} needs batch.old_mean, the old (sampling) policy's SDE mean of this step: the "
            "rollout's stored means[:, j] when its log-probs are reused, else the recomputed old means"
        )
    if batch.old_mean.shape != policy_out.mean.shape:
        raise ValueError(
            f"policy_out.mean has shape {tuple(policy_out.mean.shape)} but batch.old_mean has "
            f"{tuple(batch.old_mean.shape)}; they must be the same samples and latents"
        )


def ppo_clip_terms(adv_B: torch.Tensor, ratio_B: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-sample PPO-clip loss max(−Â·ρ, −Â·clamp(ρ, 1−ε, 1+ε)) (the pessimistic term)."""
    return torch.maximum(-adv_B * ratio_B, -adv_B * ratio_B.clamp(1.0 - eps, 1.0 + eps))


def clip_ratio_stats(log_ratio_B: torch.Tensor, ratio_B: torch.Tensor, eps: float) -> list[torch.Tensor]:
    """0-d fp64 tensors, in `CLIP_RATIO_METRICS` order: mean(−log ρ) (a first-order KL(old ‖ θ)
    estimate), the fractions with |ρ − 1| > ε, ρ > 1 + ε, ρ < 1 − ε, and mean and population std
    of ρ. The clip masks use ρ's own dtype, so they agree with the clamp of `ppo_clip_terms`."""
    ratio_B, log_ratio_B = ratio_B.detach(), log_ratio_B.detach()
    return [
        (-log_ratio_B.double()).mean(),
        ((ratio_B - 1.0).abs() > eps).double().mean(),
        (ratio_B > 1.0 + eps).double().mean(),
        (ratio_B < 1.0 - eps).double().mean(),
        ratio_B.double().mean(),
        ratio_B.double().std(correction=0),
    ]


class Loss(Protocol):
    """A policy-gradient loss (`PolicyGradientSpec.loss`): stateless, constructed without arguments."""

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
