"""The engine's optimizer: AdamW over the trained parameters, with the configured LR schedule."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from diffrl.config.schema import OptimConfig


def lr_lambda(scheduler: str, warmup_steps: int, total_steps: int):
    """Multiplier of the base LR after `step` optimizer steps: linear warmup, then the shape."""

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if scheduler == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        if scheduler == "linear":
            return 1.0 - progress
        raise ValueError(f"actor.optim.scheduler={scheduler!r} is not constant, cosine or linear")

    return factor


def adamw(
    params: Sequence[torch.nn.Parameter], optim: OptimConfig, total_steps: int
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `params` with actor.optim's settings, and its LR schedule over `total_steps`
    optimizer steps (`lr_lambda`)."""
    optimizer = torch.optim.AdamW(
        params,
        lr=optim.lr,
        betas=tuple(optim.betas),
        eps=optim.eps,
        weight_decay=optim.weight_decay,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lr_lambda(optim.scheduler, optim.warmup_steps, total_steps)
    )
    return optimizer, scheduler


__all__ = ["adamw", "lr_lambda"]
