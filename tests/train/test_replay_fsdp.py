"""Batched replay under FSDP2 (2 gloo processes on the CPU): the same update as one forward per step.

Each rank trains two micro-batches with DanceGRPO's step subsets (test_engine_dance_fsdp.py's
mask): on rank 0 every micro-batch trains both window steps (with actor.replay_steps_per_forward=2
one batched forward of both steps' rows), on rank 1 each trains one step (a single-step forward).
Each rank runs the step twice, with replay 1 and with replay 2, in one process group: the batched
run's forwards are fewer and its gradients (FSDP-averaged over the ranks) and metrics equal the
unbatched run's within float32 round-off; a batched log-prob pass equals the unbatched one.
"""

from __future__ import annotations

import os

import pytest
import torch
from masked_batches import masked_micro_batches
from spawn_ranks import free_port, join_gloo, spawn_with_deadlines
from test_engine_dance_fsdp import (
    MASK,
    MICRO,
    PG_TIMEOUT_S,
    START_DEADLINE_S,
    STEP_DEADLINE_S,
    WORLD,
    engine_for,
    step,
)

from diffrl.train import distributed, parallel

REPLAYS = (1, 2)


def _worker(rank: int, port: int, model_dir: str, shards, out_dir: str) -> None:
    join_gloo(rank, WORLD, port, out_dir, PG_TIMEOUT_S)
    try:
        parallel.KEEP_GATHERED_FRACTION = 0.0  # an all-gather per unit per forward: what batching saves
        results = {}
        for replay in REPLAYS:
            engine = engine_for(model_dir, "fsdp2")
            engine.cfg.replay_steps_per_forward = replay
            metrics, grads, sizes = step(engine, shards[rank])
            results[replay] = {
                "metrics": metrics,
                "grads": grads,
                "sizes": sizes,
                "log_probs": engine.log_probs(shards[rank][0].rollout)[0],
            }
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        distributed.shutdown_distributed()


def test_batched_replay_under_fsdp2_matches_one_forward_per_step(tiny_model, tmp_path):
    micro_batches = masked_micro_batches(tiny_model("sd3"), MASK, MICRO)
    half = len(micro_batches) // WORLD
    shards = [micro_batches[:half], micro_batches[half:]]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CUDA_VISIBLE_DEVICES", "")  # the ranks' FSDP mesh is the CPU, as in CI
        spawn_with_deadlines(
            _worker,
            (free_port(), str(tiny_model("sd3")), shards, str(tmp_path)),
            WORLD,
            tmp_path,
            start_s=START_DEADLINE_S,
            run_s=2 * STEP_DEADLINE_S,
            what="batched-replay FSDP2 step",
            fork=True,
        )
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    # `step` counts `_step_loss` calls, the single-step forwards: rank 0's steps are batched now
    # (rank 1 pads its 2 single-step terms to rank 0's 4 without batching, to 2 with it: none)
    assert [r[1]["sizes"] for r in ranks] == [[1, 1, 1, 1], [2, 2, 1, 1]]
    assert [r[2]["sizes"] for r in ranks] == [[], [2, 2]]
    for result in ranks:
        one, batched = result[1], result[2]
        torch.testing.assert_close(batched["log_probs"], one["log_probs"], rtol=1e-6, atol=1e-6)
        assert batched["metrics"].keys() == one["metrics"].keys()
        for key, value in one["metrics"].items():
            assert batched["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
        assert one["grads"].keys() == batched["grads"].keys() and one["grads"]
        for name, expected in one["grads"].items():
            torch.testing.assert_close(
                batched["grads"][name], expected, rtol=1e-4, atol=1e-8, msg=lambda m, n=name: f"{n}: {m}"
            )
