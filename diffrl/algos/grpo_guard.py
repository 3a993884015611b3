"""GRPO-Guard: Flow-GRPO's PPO clip on a bias-corrected, step-normalised probability ratio.

Reference: GRPO-Guard (arXiv 2510.22319); the formula below is the one VeRL-Omni's `grpo_guard`
loss mode computes (docs/algorithms.md, "More policy-gradient losses").

For one window step of a micro-batch of B samples, with the current policy's SDE mean μ_θ, the
old (sampling) policy's mean μ_old, s = `std_dev_t_B` and h = `sqrt_neg_dt_B` = sqrt(−dt):

    σ̄  = mean_B(s),   h̄ = mean_B(h),   κ = h̄·σ̄                  one scale shared by the batch
    b  = mean_elems((μ_θ − μ_old)²) / (2κ²)                       ratio-mean bias, (B,), ≥ 0
    ρ  = exp((logp_θ − logp_old + b)·κ)                           guarded ratio
    Â  = clamp(A, −adv_clip_max, +adv_clip_max)
    ℓ  = max(−Â·ρ, −Â·clamp(ρ, 1−ε, 1+ε))                          ε = clip_ratio
    L  = (1/h̄²) · (1/B) · Σ_i w_i·ℓ_i                             w = rollout-correction weights

Why it works (the `sde` step kind, transition std τ = s·h, x' = μ_old + τ·ξ with ξ ~ N(0, I)):
the log-ratio of two Gaussians with the same τ is

    logp_θ − logp_old = mean((x' − μ_old)² − (x' − μ_θ)²)/(2τ²) = mean(ξ·Δμ)/τ − mean(Δμ²)/(2τ²)

with Δμ = μ_θ − μ_old. The second term is always ≤ 0: the plain Flow-GRPO ratio is biased below
1 and the bias grows as τ shrinks (late, low-noise steps), so those steps are clipped on the low
side far more often. Adding b cancels it (exactly when every sample has τ = κ), and multiplying
by κ removes the 1/τ, so the guarded log-ratio is mean(ξ·Δμ): zero-mean under the sampling noise
and on the same scale at every step. The final 1/h̄² restores a gradient magnitude comparable
across steps. b depends on μ_θ and carries gradient (as in the reference); s, h, μ_old, logp_old,
A and w are constants.

Only the `sde` step kind has this form (its log-prob is the normalised Gaussian density and
std_B = std_dev_t_B·sqrt_neg_dt_B); the loss raises for a StepOut of another kind. Recipes use a
much smaller ε than Flow-GRPO (2e-6).
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

METRIC_NAMES = (
    "policy_loss",
    *CLIP_RATIO_METRICS,
    "ratio_mean_bias",
    "sigma_t",
    "sqrt_dt",
)

# std_B must equal std_dev_t_B·sqrt_neg_dt_B (the `sde` kind) to this relative tolerance.
_SDE_KIND_RTOL = 1e-4


def guard_scale(policy_out: StepOut) -> tuple[torch.Tensor, torch.Tensor]:
    """(κ, h̄): the batch-shared scale κ = mean(sqrt_neg_dt)·mean(std_dev_t) and h̄ = mean(sqrt_neg_dt).

    Both are 0-d, detached: they are properties of the step, not of the trained weights.
    """
    sqrt_dt_mean = policy_out.sqrt_neg_dt_B.detach().mean()
    sigma_mean = policy_out.std_dev_t_B.detach().mean()
    return sqrt_dt_mean * sigma_mean, sqrt_dt_mean


def ratio_mean_bias(mean: torch.Tensor, old_mean: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """b = mean_elems((μ_θ − μ_old)²) / (2κ²), one value per sample (B,); differentiable in `mean`."""
    sq_gap_B = (mean - old_mean.detach()).pow(2).flatten(1).mean(dim=1)
    return sq_gap_B / (2.0 * scale.to(sq_gap_B.dtype) ** 2)


class GRPOGuardLoss:
    """GRPO-Guard policy loss. Needs `batch.old_mean`; reads `cfg.clip_ratio`, `cfg.adv_clip_max`.

    Metrics (plain floats, unweighted over the B samples):
        policy_loss                  L (the returned loss, including the 1/h̄² factor)
        ppo_kl                       mean(logp_old − logp_θ) of the *unguarded* log-ratio
        clipfrac, clipfrac_higher,   fractions of the guarded ratio ρ with |ρ − 1| > ε, ρ > 1 + ε,
        clipfrac_lower               ρ < 1 − ε
        ratio_mean, ratio_std        mean and population std of ρ
        ratio_mean_bias              mean(b)
        sigma_t, sqrt_dt             σ̄ and h̄ of this step
    """

    def compute(
        self, batch: LossInputs, policy_out: StepOut, cfg: LossConfig
    ) -> tuple[torch.Tensor, dict[str, float]]:
        check_step_inputs(batch, policy_out, "grpo_guard", needs_old_mean=True)
        eps = cfg.clip_ratio
        scale, sqrt_dt_mean = guard_scale(policy_out)
        adv_B = batch.advantages_B.detach().clamp(-cfg.adv_clip_max, cfg.adv_clip_max)
        bias_B = ratio_mean_bias(policy_out.mean, batch.old_mean, scale)
        log_ratio_B = policy_out.log_prob_B - batch.old_log_prob_B.detach()
        ratio_B = torch.exp((log_ratio_B + bias_B.to(log_ratio_B.dtype)) * scale.to(log_ratio_B.dtype))
        loss_B = ppo_clip_terms(adv_B, ratio_B, eps)
        if batch.weights_B is not None:
            loss_B = loss_B * batch.weights_B.detach()
        loss = loss_B.mean() / sqrt_dt_mean.to(loss_B.dtype) ** 2

        with torch.no_grad():
            ratio_B = ratio_B.detach()
            std_B = policy_out.std_B.detach().double()
            kind_gap = (std_B - policy_out.std_dev_t_B.double() * policy_out.sqrt_neg_dt_B.double()).abs()
            stats = torch.stack(
                [
                    loss.detach().double(),
                    # ppo_kl of the unguarded log-ratio; clip fractions and moments of the guarded ρ
                    *clip_ratio_stats(log_ratio_B, ratio_B, eps),
                    bias_B.detach().double().mean(),
                    policy_out.std_dev_t_B.detach().double().mean(),
                    sqrt_dt_mean.double(),
                    (kind_gap / std_B.clamp_min(1e-30)).max(),
                ]
            ).tolist()  # one device sync
        *values, kind_gap = stats
        metrics = dict(zip(METRIC_NAMES, values, strict=True))
        if not (metrics["sigma_t"] > 0 and metrics["sqrt_dt"] > 0):
            raise ValueError(
                "grpo_guard got a deterministic step (std_dev_t or sqrt(-dt) is 0: ODE, or σ' = σ); "
                "train it only on SDE window steps"
            )
        if not kind_gap <= _SDE_KIND_RTOL:
            raise ValueError(
                "grpo_guard is defined for the `sde` step kind (std_B == std_dev_t_B·sqrt_neg_dt_B, "
                f"normalised Gaussian log-probs); this step differs by {kind_gap:.3g} (relative). "
                "Set rollout.sde.type=sde or use another loss"
            )
        return loss, metrics


register_algorithm(
    PolicyGradientSpec(name="grpo_guard", loss=GRPOGuardLoss, metrics=METRIC_NAMES, needs_old_mean=True)
)
