"""Rollout correction: importance weights and rejection when the sampler's log-probs differ from the trainer's.

References: verl's rollout correction (`verl/trainer/ppo/rollout_corr_helper.py`: TIS / IcePop
importance sampling, k1/k2/k3 rejection, off-policy diagnostics), VeRL-Omni's diffusion
adaptation (no padding: every window step is valid; a rejection is a 0 weight), docs/algorithms.md
("Rollout correction").

The trainer's old policy (weights θ_old, recomputed in fp32) and the sampler that drew the
trajectories (same weights in another engine, another dtype, or a step behind when asynchronous)
can assign different log-probabilities to the same stored transition. Per sample b and window
step j:

    λ_bj = logp_old,bj − logp_rollout,bj                 log of π_old/π_rollout for that step

Importance weights (`is_level`), with λ clamped to ±20 before exponentiating:

    step        w_bj = exp(λ_bj)                           per step ("token level"): biased, low variance
    sequence    w_b  = exp(Σ_j λ_bj)                       the trajectory ratio over the window: unbiased,
                                                           high variance; the same for all of b's steps
    geometric   w_b  = exp(mean_j λ_bj)                    the geometric mean of the per-step ratios

then (`is_mode`):

    truncate    w ← min(w, is_threshold)                   TIS
    mask        w ← w·1[is_lower ≤ w ≤ is_threshold]       MIS / IcePop: weights outside the band are 0

Rejection (`rejection`, `rejection_level`): a per-step divergence statistic from λ,

    k1 = −λ             (E_rollout[k1] = KL(rollout ‖ old); signed per sample)
    k2 = ½·λ²
    k3 = e^λ − 1 − λ    (≥ 0, an unbiased low-variance KL(rollout ‖ old) estimator)

aggregated per `rejection_level` (step: itself; sequence_mean / sequence_sum / sequence_max:
over b's window steps, broadcast back to them), rejects when k2, k3 > rejection_threshold, or
|k1| > rejection_threshold (a symmetric bound on the log-ratio: verl's ratio bound u is
threshold = log u). sequence_max is not defined for the signed k1.

The weight passed to the loss is w·keep (detached, ≥ 0; 0 for a rejected step): the trainer hands
column j of `weights_BW` to `LossInputs.weights_B` at window step j, where it multiplies the
sample's loss term (the mean still divides by the micro-batch size).

Bypass mode: when the trainer skips the recompute and uses the sampler's log-probs as the old ones
(`algorithm.old_log_probs=rollout`), λ ≡ 0: every weight is 1, nothing is rejected and the
mismatch metrics are 0. The PPO ratio π_θ/π_rollout then corrects the mismatch by itself (the
ratio is taken against the behaviour policy), at no recompute cost; what is lost is the trust
region against the trainer's own old policy and the visibility of the mismatch.

Diagnostics (`mismatch_metrics`, always worth logging when both log-probs exist): |λ| mean and
max over the batch and per window step, the k1 and k3 KL estimates, and — with weights — their
effective sample size (Σw)²/(N·Σw²) ∈ [0, 1] (1 = uniform weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffrl.config.choices import IS_LEVELS, IS_MODES, REJECTION_LEVELS, REJECTIONS
from diffrl.lazy import lazy_import

if TYPE_CHECKING:
    from diffrl.config.schema import RolloutCorrectionConfig

torch = lazy_import("torch")  # deferred: see diffrl.lazy

SAFETY_BOUND = 20.0
"""|λ| (or its sum/mean) is clamped to this before exp: exp(20) ≈ 4.9e8."""

PREFIX = "rollout_correction/"


def log_ratio(old_log_probs_BW: torch.Tensor, rollout_log_probs_BW: torch.Tensor) -> torch.Tensor:
    """λ = logp_old − logp_rollout, (B, W) float64, detached."""
    for name, value in (
        ("old_log_probs_BW", old_log_probs_BW),
        ("rollout_log_probs_BW", rollout_log_probs_BW),
    ):
        if not isinstance(value, torch.Tensor) or value.ndim != 2 or value.numel() == 0:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"{name} must be a non-empty (B, W) tensor (samples × window steps), got {shape}"
            )
    if old_log_probs_BW.shape != rollout_log_probs_BW.shape:
        raise ValueError(
            f"old_log_probs_BW {tuple(old_log_probs_BW.shape)} and rollout_log_probs_BW "
            f"{tuple(rollout_log_probs_BW.shape)} must have the same shape"
        )
    lam = old_log_probs_BW.detach().double() - rollout_log_probs_BW.detach().double()
    if not bool(torch.isfinite(lam).all()):
        raise ValueError("log-probs have non-finite entries: rollout correction needs finite log-probs")
    return lam


def importance_weights(
    log_ratio_BW: torch.Tensor, level: str, mode: str, threshold: float, lower: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights_BW, raw_BW): the applied IS weights and the weights before truncation/masking.

    For `sequence` and `geometric` every step of a sample carries the sample's one weight.
    `level="none"` gives all ones (both tensors).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_correction.is_level must be one of {list(IS_LEVELS)}, got {level!r}")
    if mode not in IS_MODES:
        raise ValueError(f"rollout_correction.is_mode must be one of {list(IS_MODES)}, got {mode!r}")
    if not threshold > 0 or not 0 <= lower < threshold:
        raise ValueError(f"need 0 <= is_lower < is_threshold, got is_lower={lower}, is_threshold={threshold}")
    lam = log_ratio_BW.detach().double()
    if level == "none":
        ones = torch.ones_like(lam)
        return ones, ones
    if level == "step":
        log_w = lam
    elif level == "sequence":
        log_w = lam.sum(dim=1, keepdim=True).expand_as(lam)
    else:  # geometric
        log_w = lam.mean(dim=1, keepdim=True).expand_as(lam)
    raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    if mode == "truncate":
        return raw.clamp_max(threshold), raw
    inside = (raw >= lower) & (raw <= threshold)
    return torch.where(inside, raw, torch.zeros_like(raw)), raw


def divergence_statistic(log_ratio_BW: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-step k1 = −λ, k2 = ½λ², or k3 = e^λ − 1 − λ (λ clamped to ±20), (B, W) float64."""
    lam = log_ratio_BW.detach().double().clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if estimator == "k1":
        return -lam
    if estimator == "k2":
        return 0.5 * lam**2
    if estimator == "k3":
        return torch.expm1(lam) - lam
    raise ValueError(f"divergence estimator must be k1, k2 or k3, got {estimator!r}")


def rejection_mask(
    log_ratio_BW: torch.Tensor, estimator: str, threshold: float, level: str = "step"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(keep_BW, statistic): keep_BW is True where the step is kept; the statistic is the
    aggregated one compared to the threshold ((B, W) at level `step`, (B,) otherwise).
    `estimator="none"` keeps everything (statistic all zeros)."""
    if estimator not in REJECTIONS:
        raise ValueError(f"rollout_correction.rejection must be one of {list(REJECTIONS)}, got {estimator!r}")
    if level not in REJECTION_LEVELS:
        raise ValueError(
            f"rollout_correction.rejection_level must be one of {list(REJECTION_LEVELS)}, got {level!r}"
        )
    if not threshold > 0:
        raise ValueError(f"rollout_correction.rejection_threshold must be > 0, got {threshold}")
    lam = log_ratio_BW.detach().double()
    if estimator == "none":
        return torch.ones_like(lam, dtype=torch.bool), torch.zeros_like(lam)
    per_step = divergence_statistic(lam, estimator)
    if level == "step":
        stat = per_step
    elif level == "sequence_mean":
        stat = per_step.mean(dim=1)
    elif level == "sequence_sum":
        stat = per_step.sum(dim=1)
    else:  # sequence_max
        if estimator == "k1":
            raise ValueError("rejection_level=sequence_max is defined for k2 and k3 only (k1 is signed)")
        stat = per_step.max(dim=1).values
    reject = stat.abs() > threshold if estimator == "k1" else stat > threshold
    if level != "step":
        reject = reject.unsqueeze(1).expand_as(lam)
    return ~reject, stat


def effective_sample_size(weights: torch.Tensor) -> float:
    """(Σw)² / (N·Σw²) over all N entries: 1 for uniform weights, 1/N for one non-zero, 0 if all are 0."""
    w = weights.detach().double().flatten()
    sq = (w**2).sum()
    if w.numel() == 0 or sq.item() == 0.0:
        return 0.0
    return (w.sum() ** 2 / (w.numel() * sq)).item()


def mismatch_metrics(old_log_probs_BW: torch.Tensor, rollout_log_probs_BW: torch.Tensor) -> dict[str, float]:
    """Train/sample mismatch diagnostics, `rollout_correction/...` plain floats (the first two are the
    names the policy-gradient trainer already logs when it recomputes old log-probs):

        abs_logp_diff_mean, abs_logp_diff_max   over all (sample, step), in nats
        step{j}/abs_logp_diff_mean, .../max     per window step j (0 = the window's first step)
        kl       mean(logp_rollout − logp_old), the k1 estimate of KL(rollout ‖ old)
        k3_kl    mean(e^λ − 1 − λ), the k3 estimate of the same KL
    """
    lam = log_ratio(old_log_probs_BW, rollout_log_probs_BW)
    abs_diff = lam.abs()
    per_step_mean = abs_diff.mean(dim=0).tolist()
    per_step_max = abs_diff.max(dim=0).values.tolist()
    metrics = {
        f"{PREFIX}abs_logp_diff_mean": abs_diff.mean().item(),
        f"{PREFIX}abs_logp_diff_max": abs_diff.max().item(),
        f"{PREFIX}kl": (-lam).mean().item(),
        f"{PREFIX}k3_kl": divergence_statistic(lam, "k3").mean().item(),
    }
    for j, (mean_j, max_j) in enumerate(zip(per_step_mean, per_step_max, strict=True)):
        metrics[f"{PREFIX}step{j}/abs_logp_diff_mean"] = mean_j
        metrics[f"{PREFIX}step{j}/abs_logp_diff_max"] = max_j
    return metrics


def rollout_correction(
    old_log_probs_BW: torch.Tensor,
    rollout_log_probs_BW: torch.Tensor,
    *,
    is_level: str = "none",
    is_mode: str = "truncate",
    is_threshold: float = 2.0,
    is_lower: float = 0.5,
    rejection: str = "none",
    rejection_threshold: float = 0.01,
    rejection_level: str = "step",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-(sample, window step) loss weights and all metrics.

    Args:
        old_log_probs_BW: (B, W) log-probs of the stored transitions under the trainer's old policy.
        rollout_log_probs_BW: (B, W) the sampler's own log-probs of the same transitions.
        is_level, is_mode, is_threshold, is_lower: importance weights (module docstring).
        rejection, rejection_threshold, rejection_level: the rejection mask (module docstring).

    Returns:
        weights_BW: (B, W) float32 on the inputs' device, detached: IS weight × keep (all ones
            when both parts are off). Column j feeds `LossInputs.weights_B` at window step j.
        metrics: `mismatch_metrics` plus, when on, `rollout_correction/rollout_is_{mean,max,min,
            ratio_fraction_high,ratio_fraction_low}` (of the IS weights; the fractions of raw
            weights above is_threshold / below is_lower), `rollout_correction/rollout_rs_{masked_fraction,
            seq_masked_fraction}` (rejected steps; samples with any rejected step),
            `rollout_correction/rollout_rs_<k>_{mean,max}` (the aggregated statistic), and
            `rollout_correction/rollout_is_eff_sample_size` of the final weights.
    """
    lam = log_ratio(old_log_probs_BW, rollout_log_probs_BW)
    is_w, raw = importance_weights(lam, is_level, is_mode, is_threshold, is_lower)
    keep, stat = rejection_mask(lam, rejection, rejection_threshold, rejection_level)
    weights = is_w * keep.double()
    metrics = mismatch_metrics(old_log_probs_BW, rollout_log_probs_BW)
    if is_level != "none":
        metrics.update(
            {
                f"{PREFIX}rollout_is_mean": is_w.mean().item(),
                f"{PREFIX}rollout_is_max": is_w.max().item(),
                f"{PREFIX}rollout_is_min": is_w.min().item(),
                f"{PREFIX}rollout_is_ratio_fraction_high": (raw > is_threshold).double().mean().item(),
                f"{PREFIX}rollout_is_ratio_fraction_low": (raw < is_lower).double().mean().item(),
            }
        )
    if rejection != "none":
        metrics.update(
            {
                f"{PREFIX}rollout_rs_masked_fraction": (~keep).double().mean().item(),
                f"{PREFIX}rollout_rs_seq_masked_fraction": (~keep).any(dim=1).double().mean().item(),
                f"{PREFIX}rollout_rs_{rejection}_mean": stat.mean().item(),
                f"{PREFIX}rollout_rs_{rejection}_max": stat.max().item(),
            }
        )
    if is_level != "none" or rejection != "none":
        metrics[f"{PREFIX}rollout_is_eff_sample_size"] = effective_sample_size(weights)
    return weights.to(device=old_log_probs_BW.device, dtype=torch.float32), metrics


def rollout_correction_from_config(
    old_log_probs_BW: torch.Tensor, rollout_log_probs_BW: torch.Tensor, cfg: RolloutCorrectionConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """`rollout_correction` with every knob read from `algorithm.rollout_correction` (`cfg`):
    is_level, is_mode, is_threshold, is_lower, rejection, rejection_threshold, rejection_level."""
    return rollout_correction(
        old_log_probs_BW,
        rollout_log_probs_BW,
        is_level=cfg.is_level,
        is_mode=cfg.is_mode,
        is_threshold=cfg.is_threshold,
        is_lower=cfg.is_lower,
        rejection=cfg.rejection,
        rejection_threshold=cfg.rejection_threshold,
        rejection_level=cfg.rejection_level,
    )
