"""Flow-GRPO: the PPO clipped objective on per-step SDE log-probabilities.

For one window step of a micro-batch of B samples (all tensors (B,)):

    ρ  = exp(logp_θ − logp_old)                        probability ratio (dimensionless)
    Â  = clamp(A, −adv_clip_max, +adv_clip_max)        advantage in reward-std units
    ℓ  = max(−Â·ρ, −Â·clamp(ρ, 1−ε, 1+ε))               ε = clip_ratio
    L  = (1/B) · Σ_i w_i·ℓ_i                            w = rollout-correction weights (1 if absent)

logp is the Gaussian log-density averaged over all latent elements (see `diffrl.sde`), so ρ is
very close to 1 and ε is tiny (1e-4 by default). Note that L divides by B, not Σw: a rejected
sample (w = 0) lowers the step's loss magnitude rather than re-weighting the others.

The max picks the pessimistic term, so the gradient w.r.t. logp_θ of sample i is
−Â_i·ρ_i·w_i/B, except that it is exactly zero when the ratio has already moved past the clip in
the direction the advantage pushes it: Â>0 and ρ>1+ε, or Â<0 and ρ<1−ε.

The trainer accumulates gradients over micro-batches and window steps and divides by their count;
a KL penalty to the reference, when `kl_coef > 0`, is the separate `kl` loss (see `kl.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrl.algos.base import (
    CLIP_RATIO_METRICS,
    LossInputs,
    check_step_inputs,
    clip_ratio_stats,
    ppo_clip_terms,
)
from diffrl.algos.spec import PolicyGradientSpec, register_algorithm
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig
    from diffrl.sde import StepOut

torch = lazy_import("torch")  # deferred: see diffrl.lazy


METRIC_NAMES = ("policy_loss", *CLIP_RATIO_METRICS)


class FlowGRPOLoss:
    """PPO-clip policy loss of Flow-GRPO. Reads `cfg.clip_ratio` and `cfg.adv_clip_max`.

    Metrics (plain floats, unweighted means over the B samples):
        policy_loss      L (the returned loss)
        ppo_kl           mean(logp_old − logp_θ), a first-order KL(old ‖ θ) estimate
        clipfrac         fraction with |ρ − 1| > ε
        clipfrac_higher  fraction with ρ > 1 + ε
        clipfrac_lower   fraction with ρ < 1 − ε
        ratio_mean       mean(ρ)
        ratio_std        population std of ρ (0 for B = 1)
    """

    def compute(
        self, batch: LossInputs, policy_out: StepOut, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_step_inputs(batch, policy_out, "flow_grpo")
        eps = cfg.clip_ratio
        adv_B = batch.advantages_B.detach().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        log_ratio_B = policy_out.log_prob_B - batch.old_log_prob_B.detach()
        ratio_B = torch.exp(log_ratio_B)
        loss_B = ppo_clip_terms(adv_B, ratio_B, eps)
        if batch.weights_B is not None:
            loss_B = loss_B * batch.weights_B.detach()
        loss = loss_B.mean()

        with torch.no_grad():
            stats = torch.stack(
                [loss.detach().double(), *clip_ratio_stats(log_ratio_B, ratio_B, eps)]
            ).tolist()  # one device sync for all metrics
        metrics = dict(zip(METRIC_NAMES, stats, strict=True))
        return loss, metrics


register_algorithm(PolicyGradientSpec(name="flow_grpo", loss=FlowGRPOLoss, metrics=METRIC_NAMES))
