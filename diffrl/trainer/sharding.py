"""Splitting a step's work across workers and joining their results (used by every loop)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffrl.data import PromptRecord
from diffrl.models.base import PromptEmbeds
from diffrl.rollout.types import Rollout
from diffrl.seeding import SHUFFLE_STREAM, numpy_rng
from diffrl.workers.roles import PromptShard

if TYPE_CHECKING:
    from diffrl.config.schema import Config
    from diffrl.workers.group import WorkerGroup


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


def sample_groups(
    cfg: Config,
    workers: WorkerGroup,
    records: Sequence[PromptRecord],
    uids: Sequence[str],
    *,
    step: int,
    rewards: Any,
    method: str = "sample_and_score",
    **method_kwargs: Any,
) -> Rollout:
    """Each worker samples `rollout.n` trajectories for an equal share of whole prompt groups with
    `method` (`sample_and_score`, or `sample_and_score_policy` with a `policy`); their
    micro-batches are scored as they decode. Returns the joined rollout, reward handles in extras."""
    world = workers.size
    per_worker = len(records) // world
    n = cfg.rollout.n
    shards = [
        prompt_shard(
            records[rank * per_worker : (rank + 1) * per_worker],
            uids[rank * per_worker :],
            rank * per_worker * n,
            cfg.rollout.pipeline.negative_prompt,
        )
        for rank in range(world)
    ]
    rollouts = workers.scatter(
        method, shards, seed=cfg.rollout_seed, step=step, rewards=rewards, **method_kwargs
    )
    return concat_rollouts(rollouts)


def group_order(cfg: Config, groups: int, step: int, epoch: int) -> list[int]:
    """The order in which a step's prompt groups (or pairs) form mini-batches in `epoch`: shuffled
    per (seed, step, epoch) with `actor.shuffle`, else as sampled. Both trainers use it."""
    if not cfg.actor.shuffle:
        return list(range(groups))
    return numpy_rng(SHUFFLE_STREAM, cfg.trainer.seed, step, epoch).permutation(groups).tolist()


def split_even(rollout: Rollout, parts: int) -> list[Rollout]:
    """`parts` consecutive, equal slices (the config guarantees divisibility)."""
    size = len(rollout) // parts
    return [rollout.select(slice(i * size, (i + 1) * size)).compact() for i in range(parts)]


def concat_rollouts(rollouts: Sequence[Rollout]) -> Rollout:
    """Join workers' rollouts of the same step: samples, prompt tables (re-indexed), reward handles."""
    if len(rollouts) == 1:
        return rollouts[0]
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
    embeds = _cat_prompt_embeds([r.prompt_embeds for r in rollouts])
    return replace(
        first,
        samples=torch.cat(samples),
        prompt_embeds=embeds,
        prompts=[p for r in rollouts for p in r.prompts],
        uids=[u for r in rollouts for u in r.uids],
        metadata=[m for r in rollouts for m in r.metadata],
        extras={"reward_handles": [h for r in rollouts for h in r.extras.get("reward_handles", [])]},
    )


def _cat_prompt_embeds(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
    """Concatenate prompt tables whose text lengths may differ: each worker pads its own prompts to
    their longest (Qwen-Image), so right-pad with zeros to the longest overall and extend the masks
    with zeros (padded keys are masked out, so the model computes the same thing)."""
    lengths = {p.embeds.shape[1] for p in parts} | {
        p.negative_embeds.shape[1] for p in parts if p.negative_embeds is not None
    }
    if len(lengths) == 1:
        return torch.cat(list(parts))
    if any(p.mask is None for p in parts):
        raise ValueError(
            f"workers returned prompt embeddings of different text lengths {sorted(lengths)} without "
            "attention masks: this family must pad every prompt to rollout.pipeline.max_sequence_length"
        )
    length = max(lengths)
    padded = []
    for p in parts:
        negative = p.negative_embeds is not None
        padded.append(
            PromptEmbeds(
                embeds=_pad_tokens(p.embeds, length),
                mask=_pad_tokens(p.mask, length),
                pooled=p.pooled,
                negative_embeds=_pad_tokens(p.negative_embeds, length) if negative else None,
                negative_mask=_pad_tokens(p.negative_mask, length) if negative else None,
                negative_pooled=p.negative_pooled,
                batch_size=p.batch_size,
            )
        )
    return torch.cat(padded)


def _pad_tokens(values: torch.Tensor, length: int) -> torch.Tensor:
    """Right-pad dim 1 (tokens) with zeros to `length`."""
    pad = [0, 0] * (values.dim() - 2) + [0, length - values.shape[1]]
    return torch.nn.functional.pad(values, pad)


def write_json(path: Path, payload: dict) -> None:
    """Atomically: a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(path)
