"""The 2-rank engine tests' shared data: a tiny SD3 rollout of two prompts × 4 samples with
advantages and a DanceGRPO step mask, cut into micro-batches (test_engine_dance_fsdp.py,
test_parallel.py)."""

from __future__ import annotations

import torch

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets

PROMPTS = ["a red circle", "a blue square"]


def masked_micro_batches(model_dir, mask_BW: torch.Tensor, micro: int) -> list[PolicyGradientBatch]:
    """A rollout of the base policy (window of 2 SDE steps), advantages spread over [-1, 1] and
    `mask_BW` as each sample's trained steps, cut into micro-batches of `micro`."""
    adapter = load_model(model_dir, dtype="float32")
    rollout_cfg = RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=32, width=32, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
    rollout = TrajectorySampler(adapter, rollout_cfg, progress=False).sample(PROMPTS, seed=5, step=0)
    rollout.extras.clear()  # nothing the trainer reads; keeps what is sent to the ranks to tensors
    targets = TrainingTargets(
        advantages_B=torch.linspace(-1.0, 1.0, len(rollout)), train_mask_BW=mask_BW, batch_size=[len(rollout)]
    )
    batch = PolicyGradientBatch(rollout, targets)
    return [batch.select(slice(s, s + micro)).compact() for s in range(0, len(batch), micro)]
