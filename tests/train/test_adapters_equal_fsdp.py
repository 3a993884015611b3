"""`TrainEngine.adapters_equal` under FSDP2 (2 gloo processes on the CPU): every rank must give the
same answer, since it decides how many forward passes each rank runs (the old policy's velocity is
skipped when the `old` adapter equals the trained one). Each rank only holds a shard of every LoRA
tensor, so a difference in one rank's shard has to reach the other rank: without the all-reduce,
rank 0 would answer "equal" here while rank 1 answers "different", and the next backward would hang.
"""

from __future__ import annotations

import os

import torch
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines
from torch.distributed.tensor import DTensor

from diffrl.config.schema import ActorConfig, LoraConfig, ModelConfig, OptimConfig
from diffrl.models import load_model
from diffrl.train import distributed
from diffrl.train.engine import OLD, POLICY, TrainEngine

WORLD = 2
START_DEADLINE_S = 120.0
RUN_DEADLINE_S = 60.0
PG_TIMEOUT_S = 30


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    join_gloo(rank, WORLD, port, out_dir, PG_TIMEOUT_S)
    try:
        engine = TrainEngine(
            load_model(model_dir, dtype="float32"),
            ModelConfig(lora=LoraConfig(rank=4, alpha=4)),
            ActorConfig(strategy="fsdp2", mini_batch_size=2, micro_batch_size=1, optim=OptimConfig(lr=1e-3)),
            total_optim_steps=1,
            with_old=True,
        )
        result = {"after_init": engine.adapters_equal(POLICY, OLD)}
        # One old-adapter tensor sharded over both ranks; change only rank 1's rows of it.
        old = next(p for n, p in engine.transformer.named_parameters() if f".{OLD}." in n and "lora_A" in n)
        result["sharded"] = isinstance(old, DTensor) and old.to_local().shape[0] < old.shape[0]
        if rank == 1:
            with torch.no_grad():
                old.to_local().add_(1.0)
        result["one_shard_differs"] = engine.adapters_equal(POLICY, OLD)
        engine.copy_adapter(POLICY, OLD)
        result["after_copy"] = engine.adapters_equal(POLICY, OLD)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


def test_every_rank_sees_a_difference_in_any_ranks_shard(tiny_model, tmp_path):
    model_dir = str(tiny_model("sd3"))
    spawn_with_deadlines(
        _worker,
        (free_port(), model_dir, str(tmp_path)),
        WORLD,
        tmp_path,
        start_s=START_DEADLINE_S,
        run_s=RUN_DEADLINE_S,
        what="adapters_equal",
        fork=True,  # the ranks start from this process's imports (tests/train/spawn_ranks.py)
    )
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["sharded"], f"rank {rank}: the LoRA tensor is not sharded, so the test proves nothing"
        assert result["after_init"] is True, f"rank {rank}: the old adapter starts as a copy"
        assert result["one_shard_differs"] is False, f"rank {rank} missed the difference in rank 1's shard"
        assert result["after_copy"] is True, f"rank {rank}: equal again after copy_adapter"
