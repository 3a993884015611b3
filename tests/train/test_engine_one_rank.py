"""FSDP2 on one worker: `actor.strategy=fsdp2` and `actor.param_offload=true` with no process group.

An engine built to shard outside a group joins a one-rank group of its own
(diffrl.train.distributed.join_one_rank_group) and shards its transformer over it, with FSDP2's
`CPUOffloadPolicy` under param_offload: its parameters, gradients and AdamW state are DTensors
in host memory. It must train as the unsharded engine does: the same losses and grad norms (to
float round-off, the tolerance of the 2-rank FSDP2 tests), LoRA and full fine-tuning, through
policy-gradient and flow-matching steps. The engine runs in a forked child: the process group is
process-wide and would outlive the test in pytest's process.
"""

from __future__ import annotations

import os

import pytest
import torch
from spawn_ranks import start_ranks
from test_engine_offload import PROMPTS, SIZE, build, flow_batches, train_flow

from diffrl.config.schema import PipelineConfig, RolloutConfig, SdeConfig
from diffrl.models import load_model
from diffrl.rollout import TrajectorySampler
from diffrl.train.batch import PolicyGradientBatch, TrainingTargets

MODES = {
    "none": {"strategy": "none"},
    "fsdp2": {"strategy": "fsdp2"},
    "param_offload": {"strategy": "fsdp2", "param_offload": True},
}


def _rollout_batches(model_dir: str) -> list[PolicyGradientBatch]:
    adapter = load_model(model_dir, dtype="float32")
    cfg = RolloutConfig(
        n=4,
        micro_batch_size=4,
        pipeline=PipelineConfig(
            height=SIZE, width=SIZE, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=8
        ),
        sde=SdeConfig(noise_level=0.8, window_size=2, window_range=[0, 3]),
    )
    rollout = TrajectorySampler(adapter, cfg, progress=False).sample(PROMPTS, seed=3, step=0)
    targets = TrainingTargets(advantages_B=torch.linspace(-1, 1, len(rollout)), batch_size=[len(rollout)])
    batch = PolicyGradientBatch(rollout, targets)
    return [batch.select(slice(0, 4)), batch.select(slice(4, 8))]


def _worker(_rank: int, model_dir: str, out_dir: str) -> None:
    batches = _rollout_batches(model_dir)
    results = {}
    for lora in (4, 0):
        for mode, settings in MODES.items():
            engine = build(model_dir, rank=lora, **settings)
            metrics = []
            for _ in range(2):
                step = engine.forward_backward(batches)
                metrics.append({**step, **engine.optim_step()})
            metrics += train_flow(engine, flow_batches(engine), 1)
            # after the optimizer step (FSDP2's root stays gathered after a forward without grad)
            params = {(type(p).__name__, p.device.type) for p in engine.transformer.parameters()}
            log_probs, _ = engine.log_probs(batches[0].rollout)
            results[(lora, mode)] = {
                "metrics": metrics,
                "log_probs": log_probs,
                "sharded": engine._sharded,
                "world": torch.distributed.get_world_size() if torch.distributed.is_initialized() else None,
                "params": params,
                "optim": {
                    v.device.type for s in engine.optimizer.state.values() for v in s.values() if v.dim()
                },
            }
    torch.save(results, os.path.join(out_dir, "results.pt"))


@pytest.fixture(scope="module")
def one_rank(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("one_rank")
    start_ranks(_worker, (str(tiny_model("sd3")), str(out)), 1, fork=True)
    return torch.load(out / "results.pt", weights_only=False)


@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
@pytest.mark.parametrize("mode", ["fsdp2", "param_offload"])
def test_one_worker_fsdp2_trains_as_the_unsharded_engine(one_rank, lora, mode):
    plain, sharded = one_rank[(lora, "none")], one_rank[(lora, mode)]
    assert not plain["sharded"]
    assert one_rank[(4, "none")]["world"] is None  # the first engine, unsharded, formed no group
    assert sharded["sharded"] and sharded["world"] == 1  # a one-rank group of the engine's own
    assert sharded["params"] == {("DTensor", "cpu")}
    assert sharded["optim"] == {"cpu"}
    assert [m.keys() for m in sharded["metrics"]] == [m.keys() for m in plain["metrics"]]
    for got, want in zip(sharded["metrics"], plain["metrics"], strict=True):
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), key
    assert plain["metrics"][0]["grad_norm"] > 0
    torch.testing.assert_close(sharded["log_probs"], plain["log_probs"], atol=1e-6, rtol=1e-5)


def test_one_worker_run_with_param_offload_trains_as_without(tmp_path):
    """`diffrl train` on one worker with actor.param_offload=true: the plan shards on a one-rank
    group and says so, and the run's metrics are the unsharded run's (fp32 on the CPU: bit for bit,
    a reduce-scatter over one rank divides by 1)."""
    import json
    import subprocess
    import sys

    def run(name: str, *extra: str) -> tuple[list[dict], dict, str]:
        out = tmp_path / name
        args = ["tiny_sd3", "trainer.total_steps=1", "trainer.val_before_train=false", "trainer.test_freq=0"]
        args += ["trainer.save_freq=0", "trainer.check_at_start=false", f"trainer.output_dir={out}"]
        done = subprocess.run(
            [sys.executable, "-m", "diffrl.cli", "train", *args, "trainer.run_name=run", *extra],
            capture_output=True,
            text=True,
            timeout=600,
            env={**os.environ, "DIFFRL_CACHE": str(tmp_path / "cache")},
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        computed = [
            {k: v for k, v in r.items() if k.startswith(("actor/", "reward/", "rollout/"))} for r in rows
        ]
        return computed, json.loads((out / "run" / "plan.json").read_text()), done.stdout + done.stderr

    plain, plain_plan, _ = run("plain")
    offloaded, plan, console = run("param_offload", "actor.param_offload=true")
    assert (plain_plan["strategy"], plan["strategy"], plan["offload"]) == ("none", "fsdp2", ["param"])
    assert (
        "actor.strategy=fsdp2 (actor.param_offload is FSDP2's CPU offload; one worker: FSDP2 on a " in console
    )
    assert any("actor/grad_norm" in row for row in plain)
    assert offloaded == plain
