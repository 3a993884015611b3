"""Splitting a step's prompts into worker shards (used by every loop; which shards go where is the
placement's choice, diffrl.controller.placement; joining the rollouts is
`diffrl.transition.concat_rollouts`). The mini-batch schedule lives in `controller/minibatches.py`."""

from __future__ import annotations

from collections.abc import Sequence

from diffrl.data import PromptRecord
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
        images=[r.images for r in records] if any(r.images for r in records) else None,
    )
