"""Supervised flow matching: the pretraining objective of every family, used by `diffrl sft`.

For clean latents x₀, noise ε ~ N(0, I) and a noise level σ ∈ (0, 1]:

    x_σ = (1 − σ)·x₀ + σ·ε            the rectified-flow interpolation the samplers integrate
    v*  = ε − x₀                       its velocity, d x_σ / dσ (what the transformer predicts)
    L   = mean_i  w(σ_i) · mean_elements (v_θ(x_σ, σ) − v*)²

σ is drawn per sample as the SD3 training scripts do (diffusers'
`compute_density_for_timestep_sampling`: logit-normal by default, indexing the scheduler's own
shifted sigmas), and w(σ) is diffusers' `compute_loss_weighting_for_sd3` (1 for logit_normal).
"""

from __future__ import annotations

from diffrl.lazy import lazy_import

torch = lazy_import("torch")  # deferred: see diffrl.lazy


def sample_sigmas(
    scheduler_sigmas: torch.Tensor,
    generators: list[torch.Generator],
    weighting_scheme: str,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
) -> torch.Tensor:
    """(B,) fp32 noise levels, one draw from each sample's generator.

    `scheduler_sigmas` are the training scheduler's sigmas (`FlowMatchEulerDiscreteScheduler(...)
    .sigmas` before any `set_timesteps`: num_train_timesteps values from 1 down, shift applied);
    u ~ the scheme's density on (0, 1) selects index ⌊u·N⌋, as the diffusers SD3 scripts do.
    """
    from diffusers.training_utils import compute_density_for_timestep_sampling  # diffrl.lazy

    n = len(scheduler_sigmas) - 1 if scheduler_sigmas[-1] == 0 else len(scheduler_sigmas)
    u = torch.cat(
        [
            compute_density_for_timestep_sampling(
                weighting_scheme, 1, logit_mean, logit_std, mode_scale, device="cpu", generator=g
            )
            for g in generators
        ]
    )
    indices = (u * n).long().clamp(0, n - 1)
    return scheduler_sigmas[indices].float()


def flow_matching_loss(
    velocity: torch.Tensor,
    latents: torch.Tensor,
    noise: torch.Tensor,
    sigmas_B: torch.Tensor,
    weighting_scheme: str,
) -> torch.Tensor:
    """The weighted velocity MSE above, averaged over elements then samples (a scalar with grad)."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3  # diffrl.lazy

    target = (noise - latents).to(velocity.dtype)
    weights_B = compute_loss_weighting_for_sd3(weighting_scheme, sigmas_B.to(velocity.device)).float()
    per_sample_B = (velocity - target).pow(2).flatten(1).mean(dim=1)
    return (weights_B * per_sample_B).mean()


def interpolate(latents: torch.Tensor, noise: torch.Tensor, sigmas_B: torch.Tensor) -> torch.Tensor:
    """x_σ = (1 − σ)·x₀ + σ·ε, with σ broadcast over each sample's elements."""
    sigma = sigmas_B.to(latents.device, latents.dtype).view(-1, *([1] * (latents.ndim - 1)))
    return (1.0 - sigma) * latents + sigma * noise


__all__ = ["flow_matching_loss", "interpolate", "sample_sigmas"]
