"""Pool metrics, the balanced split a separate run recommends, and where `rollout.log_prob_passes`
puts the passes without gradient."""

import pytest

from diffrl.config import load_config
from diffrl.controller.pool_sizing import SizingAdvisor, balanced_split, pool_metrics


def test_pool_metrics_are_the_fractions_of_the_step():
    m = pool_metrics(wait_s=1.0, rollout_busy_s=3.0, replicas=2, step_s=4.0)
    assert m["trainer/wait_fraction"] == 0.25
    assert m["rollout/idle_fraction"] == 1.0 - 3.0 / 8.0
    # busier than the step (one-step-off: sampled during the previous step) is no negative idle
    assert pool_metrics(wait_s=0.0, rollout_busy_s=9.0, replicas=1, step_s=4.0)["rollout/idle_fraction"] == 0


@pytest.mark.parametrize(
    ("trainer_work", "rollout_work", "workers", "expected"),
    [
        (3.0, 1.0, 4, (3, 1)),  # 1.0 s each way
        (1.0, 1.0, 2, (1, 1)),
        (1.0, 3.0, 4, (1, 3)),
        (2.0, 2.0, 4, (2, 2)),
        # the Flow-GRPO numbers per image: trainer 0.49 s, replica 0.17 s -> 3+1 of 4
        (0.49, 0.17, 4, (3, 1)),
    ],
)
def test_balanced_split_minimises_the_busier_pool(trainer_work, rollout_work, workers, expected):
    split = balanced_split(trainer_work, rollout_work, workers)
    assert (split.trainer, split.rollout) == expected
    # no other split of the same workers is faster (brute force, independently)
    best = min(max(trainer_work / t, rollout_work / (workers - t)) for t in range(1, workers))
    assert split.step_s == best


def test_the_recommendation_is_printed_once_after_the_measured_steps():
    advisor = SizingAdvisor(1, 1, whole_workers=True)
    step = {"timing_s/step": 10.0, "trainer/wait_seconds": 1.0, "rollout/busy_seconds": 3.0}
    assert advisor.observe({**step, "timing_s/step": 99.0, "trainer/wait_seconds": 0.0}) is None  # warm-up
    assert advisor.observe(step) is None
    advice = advisor.observe(step)
    # trainer 9 s, rollout 3 s of work on 2 workers: 1+1 is already the best split of 2
    assert "1+1 split is the balanced one of 2 GPUs" in advice and "9.00 s" in advice
    assert advisor.observe(step) is None
    four = SizingAdvisor(2, 2, whole_workers=True)
    for _ in range(3):
        advice = four.observe(step)
    # trainer 2 ranks × 9 s = 18 s, rollout 3 s: 3+1 gives max(6, 3) = 6 s, against 9 s now
    assert "3+1 split would balance" in advice and "rollout.replicas=1" in advice
    shared = SizingAdvisor(1, 1, whole_workers=False)
    for _ in range(3):
        advice = shared.observe(step)
    assert "no split to recommend" in advice


def test_log_prob_passes_resolution():
    separate = ["trainer.placement=separate", "actor.loss.kl_coef=0.01"]
    assert load_config("tiny_sd3", separate).rollout_passes == ("default", "reference")
    assert load_config("tiny_sd3", [*separate, "rollout.log_prob_passes=trainer"]).rollout_passes == ()
    assert load_config("tiny_sd3", ["actor.loss.kl_coef=0.01"]).rollout_passes == ()  # colocated
    # the rollout's own log-probs: nothing to recompute, the reference pass still moves
    own = [*separate, "algorithm.old_log_probs=rollout"]
    assert load_config("tiny_sd3", own).rollout_passes == ("reference",)
    # FSDP2 over 2 ranks casts LoRA to bf16: auto keeps the old log-probs on the trainer
    fsdp = [*separate, "trainer.n_gpus_per_node=2", "actor.strategy=fsdp2"]
    assert load_config("tiny_sd3", fsdp).rollout_passes == ("reference",)
    assert load_config("tiny_sd3", [*fsdp, "rollout.log_prob_passes=rollout"]).rollout_passes == (
        "default",
        "reference",
    )
    # compiled full fine-tuning: the trainer recomputes through its training graph, which a replica
    # (no trainable weights) does not trace: the old log-probs stay; with LoRA they move
    compiled = [*separate, "model.compile=true"]
    assert load_config("tiny_sd3", compiled).rollout_passes == ("default", "reference")
    assert load_config("tiny_sd3", [*compiled, "model.lora.rank=0"]).rollout_passes == ()
    assert load_config("tiny_sd3", [*separate, "model.lora.rank=0"]).rollout_passes == ("default",)
    # requests of 4 samples do not split into micro-batches of 8: auto keeps everything on the trainer
    odd = [*separate, "rollout.micro_batch_size=4", "actor.micro_batch_size=8", "actor.mini_batch_size=16"]
    assert load_config("tiny_sd3", odd).rollout_passes == ()


@pytest.mark.parametrize(
    ("overrides", "names"),
    [
        (["rollout.log_prob_passes=rollout"], "trainer.placement=separate"),
        (
            [
                "trainer.placement=separate",
                "rollout.log_prob_passes=rollout",
                "rollout.micro_batch_size=4",
                "actor.micro_batch_size=8",
                "actor.mini_batch_size=16",
            ],
            "rollout.log_prob_passes=trainer",
        ),
        (
            [
                "trainer.placement=separate",
                "rollout.log_prob_passes=rollout",
                "model.lora.rank=0",
                "actor.loss.kl_coef=0.01",
            ],
            "rollout.log_prob_passes=trainer",
        ),
        (["rollout.log_prob_passes=replicas"], "rollout.log_prob_passes"),
    ],
)
def test_log_prob_passes_errors_name_the_value_and_the_fix(overrides, names):
    with pytest.raises(ValueError) as err:
        load_config("tiny_sd3", overrides)
    assert names in str(err.value)
