"""The mini-batch schedule of one training step: every loop's optimizer steps come from here.

A step's samples come in prompt groups of `rollout.n` (group g holds samples g·n .. g·n + n − 1;
offline DPO: one dataset row per group). For each of `actor.epochs` epochs the groups are shuffled
per (seed, step, epoch) with `actor.shuffle`, then cut into mini-batches of
`actor.mini_batch_size // rollout.n` whole groups: one optimizer step each. A mini-batch's samples
are dealt to the workers in consecutive equal shares, each cut into micro-batches of
`actor.micro_batch_size` (the config makes every division exact).

Colocated on W workers, worker r samples the r-th consecutive block of the step's groups. When every
mini-batch can hold the same number of groups from each block (`local_owners`), the schedule is
stratified by block: the shuffled order is kept within each block, and mini-batch k takes the k-th
slice of every block, block after block, so the consecutive shares deal each worker the groups it
sampled itself: the trajectories never leave the worker that made them. On one worker the order is
the plain shuffle; on several, mini-batches hold the same number of groups from each worker's
prompts instead of a uniformly random mix (one mini-batch per step: the same groups either way).
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


def group_order(cfg: Config, groups: int, step: int, epoch: int, owners: int = 1) -> list[int]:
    """The order in which a step's prompt groups (or pairs) form mini-batches in `epoch`: shuffled
    per (seed, step, epoch) with `actor.shuffle`, else as sampled; with `owners` > 1 stratified
    by owner block (module docstring)."""
    if not cfg.actor.shuffle:
        order = list(range(groups))
    else:
        order = numpy_rng(SHUFFLE_STREAM, cfg.trainer.seed, step, epoch).permutation(groups).tolist()
    if owners == 1:
        return order
    per_owner, per_mini = groups // owners, cfg.actor.mini_batch_size // cfg.rollout.n // owners
    blocks = [[g for g in order if g // per_owner == owner] for owner in range(owners)]
    return [
        g
        for start in range(0, per_owner, per_mini)
        for block in blocks
        for g in block[start : start + per_mini]
    ]


def local_owners(cfg: Config, groups: int, workers: int) -> int:
    """How many owner blocks the schedule can be stratified by (`workers`), or 1 when it cannot:
    one worker, a worker count that does not divide the step's groups or a mini-batch's groups,
    or sequence parallelism (the ranks of one group train the same rows)."""
    groups_per_mini = cfg.actor.mini_batch_size // cfg.rollout.n
    if workers == 1 or cfg.actor.sequence_parallel_size > 1:
        return 1
    if groups % workers or groups_per_mini % workers:
        return 1
    return workers


def mini_batches(cfg: Config, groups: int, step: int, owners: int = 1) -> Iterator[MiniBatch]:
    """The mini-batches of training step `step` over `groups` prompt groups, epoch after epoch;
    `owners` > 1 stratifies them by the workers that sampled the groups (`local_owners`)."""
    n = cfg.rollout.n
    groups_per_mini = cfg.actor.mini_batch_size // n
    for epoch in range(cfg.actor.epochs):
        order = group_order(cfg, groups, step, epoch, owners)
        for start in range(0, groups, groups_per_mini):
            chunk = order[start : start + groups_per_mini]
            yield MiniBatch(epoch, chunk, torch.tensor([g * n + j for g in chunk for j in range(n)]))
