"""Flow-DPPO: a divergence trust region on the SDE means instead of PPO's ratio clip.

References: Flow-DPPO (arXiv 2606.11025; UniRL's `flowdppo`), VeRL-Omni's `flow_dppo` loss mode,
docs/algorithms.md ("flow_dppo").

For one window step of a micro-batch of B samples (all per-sample quantities (B,)):

    ρ  = exp(logp_θ − logp_old)                                   unclipped probability ratio
    τ  = std_B = s·sqrt(−dt)   (cfg.add_kl_coefficient = True)    the transition std
    τ  = 1                     (cfg.add_kl_coefficient = False)
    D  = mean_elems((μ_θ − μ_old)²) / (2τ²)                      divergence of the two steps
    Â  = clamp(A, −adv_clip_max, +adv_clip_max)
    drop_i = D_i ≥ δ  and  ((Â_i > 0 and ρ_i > 1)  or  (Â_i < 0 and ρ_i < 1))
    ℓ_i = 0 if drop_i else −Â_i·ρ_i                               δ = cfg.kl_mask_threshold
    L  = (1/B) · Σ_i w_i·ℓ_i                                      w = rollout-correction weights

With τ = std_B, D is the exact KL between the old and the current Gaussian transition (both have
std τ). The mask is asymmetric: a sample outside the trust region (D ≥ δ) stops contributing only
when the update would push it further out, i.e. the advantage and the ratio agree in direction;
a sample whose ratio moves against its advantage keeps its gradient, which pulls the policy back
toward the old one. Inside the region the objective is the plain −Â·ρ (no clipping at all).
The mask is a constant (no gradient); ρ carries the gradient through logp_θ. D is computed from
μ_θ but only used in the mask, so the mean gets no gradient from this loss.

Choices worth knowing:
- τ is the transition std `std_B`. For the `sde` kind this equals the reference's
  std_dev_t·sqrt(−dt); for cps / dance_sde the reference multiplies their std_dev_t (already the
  transition std) by sqrt(−dt) again; diffrl keeps the exact KL for every kind.
- Â is clamped like every other policy loss in diffrl (VeRL-Omni's flow_dppo does not clamp; with
  standardised advantages |A| > adv_clip_max is rare, so the two agree in practice).
- ρ exactly 1 (the first update on fresh rollouts) keeps every sample: the mask needs ρ to have
  moved in the advantage's direction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffrl.algos.base import LossInputs, check_step_inputs
from diffrl.algos.spec import PolicyGradientSpec, register_algorithm
from diffrl.config.checks import require_positive
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import LossConfig
    from diffrl.sde import StepOut

torch = lazy_import("torch")  # deferred: see diffrl.lazy

METRIC_NAMES = (
    "policy_loss",
    "ppo_kl",
    "approx_kl",
    "ratio_mean",
    "ratio_std",
    "ratio_min",
    "ratio_max",
    "kl_new_old_mean",
    "kl_new_old_max",
    "kl_mask_fraction",
    "pos_rm_fraction",
    "neg_rm_fraction",
    "masked_fraction",
)


def step_divergence(mean: torch.Tensor, old_mean: torch.Tensor, std_B: torch.Tensor | None) -> torch.Tensor:
    """D = mean_elems((μ_θ − μ_old)²) / (2τ²) per sample (B,), no grad; τ = `std_B`, or 1 when None."""
    with torch.no_grad():
        sq_gap_B = (mean.detach() - old_mean.detach()).pow(2).flatten(1).mean(dim=1)
        if std_B is None:
            return sq_gap_B / 2.0
        return sq_gap_B / (2.0 * std_B.detach().to(sq_gap_B.dtype) ** 2)


def trust_region_masks(
    adv_B: torch.Tensor, ratio_B: torch.Tensor, divergence_B: torch.Tensor, threshold: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(outside_B, pos_drop_B, neg_drop_B), bool: D ≥ δ; dropped with Â > 0, ρ > 1; with Â < 0, ρ < 1."""
    outside_B = divergence_B >= threshold
    ratio_B = ratio_B.detach()
    pos_drop_B = outside_B & (adv_B > 0) & (ratio_B > 1.0)
    neg_drop_B = outside_B & (adv_B < 0) & (ratio_B < 1.0)
    return outside_B, pos_drop_B, neg_drop_B


class FlowDPPOLoss:
    """Flow-DPPO policy loss. Needs `batch.old_mean`; reads `cfg.kl_mask_threshold`,
    `cfg.add_kl_coefficient` and `cfg.adv_clip_max` (`cfg.clip_ratio` is not used).

    Metrics (plain floats, unweighted over the B samples):
        policy_loss                     L (the returned loss)
        ppo_kl                          mean(logp_old − logp_θ)
        approx_kl                       mean(½·(logp_θ − logp_old)²)
        ratio_mean/std/min/max          statistics of ρ (std: population)
        kl_new_old_mean, kl_new_old_max mean and max of D
        kl_mask_fraction                fraction outside the trust region (D ≥ δ)
        pos_rm_fraction, neg_rm_fraction  fractions dropped with Â > 0 (ρ > 1) / Â < 0 (ρ < 1)
        masked_fraction                 fraction dropped (the sum of the two)
    """

    def compute(
        self, batch: LossInputs, policy_out: StepOut, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_step_inputs(batch, policy_out, "flow_dppo", needs_old_mean=True)
        std_B = policy_out.std_B if cfg.add_kl_coefficient else None
        if std_B is not None and not bool((std_B > 0).all()):
            raise ValueError(
                f"flow_dppo got a non-positive transition std ({std_B.min().item()}): the step is "
                "deterministic (ODE, or the last cps step); train only on SDE steps, or set "
                "actor.loss.add_kl_coefficient=false to measure the divergence with τ = 1"
            )
        adv_B = batch.advantages_B.detach().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        log_ratio_B = policy_out.log_prob_B - batch.old_log_prob_B.detach()
        divergence_B = step_divergence(policy_out.mean, batch.old_mean, std_B)
        outside_B, pos_drop_B, neg_drop_B = trust_region_masks(
            adv_B, torch.exp(log_ratio_B.detach()), divergence_B, cfg.kl_mask_threshold
        )
        dropped_B = pos_drop_B | neg_drop_B
        # Dropped samples get log-ratio 0 before the exp and a 0 term after it: an overflowing ρ
        # of a dropped sample then gives loss 0 and gradient 0, not inf·0 = nan.
        zeros_B = torch.zeros_like(log_ratio_B)
        ratio_B = torch.exp(torch.where(dropped_B, zeros_B, log_ratio_B))
        loss_B = torch.where(dropped_B, zeros_B, -adv_B * ratio_B)
        if batch.weights_B is not None:
            loss_B = loss_B * batch.weights_B.detach()
        loss = loss_B.mean()

        with torch.no_grad():
            log_ratio64_B = log_ratio_B.detach().double()
            ratio64_B = torch.exp(log_ratio64_B)
            stats = torch.stack(
                [
                    loss.detach().double(),
                    (-log_ratio64_B).mean(),
                    (0.5 * log_ratio64_B**2).mean(),
                    ratio64_B.mean(),
                    ratio64_B.std(correction=0),
                    ratio64_B.min(),
                    ratio64_B.max(),
                    divergence_B.double().mean(),
                    divergence_B.double().max(),
                    outside_B.double().mean(),
                    pos_drop_B.double().mean(),
                    neg_drop_B.double().mean(),
                    dropped_B.double().mean(),
                ]
            ).tolist()  # one device sync
        return loss, dict(zip(METRIC_NAMES, stats, strict=True))


@dataclass
class FlowDPPOSettings:
    """Flow-DPPO's keys under `actor.loss`."""

    # drop a sample's term once D(μ_θ, μ_old) ≥ kl_mask_threshold and it moves further out
    kl_mask_threshold: float = 1e-5
    add_kl_coefficient: bool = True  # D divides by the transition variance (false: by 1)

    def validate(self, at: str) -> None:
        require_positive(f"{at}.kl_mask_threshold", self.kl_mask_threshold)


register_algorithm(
    PolicyGradientSpec(
        name="flow_dppo",
        loss=FlowDPPOLoss,
        settings=FlowDPPOSettings,
        metrics=METRIC_NAMES,
        needs_old_mean=True,
    )
)
