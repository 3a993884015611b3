"""Compiled training on 2 GPUs (NCCL) for every family: replicated LoRA, sharded LoRA, sharded full
fine-tuning (run on a 2-GPU machine: pytest -m gpu; skipped with fewer GPUs).

Each rank loads the tiny model in bf16 on its GPU, builds the engine with the strategy, compiles
the blocks after sharding (as ActorWorker does: the blocks must be found in their FSDP classes),
samples a rollout with the shared module and takes one optimizer step on its half of it. Checked:
every block compiled, finite loss and gradient norm, the same gradient norm on both ranks (it is
taken after the gradients are averaged), the trained weights moved, and, replicated, both ranks
holding bit-identical weights afterwards (NCCL's all-reduce hands every rank the same sum).
"""

from __future__ import annotations

import os

import pytest
import torch
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
    PipelineConfig,
    RolloutConfig,
    SdeConfig,
)
from diffrl.models import load_model
from diffrl.models.blocks import find_blocks
from diffrl.rollout import TrajectorySampler
from diffrl.train import distributed
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets
from diffrl.train.engine import TrainEngine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

WORLD = 2
CASES = {  # (strategy, LoRA rank): full fine-tuning is sharded, as actor.strategy=auto does
    "sd3": [("ddp", 4), ("fsdp2", 4), ("fsdp2", 0)],
    "flux": [("ddp", 4), ("fsdp2", 4)],
    "qwen_image": [("ddp", 4), ("fsdp2", 4)],
    "wan": [("ddp", 4), ("fsdp2", 4)],
}


def rollout_config(family: str) -> RolloutConfig:
    return RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=32,
            width=32,
            num_inference_steps=4,
            guidance_scale=4.5,
            true_cfg_scale=4.0 if family in ("flux", "qwen_image") else None,
            max_sequence_length=16,
            num_frames=5 if family == "wan" else 1,
        ),
        sde=SdeConfig(noise_level=0.7, window_size=2, window_range=[0, 3]),
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def one_step(
    family: str, model_dir: str, strategy: str, lora_rank: int, device: torch.device, dtype: str = "bfloat16"
) -> dict:
    torch._dynamo.reset()
    rank = torch.distributed.get_rank()
    adapter = load_model(model_dir, dtype=dtype, device=device)
    if family == "flux":
        # as flux_dev_lora sets model.attn_backend: with torch's default SDPA choice (cuDNN on
        # H100/H200) FLUX's training backward fails at full size, and here gave a NaN gradient
        adapter.transformer.set_attention_backend("_native_flash")
    engine = TrainEngine(
        adapter,
        ModelConfig(dtype=dtype, lora=LoraConfig(rank=lora_rank, alpha=2 * max(lora_rank, 1))),
        ActorConfig(
            strategy=strategy,
            mini_batch_size=8,
            micro_batch_size=2,
            optim=OptimConfig(lr=1e-4),
            loss=LossConfig(clip_ratio=1e-2, kl_coef=0.0),
        ),
        total_optim_steps=1,
    )
    compiled = adapter.compile_blocks()
    before = {n: full(p) for n, p in engine.transformer.named_parameters() if p.requires_grad}
    rollout = TrajectorySampler(adapter, rollout_config(family), progress=False).sample(
        ["a red circle", "a blue square"], seed=3, step=0
    )
    rollout.extras.clear()
    mine = rollout.select(slice(rank * 4, rank * 4 + 4))
    targets = TrainingTargets(advantages_B=torch.tensor([1.0, -1.0, 0.5, -0.5]), batch_size=[4])
    batch = PolicyGradientBatch(mine, targets)
    metrics = engine.forward_backward([batch.select(slice(0, 2)), batch.select(slice(2, 4))])
    metrics.update(engine.optim_step())
    after = {n: full(p) for n, p in engine.transformer.named_parameters() if p.requires_grad}
    return {
        "strategy": engine.strategy,
        "blocks": len(find_blocks(adapter.transformer, adapter.block_class_names)),
        "compiled": compiled,
        "loss": metrics["loss"],
        "grad_norm": metrics["grad_norm"],
        "moved": max((after[n] - before[n]).abs().max().item() for n in after),
        # a digest of the trained weights: replicated, each rank's own copy
        "digest": torch.stack([after[n].double().sum() for n in sorted(after)]),
    }


def _worker(rank: int, port: int, family: str, model_dir: str, out_dir: str) -> None:
    join_gloo(rank, WORLD, port, out_dir, 120, backend="nccl")
    try:
        results = {
            f"{strategy}-{lora}": one_step(family, model_dir, strategy, lora, torch.device("cuda", rank))
            for strategy, lora in CASES[family]
        }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


@pytest.mark.parametrize("family", list(CASES))
def test_compiled_two_gpu_training_replicated_and_sharded(tiny_model, family, tmp_path):
    model_dir = str(tiny_model(family))
    spawn_with_deadlines(
        _worker,
        (free_port(), family, model_dir, str(tmp_path)),
        WORLD,
        tmp_path,
        start_s=180.0,
        run_s=480.0,
        what=f"compiled {family} training",
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for case in ranks[0]:
        a, b = ranks[0][case], ranks[1][case]
        assert a["strategy"] == case.split("-")[0]
        assert a["compiled"] == a["blocks"] > 0, case
        assert torch.isfinite(torch.tensor([a["loss"], b["loss"], a["grad_norm"]])).all(), case
        assert a["grad_norm"] == b["grad_norm"], f"{case}: the ranks clipped different gradients"
        assert a["moved"] > 0, f"{case}: the optimizer step changed nothing"
        if case.startswith("ddp"):  # sharded, both digests come from the same gathered tensors
            assert torch.equal(a["digest"], b["digest"]), f"{case}: the replicas hold different weights"
