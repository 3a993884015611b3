"""Supervised flow matching's random draws (`diffrl sft`): what each image trains on.

Per image, from its own generator (SFT_STREAM, seed, step, image index within the step), in this
order: prompt dropout (train on the empty prompt with probability `sft.prompt_dropout`), the noise
level (`sample_sigmas` from the scheduler's training sigmas with `sft.weighting_scheme`), then the
noise. Keying by the step-wide image index makes the draws independent of how the step's images
are split over workers and micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffrl.algos.flow_matching import sample_sigmas
from diffrl.seeding import SFT_STREAM, generator

if TYPE_CHECKING:
    from diffrl.config.schema import SftConfig


@dataclass(frozen=True)
class SupervisedDraws:
    """The draws of B images: dropped[i] trains image i on the empty prompt."""

    dropped: list[bool]
    sigmas_B: torch.Tensor  # fp32 (B,) noise levels, on the CPU
    noise: torch.Tensor  # fp32 [B, ...] in the latent layout, on the CPU


def training_sigmas(scheduler_config: dict) -> torch.Tensor:
    """The scheduler's training sigmas (shift applied), as the diffusers training scripts use them."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler.from_config(scheduler_config).sigmas


def supervised_draws(
    count: int,
    latent_shape: Sequence[int],
    scheduler_sigmas: torch.Tensor,
    sft: SftConfig,
    *,
    seed: int,
    step: int,
    sample_offset: int,
) -> SupervisedDraws:
    """The draws of `count` images whose first has step-wide index `sample_offset`."""
    gens = [generator("cpu", SFT_STREAM, seed, step, sample_offset + i) for i in range(count)]
    dropped = [bool(torch.rand((), generator=g) < sft.prompt_dropout) for g in gens]
    sigmas_B = sample_sigmas(
        scheduler_sigmas, gens, sft.weighting_scheme, sft.logit_mean, sft.logit_std, sft.mode_scale
    )
    noise = torch.cat([torch.randn((1, *latent_shape), generator=g, dtype=torch.float32) for g in gens])
    return SupervisedDraws(dropped, sigmas_B, noise)
