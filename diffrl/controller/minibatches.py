"""The mini-batch schedule of one training step: every loop's optimizer steps come from here.

A step's samples come in prompt groups of `rollout.n` (group g holds samples g·n .. g·n + n − 1;
offline DPO: one dataset row per group). For each of `actor.epochs` epochs the groups are shuffled
per (seed, step, epoch) with `actor.shuffle`, then cut into mini-batches of
`actor.mini_batch_size // rollout.n` whole groups: one optimizer step each. A mini-batch's samples
are dealt to the workers in consecutive equal shares, each cut into micro-batches of
`actor.micro_batch_size` (the config makes every division exact).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from diffrl.seeding import SHUFFLE_STREAM, numpy_rng

if TYPE_CHECKING:
    from diffrl.config.schema import Config


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's share of a training step."""

    epoch: int
    groups: list[int]  # the prompt groups (or offline rows), in training order
    rows_B: torch.Tensor  # long [B]: their samples, group after group

    def shards(self, world: int, micro_batch_size: int) -> list[list[torch.Tensor]]:
        """Each worker's micro-batches, as sample rows: `world` consecutive equal shares of the
        mini-batch, each cut into slices of `micro_batch_size`."""
        per_worker = len(self.rows_B) // world
        return [
            list(self.rows_B[rank * per_worker : (rank + 1) * per_worker].split(micro_batch_size))
            for rank in range(world)
        ]


def group_order(cfg: Config, groups: int, step: int, epoch: int) -> list[int]:
    """The order in which a step's prompt groups (or pairs) form mini-batches in `epoch`: shuffled
    per (seed, step, epoch) with `actor.shuffle`, else as sampled."""
    if not cfg.actor.shuffle:
        return list(range(groups))
    return numpy_rng(SHUFFLE_STREAM, cfg.trainer.seed, step, epoch).permutation(groups).tolist()


def mini_batches(cfg: Config, groups: int, step: int) -> Iterator[MiniBatch]:
    """The mini-batches of training step `step` over `groups` prompt groups, epoch after epoch."""
    n = cfg.rollout.n
    groups_per_mini = cfg.actor.mini_batch_size // n
    for epoch in range(cfg.actor.epochs):
        order = group_order(cfg, groups, step, epoch)
        for start in range(0, groups, groups_per_mini):
            chunk = order[start : start + groups_per_mini]
            yield MiniBatch(epoch, chunk, torch.tensor([g * n + j for g in chunk for j in range(n)]))
