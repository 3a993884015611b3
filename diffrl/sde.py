"""Flow-matching step math shared by the sampler and the trainer (work in progress: see step())."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepOut:
    """One denoising step x_σ -> x_σ' and the Gaussian transition that produced it.

    All tensors are fp32. `log_prob_B` is the log-density of `next_latents` averaged over every
    non-batch element (one scalar per sample). `std_B` is the standard deviation of the transition
    x' | x (what log_prob uses); `std_dev_t_B` is the reference implementations' "std_dev_t" (for
    `sde` it excludes the sqrt(-dt) factor, for the other kinds it equals `std_B`); `sqrt_neg_dt_B`
    is sqrt(σ - σ'). For `ode` the transition is deterministic: stds are 0 and log_prob is 0.
    """

    next_latents: torch.Tensor
    log_prob_B: torch.Tensor
    mean: torch.Tensor
    std_B: torch.Tensor
    std_dev_t_B: torch.Tensor
    sqrt_neg_dt_B: torch.Tensor
