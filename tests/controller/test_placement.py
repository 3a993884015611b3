"""Separate placement (trainer ranks and rollout replicas in their own Ray processes), weight sync,
and one-step-off async training, end to end on CPU with the tiny SD3."""

import math
from pathlib import Path

import pytest
import ray
import torch
from in_process_pools import in_process_pools

from diffrl.config import load_config
from diffrl.controller.placement import Separate
from diffrl.controller.policy_gradient import PolicyGradientTrainer
from diffrl.controller.run import placement_session, preflight, train
from diffrl.models import load_model
from diffrl.telemetry import RunLogger
from diffrl.telemetry import read_metrics as diffrl_read_metrics
from diffrl.train.lora import inject_lora

# 4 prompts x 4 samples, rollout micro-batches of 8 (two requests a step), three steps.
BASE = [
    "tiny_sd3",
    "trainer.total_steps=3",
    "trainer.save_freq=0",
    "trainer.test_freq=3",
    "trainer.val_before_train=false",
    "trainer.loggers=[jsonl]",
    "trainer.check_at_start=false",  # the start-up check is not what these test
]
SEPARATE = ["trainer.placement=separate", "rollout.replicas=2", "rollout.requests_in_flight=1"]
# Wall clock, and what only a separate run has: weight-sync costs, weight versions, pool times.
ONE_MODE_ONLY = (
    "timing",
    "throughput",
    "perf/",
    "time",
    "memory",
    "weight_sync/",
    "rollout/",
    "trainer/wait",
)


@pytest.fixture(autouse=True)
def one_thread(monkeypatch, shared_ray):
    # one compute thread in every process, so the driver and the Ray workers run the same kernels;
    # every run joins one Ray cluster (tests/conftest.py), whose actors read the tiny model's cache
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("DIFFRL_CACHE", str(shared_ray))


def read_metrics(run_dir: Path) -> dict[int, dict]:
    return diffrl_read_metrics(run_dir / "metrics.jsonl")


def comparable(row: dict) -> dict:
    return {
        k: v for k, v in row.items() if not k.startswith(ONE_MODE_ONLY) and "seconds" not in k and k != "step"
    }


def test_separate_placement_in_sync_mode_reproduces_the_colocated_run(tmp_path):
    # a separate run recomputes the old log-probs (its sampler is another process): so does this one
    recompute = "algorithm.old_log_probs=recompute"
    colocated = read_metrics(
        train(BASE[0], [*BASE[1:], recompute, f"trainer.output_dir={tmp_path}", "trainer.run_name=co"])
    )
    separate = read_metrics(
        train(BASE[0], [*BASE[1:], *SEPARATE, f"trainer.output_dir={tmp_path}", "trainer.run_name=sep"])
    )
    assert sorted(separate) == sorted(colocated) == [1, 2, 3]
    for step in (1, 2, 3):
        assert comparable(separate[step]) == comparable(colocated[step]), step
        # sync mode: every trajectory was sampled with the weights the step started from
        assert separate[step]["rollout/weight_version"] == step - 1
        assert separate[step]["rollout/staleness"] == 0
    assert "val/rewards/mean" in separate[3]
    # the first sync moves every tensor, the later ones (LoRA) only the adapters
    assert separate[1]["weight_sync/full"] == 1.0
    assert separate[2]["weight_sync/full"] == 0.0
    assert separate[2]["weight_sync/bytes"] < separate[1]["weight_sync/bytes"] / 10


def _adapter_bytes(cfg) -> int:
    """The LoRA tensors a sync must move, counted on an independently built model."""
    adapter = load_model(cfg.model.path, cfg.model.dtype, torch.device("cpu"))
    inject_lora(adapter, cfg.model.lora, ["default"], seed=cfg.trainer.seed)
    return sum(
        p.numel() * 4  # the trainer keeps fp32 LoRA weights
        for name, p in adapter.transformer.named_parameters()
        if "lora_" in name
    )


@pytest.fixture(scope="module")
def synced_pools(shared_ray, tmp_path_factory) -> dict:
    """One separate session with KL (so the replicas also run the reference pass), driven step by
    step: two updates, each followed by a weight sync, then batch 3 sampled three ways (default
    passes; both passes with the sample; the reference pass with the sample and the policy's
    later, as one step off does), each staged on the trainer rank beside its own passes of the
    same rows. Two tests read what it saw: a session starts three model workers, most of its time."""
    tmp_path = tmp_path_factory.mktemp("synced_pools")
    cfg = load_config(
        BASE[0],
        [
            *BASE[1:],
            *SEPARATE,
            "trainer.total_steps=2",
            "actor.loss.kl_coef=0.01",
            f"trainer.output_dir={tmp_path}",
        ],
    )
    seen: dict = {"cfg": cfg, "steps": []}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("DIFFRL_CACHE", str(shared_ray))
        train_records, _ = preflight(cfg)
        with (
            placement_session(cfg) as (placement, rewards),
            RunLogger(tmp_path, ["jsonl"], total_steps=2, config={}, run_name="sync") as logger,
        ):
            seen["placement_type"] = type(placement)
            loop = PolicyGradientTrainer(
                cfg,
                tmp_path,
                reuse_rollout_log_probs=False,
                placement=placement,
                rewards=rewards,
                train_records=train_records,
                val_records=[],
                logger=logger,
            )
            for step in (1, 2):
                loop.step = step
                loop.train_step()
                sent = placement.sync_weights(step)
                seen["steps"].append(
                    {
                        "sent": sent,
                        "trainer": placement.trainer.call("weights.digest")[0],
                        "replicas": placement.replicas.call("weight_digest"),
                    }
                )
            records = train_records[: cfg.data.prompts_per_step]
            uids = [str(i) for i in range(len(records))]
            staged = placement.sample(records, uids, step=3, rewards=rewards).result()
            full = staged.fetch()
            seen["staged"] = {
                "parts": list(staged.parts),
                "summary": staged.summary,
                "fetched_log_probs": full.samples.log_probs_BW,
                "fetched_uids": full.sample_uids(),
            }
            with_sample = placement.sample(
                records, uids, step=3, rewards=rewards, passes=("default", "reference")
            ).result()
            later = placement.sample(records, uids, step=3, rewards=rewards, passes=("reference",)).result()
            seen["later_had_default"] = later.computed("default")
            placement.evaluate_later(later, ["default"], version=2)
            rows = slice(0, cfg.images_per_step)
            seen["passes"] = {}
            for name, sampled in (("with_sample", with_sample), ("later", later)):
                placement.trainer.call("stage", sampled.parts)
                for policy in ("default", "reference"):
                    replica_lp, replica_means = sampled.pass_result(policy)
                    trainer_lp, trainer_means = placement.trainer.call(
                        "staged_log_probs", rows, policy=policy
                    )[0]
                    seen["passes"][name, policy] = {
                        "parts": len(sampled.parts),
                        "replica": (replica_lp, torch.cat(ray.get(replica_means))),
                        "trainer": (trainer_lp, ray.get(trainer_means)),
                    }
            seen["sampler_log_probs"] = with_sample.summary.log_probs_BW
    return seen


def test_after_every_sync_the_replicas_hold_the_trainers_weights_bitwise(synced_pools):
    cfg = synced_pools["cfg"]
    assert synced_pools["placement_type"] is Separate
    for step, seen in enumerate(synced_pools["steps"], start=1):
        assert all(replica == seen["trainer"] for replica in seen["replicas"]), (
            f"step {step}: replica weights differ"
        )
        # after the first (full) sync, only adapter bytes move
        assert seen["sent"]["weight_sync/full"] == 0.0
        assert seen["sent"]["weight_sync/bytes"] == _adapter_bytes(cfg)
    first, second = synced_pools["steps"]
    assert first["trainer"] != second["trainer"]  # the update changed what was synced
    # The controller gets summaries; the trajectories go to the trainer ranks as object
    # references (two requests of one micro-batch each), and the staged copy is the replicas'.
    staged = synced_pools["staged"]
    assert len(staged["parts"]) == 2 and all(isinstance(part, ray.ObjectRef) for part in staged["parts"])
    assert len(staged["summary"]) == cfg.images_per_step
    assert not any(
        isinstance(v, torch.Tensor) and v.numel() > 64 * 4 for v in vars(staged["summary"]).values()
    )
    assert torch.equal(staged["fetched_log_probs"], staged["summary"].log_probs_BW)
    assert staged["fetched_uids"] == staged["summary"].sample_uids()


@pytest.fixture(scope="module")
def one_step_off_runs(shared_ray, tmp_path_factory) -> dict[str, dict[int, dict]]:
    """One-step-off runs with KL, four steps validated at 2 and 4: the reference and old log-prob
    passes on the replicas (`auto`), on Ray's two replicas, and on the trainer, with the pools in
    this process (tests/controller/in_process_pools.py: one replica). Two tests read them. The
    second run's pools are in-process because a Ray run starts three model workers, on 2 cores
    most of its time; its metrics are those of the same run on Ray (test_bounded.py checks the
    harness), so the comparison still tells whether the passes' placement changes the run."""
    out = tmp_path_factory.mktemp("one_step_off")
    args = [
        *BASE[1:],
        *SEPARATE,
        "trainer.async_mode=one_step_off",
        "trainer.total_steps=4",
        "trainer.test_freq=2",
        "actor.loss.kl_coef=0.01",
        f"trainer.output_dir={out}",
    ]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")
        env.setenv("DIFFRL_CACHE", str(shared_ray))
        runs = {"replicas": read_metrics(train(BASE[0], [*args, "trainer.run_name=replicas"]))}
        env.setattr("diffrl.controller.run.placement_session", in_process_pools)
        on_trainer = [
            *args,
            "rollout.replicas=1",
            "rollout.log_prob_passes=trainer",
            "trainer.run_name=trainer",
        ]
        runs["trainer"] = read_metrics(train(BASE[0], on_trainer))
        return runs


def test_one_step_off_samples_each_batch_one_version_behind_and_trains(one_step_off_runs):
    metrics = one_step_off_runs["replicas"]
    assert sorted(metrics) == [1, 2, 3, 4]
    # step 1 has nothing to overlap with; from step 2 on, batch k was sampled during step k-1 with
    # the weights step k-1 started from (version k-2): one version behind the trainer
    assert [metrics[k]["rollout/weight_version"] for k in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert [metrics[k]["rollout/staleness"] for k in (1, 2, 3, 4)] == [0, 1, 1, 1]
    for step in (2, 3, 4):
        # the proximal (trainer) and behaviour (replica) log-probs differ: the gap is logged
        assert metrics[step]["rollout_correction/abs_logp_diff_max"] > 0
        assert math.isfinite(metrics[step]["actor/loss"])
    assert "val/rewards/mean" in metrics[2] and "val/rewards/mean" in metrics[4]


def test_separate_replicas_sample_merged_as_the_colocated_worker_does(tmp_path):
    """DiffusionNFT with model.lora.merge_inference: the replicas merge the `old` adapter they were
    sent exactly as the colocated worker merges its own, so a separate run in sync mode repeats the
    colocated run's metrics."""
    nft = [
        "algorithm.trainer_type=direct_preference",
        "actor.loss.mode=diffusion_nft",
        "model.lora.merge_inference=true",
    ]
    colocated = read_metrics(
        train(BASE[0], [*BASE[1:], *nft, f"trainer.output_dir={tmp_path}", "trainer.run_name=co"])
    )
    separate = read_metrics(
        train(BASE[0], [*BASE[1:], *nft, *SEPARATE, f"trainer.output_dir={tmp_path}", "trainer.run_name=sep"])
    )
    assert sorted(separate) == sorted(colocated) == [1, 2, 3]
    for step in (1, 2, 3):
        assert comparable(separate[step]) == comparable(colocated[step]), step
        assert math.isfinite(colocated[step]["actor/loss"])


def test_replica_passes_equal_the_trainers_bitwise(synced_pools):
    """The balanced pools' proof: after a (gloo) weight sync the replicas' log-probs and SDE means,
    computed with the sample or later (`evaluate_later`, the one-step-off path), are bitwise the
    trainer ranks' own `staged_log_probs` of the same rows, for the trained policy and for the
    reference (the adapters disabled); and after two updates the two policies differ, so the
    comparison cannot pass with a zero adapter."""
    assert synced_pools["cfg"].rollout_passes == ("default", "reference")  # auto: one trainer rank, LoRA
    assert not synced_pools["later_had_default"]
    for (name, policy), seen in synced_pools["passes"].items():
        assert seen["parts"] == 2, name  # two requests, joined on the trainer
        (replica_lp, replica_means), (trainer_lp, trainer_means) = seen["replica"], seen["trainer"]
        assert torch.equal(replica_lp, trainer_lp), (name, policy)
        assert torch.equal(replica_means, trainer_means), (name, policy)
    assert len(synced_pools["passes"]) == 4
    policy_lp = synced_pools["passes"]["with_sample", "default"]["replica"][0]
    reference_lp = synced_pools["passes"]["with_sample", "reference"]["replica"][0]
    assert not torch.equal(policy_lp, reference_lp)
    # the sampler's own log-probs: the same policy, not asserted bitwise (the sampler's path)
    torch.testing.assert_close(synced_pools["sampler_log_probs"], policy_lp, rtol=1e-4, atol=1e-4)


def test_one_step_off_with_replica_passes_trains_as_with_trainer_passes(one_step_off_runs):
    """One step off with KL: the passes on the replicas (auto) and on the trainer give the same
    run, metric for metric, and the pool metrics are logged."""
    on_replicas, on_trainer = one_step_off_runs["replicas"], one_step_off_runs["trainer"]
    assert sorted(on_replicas) == sorted(on_trainer) == [1, 2, 3, 4]
    for step in (1, 2, 3, 4):
        assert comparable(on_replicas[step]) == comparable(on_trainer[step]), step
        for key in ("trainer/wait_fraction", "rollout/idle_fraction"):
            assert 0.0 <= on_replicas[step][key] <= 1.0, key
        assert on_replicas[step]["rollout/busy_seconds"] > 0
