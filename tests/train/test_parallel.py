"""Replicated training (`actor.strategy=ddp`) and the automatic choice of strategy.

The reference for the 2-rank run is the same optimizer step taken in this (pytest) process on one
device: the same initial weights, both ranks' micro-batches at once. Each rank holds the whole
model and averages its gradients with its peer's before the optimizer step, which equals the
gradient of the whole mini-batch's mean, so the updated weights must agree with one process within
float32 round-off, and with each other bit for bit (every rank then runs the same AdamW update).
DanceGRPO's step subsets give the ranks different numbers of backward passes: without FSDP's
per-forward collectives that needs no padding, and must neither hang nor change the update.
"""

from __future__ import annotations

import os

import pytest
import torch
from masked_batches import masked_micro_batches
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
)
from diffrl.models import load_model
from diffrl.train import distributed
from diffrl.train.batch import PolicyGradientBatch
from diffrl.train.engine import POLICY, TrainEngine
from diffrl.train.parallel import (
    REPLICATE_MAX_WEIGHT_SHARE,
    choose_strategy,
    pipeline_weight_bytes,
)

WORLD = 2
MICRO = 2
START_DEADLINE_S = 120.0
STEP_DEADLINE_S = 60.0
PG_TIMEOUT_S = 30
# Rows 0-3 are rank 0's two micro-batches, rows 4-7 rank 1's: rank 0 has 4 (micro-batch, step)
# terms, rank 1 two. True = the sample trains that window step.
MASK = torch.tensor([[1, 0], [0, 1], [0, 1], [1, 0], [1, 0], [1, 0], [0, 1], [0, 1]], dtype=torch.bool)
GIB = 2**30


def engine_for(model_dir: str, strategy: str) -> TrainEngine:
    """An engine whose trained LoRA is perturbed (B ≠ 0, so every LoRA tensor gets a gradient)."""
    actor_cfg = ActorConfig(
        strategy=strategy,
        mini_batch_size=8,
        micro_batch_size=MICRO,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        loss=LossConfig(clip_ratio=2e-4, kl_coef=0.0),
    )
    model_cfg = ModelConfig(lora=LoraConfig(rank=4, alpha=4))
    engine = TrainEngine(load_model(model_dir, dtype="float32"), model_cfg, actor_cfg, total_optim_steps=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.transformer.named_parameters():
            if f".{POLICY}." in name:
                p.add_(0.05 * torch.randn(p.shape, generator=g))
    return engine


def train_step(engine: TrainEngine, micro_batches) -> tuple[dict, dict[str, torch.Tensor]]:
    metrics = engine.forward_backward(micro_batches)
    metrics.update(engine.optim_step())
    weights = {n: p.detach().clone() for n, p in engine.transformer.named_parameters() if p.requires_grad}
    return metrics, weights


def _worker(rank: int, port: int, model_dir: str, shards, out_dir: str) -> None:
    join_gloo(rank, WORLD, port, out_dir, PG_TIMEOUT_S)
    try:
        engine = engine_for(model_dir, "ddp")
        plain = not any(hasattr(p, "full_tensor") for p in engine.transformer.parameters())
        metrics, weights = train_step(engine, shards[rank])
        result = {"strategy": engine.strategy, "plain": plain, "metrics": metrics, "weights": weights}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


@pytest.fixture(scope="module")
def micro_batches(tiny_model) -> list[PolicyGradientBatch]:
    return masked_micro_batches(tiny_model("sd3"), MASK, MICRO)


def test_replicated_ranks_take_one_process_step_and_stay_identical(
    tiny_model, micro_batches, tmp_path, monkeypatch
):
    model_dir = str(tiny_model("sd3"))
    half = len(micro_batches) // WORLD
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    spawn_with_deadlines(
        _worker,
        (free_port(), model_dir, [micro_batches[:half], micro_batches[half:]], str(tmp_path)),
        WORLD,
        tmp_path,
        start_s=START_DEADLINE_S,
        run_s=STEP_DEADLINE_S,
        what="replicated (ddp) step",
        fork=True,  # the ranks start from this process's imports (tests/train/spawn_ranks.py)
    )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    single = engine_for(model_dir, "none")
    initial = {n: p.detach().clone() for n, p in single.transformer.named_parameters() if p.requires_grad}
    expected_metrics, expected = train_step(single, micro_batches)

    for rank in ranks:
        assert rank["strategy"] == "ddp" and rank["plain"], "each rank holds whole (unsharded) weights"
        # the gradient norm is taken after averaging: the whole mini-batch's, as in one process
        assert rank["metrics"]["grad_norm"] == pytest.approx(expected_metrics["grad_norm"], rel=1e-5)
    moved = max((expected[n] - initial[n]).abs().max().item() for n in expected)
    assert moved > 1e-4, "the weights barely moved: the comparison would be vacuous"
    for name, want in expected.items():
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), f"{name}: ranks diverged"
        torch.testing.assert_close(
            ranks[0]["weights"][name], want, rtol=1e-4, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize(
    ("requested", "world", "lora", "weights_gib", "expected"),
    [
        ("auto", 1, True, 5, "none"),  # one worker
        ("auto", 2, False, 5, "fsdp2"),  # full fine-tuning: shard AdamW's state
        ("auto", 4, True, 16, "ddp"),  # SD3.5-M LoRA on an 80 GiB card
        ("auto", 2, True, 57, "fsdp2"),  # Qwen-Image LoRA on an 80 GiB card
        ("auto", 2, True, None, "ddp"),  # memory unknown: LoRA replicates
        ("fsdp2", 2, True, 5, "fsdp2"),  # the user's choice stands
        ("ddp", 2, False, 5, "ddp"),
    ],
)
def test_choose_strategy(requested, world, lora, weights_gib, expected):
    choice = choose_strategy(
        requested,
        world_size=world,
        lora=lora,
        weight_bytes=None if weights_gib is None else weights_gib * GIB,
        device_bytes=None if weights_gib is None else 80 * GIB,
    )
    assert choice.strategy == expected
    assert choice.line().startswith(f"parallelism: actor.strategy={expected} (") and choice.reason


def test_choose_strategy_threshold_and_sequence_parallel():
    just_fits = int(REPLICATE_MAX_WEIGHT_SHARE * 80 * GIB)
    kw = dict(world_size=2, lora=True, device_bytes=80 * GIB)
    assert choose_strategy("auto", weight_bytes=just_fits, **kw).strategy == "ddp"
    assert choose_strategy("auto", weight_bytes=just_fits + 1, **kw).strategy == "fsdp2"
    assert choose_strategy("auto", weight_bytes=GIB, sequence_parallel=True, **kw).strategy == "fsdp2"
    # actor.param_offload is FSDP2's offload: a LoRA run that would replicate shards instead
    assert choose_strategy("auto", weight_bytes=GIB, param_offload=True, **kw).strategy == "fsdp2"
    with pytest.raises(ValueError, match=r"actor\.strategy='ddpp' is not one of auto, ddp, fsdp2, none"):
        choose_strategy("ddpp", world_size=2, lora=True)


def test_pipeline_weight_bytes_counts_every_component(tiny_model):
    model_dir = tiny_model("sd3")
    pipe = load_model(model_dir, dtype="float32").pipe
    # the loaded pipeline's saved state: parameters and persistent buffers (a position table),
    # tied weights once
    tensors = {
        t.data_ptr(): t.numel()
        for component in pipe.components.values()
        if isinstance(component, torch.nn.Module)
        for t in component.state_dict().values()
    }
    numel = sum(tensors.values())
    assert pipeline_weight_bytes(model_dir, torch.bfloat16) == 2 * numel
    assert pipeline_weight_bytes(model_dir, torch.float32) == 4 * numel
