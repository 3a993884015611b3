"""DanceGRPO step subsets under FSDP2 (2 gloo processes on the CPU): ranks with different numbers of
(micro-batch, window step) terms must neither hang nor change the update.

Each sample trains K = 1 of the W = 2 window steps (`train_mask_BW`). On rank 0 every micro-batch
holds samples of both steps (two terms each); on rank 1 each micro-batch trains one step (one term
each). Without padding rank 1 would reach its gradient reduce-scatter while rank 0 still gathers
parameters for its third forward, and both would wait for each other. The reference is the same
mini-batch (both ranks' micro-batches) trained in this process on one device without FSDP: FSDP
averages the two ranks' gradients, which equals that gradient, so gradients and metrics must agree
within float32 round-off.

It runs twice: with FSDP2's per-forward all-gathers, and with the units kept gathered through a
pass (what the engine does for a model small next to the device: `KEEP_GATHERED_FRACTION`), where
the gradient is reduce-scattered and the units resharded only after the last backward, and a
log-prob pass afterwards must still compute the one-process values.
"""

from __future__ import annotations

import os

import pytest
import torch
from masked_batches import masked_micro_batches
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines
from torch.distributed.tensor import DTensor, distribute_tensor

from diffrl.config.schema import (
    ActorConfig,
    LoraConfig,
    LossConfig,
    ModelConfig,
    OptimConfig,
)
from diffrl.models import load_model
from diffrl.train import distributed, parallel
from diffrl.train.batch import PolicyGradientBatch
from diffrl.train.engine import POLICY, TrainEngine

WORLD = 2
MICRO = 2
# A hang fails the test: gloo's collective timeout raises on the ranks, and the ranks are killed
# if they are still running at the step deadline.
START_DEADLINE_S = 120.0
STEP_DEADLINE_S = 60.0
PG_TIMEOUT_S = 30
# Rows 0-3 are rank 0's two micro-batches, rows 4-7 rank 1's. True = the sample trains that step.
RANK0_MASK = [[True, False], [False, True], [False, True], [True, False]]
RANK1_MASK = [[True, False], [True, False], [False, True], [False, True]]
MASK = torch.tensor([*RANK0_MASK, *RANK1_MASK])
REAL_TERMS = (4, 2)  # (micro-batch, step) pairs with at least one sample, per rank


def configs(strategy: str) -> tuple[ModelConfig, ActorConfig]:
    model_cfg = ModelConfig(lora=LoraConfig(rank=4, alpha=4))
    actor_cfg = ActorConfig(
        strategy=strategy,
        mini_batch_size=8,
        micro_batch_size=MICRO,
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        loss=LossConfig(clip_ratio=2e-4, kl_coef=0.0),
    )
    return model_cfg, actor_cfg


def engine_for(model_dir: str, strategy: str) -> TrainEngine:
    """An engine whose trained LoRA is perturbed the same way sharded or not (B ≠ 0, so every LoRA
    tensor gets a gradient, and the policy differs from the rollout's: ratios leave 1)."""
    engine = TrainEngine(load_model(model_dir, dtype="float32"), *configs(strategy), total_optim_steps=1)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.transformer.named_parameters():
            if f".{POLICY}." in name:
                delta = 0.05 * torch.randn(p.shape, generator=g)
                if isinstance(p, DTensor):
                    delta = distribute_tensor(delta, p.device_mesh, p.placements)
                p.add_(delta)
    return engine


def step(engine: TrainEngine, micro_batches: list[PolicyGradientBatch]):
    """One forward_backward: (metrics, full gradients, batch size of every evaluated term)."""
    sizes = []
    step_loss = engine._step_loss

    def counted(mb, j):
        sizes.append(len(mb))
        return step_loss(mb, j)

    engine._step_loss = counted  # partial(self._step_loss, ...) looks the instance attribute up
    metrics = engine.forward_backward(micro_batches)
    grads = {
        name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
        for name, p in engine.transformer.named_parameters()
        if p.requires_grad
    }
    return metrics, grads, sizes


def _worker(rank: int, port: int, model_dir: str, shards, out_dir: str) -> None:
    """Both ways of gathering in one process group: one engine resharding after every forward and
    backward, then one keeping its units gathered through a pass."""
    join_gloo(rank, WORLD, port, out_dir, PG_TIMEOUT_S)
    try:
        results = {}
        for keep_gathered in (False, True):
            parallel.KEEP_GATHERED_FRACTION = 1.0 if keep_gathered else 0.0
            engine = engine_for(model_dir, "fsdp2")
            metrics, grads, sizes = step(engine, shards[rank])
            results[keep_gathered] = {
                "metrics": metrics,
                "grads": grads,
                "sizes": sizes,
                "log_probs": engine.log_probs(shards[rank][0].rollout)[0],
                "kept_gathered": engine._keep_gathered,
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


@pytest.fixture(scope="module")
def micro_batches(tiny_model) -> list[PolicyGradientBatch]:
    return masked_micro_batches(tiny_model("sd3"), MASK, MICRO)


@pytest.fixture(scope="module")
def sharded_runs(tiny_model, micro_batches, tmp_path_factory):
    """Each rank's results of both engines (keyed by keep_gathered), from one 2-process gloo run."""
    model_dir = str(tiny_model("sd3"))
    half = len(micro_batches) // WORLD
    shards = [micro_batches[:half], micro_batches[half:]]
    out = tmp_path_factory.mktemp("dance_fsdp")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks' FSDP mesh is the CPU, as in CI
        spawn_with_deadlines(
            _worker,
            (free_port(), model_dir, shards, str(out)),
            WORLD,
            out,
            start_s=START_DEADLINE_S,
            run_s=2 * STEP_DEADLINE_S,
            what="DanceGRPO FSDP2 step",
            fork=True,  # the ranks start from this process's imports (tests/train/spawn_ranks.py)
        )
    return shards, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def one_process(tiny_model, micro_batches, sharded_runs):
    """The same mini-batch on one device without FSDP: metrics, gradients, term sizes, and the
    log-probs of each rank's first micro-batch."""
    shards, _ = sharded_runs
    single = engine_for(str(tiny_model("sd3")), "none")
    metrics, grads, sizes = step(single, micro_batches)
    return metrics, grads, sizes, [single.log_probs(shard[0].rollout)[0] for shard in shards]


@pytest.mark.parametrize("keep_gathered", [False, True], ids=["reshard", "kept_gathered"])
def test_uneven_step_subsets_across_ranks_finish_and_match_one_process(
    sharded_runs, one_process, keep_gathered
):
    ranks = [result[keep_gathered] for result in sharded_runs[1]]
    expected_metrics, expected_grads, single_sizes, expected_log_probs = one_process
    assert [r["kept_gathered"] for r in ranks] == [keep_gathered] * WORLD
    for result, expected in zip(ranks, expected_log_probs, strict=True):
        torch.testing.assert_close(result["log_probs"], expected, rtol=1e-5, atol=1e-6)
    assert len(single_sizes) == sum(REAL_TERMS)  # one process pads nothing

    # Both ranks ran as many forwards; rank 1's extra ones are single-sample padding.
    assert [len(r["sizes"]) for r in ranks] == [max(REAL_TERMS)] * WORLD
    assert ranks[0]["sizes"] == [1, 1, 1, 1]  # each micro-batch: one sample per step
    assert ranks[1]["sizes"] == [2, 2, 1, 1]  # two real terms of 2 samples, two padding terms

    assert 0 < expected_metrics["clipfrac"] < 1  # the clip is active for some terms only
    for result in ranks:
        assert result["metrics"].keys() == expected_metrics.keys()
        for key, value in expected_metrics.items():
            assert result["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    grads = ranks[0]["grads"]
    assert grads.keys() == expected_grads.keys() and grads
    assert max(g.abs().max().item() for g in expected_grads.values()) > 1e-4  # not a trivial agreement
    for name, expected in expected_grads.items():
        torch.testing.assert_close(
            grads[name], expected, rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
        )
