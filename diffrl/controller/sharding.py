"""Splitting a step's prompts into worker shards and joining their rollouts (used by every loop;
which shards go where is the placement's choice, diffrl.controller.placement).

The mini-batch schedule lives in `trainer.minibatches`; padding prompt tables of different text
lengths in `PromptEmbeds.cat_padded`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from diffrl.data import PromptRecord
from diffrl.models.base import PromptEmbeds
from diffrl.transition import Rollout
from diffrl.workers.roles import PromptShard


def _negatives(records: Sequence[PromptRecord], default: str) -> list[str] | None:
    """Per-prompt negatives when any row has one; None lets the sampler apply the configured default."""
    if not any(r.negative_prompt for r in records):
        return None
    return [r.negative_prompt or default for r in records]


def prompt_shard(
    records: Sequence[PromptRecord], uids: Sequence[str], sample_offset: int, negative: str
) -> PromptShard:
    return PromptShard(
        prompts=[r.prompt for r in records],
        uids=list(uids[: len(records)]),
        metadata=[dict(r.metadata) for r in records],
        negative_prompts=_negatives(records, negative),
        sample_offset=sample_offset,
    )


def split_even(rollout: Rollout, parts: int) -> list[Rollout]:
    """`parts` consecutive, equal slices (the config guarantees divisibility)."""
    size = len(rollout) // parts
    return [rollout.select(slice(i * size, (i + 1) * size)).compact() for i in range(parts)]


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Join workers' rollouts of the same step: samples, prompt tables (re-indexed), reward handles,
    and each sample's weight version (`extras["weight_version_B"]`, from each part's
    `extras["weight_version"]`)."""
    versions = torch.cat(
        [torch.full((len(r),), int(r.extras.get("weight_version", 0)), dtype=torch.long) for r in rollouts]
    )
    if len(rollouts) == 1:
        only = rollouts[0]
        extras = {key: value for key, value in only.extras.items() if key != "weight_version"}
        return replace(only, extras={**extras, "weight_version_B": versions})
    first = rollouts[0]
    offsets, total = [], 0
    for r in rollouts:
        offsets.append(total)
        total += len(r.prompts)
    samples = []
    for r, offset in zip(rollouts, offsets, strict=True):
        s = r.samples.clone()
        s.prompt_index_B = s.prompt_index_B + offset
        samples.append(s)
    embeds = PromptEmbeds.cat_padded([r.prompt_embeds for r in rollouts])
    return replace(
        first,
        samples=torch.cat(samples),
        prompt_embeds=embeds,
        prompts=[p for r in rollouts for p in r.prompts],
        uids=[u for r in rollouts for u in r.uids],
        metadata=[m for r in rollouts for m in r.metadata],
        extras={
            "reward_handles": [h for r in rollouts for h in r.extras.get("reward_handles", [])],
            "weight_version_B": versions,
        },
    )
