"""Flow-matching step math shared by the sampler and the trainer.

One pure function, `step`, takes x_σ and the network's velocity v and returns x_σ' together with
the Gaussian transition x' | x that produced it (mean, std, log-probability). The sampler calls it
to draw x' and the trainer calls it again on the stored (x, x') to re-score it under new weights;
because both go through the same fp32 code, the recomputed log-prob equals the sampled one exactly
when the weights are the same (the PPO ratio is exactly 1 before the first update).

Notation (docs/algorithms.md, "One step, one function"): flow matching x_σ = (1 − σ)·x₀ + σ·ε, v ≈ ε − x₀,
σ = σ_k, σ' = σ_{k+1}, dt = σ' − σ < 0, η = noise_level, ε ~ N(0, I).

sde (Flow-GRPO)::

    s    = η · sqrt(σ / (1 − σ̃)),   σ̃ = σ_1 (the schedule's second sigma) where σ == 1, else σ
    μ    = x·(1 + s²·dt/(2σ)) + v·(1 + s²·(1 − σ)/(2σ))·dt
    x'   = μ + s·sqrt(−dt)·ε
    logp = mean[ −(x' − μ)² / (2·s²·(−dt)) − log(s·sqrt(−dt)) − ½·log(2π) ]

cps (coefficients-preserving)::

    s    = σ'·sin(η·π/2);   x̂₀ = x − σ·v;   x̂₁ = x + (1 − σ)·v
    μ    = (1 − σ')·x̂₀ + sqrt(σ'² − s²)·x̂₁;   x' = μ + s·ε
    logp = mean[ −(x' − μ)² ]      (unnormalised, as in the reference; only differences are used)

dance_sde (DanceGRPO)::

    x̂₀ = x − σ·v;   score = −(x − (1 − σ)·x̂₀)/σ²;   μ = x + dt·v − ½·η²·score·dt
    s  = η·sqrt(σ − σ');   x' = μ + s·ε;   logp = mean[ −(x' − μ)²/(2s²) − log s − ½·log(2π) ]

ode (Euler)::

    x' = μ = x + v·dt;   stds 0;   logp 0

Every `mean[...]` is over all non-batch elements, so log-probs are one scalar per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from diffrl.config.choices import SDE_KINDS
from diffrl.lazy import lazy_import

# Deferred (diffrl.lazy): `diffrl config` loads no torch.
torch = lazy_import("torch")

_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass(frozen=True)
class StepOut:
    """One denoising step x_σ -> x_σ' and the Gaussian transition that produced it.

    All tensors are fp32. `log_prob_B` is the log-density of `next_latents` averaged over every
    non-batch element (one scalar per sample). `std_B` is the standard deviation of the transition
    x' | x (what log_prob uses); `std_dev_t_B` is the reference implementations' "std_dev_t" (for
    `sde` it excludes the sqrt(-dt) factor, for the other kinds it equals `std_B`); `sqrt_neg_dt_B`
    is sqrt(σ - σ'). For `ode` the transition is deterministic: stds are 0 and log_prob is 0.

    Shapes: `next_latents` and `mean` have the latents' shape [B, ...]; the `_B` fields are [B].
    `mean` (μ) carries the autograd graph of the velocity, which is what the losses differentiate.
    """

    next_latents: torch.Tensor
    log_prob_B: torch.Tensor
    mean: torch.Tensor
    std_B: torch.Tensor
    std_dev_t_B: torch.Tensor
    sqrt_neg_dt_B: torch.Tensor


def step(
    kind: str,
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    noise_level: float,
    *,
    sigma_1: float | torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    next_latents: torch.Tensor | None = None,
) -> StepOut:
    """One step x_σ -> x_σ' of `kind` (one of `SDE_KINDS`; formulas in the module docstring).

    Args:
        kind: "sde" (Flow-GRPO), "cps", "dance_sde" (DanceGRPO) or "ode" (Euler).
        latents: x_σ, [B, ...] (at least one non-batch dim), any float dtype; computed in fp32.
        velocity: v, same shape; may be bf16 straight from the network; computed in fp32.
        sigma, sigma_next: σ and σ' as a python float, a 0-d tensor or a per-sample [B] tensor,
            with 0 <= σ' < σ <= 1 (checked when given as floats or CPU tensors; device tensors are
            not read back, to avoid a host sync per step).
        noise_level: η >= 0. The stochastic kinds need η > 0: η == 0 raises, use kind="ode".
            (sde and dance_sde would divide by s² = 0, and a zero-noise cps step would hand the
            trainer ratios from a transition with no randomness; a silent switch to ode would give
            log_prob 0 and train nothing.) cps also needs η <= 1: s/σ' = sin(η·π/2) folds back
            above 1.
        sigma_1: the schedule's second sigma σ_1, used by `sde` in place of σ where σ == 1 (where
            s = η·sqrt(σ/(1 − σ)) is infinite). Required by `sde` when a σ equals 1. Passing it
            always also avoids reading σ back from the device to look for 1s.

    Exactly one mode, chosen by the keyword given:
        noise: sampling with this standard-normal tensor of the latents' shape;
        generator: sampling with noise drawn by diffusers' `randn_tensor` on the latents' device,
            from one generator for the whole batch, or from a sequence of one generator per sample
            (each sample draws its own [1, ...] block, so its noise does not depend on which other
            samples share the micro-batch);
        next_latents: evaluation: the log-prob of these given x' under the transition; they are
            returned as given (the same tensor when already fp32).
    None or several raise ValueError, except that `ode` needs no noise: with no mode keyword it
    steps deterministically, noise= / generator= are accepted and ignored, and next_latents=
    (evaluation) returns them as given with log_prob 0 (a deterministic step has no density; 0
    makes PPO ratios exactly 1 and is what the sampler records for ode steps).

    Choices worth knowing:
        - The log-prob numerator uses x'.detach(): x' is data, the gradient flows through μ only.
          This does not change any value, only gradients, and it matters: in sampling mode with
          autograd on, x' = μ + std·ε is itself a function of μ, and without the detach
          (x' − μ)² = (std·ε)² would not depend on μ at all, so ∂logp/∂μ would be 0 instead of the
          score-function gradient (x' − μ)/std². Stored x' from a rollout carry no graph, so
          evaluation is unaffected. The returned next_latents keep their graph (μ + std·ε), as in
          the references, for methods that backpropagate through sampling.
        - Last step σ' = 0: every kind is finite. sde: s = η·sqrt(σ/(1 − σ)) is finite and
          μ = x̂₀ − (s²/2)·x̂₁, so x' is a proper Gaussian sample around the (slightly shrunk) clean
          prediction that still carries noise of std s·sqrt(σ); keep SDE windows off the last step
          if clean final latents matter. dance_sde: s = η·sqrt(σ) > 0. cps: s = 0, the step is
          deterministic (x' = μ = x̂₀) and the unnormalised log-prob −mean((x' − μ)²) stays finite:
          exactly 0 for the sampled x', and −mean((x' − μ_θ)²) when re-scored under changed weights
          (the reference's formula, applied uniformly with no special case).

    Returns:
        StepOut (all fp32): next_latents [B, ...], log_prob_B [B], mean [B, ...], std_B,
        std_dev_t_B, sqrt_neg_dt_B [B].
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"unknown SDE kind {kind!r}; expected one of {SDE_KINDS}")
    _check_noise_level(kind, noise_level)
    if latents.ndim < 2:
        raise ValueError(
            f"latents must be [B, ...] with at least one non-batch dim (log-probs average over them); "
            f"got shape {tuple(latents.shape)}"
        )
    if velocity.shape != latents.shape:
        raise ValueError(f"velocity shape {tuple(velocity.shape)} != latents shape {tuple(latents.shape)}")
    given = [
        name
        for name, value in (("noise", noise), ("generator", generator), ("next_latents", next_latents))
        if value is not None
    ]
    if len(given) > 1 or (not given and kind != "ode"):
        raise ValueError(
            f"pass exactly one of noise= (sampling), generator= (sampling) or next_latents= "
            f"(evaluation); got {given or 'none'}"
        )

    for name, value in (("noise", noise), ("next_latents", next_latents)):
        if value is not None and value.shape != latents.shape:
            raise ValueError(f"{name} shape {tuple(value.shape)} != latents shape {tuple(latents.shape)}")

    x = latents.float()
    v = velocity.float()
    batch = x.shape[0]
    sigma_b = _sigma_tensor(sigma, "sigma", x)
    sigma_next_b = _sigma_tensor(sigma_next, "sigma_next", x)
    _check_sigmas(sigma, sigma_next)
    dt = sigma_next_b - sigma_b
    sqrt_neg_dt = torch.sqrt(-dt)

    if kind == "ode":
        mean = x + v * dt
        x_next = mean if next_latents is None else next_latents.float()
        return StepOut(
            next_latents=x_next,
            log_prob_B=x.new_zeros(batch),
            mean=mean,
            std_B=x.new_zeros(batch),
            std_dev_t_B=x.new_zeros(batch),
            sqrt_neg_dt_B=_per_sample(sqrt_neg_dt, batch),
        )

    if kind == "sde":
        sigma_tilde = sigma_b
        if sigma_1 is not None:
            sigma_1_b = _sigma_tensor(sigma_1, "sigma_1", x)
            if _on_host(sigma_1) and not bool(((sigma_1_b >= 0) & (sigma_1_b < 1)).all()):
                raise ValueError(f"sigma_1 must be in [0, 1); got {sigma_1_b.flatten().tolist()}")
            sigma_tilde = torch.where(sigma_b == 1, sigma_1_b, sigma_b)
        elif bool((sigma_b == 1).any()):
            raise ValueError(
                "kind='sde' at sigma == 1 needs sigma_1 (s = η·sqrt(σ/(1 − σ)) is infinite there): "
                "pass sigma_1=schedule.sigma_1, the schedule's second sigma"
            )
        std_dev_t = noise_level * torch.sqrt(sigma_b / (1 - sigma_tilde))
        s2 = std_dev_t**2
        mean = x * (1 + s2 * dt / (2 * sigma_b)) + v * (1 + s2 * (1 - sigma_b) / (2 * sigma_b)) * dt
        std = std_dev_t * sqrt_neg_dt
    elif kind == "cps":
        std = sigma_next_b * math.sin(noise_level * math.pi / 2)
        std_dev_t = std
        x0_hat = x - sigma_b * v
        x1_hat = x + (1 - sigma_b) * v
        # clamp: σ'² − s² can round below 0 when η == 1 (then s == σ')
        mean = (1 - sigma_next_b) * x0_hat + torch.sqrt((sigma_next_b**2 - std**2).clamp_min(0)) * x1_hat
    else:  # dance_sde
        x0_hat = x - sigma_b * v
        score = -(x - (1 - sigma_b) * x0_hat) / sigma_b**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std = noise_level * sqrt_neg_dt
        std_dev_t = std

    if next_latents is not None:
        x_next = next_latents.float()
    else:
        eps = noise.float() if noise is not None else _draw_noise(generator, x)
        x_next = mean + std * eps

    diff_sq = (x_next.detach() - mean) ** 2
    # cps keeps the reference's unnormalised form: no 1/s², so it stays finite where s == 0
    log_prob = -diff_sq if kind == "cps" else -diff_sq / (2 * std**2) - torch.log(std) - _HALF_LOG_2PI
    log_prob_B = log_prob.mean(dim=tuple(range(1, x.ndim)))
    return StepOut(
        next_latents=x_next,
        log_prob_B=log_prob_B,
        mean=mean,
        std_B=_per_sample(std, batch),
        std_dev_t_B=_per_sample(std_dev_t, batch),
        sqrt_neg_dt_B=_per_sample(sqrt_neg_dt, batch),
    )


def _check_noise_level(kind: str, noise_level: float) -> None:
    if not (math.isfinite(noise_level) and noise_level >= 0):
        raise ValueError(f"noise_level must be a finite number >= 0; got {noise_level!r}")
    if kind != "ode" and noise_level == 0:
        raise ValueError(
            f"noise_level == 0 with kind={kind!r} has no log-probability (std 0); use kind='ode' "
            f"for a deterministic step"
        )
    if kind == "cps" and noise_level > 1:
        raise ValueError(f"kind='cps' needs noise_level in (0, 1] (s = σ'·sin(η·π/2)); got {noise_level!r}")


def _sigma_tensor(value: float | torch.Tensor, name: str, x: torch.Tensor) -> torch.Tensor:
    """`value` as fp32 on x's device, 0-d or [B, 1, ..., 1] so it broadcasts over x."""
    t = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if t.ndim == 0:
        return t
    if t.ndim == 1 and t.shape[0] == x.shape[0]:
        return t.view(x.shape[0], *([1] * (x.ndim - 1)))
    raise ValueError(
        f"{name} must be a float, a 0-d tensor or a per-sample [B={x.shape[0]}] tensor; "
        f"got shape {tuple(t.shape)}"
    )


def _on_host(value: float | torch.Tensor) -> bool:
    return not isinstance(value, torch.Tensor) or value.device.type == "cpu"


def _check_sigmas(sigma: float | torch.Tensor, sigma_next: float | torch.Tensor) -> None:
    # Reading device tensors back would sync every step; the schedule normally lives on the CPU.
    if not (_on_host(sigma) and _on_host(sigma_next)):
        return
    sigma_b = torch.as_tensor(sigma, dtype=torch.float32, device="cpu")
    sigma_next_b = torch.as_tensor(sigma_next, dtype=torch.float32, device="cpu")
    ok = (sigma_next_b >= 0) & (sigma_next_b < sigma_b) & (sigma_b <= 1)
    if not bool(ok.all()):
        raise ValueError(
            f"need 0 <= sigma_next < sigma <= 1 (sigmas decrease); got sigma={sigma_b.flatten().tolist()}, "
            f"sigma_next={sigma_next_b.flatten().tolist()}"
        )


def _draw_noise(generator: torch.Generator | Sequence[torch.Generator], x: torch.Tensor) -> torch.Tensor:
    from diffusers.utils.torch_utils import randn_tensor  # diffrl.lazy

    if isinstance(generator, torch.Generator):
        return randn_tensor(x.shape, generator=generator, device=x.device, dtype=torch.float32)
    generators = list(generator)
    if len(generators) != x.shape[0]:
        raise ValueError(
            f"got {len(generators)} generators for a batch of {x.shape[0]}: pass one torch.Generator "
            f"for the batch or exactly one per sample"
        )
    return randn_tensor(x.shape, generator=generators, device=x.device, dtype=torch.float32)


def _per_sample(t: torch.Tensor, batch: int) -> torch.Tensor:
    """A 0-d or [B, 1, ..., 1] tensor as a contiguous [B] tensor."""
    return t.reshape(-1).expand(batch).contiguous() if t.numel() == 1 else t.reshape(batch)
