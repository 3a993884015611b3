"""Exact resume of the distillation loop (DMD2) on the tiny random SD3, on CPU: a `diffrl train` run
killed with SIGKILL mid-save and right after a checkpoint, then resumed with trainer.resume=auto,
logs exactly the metrics of an uninterrupted run (the student's and the fake score's optimizers,
their update counters, the data position and every draw continue), and a resume that changes a
training setting stops, naming it. The runs are forked from the fault-injection tests' zygote
(tests/controller/fault_zygote.py), which kills each at the same place every time."""

import pytest
from fault_zygote import start_zygote
from test_distillation import DISTILL
from test_fault_injection import comparable

from diffrl.config import load_config
from diffrl.controller.distillation import check_resume_changes, training_changes
from diffrl.telemetry import read_metrics
from diffrl.workers.distillation_worker import FAKE_SCORE_CHECKPOINTS

ARGS = [
    "tiny_sd3",
    *DISTILL,
    "actor.loss.dmd_fake_updates=2",
    "actor.optim.scheduler=cosine",  # the schedulers' positions matter too
    "trainer.total_steps=4",
    "trainer.save_freq=1",
    "trainer.test_freq=0",
    "trainer.val_before_train=false",
]


@pytest.fixture(scope="module")
def zygote(tmp_path_factory):
    yield from start_zygote(tmp_path_factory)


def test_kill_9_mid_save_and_after_a_checkpoint_then_resume_matches_an_uninterrupted_run(zygote, tmp_path):
    train = ["train", *ARGS, f"trainer.output_dir={tmp_path}"]
    assert zygote([*train, "trainer.run_name=full"]) == 0, zygote.log.read_text()[-3000:]
    killed = [*train, "trainer.run_name=killed"]
    run_dir = tmp_path / "killed"
    # each step saves two checkpoints, the fake score's first: the 4th meta.json is step 2's
    # student checkpoint, killed once its fake-score partner is published
    assert zygote(killed, {"at": "save", "call": 4}) == -9
    assert (run_dir / "checkpoints" / FAKE_SCORE_CHECKPOINTS / "step_00000002" / "complete").is_file()
    assert not (run_dir / "checkpoints" / "step_00000002").exists()
    # resumed from step 1; killed right after step 2's checkpoint is published
    assert zygote(killed, {"at": "saved", "call": 1}) == -9
    # a resume that changes a training key stops before any model loads, naming the key
    earlier = len(zygote.log.read_text())
    assert zygote([*killed, "actor.loss.dmd_fake_updates=3"]) != 0
    log = zygote.log.read_text()[earlier:]
    assert "actor.loss.dmd_fake_updates: 2 -> 3" in log and "dmd_resume_changes=true" in log, log[-3000:]
    assert zygote(killed) == 0, zygote.log.read_text()[-3000:]
    expected, got = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(run_dir / "metrics.jsonl")
    assert sorted(got) == [1, 2, 3, 4]
    assert "actor/fake_score_loss" in got[4] and "actor/dmd_loss" in got[4]
    for step in (1, 2, 3, 4):
        assert comparable(got[step]) == pytest.approx(comparable(expected[step]), rel=1e-6, abs=1e-9), step


def test_only_training_keys_count_as_changes(tmp_path):
    from diffrl.config import to_yaml

    base = [*DISTILL, f"trainer.output_dir={tmp_path}"]
    (tmp_path / "config.yaml").write_text(to_yaml(load_config("tiny_sd3", base)))
    harmless = load_config(
        "tiny_sd3", [*base, "trainer.total_steps=7", "trainer.test_freq=3", "rollout.val.n=2"]
    )
    assert training_changes(harmless, tmp_path) == []
    changed = load_config("tiny_sd3", [*base, "actor.optim.lr=0.5", "rollout.pipeline.sigmas=[1.0,0.5]"])
    assert [key for key, _, _ in training_changes(changed, tmp_path)] == [
        "actor.optim.lr",
        "rollout.pipeline.sigmas",
    ]
    check_resume_changes(changed, tmp_path, None)  # a fresh start: nothing to compare
    with pytest.raises(ValueError, match=r"actor\.optim\.lr"):
        check_resume_changes(changed, tmp_path, tmp_path / "checkpoints" / "step_00000001")
    allowed = load_config("tiny_sd3", [*base, "actor.optim.lr=0.5", "actor.loss.dmd_resume_changes=true"])
    check_resume_changes(allowed, tmp_path, tmp_path / "checkpoints" / "step_00000001")
